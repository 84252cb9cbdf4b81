"""Migration findings of the 2026-12-02 review (issue 26), on sim hosts and through the API and the CLI.

- N1: a target's paused *incoming* domain (libvirt's PAUSED_MIGRATION) is never taken for "moved": with the
  source fenced during pre-copy, the guest is lost, the HA VM is restarted and the only complete disk kept.
- N7 (the migration's side): a copy taken over from a process whose lease lapsed is aborted on its source first.
- N11: tuning a migration is an admin's; a post-copy has a bandwidth floor.
- A migration right after a start: the guest check compares with the guest before the move, and a VM that
  moved is never reported `failed` (`moved-unhealthy`, its own CLI exit code).
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from vmplane.controllers import migrator as migrator_module
from vmplane.core.driver import DomainInfo
from vmplane.core.migration import (
    POSTCOPY_BANDWIDTH_FLOOR_MIB_S,
    MigrationState,
    Outcome,
    settle_outcome,
    tuning_refusal,
)
from vmplane.core.model import HostState, Offering, OfferingKind
from vmplane.core.names import domain_name
from vmplane.orchestrator import InlineExecutor, Orchestrator
from vmplane.store import ledger as L

from .conftest import add_sim_hosts
from .test_migration_settle import _cluster, blocked_copy, hosts, restarted, used, where

GIB = 1024


def info(state: str = "running", reason: str = "") -> DomainInfo:
    return DomainInfo("vmplane-x", state in ("running", "blocked"), 1, 256, state=state, reason=reason)


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


# -- N1: the pure rule ---------------------------------------------------------------------------------
@pytest.mark.parametrize("reason", ["migration", "starting-up"])
def test_a_paused_incoming_target_is_never_moved(reason):
    incoming = info("paused", reason)
    assert settle_outcome(None, incoming) != Outcome.moved
    assert settle_outcome(None, incoming) == Outcome.unclear  # a source that answers: ask again
    assert settle_outcome(None, incoming, source_off=True) == Outcome.gone  # a source known off: the guest is lost
    assert settle_outcome(info(), incoming) == Outcome.stayed  # the source runs it
    assert settle_outcome(None, info("paused", "user")) == Outcome.moved  # paused after the switch-over
    assert settle_outcome(None, info("paused", "postcopy")) == Outcome.moved


# -- N1: the source fenced during pre-copy ---------------------------------------------------------------
@pytest.fixture
def ha(db):
    """Three sim hosts with local pools, threaded (as the API runs): an HA VM and a VM with a local disk."""
    o = Orchestrator(db, ThreadPoolExecutor(8, thread_name_prefix="test-op"))
    o.load()
    o.catalog.create_zone("z1")
    o.catalog.create_cluster("c1", "z1")
    add_sim_hosts(o, 3, cores=8, memory_mib=16 * GIB)
    o.catalog.create_offering(Offering("one", OfferingKind.fixed, vcpus=1, memory_mib=GIB))
    o.catalog.create_template("t", "tiny-linux")
    o.catalog.create_template("disk", "tiny-linux", disk="tiny-linux")
    o.catalog.create_project("p", 12, 24 * GIB, 20, storage_mib=10 * GIB)
    for i in (1, 2, 3):
        o.pools.create(f"local-h{i}", "local", host=f"h{i}")
    o.catalog.set_setting("vmplane.ha.grace", "0")
    fabric = o.drivers["h1"].fabric
    linger = fabric.incoming_linger_s
    fabric.incoming_linger_s = 600  # the target's keepalive never notices within the test
    yield o
    fabric.incoming_linger_s = linger
    for name in ("h1", "h2", "h3"):
        fabric.recover_host(name)
    o.close()


def restarts(o) -> list:
    with o.db.read() as s:
        return s.connection().execute(L.OPERATIONS.select().where(L.OPERATIONS.c.kind == "restart")).all()


def recovery_state(o, host: str) -> str | None:
    with o.db.read() as s:
        row = (
            s.connection()
            .execute(L.OPERATIONS.select().where(L.OPERATIONS.c.kind == "recover", L.OPERATIONS.c.target == host))
            .first()
        )
    return row.state if row is not None else None


def root_files(o, host: str) -> int:
    """How many files of d's root disk the host's local pool holds."""
    return sum(v.name.startswith("vmp-d-root") for v in o.drivers[host].volumes(f"local-{host}"))


def test_a_source_fenced_during_precopy_is_not_taken_for_moved_the_ha_vm_restarts_and_the_disk_stays(ha):
    o = ha
    for other in ("h2", "h3"):
        o.set_host_state(other, HostState.disabled)
    o.create_vm("a", "p", "one", "t", start=True, ha_policy="restart")
    o.create_vm("d", "p", "one", "disk", start=True, pool="local-h1")
    wait_for(lambda: o.vm("a").state == o.vm("d").state == "running", 10, "both VMs to run")
    for other in ("h2", "h3"):
        o.set_host_state(other, HostState.enabled)
    for driver in o.drivers.values():
        driver.copy_rate_mib_s = 1  # 1 GiB at 1 MiB/s: pre-copy for the whole test
    fabric = o.drivers["h1"].fabric
    migs = {vm: o.migrator.migrate(vm, to="h2")["id"] for vm in ("a", "d")}
    for vm in migs:  # the sim now holds libvirt's incoming domain on the target
        wait_for(
            lambda vm=vm: (o.drivers["h2"].domain(domain_name(vm)) or info("shutoff")).reason == "migration",
            10,
            f"{vm}'s incoming domain on h2",
        )
    assert o.drivers["h2"].domain(domain_name("a")).state == "paused"

    fabric.fail_host("h1", "power")
    o.check_hosts()
    assert o.host("h1").state == "down"
    wait_for(lambda: all(o.migrator.orphaned(o.migrator.get(m)) for m in migs.values()), 20, "the copy threads to end")
    o.ha.fence("h1", confirm_off=True)
    wait_for(lambda: recovery_state(o, "h1") == "succeeded", 30, "the recovery of h1")

    for mig_id in migs.values():  # not moved: the guest was on neither host
        row = o.migrator.get(mig_id)
        assert row["state"] == "failed" and "neither" in row["reason"], row
    a = o.vm("a")
    assert [op.target for op in restarts(o)] == ["a"]  # the HA VM is restarted ...
    assert a.state == "running" and fabric.hosts_of(domain_name("a")) == [a.host.name]  # ... once, shell gone
    assert o.vm("d").state == "stopped" and fabric.hosts_of(domain_name("d")) == []
    root = o.volumes.row("d-root")
    assert (root.pool_name, root.copy_pool_name) == ("local-h1", None)  # the source's file is the disk

    fabric.recover_host("h1")  # repaired: the storage settle cleans copies now
    o.check_hosts()
    o.disk_moves.cleanup()
    assert root_files(o, "h1") == 1  # the only complete copy is kept
    assert root_files(o, "h2") == 0  # the partial one is gone


def test_an_incoming_domain_goes_with_a_failed_copy_and_lingers_only_after_a_power_loss(ha):
    """The sim as libvirt: the target's incoming domain ends with the copy (a connection reset tells it), but a
    source that lost its power leaves it there until the target's keepalive (incoming_linger_s)."""
    o = ha
    fabric = o.drivers["h1"].fabric
    fabric.incoming_linger_s = 3.0
    o.create_vm("x", "p", "one", "t", start=True)
    wait_for(lambda: o.vm("x").state == "running", 10, "x to run")
    source = o.vm("x").host.name
    target = next(h for h in ("h1", "h2", "h3") if h != source)
    for driver in o.drivers.values():
        driver.copy_rate_mib_s = 1
    mig = o.migrator.migrate("x", to=target)
    wait_for(lambda: fabric.hosts_of(domain_name("x")) == sorted([source, target]), 10, "the incoming domain")
    o.migrator.cancel("x")
    wait_for(lambda: o.migrator.get(mig["id"])["state"] == "cancelled", 10, "the cancel")
    assert fabric.hosts_of(domain_name("x")) == [source]  # gone with the aborted copy

    o.migrator.migrate("x", to=target)
    wait_for(lambda: fabric.hosts_of(domain_name("x")) == sorted([source, target]), 10, "the incoming domain")
    fabric.fail_host(source, "power")
    assert fabric.hosts_of(domain_name("x")) == [target]  # still there right after
    wait_for(lambda: fabric.hosts_of(domain_name("x")) == [], 10, "the keepalive to remove it")


