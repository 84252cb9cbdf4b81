"""Start-up reconcile looks at every host of a VM's zone (review findings 1.2 and 4): a VM whose domain runs
on another host (a migration whose client connection was lost completed behind vmplane's back) is
adopted there, its claim following, or set unknown when that host has no room; a VM is recorded stopped
only when every host of its zone answered and none runs it; a host that can not be asked changes nothing."""

from __future__ import annotations

import uuid

import pytest

from vmplane.core.driver import DriverError
from vmplane.core.model import Offering, OfferingKind
from vmplane.hosts.drivers.simfabric import SimFabric
from vmplane.store import ledger as L

from .conftest import add_sim_hosts, ledger_usage


@pytest.fixture
def cluster(orch):
    add_sim_hosts(orch, 3, cores=8, memory_mib=16384)
    orch.catalog.create_offering(Offering("one", OfferingKind.fixed, vcpus=1, memory_mib=1024))
    orch.catalog.create_offering(Offering("huge", OfferingKind.fixed, vcpus=8, memory_mib=2048))
    orch.catalog.create_template("t", "tiny-linux")
    orch.catalog.create_project("p", 64, 262144, 20)
    return orch


def run(o, name: str, offering: str = "one") -> str:
    o.create_vm(name, "p", offering, "t", start=True)
    return o.vm(name).host.name


def moved_behind_our_back(o, name: str, source: str, target: str) -> None:
    assert SimFabric.for_store(o.db.url).move(f"vmplane-{name}", source, target)


def other(host: str, *besides: str) -> str:
    return next(h for h in ("h1", "h2", "h3") if h != host and h not in besides)


def used(o, host: str) -> tuple[int, int]:
    h = o.host(host)
    return h.used_vcpus, h.used_memory_mib


def vm_events(o, vm: str) -> list:
    from vmplane.store.events import EVENTS

    with o.db.read() as s:
        return s.connection().execute(EVENTS.select().where(EVENTS.c.vm == vm).order_by(EVENTS.c.id)).all()


def test_a_vm_that_runs_on_another_host_is_adopted_there_with_its_claim(cluster):
    o = cluster
    source = run(o, "v")
    target = other(source)
    footprint = used(o, source)
    charged = ledger_usage(o, "p")
    moved_behind_our_back(o, "v", source, target)
    findings = o.reconcile()
    vm = o.vm("v")
    assert vm.state == "running" and vm.host.name == target, findings
    assert used(o, source) == (0, 0) and used(o, target) == footprint  # the claim moved
    assert o.host_capacity(target).used_vcpus == footprint[0]  # and the index with it
    assert o.host_capacity(source).used_vcpus == 0
    assert ledger_usage(o, "p") == charged  # quota-neutral
    assert o.audit() == []
    [moved] = [e for e in vm_events(o, "v") if e.kind == "vm" and "adopted" in e.message]
    assert f"moved from {source} to {target}" in moved.message
    assert any("adopted there" in f for f in findings)


def test_a_vm_that_runs_on_a_host_without_room_is_set_unknown_naming_both_and_keeps_its_claim(cluster):
    o = cluster
    source = run(o, "v")
    target = other(source)
    o.create_vm("big", "p", "huge", "t", start=True)
    big_host = o.vm("big").host.name
    if big_host != target:  # put the big VM's domain and claim on the target
        target = big_host
    moved_behind_our_back(o, "v", source, target)
    footprint = used(o, source)
    o.reconcile()
    vm = o.vm("v")
    assert vm.state == "unknown" and vm.host.name == source
    assert used(o, source) == footprint  # the claim stays
    note = [e for e in vm_events(o, "v") if e.new_state == "unknown"][-1].message
    assert source in note and target in note and "no room" in note
    ledger_usage(o, "p")
    # its old host answering again (the monitor, the sync) must not record it stopped: it runs elsewhere
    from vmplane.plane.settle import settle_vm

    assert settle_vm(o.plane, "v", source, "monitor", f"host {source} is back") is None
    assert o.vm("v").state == "unknown" and used(o, source) == footprint


