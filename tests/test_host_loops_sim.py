"""Listening to the hosts, on sim hosts: the periodic full sync, what a lifecycle event changes, the
host monitor across a flap (maintenance kept, every VM reconciled), and start-up recovery that runs
in the background while the API answers. No duration is asserted: how soon the sync loop records a
vanished domain is measured by bench/timing.py."""

from __future__ import annotations

import threading
import time

import pytest
from fastapi.testclient import TestClient

from vmplane import server
from vmplane.controllers.hostevents import STOPPED
from vmplane.core.driver import DriverError
from vmplane.core.migration import MigrationState
from vmplane.core.model import HostState, Offering, OfferingKind
from vmplane.hosts.drivers.sim import SimDriver
from vmplane.hosts.drivers.simfabric import SimFabric
from vmplane.store import ledger as L

from .conftest import ADMIN_TOKEN, add_sim_hosts, ledger_usage
from .stores import store_url


@pytest.fixture
def cluster(orch):
    add_sim_hosts(orch, 2, cores=8, memory_mib=16384)
    orch.catalog.create_offering(Offering("one", OfferingKind.fixed, vcpus=1, memory_mib=1024))
    orch.catalog.create_template("t", "tiny-linux")
    orch.catalog.create_project("p", 16, 65536, 20)
    return orch


def run(o, name: str) -> str:
    o.create_vm(name, "p", "one", "t", start=True)
    vm = o.vm(name)
    assert vm.state == "running"
    return vm.host.name


def vm_events(o, vm: str) -> list:
    from vmplane.store.events import EVENTS

    with o.db.read() as s:
        return s.connection().execute(EVENTS.select().where(EVENTS.c.vm == vm).order_by(EVENTS.c.id)).all()


def host_used(o, host: str) -> tuple[int, int]:
    h = o.host(host)
    return h.used_vcpus, h.used_memory_mib


def wait_for(predicate, timeout: float, what: str) -> None:
    """A bounded wait on a condition; `timeout` generous (tens of seconds): a loaded machine is slow."""
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


class PacedStop(threading.Event):
    """A loop's stop event that notes each pause the loop asks of it (loops.every waits on it between passes)."""

    def __init__(self):
        super().__init__()
        self.pauses: list[float] = []

    def wait(self, timeout=None):
        self.pauses.append(timeout)
        return super().wait(timeout)


# -- the periodic full sync ----------------------------------------------------------------------
def test_the_sync_loop_records_a_vm_whose_domain_vanished_stopped_paced_by_its_interval(cluster):
    o = cluster
    host = run(o, "gone")
    run(o, "kept")
    charged = ledger_usage(o, "p")
    o.catalog.set_setting("vmplane.host.sync.interval", 1)
    SimFabric.for_store(o.db.url).remove(host, "vmplane-gone")  # behind vmplane's back
    o.sync._stop = stop = PacedStop()
    o.sync.start()
    wait_for(lambda: o.vm("gone").state == "stopped", 60, "the sync to record it stopped")
    assert stop.pauses and set(stop.pauses) == {1.0}  # its passes paced by the setting (not 30 s)
    assert o.vm("kept").state == "running"
    usage = ledger_usage(o, "p")  # ledger == recomputed
    assert (usage.vcpus, usage.memory_mib) == (charged.vcpus - 1, charged.memory_mib - o.vm("kept").charged_memory_mib)
    assert o.vm("gone").host is None and o.vm("gone").charged_vcpus == 0
    assert not [p for p in o.audit() if "gone" in p]
    [event] = [e for e in vm_events(o, "gone") if e.new_state == "stopped"]
    assert event.cause == "sync" and "does not run it" in event.message


def test_the_sync_reports_a_domain_running_where_the_record_says_stopped_and_does_not_kill_it(cluster):
    o = cluster
    host = run(o, "ghost")
    o.stop_vm("ghost", force=True)
    assert o.vm("ghost").state == "stopped"
    fabric = SimFabric.for_store(o.db.url)
    from vmplane.core.driver import DomainSpec

    fabric.put(host, DomainSpec("vmplane-ghost", 1, 1, 1024, 1024, "tiny-linux"))  # started by hand
    findings = o.sync.sync()
    assert any("vmplane-ghost" in f and "recorded stopped" in f for f in findings), findings
    assert fabric.hosts_of("vmplane-ghost") == [host]  # reported, not killed
    assert o.vm("ghost").state == "stopped"
    assert any(e.cause == "sync" and "not killed" in e.message for e in vm_events(o, "ghost"))
    assert o.sync.sync() == []  # reported once


