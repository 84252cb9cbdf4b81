"""Live scaling rules and ledger on sim hosts (DESIGN section 5)."""

from concurrent.futures import Executor

import pytest

from vmplane.core.errors import Conflict, InsufficientCapacity, Invalid, QuotaExceeded
from vmplane.core.model import Offering, OfferingKind, Size, Usage
from vmplane.core.quota import overhead_mib

from .conftest import add_sim_hosts
from .conftest import ledger_usage as usage

GIB = 1024


def op_of(o, result):
    op = o.operation(result["operation_id"])
    assert op.state == "succeeded", op.message
    return op


@pytest.fixture
def cluster(orch):
    add_sim_hosts(orch, 2, cores=8, memory_mib=8 * GIB)
    orch.catalog.set_setting("enable.dynamic.scale.vm", "true", "zone", "z1")
    orch.catalog.create_offering(Offering("f1", OfferingKind.fixed, vcpus=1, memory_mib=256, dynamic_scaling=True))
    orch.catalog.create_offering(
        Offering(
            "f2", OfferingKind.fixed, vcpus=2, memory_mib=512, dynamic_scaling=True, cpu_cap=True, cpu_speed_mhz=1200
        )
    )
    orch.catalog.create_offering(Offering("big", OfferingKind.fixed, vcpus=4, memory_mib=6 * GIB, dynamic_scaling=True))
    orch.catalog.create_offering(
        Offering(
            "flex",
            OfferingKind.custom_constrained,
            min_vcpus=1,
            max_vcpus=8,
            min_memory_mib=256,
            max_memory_mib=8 * GIB,
            dynamic_scaling=True,
        )
    )
    orch.catalog.create_template("t", "tiny-linux", dynamic_scaling=True)
    orch.catalog.create_project("p", 16, 32 * GIB, 10, count_overhead=True)
    return orch


def test_a_fixed_offering_vm_scales_to_another_fixed_offering_and_back(cluster):
    o = cluster
    o.create_vm("v", "p", "f1", "t", start=True)
    before = usage(o, "p")
    op = op_of(o, o.scaler.scale("v", offering="f2"))
    vm = o.vm("v")
    assert (vm.vcpus, vm.memory_mib, vm.offering.name) == (2, 512, "f2")
    assert vm.cpu_cap_percent == 50.0  # 1200 MHz of a 2400 MHz sim host
    assert "memory dimm" in op.message and "vcpus hotplug" in op.message and "cpu cap 0.50" in op.message
    grown = usage(o, "p")
    assert grown - before == Usage(1, 256 + overhead_mib(Size(2, 512)) - overhead_mib(Size(1, 256)), 0)
    op_of(o, o.scaler.scale("v", offering="f1"))  # and down again, live
    assert usage(o, "p") == before and o.vm("v").cpu_cap_percent is None and o.audit() == []


@pytest.mark.parametrize(
    "switch,words",
    [
        ("zone", "setting enable.dynamic.scale.vm is false in zone z1 \\(host h[12]\\)"),
        ("offering", "offering dynamic_scaling is false"),
        ("template", "template dynamic_scaling is false"),
        ("vm", "vm dynamic_scaling is false"),
    ],
)
def test_each_switch_off_means_not_prepared_and_scaling_refused_naming_it(cluster, switch, words):
    o = cluster
    if switch == "zone":
        o.catalog.set_setting("enable.dynamic.scale.vm", "false", "zone", "z1")
    o.catalog.create_offering(
        Offering("fo", OfferingKind.fixed, vcpus=1, memory_mib=256, dynamic_scaling=switch != "offering")
    )
    o.catalog.create_template("to", "tiny-linux", dynamic_scaling=switch != "template")
    o.create_vm("v", "p", "fo", "to", dynamically_scalable=switch != "vm", start=True)
    vm = o.vm("v")
    assert not vm.prepared and (vm.max_vcpus, vm.max_memory_mib) == (1, 256)
    with pytest.raises(Conflict, match=words):
        o.scaler.scale("v", offering="f2")
    assert o.vm("v").vcpus == 1 and o.audit() == []


def test_above_the_ceiling_is_refused_with_the_ceiling_and_a_restart_hint(cluster):
    o = cluster
    o.catalog.set_setting("kvm.cpu.dynamic.scaling.capacity", "2", "cluster", "c1")
    o.create_vm("v", "p", "flex", "t", vcpus=1, memory_mib=512, start=True)
    with pytest.raises(Conflict, match="vcpus=3 is above vm v's ceiling of 2 prepared at start; a restart"):
        o.scaler.scale("v", vcpus=3)
    op_of(o, o.scaler.scale("v", vcpus=2))


