"""The quota ledger through the orchestrator on sim hosts: admission, release, and random sequences."""

import tempfile

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from vmplane.core.errors import Conflict, InsufficientCapacity, QuotaExceeded, VmplaneError
from vmplane.core.model import Size, Usage
from vmplane.core.quota import overhead_mib
from vmplane.orchestrator import InlineExecutor, Orchestrator
from vmplane.store import Database

from . import stores
from .conftest import add_basics, add_sim_hosts
from .conftest import ledger_usage as usage
from .stores import store_url


@pytest.fixture
def cluster(orch):
    add_sim_hosts(orch, 2)
    add_basics(orch)
    return orch


@pytest.mark.parametrize(
    "quota,field", [((1, 65536, 10), "vcpus"), ((8, 1024, 10), "memory_mib"), ((8, 65536, 0), "vms")]
)
def test_a_start_over_any_quota_is_refused_naming_the_resource(cluster, quota, field):
    cluster.catalog.create_project("p", *quota, count_overhead=False)
    with pytest.raises(QuotaExceeded) as exc:
        cluster.create_vm("v", "p", "ranged", "tiny", vcpus=2, memory_mib=2048, start=True)
    assert exc.value.field == field and field in exc.value.message
    assert cluster.vms() == [] and usage(cluster, "p") == Usage()  # nothing half-created


def test_overhead_is_charged_only_when_count_overhead(cluster):
    cluster.catalog.create_project("with", 8, 4096, 10, count_overhead=True)
    cluster.catalog.create_project("without", 8, 4096, 10, count_overhead=False)
    ovh = overhead_mib(Size(1, 1024))
    for project in ("with", "without"):
        for i in range(3):
            cluster.create_vm(f"{project}-{i}", project, "small", "tiny", start=True)
    assert usage(cluster, "with") == Usage(3, 3 * (1024 + ovh), 3)
    assert usage(cluster, "without") == Usage(3, 3 * 1024, 3)
    # a fourth 1 GiB VM fits 4096 MiB without overhead, not with it
    cluster.create_vm("without-3", "without", "small", "tiny", start=True)
    with pytest.raises(QuotaExceeded, match="memory_mib"):
        cluster.create_vm("with-3", "with", "small", "tiny", start=True)
    # host claims always include overhead
    hosts = {h.name: h.used_memory_mib for h in cluster.hosts()}
    assert sum(hosts.values()) == 7 * (1024 + ovh)
    assert cluster.audit() == []


def test_stop_releases_and_start_charges_again(cluster):
    cluster.catalog.create_project("p", 4, 65536, 10)
    cluster.create_vm("a", "p", "small", "tiny", start=True)
    assert cluster.vm("a").state == "running" and usage(cluster, "p").vcpus == 1
    cluster.stop_vm("a")
    assert cluster.vm("a").state == "stopped" and cluster.vm("a").host is None
    assert usage(cluster, "p") == Usage(0, 0, 1)
    assert all(h.used_vcpus == 0 and h.used_memory_mib == 0 for h in cluster.hosts())
    cluster.start_vm("a")
    assert usage(cluster, "p").vcpus == 1
    with pytest.raises(Conflict, match="stop it before deleting"):
        cluster.delete_vm("a")
    cluster.stop_vm("a")
    cluster.delete_vm("a")
    assert usage(cluster, "p") == Usage() and cluster.audit() == []


def test_changing_count_overhead_recharges_and_is_refused_when_it_no_longer_fits(cluster):
    cluster.catalog.create_project("p", 8, 3 * 1024, 10, count_overhead=False)
    for i in range(3):
        cluster.create_vm(f"v{i}", "p", "small", "tiny", start=True)
    with pytest.raises(Conflict, match="memory_mib"):
        cluster.catalog.set_quota("p", count_overhead=True)
    assert usage(cluster, "p").memory_mib == 3 * 1024  # unchanged
    cluster.catalog.set_quota("p", memory_mib=8192, count_overhead=True)
    assert usage(cluster, "p").memory_mib == 3 * (1024 + overhead_mib(Size(1, 1024)))


def test_a_recharge_locks_the_projects_vms_before_the_project_as_a_start_does(pg_orch):
    """Lock order (PostgreSQL): changing count_overhead re-charges the project's VMs. Waiting for a VM's row
    (a start or a delete holds it, then wants the project), it must not hold the project's row yet."""
    from concurrent.futures import ThreadPoolExecutor

    from .rowlocks import row_held

    o = pg_orch
    add_basics(o)
    add_sim_hosts(o, 2)
    o.catalog.create_project("p", 8, 8192, 10, count_overhead=False)
    o.create_vm("v0", "p", "small", "tiny", start=True)
    with ThreadPoolExecutor(1) as pool, row_held(o.db.url, "SELECT id FROM vms WHERE name = 'v0' FOR UPDATE") as probe:
        changed = pool.submit(o.catalog.set_quota, "p", count_overhead=True)
        probe.wait_for_a_waiter()
        probe.lock_now("SELECT id FROM projects WHERE name = 'p' FOR UPDATE")  # the start can go on
    assert changed.result(timeout=30).count_overhead
    assert usage(o, "p").memory_mib == 1024 + overhead_mib(Size(1, 1024)) and o.audit() == []