# -- N7: a copy taken over from a lapsed owner ------------------------------------------------------------
def test_a_copy_taken_over_from_a_lapsed_process_is_aborted_on_its_source_then_settled(db, monkeypatch):
    first = _cluster(Orchestrator(db, ThreadPoolExecutor(4)))
    source, target = hosts(first)
    mig, release = blocked_copy(first, monkeypatch)  # its process hangs inside libvirt's call
    again = restarted(db)
    try:
        aborted = threading.Event()
        src = again.drivers[source]
        monkeypatch.setattr(src, "migration_active", lambda name: not aborted.is_set())  # libvirtd's job
        monkeypatch.setattr(src, "abort_migration", lambda name: aborted.set())
        again.migration_settle.run_once()
        row = again.migrator.get(mig["id"])
        assert aborted.is_set(), "the source was not asked to abort the taken-over copy"
        assert row["state"] == "failed" and f"runs on {source}" in row["reason"], row
        assert again.vm("v").host.name == source and used(again, target) == 0 and where(again) == [source]
    finally:
        release.set()
        again.close()
        first.close()


# -- a migration right after a start -------------------------------------------------------------------
@pytest.fixture
def o(db):
    orch = _cluster(Orchestrator(db, InlineExecutor()))
    yield orch
    orch.drivers["h1"].fabric.silence_guest("vmplane-v", 0)
    orch.close()