def test_quota_for_the_increase_is_checked(cluster):
    o = cluster
    o.catalog.set_quota("p", vcpus=2)
    o.create_vm("v", "p", "f1", "t", start=True)
    with pytest.raises(QuotaExceeded, match="vcpus quota exceeded"):
        o.scaler.scale("v", offering="big")
    assert o.vm("v").vcpus == 1 and usage(o, "p").vcpus == 1 and o.audit() == []


def test_memory_moves_in_128_mib_steps(cluster):
    cluster.create_vm("v", "p", "flex", "t", vcpus=1, memory_mib=512, start=True)
    with pytest.raises(Invalid, match="steps of 128 MiB"):
        cluster.scaler.scale("v", memory_mib=600)


def test_a_full_host_moves_the_vm_first_when_auto_migrate_is_on_and_refuses_when_off(cluster):
    o = cluster
    o.create_vm("filler", "p", "flex", "t", vcpus=1, memory_mib=5 * GIB, start=True)  # on h1
    o.create_vm("v", "p", "f1", "t", start=True)  # spread: on h2
    o.create_vm("filler2", "p", "flex", "t", vcpus=1, memory_mib=5 * GIB, start=True)  # fills h2
    host = o.vm("v").host.name
    o.catalog.set_setting("auto.migrate.vm.on.live.scale.insufficient.capacity", "false", "cluster", "c1")
    before = usage(o, "p")
    with pytest.raises(
        InsufficientCapacity,
        match=f"host {host} has no room.*auto.migrate.vm.on.live.scale"
        f".insufficient.capacity is false in cluster c1 \\(host {host}\\)",
    ):
        o.scaler.scale("v", vcpus=None, offering="big")
    assert usage(o, "p") == before and o.vm("v").host.name == host and o.audit() == []
    o.stop_vm("filler")  # make room elsewhere
    o.catalog.set_setting("auto.migrate.vm.on.live.scale.insufficient.capacity", "true", "cluster", "c1")
    plan = o.scaler.scale("v", offering="big", dry_run=True)
    assert plan["path"] == "migrate-then-scale" and plan["migrate_to"] != host
    op = op_of(o, o.scaler.scale("v", offering="big"))
    assert o.vm("v").host.name == plan["migrate_to"] and o.vm("v").vcpus == 4
    assert op.result["path"] == "migrate-then-scale" and o.audit() == []


def test_only_the_cpu_cap_can_change(cluster):
    o = cluster
    o.create_vm("v", "p", "f1", "t", start=True)
    op_of(o, o.scaler.scale("v", cpu_cap=True))
    assert o.vm("v").cpu_cap_percent == round(1000 / 2400, 2) * 100
    op_of(o, o.scaler.scale("v", cpu_cap=False))
    assert o.vm("v").cpu_cap_percent is None
    with pytest.raises(Conflict, match="nothing to change") as refused:
        o.scaler.scale("v", cpu_cap=False)
    assert refused.value.status == 409 and refused.value.code == "conflict"


def test_a_failed_hot_plug_rolls_back_quota_and_claim(cluster):
    o = cluster
    o.create_vm("v", "p", "f1", "t", start=True)
    before, hosts = usage(o, "p"), {h.name: (h.used_vcpus, h.used_memory_mib) for h in o.hosts()}

    def broken(name, vcpus):
        raise RuntimeError("QEMU refused the vCPU")

    o.drivers[o.vm("v").host.name].set_vcpus = broken
    result = o.scaler.scale("v", offering="f2")
    op = o.operation(result["operation_id"])
    assert op.state == "failed" and "QEMU refused the vCPU" in op.message
    assert usage(o, "p") == before and {h.name: (h.used_vcpus, h.used_memory_mib) for h in o.hosts()} == hosts
    assert o.vm("v").state == "running" and o.audit() == []


def _sizes(o, name):
    vm = o.vm(name)
    dom = o.drivers[vm.host.name].domain(o.domain_name(name))
    return (vm.vcpus, vm.memory_mib), (dom.usable_vcpus, dom.memory_mib)


def test_a_step_that_changed_the_domain_then_failed_is_recorded_at_what_the_domain_has(cluster):
    """Review finding 2: the vCPU was plugged, the guest never showed it, and the undo failed too: the
    record, charge and claim follow the domain (2 vCPUs / 512 MiB), they are not given back."""
    o = cluster
    o.create_vm("v", "p", "f1", "t", start=True)
    driver = o.drivers[o.vm("v").host.name]
    real = driver.set_vcpus

    def plugs_then_times_out(name, vcpus):
        if vcpus < 2:
            raise RuntimeError("the console does not answer")  # the undo: no effect
        real(name, vcpus)
        raise RuntimeError("the guest shows 1 vCPUs online, not 2")

    driver.set_vcpus = plugs_then_times_out
    op = o.operation(o.scaler.scale("v", offering="f2")["operation_id"])
    assert op.state == "failed" and "not 2" in op.message and "recorded and charged at that size" in op.message
    assert _sizes(o, "v") == ((2, 256), (2, 256))  # the DIMM was unplugged by the undo, the vCPU stays
    usage(o, "p")  # ledger == recomputed from the record
    assert o.audit() == []  # claims == record == domain


