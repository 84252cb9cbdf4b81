"""Quota-neutral live migration and host maintenance on sim hosts (the Harvester seed scenarios)."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from vmplane.core.errors import Conflict, InsufficientCapacity
from vmplane.core.migration import (
    Limits,
    MigrationSlot,
    MigrationState,
    blocking_limit,
    host_lost,
    startable,
    transition,
)
from vmplane.core.model import HostState, Offering, OfferingKind, Size, Usage
from vmplane.core.quota import overhead_mib
from vmplane.orchestrator import Orchestrator

from .conftest import add_sim_hosts
from .conftest import ledger_usage as usage

GIB = 1024


@pytest.fixture
def threaded(db):
    """An orchestrator whose operations and migrations run in threads (as in the API)."""
    o = Orchestrator(db, ThreadPoolExecutor(16))
    o.load()
    o.catalog.create_zone("z1")
    o.catalog.create_cluster("c1", "z1")
    o.catalog.create_template("t", "tiny-linux")
    yield o
    o.close()


def wait_migrations(o, ids, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = [o.migrator.get(i) for i in ids]
        if all(r["state"] in ("succeeded", "failed", "cancelled") for r in rows):
            return rows
        time.sleep(0.02)
    raise AssertionError(f"migrations still running: {[(r['vm_name'], r['state']) for r in rows]}")


def start_vms(o, project, offering, names):
    for n in names:
        o.create_vm(n, project, offering, "t", start=True)
    deadline = time.monotonic() + 10
    while any(o.vm(n).state != "running" for n in names):
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_seed_1_a_project_at_three_quarters_of_its_memory_quota_migrates_one_vm_then_all_three(threaded):
    o = threaded
    add_sim_hosts(o, 4, cores=16, memory_mib=64 * GIB)
    for h in o.drivers.values():
        h.copy_rate_mib_s = 64 * GIB  # 16 GiB in ~0.25 s: long enough to look at usage mid-copy
    o.catalog.create_offering(Offering("q4", OfferingKind.fixed, vcpus=4, memory_mib=16 * GIB))
    o.catalog.create_project("harvester", 64, 64 * GIB, 10, count_overhead=True)
    start_vms(o, "harvester", "q4", ["a", "b", "c"])
    before = usage(o, "harvester")
    assert before.memory_mib == 3 * (16 * GIB + overhead_mib(Size(4, 16 * GIB))) > 48 * GIB  # overhead counted

    first = o.migrator.migrate("a")
    assert usage(o, "harvester") == before  # not charged twice
    [done] = wait_migrations(o, [first["id"]])
    assert done["state"] == "succeeded" and o.vm("a").host.name == done["target"] != done["source"]
    assert usage(o, "harvester") == before

    ids = [o.migrator.migrate(n)["id"] for n in ("a", "b", "c")]
    time.sleep(0.05)
    assert usage(o, "harvester") == before  # during the copies
    assert all(r["state"] == "succeeded" for r in wait_migrations(o, ids))
    assert usage(o, "harvester") == before and o.audit() == []


def test_seed_3_two_vms_in_a_3_vcpu_4000_mib_project_migrate_concurrently(threaded):
    o = threaded
    add_sim_hosts(o, 2, cores=8, memory_mib=16 * GIB)
    o.catalog.create_offering(Offering("any", OfferingKind.custom_unconstrained))
    o.catalog.create_project("proj-a", 3, 4000, 10, count_overhead=True)
    o.create_vm("vm1", "proj-a", "any", "t", vcpus=1, memory_mib=1 * GIB, start=True)
    o.create_vm("vm2", "proj-a", "any", "t", vcpus=1, memory_mib=2 * GIB, start=True)
    time.sleep(0.2)
    before = usage(o, "proj-a")
    ids = [o.migrator.migrate("vm1")["id"], o.migrator.migrate("vm2")["id"]]
    assert all(r["state"] == "succeeded" for r in wait_migrations(o, ids))
    assert usage(o, "proj-a") == before and o.audit() == []


def test_at_exactly_100_percent_of_quota_every_vm_migrates_and_its_host_drains(threaded):
    o = threaded
    add_sim_hosts(o, 3, cores=16, memory_mib=32 * GIB)
    o.catalog.create_offering(Offering("two", OfferingKind.fixed, vcpus=2, memory_mib=2 * GIB))
    o.catalog.create_project("full", 100, 100 * GIB, 100, count_overhead=True)
    names = [f"v{i}" for i in range(6)]
    start_vms(o, "full", "two", names)
    used = usage(o, "full")
    o.catalog.set_quota("full", vcpus=used.vcpus, memory_mib=used.memory_mib, vms=used.vms)  # exactly full
    for n in names:
        assert wait_migrations(o, [o.migrator.migrate(n)["id"]])[0]["state"] == "succeeded"
    host = o.vm("v0").host.name
    result = o.maintenance.enter(host)
    assert result["unplaceable"] == [] and result["state"] == "maintenance"
    rows = wait_migrations(o, [m["migration"] for m in result["migrations"]])
    assert rows and all(r["state"] == "succeeded" for r in rows)
    assert all(v.host.name != host for v in o.vms())
    assert usage(o, "full") == used and o.audit() == []
    assert o.maintenance.exit(host)["state"] == "enabled"


def test_a_migration_to_a_host_without_room_is_refused_naming_host_and_resource(orch):
    add_sim_hosts(orch, 1, cores=16, memory_mib=64 * GIB, prefix="big")
    add_sim_hosts(orch, 1, cores=16, memory_mib=4 * GIB, prefix="small")
    orch.catalog.create_offering(Offering("eight", OfferingKind.fixed, vcpus=2, memory_mib=8 * GIB))
    orch.catalog.create_template("t", "tiny-linux")
    orch.catalog.create_project("p", 10, 64 * GIB, 10)
    orch.create_vm("v", "p", "eight", "t", start=True)
    with pytest.raises(InsufficientCapacity) as exc:
        orch.migrator.migrate("v", to="small1")
    assert "small1: memory 0 of 4096 MiB allocated" in exc.value.message and exc.value.field == "to"
    assert orch.vm("v").state == "running" and orch.migrator.list() == [] and orch.audit() == []
    for dry_run in (True, False):  # big1 is its own host; small1 is too small
        with pytest.raises(InsufficientCapacity) as exc:
            orch.migrator.migrate("v", dry_run=dry_run)
        assert "big1: the VM already runs here; small1: memory 0 of 4096 MiB" in exc.value.message
    add_sim_hosts(orch, 1, cores=16, memory_mib=64 * GIB, prefix="other")
    plan = orch.migrator.migrate("v", dry_run=True)
    assert plan["target"] == "other1" and plan["dry_run"] and plan["claim_memory_mib"] == 8192 + 292
    assert orch.migrator.list() == [] and orch.host_capacity("other1").used_vcpus == 0  # nothing changed


def test_ten_migrations_at_once_never_copy_more_than_two_from_one_host(threaded):
    o = threaded
    add_sim_hosts(o, 6, cores=64, memory_mib=256 * GIB)
    o.catalog.create_offering(Offering("one", OfferingKind.fixed, vcpus=1, memory_mib=1 * GIB))
    o.catalog.create_project("p", 100, 100 * GIB, 100)
    names = [f"v{i}" for i in range(10)]
    for n in names:
        o.create_vm(n, "p", "one", "t")
    for h in ("h2", "h3", "h4", "h5", "h6"):
        o.set_host_state(h, HostState.disabled)
    for n in names:  # all on h1
        o.start_vm(n)
    time.sleep(0.3)
    for h in ("h2", "h3", "h4", "h5", "h6"):
        o.set_host_state(h, HostState.enabled)
    for d in o.drivers.values():
        d.copy_rate_mib_s = 2 * GIB  # 0.5 s per 1 GiB VM: the ten are asked before one ends
    queued = [o.migrator.migrate(n) for n in names]  # each as the ask answered it: no race with the copies
    ids = [r["id"] for r in queued]
    assert sum(r["state"] == "queued" for r in queued) >= 8  # queued, not refused
    assert any(
        "leaving h1 (limit 2, vmplane.migration.max.outbound.per.host in cluster c1)" in r["waiting_for"]
        for r in queued
    )
    rows = wait_migrations(o, ids)
    assert all(r["state"] == "succeeded" for r in rows)
    events = sorted(
        [(r["started_at"], 1) for r in rows] + [(r["finished_at"], -1) for r in rows], key=lambda e: (e[0], e[1])
    )
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    assert peak == 2, f"peak concurrent copies {peak}"
    assert o.audit() == []


def test_a_queued_migration_can_be_cancelled_and_gives_back_its_target_claim(threaded):
    o = threaded
    add_sim_hosts(o, 2, cores=16, memory_mib=64 * GIB)
    o.catalog.create_offering(Offering("one", OfferingKind.fixed, vcpus=1, memory_mib=4 * GIB))
    o.catalog.create_project("p", 100, 100 * GIB, 100)
    o.catalog.set_setting("vmplane.migration.max.per.cluster", "1", "cluster", "c1")
    start_vms(o, "p", "one", ["a", "b"])
    for d in o.drivers.values():
        d.copy_rate_mib_s = 8 * GIB
    first, second = o.migrator.migrate("a"), o.migrator.migrate("b")
    assert o.migrator.get(second["id"])["state"] == "queued"
    assert o.migrator.cancel("b")["state"] == "cancelled" and o.vm("b").state == "running"
    o.migrator.cancel("a")  # copying: aborted, stays on its source
    rows = wait_migrations(o, [first["id"]])
    assert rows[0]["state"] == "cancelled" and o.vm("a").host.name == first["source"]
    assert o.audit() == []


def test_host_lost_rules():
    failed = {"f": "fenced", "d": "down"}
    assert host_lost("a", "b", failed) is None and host_lost("a", "b", {}) is None
    assert host_lost("a", "f", failed).startswith("not copied: its target f is fenced")
    assert host_lost("d", "b", failed).startswith("not copied: its source d is down")
    assert host_lost("d", "f", failed).startswith("not copied: its target f")  # the target is named first


def test_limits_rules():
    lim = Limits(per_cluster=3, outbound_per_host=2, inbound_per_host=1, per_project=2)

    def m(i, s, t, p="p"):
        return MigrationSlot(str(i), "c", s, t, p)

    assert blocking_limit(m(9, "a", "x"), [m(1, "a", "y"), m(2, "a", "z")], lim).startswith("2 migrations leaving a")
    assert blocking_limit(m(9, "b", "x"), [m(1, "a", "x")], lim).startswith("1 migration arriving on x")
    assert blocking_limit(m(9, "b", "q", "p"), [m(1, "a", "x"), m(2, "c", "y")], lim).startswith(
        "2 migrations of project p"
    )
    assert blocking_limit(m(9, "b", "q", "r"), [m(1, "a", "x"), m(2, "c", "y"), m(3, "d", "z", "s")], lim).startswith(
        "3 migrations copying in cluster c"
    )
    assert [x.id for x in startable([m(1, "a", "x"), m(2, "a", "y"), m(3, "a", "z")], [], lambda _: lim)] == ["1", "2"]
    with pytest.raises(Conflict):
        transition(MigrationState.succeeded, "cancel")


def test_quota_changes_are_allowed_while_migrations_run_and_lowering_below_usage_is_refused(threaded):
    o = threaded
    add_sim_hosts(o, 2, cores=16, memory_mib=64 * GIB)
    o.catalog.create_offering(Offering("one", OfferingKind.fixed, vcpus=2, memory_mib=4 * GIB))
    o.catalog.create_project("p", 4, 8 * GIB, 10)
    start_vms(o, "p", "one", ["a", "b"])  # exactly at the vCPU quota
    for d in o.drivers.values():
        d.copy_rate_mib_s = 8 * GIB  # 0.5 s per VM
    ids = [o.migrator.migrate(n)["id"] for n in ("a", "b")]
    o.catalog.set_quota("p", vcpus=8)  # raised during the copies
    with pytest.raises(Conflict, match="used 4, asked 3"):
        o.catalog.set_quota("p", vcpus=3)
    assert o.migrator.get(ids[0])["state"] in ("queued", "copying")
    assert all(r["state"] == "succeeded" for r in wait_migrations(o, ids))
    assert o.catalog.project("p").quota_vcpus == 8 and usage(o, "p") == Usage(4, 8 * GIB, 2) and o.audit() == []


def test_a_drain_lists_the_vms_that_fit_nowhere_and_leaves_them_running(threaded):
    o = threaded
    add_sim_hosts(o, 1, cores=32, memory_mib=64 * GIB, prefix="big")
    add_sim_hosts(o, 1, cores=32, memory_mib=8 * GIB, prefix="small")
    o.catalog.create_offering(Offering("any", OfferingKind.custom_unconstrained))
    o.catalog.create_project("p", 100, 100 * GIB, 10)
    o.set_host_state("small1", HostState.disabled)
    o.create_vm("huge", "p", "any", "t", vcpus=2, memory_mib=32 * GIB, start=True)
    o.create_vm("tiny", "p", "any", "t", vcpus=1, memory_mib=1 * GIB, start=True)
    time.sleep(0.2)
    o.maintenance.exit("small1")
    plan = o.maintenance.enter("big1", dry_run=True)
    assert [m["vm"] for m in plan["migrations"]] == ["tiny"] and plan["unplaceable"][0]["vm"] == "huge"
    assert o.host_capacity("big1").state.value == "enabled" and o.host_capacity("small1").used_vcpus == 0
    result = o.maintenance.enter("big1")
    [item] = result["unplaceable"]
    assert item["vm"] == "huge" and "small1: memory" in item["reason"]
    wait_migrations(o, [m["migration"] for m in result["migrations"]])
    assert o.vm("huge").state == "running" and o.vm("huge").host.name == "big1"  # reported, not stopped
    assert o.vm("tiny").host.name == "small1" and o.audit() == []


def test_a_migration_cancelled_while_the_queue_decides_to_start_it_is_not_started(orch, monkeypatch):
    """Found by the crash harness: the queue read `queued`, a cancel ended it, and the queue started
    it anyway; the copy then moved the VM on a claim the cancel had given back."""
    from vmplane.controllers import migrator as migrator_module

    add_sim_hosts(orch, 2)
    orch.catalog.create_offering(Offering("one", OfferingKind.fixed, vcpus=1, memory_mib=GIB))
    orch.catalog.create_template("t", "tiny-linux")
    orch.catalog.create_project("p", 10, 64 * GIB, 10)
    orch.create_vm("v", "p", "one", "t", start=True)
    source = orch.vm("v").host.name
    decide = migrator_module.rules.startable

    def cancelled_meanwhile(queued, copying, limits_of):
        chosen = decide(queued, copying, limits_of)
        for slot in chosen:  # what a concurrent `vm migrate --cancel` does first
            orch.migrator._finish(slot.id, "cancel", reason="cancelled")
        return chosen

    monkeypatch.setattr(migrator_module.rules, "startable", cancelled_meanwhile)
    mig = orch.migrator.migrate("v")
    assert orch.migrator.get(mig["id"])["state"] == "cancelled"
    assert orch.vm("v").host.name == source and orch.vm("v").state == "running" and orch.audit() == []