def test_a_vm_is_recorded_stopped_only_when_no_host_of_its_zone_runs_it(cluster):
    o = cluster
    host = run(o, "v")
    SimFabric.for_store(o.db.url).remove(host, "vmplane-v")
    o.reconcile()
    vm = o.vm("v")
    assert vm.state == "stopped" and vm.charged_vcpus == 0 and used(o, host) == (0, 0)
    assert ledger_usage(o, "p").vcpus == 0 and o.audit() == []


def test_another_host_of_the_zone_that_can_not_be_asked_leaves_the_vm_as_it_is(cluster, monkeypatch):
    o = cluster
    host = run(o, "v")
    silent = other(host)
    SimFabric.for_store(o.db.url).remove(host, "vmplane-v")

    def unreachable():
        raise DriverError(silent, "cannot connect: daemon restarting")

    monkeypatch.setattr(o.drivers[silent], "domains", unreachable)
    charged = ledger_usage(o, "p")
    findings = o.reconcile()
    assert o.vm("v").state == "running" and ledger_usage(o, "p") == charged
    assert any(silent in f and "left as it is" in f for f in findings)
    monkeypatch.undo()
    o.reconcile()
    assert o.vm("v").state == "stopped"


def test_its_own_host_that_can_not_be_asked_leaves_the_vm_as_it_is(cluster, monkeypatch):
    o = cluster
    host = run(o, "v")

    def unreachable():
        raise DriverError(host, "cannot connect")

    monkeypatch.setattr(o.drivers[host], "domains", unreachable)
    o.reconcile()
    assert o.vm("v").state == "running" and o.vm("v").host.name == host


def test_a_vm_with_an_active_migration_is_left_to_the_migration(cluster):
    o = cluster
    source = run(o, "v")
    target = other(source)
    moved_behind_our_back(o, "v", source, target)
    vm = o.vm("v")
    with o.db.transaction() as conn:  # a migration row still active (its recovery settles it)
        conn.execute(
            L.MIGRATIONS.insert().values(
                id=str(uuid.uuid4()),
                vm_id=vm.id,
                vm_name="v",
                project_id=vm.project_id,
                source_host_id=o.host(source).id,
                target_host_id=o.host(target).id,
                source=source,
                target=target,
                cluster="c1",
                state="queued",
                reason="",
                waiting_for="",
                progress=0,
            )
        )
    o.reconcile()
    assert o.vm("v").state == "running" and o.vm("v").host.name == source


def test_a_vm_running_on_two_other_hosts_is_set_unknown_naming_them(cluster):
    o = cluster
    source = run(o, "v")
    a = other(source)
    b = other(source, a)
    fabric = SimFabric.for_store(o.db.url)
    spec = fabric.spec(source, "vmplane-v")
    fabric.remove(source, "vmplane-v")
    fabric.put(a, spec)
    fabric.put(b, spec)
    o.reconcile()
    vm = o.vm("v")
    assert vm.state == "unknown" and vm.host.name == source
    note = [e for e in vm_events(o, "v") if e.new_state == "unknown"][-1].message
    assert a in note and b in note


def test_recovery_at_start_up_adopts_through_a_restart(cluster, db):
    from vmplane.orchestrator import InlineExecutor, Orchestrator

    o = cluster
    source = run(o, "v")
    target = other(source)
    o.close()
    moved_behind_our_back(o, "v", source, target)
    again = Orchestrator(db, InlineExecutor())
    try:
        again.load()
        assert again.vm("v").state == "running" and again.vm("v").host.name == target
        assert again.audit() == []
        causes = {e.cause for e in vm_events(again, "v") if "adopted" in e.message}
        assert causes == {"recovery"}
    finally:
        again.close()