def test_a_guest_still_booting_on_the_source_is_waited_for_on_the_target(o, monkeypatch):
    monkeypatch.setattr(migrator_module, "GUEST_PROBE_S", 0.3)
    o.catalog.set_setting("vmplane.migration.guest.timeout", "1", "cluster", "c1")  # shorter than its boot
    o.catalog.set_setting("vmplane.migration.guest.boot.timeout", "30", "cluster", "c1")
    source, target = hosts(o)
    o.drivers[source].fabric.silence_guest("vmplane-v", 4.0)  # answers 4 s from now (booting)
    row = o.migrator.migrate("v")
    assert row["state"] == "succeeded", row
    assert row["stats"]["guest_before"] == "not answering"
    assert row["stats"]["guest_check"].startswith("answered") and "still booting" in row["stats"]["guest_check"]
    assert o.vm("v").host.name == target and where(o) == [target]


def test_a_moved_vm_whose_guest_does_not_answer_is_moved_unhealthy_never_failed(o, monkeypatch):
    monkeypatch.setattr(migrator_module, "GUEST_PROBE_S", 0.2)
    o.catalog.set_setting("vmplane.migration.guest.boot.timeout", "1", "cluster", "c1")
    source, target = hosts(o)
    o.drivers[source].fabric.silence_guest("vmplane-v")  # never answers
    row = o.migrator.migrate("v")
    assert row["state"] == MigrationState.moved_unhealthy.value, row
    assert f"moved to {target}" in row["reason"] and "no answer" in row["reason"], row
    vm = o.vm("v")
    assert vm.host.name == target and vm.state == "running" and where(o) == [target]
    assert used(o, source) == 0 and used(o, target) > GIB  # the claims followed it