# -- a lifecycle event -------------------------------------------------------------------------------
def test_a_stopped_event_settles_the_vm_from_what_its_host_says_and_ignores_owned_vms(cluster):
    o = cluster
    host = run(o, "dies")
    SimFabric.for_store(o.db.url).remove(host, "vmplane-dies")
    assert o.host_events.handle(host, "vmplane-dies", STOPPED, 1) == "stopped"
    vm = o.vm("dies")
    assert vm.state == "stopped" and vm.charged_vcpus == 0 and host_used(o, host) == (0, 0)
    [event] = [e for e in vm_events(o, "dies") if e.new_state == "stopped"]
    assert event.cause == "libvirt event" and "destroyed" in event.message
    # an event about a VM that runs (a late or duplicate event) changes nothing
    run(o, "lives")
    assert o.host_events.handle(o.vm("lives").host.name, "vmplane-lives", STOPPED, 1) is None
    assert o.vm("lives").state == "running"
    # an event for a host the VM is not recorded on (a migration's other side) changes nothing
    other = "h2" if o.vm("lives").host.name == "h1" else "h1"
    assert o.host_events.handle(other, "vmplane-lives", STOPPED, 3) is None


# -- the host monitor across a flap ------------------------------------------------------------------
def test_a_flapping_host_keeps_its_maintenance_state_and_every_vm_of_it_is_reconciled(cluster, monkeypatch):
    o = cluster
    for name in ("a", "b", "c", "d", "e"):
        o.create_vm(name, "p", "one", "t", start=True)
    host = o.vm("a").host.name
    names = [v.name for v in o.vms() if v.host is not None and v.host.name == host]
    o.set_host_state(host, HostState.maintenance)
    driver = o.drivers[host]
    fabric = SimFabric.for_store(o.db.url)

    def unreachable():
        raise DriverError(host, "cannot connect: daemon restarting")

    monkeypatch.setattr(driver, "domains", unreachable)
    monkeypatch.setattr(driver, "domain", lambda name: unreachable())
    o.check_hosts()
    assert o.host(host).state == "down" and o.host(host).state_before_down == "maintenance"
    assert {o.vm(n).state for n in names} == {"unknown"}
    # an operation's failure path puts a VM back to running while the host is down: unknown again
    with o.db.transaction() as conn:
        L.set_vm(conn, o.vm(names[0]).id, state="running")
    o.check_hosts()
    assert o.vm(names[0]).state == "unknown"
    # while it is down: one VM's domain goes; another VM is put back to running just before it returns
    fabric.remove(host, f"vmplane-{names[0]}")
    if len(names) > 1:
        fabric.remove(host, f"vmplane-{names[1]}")
        with o.db.transaction() as conn:
            L.set_vm(conn, o.vm(names[1]).id, state="running")
    monkeypatch.undo()
    o.check_hosts()
    assert o.host(host).state == "maintenance"  # not enabled: kept across the flap
    assert o.host(host).state_before_down is None
    assert o.host_capacity(host).state == HostState.maintenance  # placement still skips it
    assert o.vm(names[0]).state == "stopped"
    if len(names) > 1:
        assert o.vm(names[1]).state == "stopped"  # running, not unknown: reconciled too
    for n in names[2:]:
        assert o.vm(n).state == "running"
    ledger_usage(o, "p")
    assert not o.audit()
    causes = {e.cause for e in vm_events(o, names[0])}
    assert "monitor" in causes


def test_a_stop_that_fails_because_its_host_went_down_leaves_the_vm_unknown_not_running(cluster, monkeypatch):
    o = cluster
    host = run(o, "s")
    driver = o.drivers[host]

    def dies_mid_stop(name, timeout_s=0.0):
        monkeypatch.setattr(driver, "domains", lambda: (_ for _ in ()).throw(DriverError(host, "gone")))
        o.check_hosts()  # the monitor sees the host go while the stop runs
        raise DriverError(host, "connection lost")

    monkeypatch.setattr(driver, "stop", dies_mid_stop)
    o.stop_vm("s", force=True)  # InlineExecutor: runs (and fails) now
    vm = o.vm("s")
    assert vm.state == "unknown" and vm.charged_vcpus == 1  # kept charged: it may still run
    assert o.host(host).state == "down"