def test_an_unplug_the_guest_refuses_keeps_the_larger_size_recorded_and_charged(cluster):
    o = cluster
    o.create_vm("v", "p", "f1", "t", start=True)
    o.scaler.scale("v", offering="f2")
    before = usage(o, "p")
    driver = o.drivers[o.vm("v").host.name]

    def refused(name, mib):
        if mib < 512:
            raise RuntimeError(
                "DIMM dimm0 (256 MiB) still attached after 3 unplug requests: the guest did not release it"
            )
        return type(driver).set_memory(driver, name, mib)

    driver.set_memory = refused
    op = o.operation(o.scaler.scale("v", offering="f1")["operation_id"])
    assert op.state == "failed" and "the guest did not release it" in op.message
    assert _sizes(o, "v") == ((2, 512), (2, 512)) and usage(o, "p") == before and o.audit() == []


def test_a_domain_that_can_not_be_read_back_keeps_the_larger_size(cluster):
    o = cluster
    o.create_vm("v", "p", "f1", "t", start=True)
    driver = o.drivers[o.vm("v").host.name]
    driver.set_vcpus = lambda name, vcpus: (_ for _ in ()).throw(RuntimeError("connection lost"))
    driver.domain = lambda name: (_ for _ in ()).throw(RuntimeError("connection lost"))
    op = o.operation(o.scaler.scale("v", offering="f2")["operation_id"])
    assert op.state == "failed" and "kept at the larger size 2 vCPU(s) / 512 MiB" in op.message
    vm = o.vm("v")
    assert (vm.vcpus, vm.memory_mib) == (2, 512)
    usage(o, "p")
    del driver.domain
    # the record keeps the larger size (charged and claimed); the audit shows the domain is smaller
    assert o.audit() and all("the record says" in problem for problem in o.audit()), o.audit()


def test_a_stopped_vm_is_resized_offline_charged_only_at_its_next_start(cluster):
    o = cluster
    o.create_vm("v", "p", "f1", "t")
    plan = o.scaler.scale("v", offering="f2", dry_run=True)
    assert plan["path"] == "offline resize" and o.vm("v").offering.name == "f1"
    o.scaler.scale("v", offering="f2")
    assert (o.vm("v").vcpus, o.vm("v").memory_mib, o.vm("v").offering.name) == (2, 512, "f2")
    assert usage(o, "p") == Usage(0, 0, 1)
    with pytest.raises(Conflict, match="its CPU cap follows its offering"):
        o.scaler.scale("v", cpu_cap=False)


def test_an_error_vm_is_refused(cluster):
    cluster.create_vm("v", "p", "f1", "t")
    from vmplane.store import ledger as L

    with cluster.db.transaction() as conn:
        L.set_vm(conn, cluster.vm("v").id, state="error")
    with pytest.raises(Conflict, match="live scaling needs a running VM"):
        cluster.scaler.scale("v", offering="f2")


class Deferred(Executor):
    """Holds submitted operations until run() (to look at the cluster while one is in flight)."""

    def __init__(self):
        self.jobs = []

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[override]
        self.jobs.append((fn, args, kwargs))

    def run(self):
        while self.jobs:
            fn, args, kwargs = self.jobs.pop(0)
            fn(*args, **kwargs)


def test_count_overhead_can_not_flip_while_a_vm_of_the_project_is_being_scaled(cluster):
    o = cluster
    o.create_vm("v", "p", "f1", "t", start=True)
    o.plane.executor = deferred = Deferred()
    o.scaler.scale("v", offering="f2")  # admitted: increase charged, size not yet changed
    with pytest.raises(Conflict, match=r"VMs being scaled \(v\)") as refused:
        o.catalog.set_quota("p", count_overhead=False)
    assert refused.value.field == "count_overhead" and o.catalog.project("p").count_overhead
    assert o.audit() == [] and o.project_usage("p")["ledger"] == o.project_usage("p")["recomputed"]  # in flight
    deferred.run()
    o.catalog.set_quota("p", count_overhead=False)  # once it is done
    assert o.vm("v").vcpus == 2 and usage(o, "p").memory_mib == 512 and o.audit() == []