# -- N11: tuning is an admin's ---------------------------------------------------------------------------
def test_the_tuning_rule():
    assert tuning_refusal({}, admin=False) is None
    assert tuning_refusal({"postcopy_bandwidth_mib_s": 1}, admin=False)[:2] == ("forbidden", "postcopy_bandwidth_mib_s")
    assert tuning_refusal({"max_downtime_ms": 10}, admin=False)[:2] == ("forbidden", "max_downtime_ms")
    assert tuning_refusal({"postcopy_bandwidth_mib_s": 1}, admin=True)[:2] == ("invalid", "postcopy_bandwidth_mib_s")
    assert tuning_refusal({"postcopy_bandwidth_mib_s": POSTCOPY_BANDWIDTH_FLOOR_MIB_S}, admin=True) is None


@pytest.fixture
def member(orch, api):
    add_sim_hosts(orch, 2)
    orch.catalog.create_offering(Offering("o", OfferingKind.fixed, vcpus=1, memory_mib=512))
    orch.catalog.create_template("t", "tiny-linux")
    orch.catalog.create_project("a", 8, 16384, 10)
    orch.create_vm("a-run", "a", "o", "t", start=True)
    token = api.post("/api/v1/tokens", json={"name": "m-a", "role": "member", "project": "a"}).json()["token"]
    return {"Authorization": f"Bearer {token}"}


@pytest.mark.parametrize(
    "field,value",
    [("postcopy_bandwidth_mib_s", 1), ("bandwidth_mib_s", 1), ("max_downtime_ms", 100000), ("postcopy", True)],
)
def test_a_member_may_not_tune_a_migration_and_nothing_is_admitted(orch, api, member, field, value):
    r = api.post("/api/v1/vms/a-run/migrate", json={field: value}, headers=member)
    assert r.status_code == 403 and r.json()["field"] == field, r.text
    assert orch.migrator.list(vm="a-run") == [] and orch.vm("a-run").state == "running"


def test_a_member_chooses_a_named_policy_and_an_admin_meets_the_postcopy_floor(orch, api, member):
    r = api.post("/api/v1/vms/a-run/migrate", json={"postcopy_bandwidth_mib_s": 1})  # as admin
    assert r.status_code == 422 and r.json()["field"] == "postcopy_bandwidth_mib_s", r.text
    assert "64 MiB/s" in r.json()["message"] and orch.migrator.list(vm="a-run") == []
    r = api.post("/api/v1/vms/a-run/migrate", json={"policy": "hypervisor-default"}, headers=member)
    assert r.status_code == 202, r.text
    assert orch.migrator.get(r.json()["id"])["params"]["policy"] == "hypervisor-default"


def test_an_admin_may_tune_at_or_above_the_floor(orch, api, member):
    r = api.post("/api/v1/vms/a-run/migrate", json={"postcopy_bandwidth_mib_s": 64, "max_downtime_ms": 300})
    assert r.status_code == 202, r.text


# -- the CLI's exit code for a VM that moved with a guest that does not answer ------------------------------
def run_json(live, *args):
    r = live.cli(*args, "--output", "json")
    assert r.returncode == 0, f"{args}: {r.stdout} {r.stderr}"
    return json.loads(r.stdout)


def test_vm_migrate_wait_exits_3_when_the_vm_moved_but_its_guest_does_not_answer(live):
    run_json(live, "setting", "set", "vmplane.migration.guest.boot.timeout", "1")
    run_json(live, "project", "create", "acme", "--vcpus", "8", "--memory", "8GiB")
    run_json(live, "offering", "create", "small", "--kind", "fixed", "--vcpus", "1", "--memory", "512MiB")
    source = run_json(
        live, "vm", "create", "w1", "--project", "acme", "--offering", "small", "--template", "tiny-linux", "--start"
    )["host"]
    live.sim_fabric().silence_guest("vmplane-w1")  # a guest that never answers its console
    r = live.cli("vm", "migrate", "w1", "--output", "json")
    assert r.returncode == 3, r.stdout + r.stderr
    mig = json.loads(r.stdout)
    assert mig["state"] == "moved-unhealthy" and mig["target"] != source, mig
    assert run_json(live, "vm", "show", "w1")["host"] == mig["target"]  # it runs there, recorded there