def test_a_probe_that_never_returns_counts_as_no_answer_at_its_deadline_and_holds_no_other_host(cluster, monkeypatch):
    from vmplane.controllers import hostmonitor

    o = cluster
    run(o, "x")
    hung, other = o.vm("x").host.name, "h2" if o.vm("x").host.name == "h1" else "h1"
    release, calls = threading.Event(), []

    def never_returns():  # a call that libvirt's keepalive never ends
        calls.append(1)
        release.wait(30)
        return []

    monkeypatch.setattr(hostmonitor, "PROBE_DEADLINE_S", 0.5)
    monkeypatch.setattr(o.drivers[hung], "domains", never_returns)
    try:
        changes = o.check_hosts()
        assert o.host(hung).state == "down" and o.vm("x").state == "unknown", changes
        assert "no answer within 0.5 s" in o.host(hung).state_reason
        assert o.host(other).state == "enabled"
        o.check_hosts()  # the probe still waits: not asked again, still not answering
        assert calls == [1] and o.host(hung).state == "down"
    finally:
        release.set()
    wait_for(lambda: o.monitor._probing[hung].done(), 60, "the hung probe to end")
    monkeypatch.undo()
    o.check_hosts()
    assert o.host(hung).state == "enabled" and o.vm("x").state == "running"


# -- start-up recovery in the background -------------------------------------------------------------
def test_up_answers_healthz_while_a_migration_recovery_still_waits_and_refuses_that_vm(tmp_path, monkeypatch):
    url = store_url(tmp_path)
    plane = server.build(url)
    o = plane.orchestrator
    o.catalog.create_zone("z1")
    o.catalog.create_cluster("c1", "z1")
    add_sim_hosts(o, 2, cores=8, memory_mib=16384)
    o.catalog.create_offering(Offering("one", OfferingKind.fixed, vcpus=1, memory_mib=1024))
    o.catalog.create_template("t", "tiny-linux")
    o.catalog.create_project("p", 16, 65536, 20)
    o.catalog.ensure_admin_token("admin", ADMIN_TOKEN)
    o.create_vm("moving", "p", "one", "t", start=True)
    o.create_vm("other", "p", "one", "t", start=True)
    wait_for(lambda: {o.vm("moving").state, o.vm("other").state} == {"running"}, 60, "VMs running")
    monkeypatch.setattr(o.migrator, "pump", lambda: None)  # admitted, never copied
    mig = o.migrator.migrate("moving")
    with o.db.transaction() as conn:  # as if killed mid-copy
        L.set_migration(conn, mig["id"], state=MigrationState.copying)
    monkeypatch.undo()
    plane.close()

    copying = threading.Event()  # libvirtd still carries the copy until this is set
    monkeypatch.setattr(SimDriver, "migration_active", lambda self, name: not copying.wait(0.05))
    built: dict = {}
    starter = threading.Thread(target=lambda: built.update(plane=server.build(url)), daemon=True)
    starter.start()
    try:
        starter.join(60)  # the copy never ends until `copying` is set: a build() that waited would not return
        assert "plane" in built, "build() (what `vmplane up` and `serve` run) waits for the migration's recovery"
        again = built["plane"]
        with TestClient(again.app, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as c:
            health = c.get("/healthz").json()
            assert health["status"] == "ok" and health["recovery"]["done"] is False
            assert health["recovery"]["pending_vms"] == 1
            rec = c.get("/api/v1/recovery").json()
            assert list(rec["vms"]) == ["moving"] and "migration" in rec["vms"]["moving"]
            r = c.post("/api/v1/vms/moving/stop")
            assert r.status_code == 409 and "still being recovered" in r.json()["message"]
            assert c.get("/api/v1/vms/moving").status_code == 200  # reads are fine
            assert c.post("/api/v1/vms/other/stop", json={"force": True}).status_code == 202  # others too
            copying.set()
            assert again.orchestrator.wait_recovered(10)
            assert c.get("/healthz").json()["recovery"]["done"] is True
            assert c.get("/api/v1/recovery").json()["vms"] == {}
            assert c.get(f"/api/v1/migrations/{mig['id']}").json()["state"] in ("failed", "succeeded")
            assert c.get("/api/v1/vms/moving").json()["state"] == "running"
    finally:
        copying.set()
        starter.join(30)
        if "plane" in built:
            built["plane"].close()