def test_a_failed_start_gives_back_quota_and_claim(cluster):
    cluster.catalog.create_project("p", 4, 65536, 10)

    def broken_start(spec):
        raise RuntimeError("QEMU refused to start")

    for driver in cluster.drivers.values():
        driver.start = broken_start
    admitted = cluster.create_vm("v", "p", "small", "tiny", start=True)
    op = cluster.operation(admitted.operation_id)
    assert op.state == "failed" and "QEMU refused to start" in op.message
    assert cluster.vm("v").state == "stopped"
    assert usage(cluster, "p") == Usage(0, 0, 1) and cluster.audit() == []


class LedgerMachine(RuleBasedStateMachine):
    """Random create/start/stop/delete/quota changes; the ledger must always equal the recomputed
    usage, stay within quota, and host claims must equal what runs."""

    def __init__(self):
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory()
        self.db = Database(store_url(self.tmp.name, "l.db"))
        self.db.migrate()
        self.o = Orchestrator(self.db, InlineExecutor())
        self.o.load()
        self.o.catalog.create_zone("z")
        self.o.catalog.create_cluster("c1", "z")
        add_sim_hosts(self.o, 3, cores=8, memory_mib=16384)
        add_basics(self.o)
        self.o.catalog.create_project("p", 10, 20000, 8, count_overhead=True)
        self.o.catalog.create_project("q", 6, 12000, 6, count_overhead=False)
        self.n = 0

    def teardown(self):
        self.o.close()
        self.db.dispose()
        self.tmp.cleanup()

    @rule(
        project=st.sampled_from(["p", "q"]),
        offering=st.sampled_from(["small", "large", "ranged"]),
        vcpus=st.integers(1, 4),
        memory=st.sampled_from([256, 1024, 3000, 8192]),
        start=st.booleans(),
    )
    def create(self, project, offering, vcpus, memory, start):
        self.n += 1
        custom = offering == "ranged"
        try:
            self.o.create_vm(
                f"v{self.n}",
                project,
                offering,
                "tiny",
                vcpus=vcpus if custom else None,
                memory_mib=memory if custom else None,
                start=start,
            )
        except (QuotaExceeded, InsufficientCapacity):
            assert f"v{self.n}" not in {v.name for v in self.o.vms()}

    def _pick(self, data, state):
        names = sorted(v.name for v in self.o.vms() if v.state == state)
        return data.draw(st.sampled_from(names)) if names else None

    @rule(data=st.data())
    def start(self, data):
        name = self._pick(data, "stopped")
        if name:
            try:
                self.o.start_vm(name)
            except (QuotaExceeded, InsufficientCapacity):
                assert self.o.vm(name).state == "stopped"

    @rule(data=st.data())
    def stop(self, data):
        name = self._pick(data, "running")
        if name:
            self.o.stop_vm(name)

    @rule(data=st.data())
    def delete(self, data):
        name = self._pick(data, "stopped")
        if name:
            self.o.delete_vm(name)

    @rule(
        project=st.sampled_from(["p", "q"]),
        vcpus=st.integers(0, 12),
        memory=st.integers(0, 25000),
        count_overhead=st.booleans(),
    )
    def change_quota(self, project, vcpus, memory, count_overhead):
        try:
            self.o.catalog.set_quota(project, vcpus=vcpus, memory_mib=memory, count_overhead=count_overhead)
        except VmplaneError as exc:
            assert exc.field in ("vcpus", "memory_mib", "vms")

    @invariant()
    def ledger_is_exact_and_within_quota(self):
        assert self.o.audit() == []


TestLedgerMachine = LedgerMachine.TestCase
# the PostgreSQL pass checks the same rules on the other store with fewer runs: the breadth of the
# exploration is the SQLite pass's (the rules are the store's, whichever it is)
TestLedgerMachine.settings = settings(
    max_examples=12 if stores.is_postgres() else 40,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_two_control_planes_on_one_database_never_overfill_a_host(db, orch):
    """A second orchestrator (another API process) claims behind the first one's index: the store's
    compare-and-add refuses the overfill and the first learns the real numbers."""
    add_sim_hosts(orch, 1, cores=4, memory_mib=65536)
    add_basics(orch)
    orch.catalog.create_project("p", 100, 10**6, 100)
    other = Orchestrator(db, InlineExecutor(), name="other")
    other.load()
    for i in range(3):
        other.create_vm(f"b{i}", "p", "small", "tiny", start=True)
    orch.create_vm("a0", "p", "small", "tiny", start=True)  # 3 + 1 = 4 vCPUs: fits
    with pytest.raises(InsufficientCapacity, match="vcpus 4 of 4 allocated"):
        orch.create_vm("a1", "p", "small", "tiny", start=True)
    assert orch.host_capacity("h1").used_vcpus == 4
    from vmplane.controllers.audit import audit

    assert audit(db, orch.catalog.recomputed_usage) == []
    other.close()
