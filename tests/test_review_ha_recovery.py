"""Review 2026-12-02, HA recovery (N4, N12) and its minor items: a recovery that meets an error is run
again, a restart on a disk lock waits for the lock, a host that answers mid-fence is not fenced at once,
HA restarts take the admissions' lock, a drain's dry run leaves the capacity index alone. Each test
fails without its fix."""

from __future__ import annotations

import datetime as dt
import threading

import pytest
from sqlalchemy import text, update
from sqlalchemy.exc import OperationalError

from vmplane.controllers.harecovery import HostRecovery
from vmplane.core.errors import Conflict
from vmplane.core.model import HostState
from vmplane.store import Database
from vmplane.store import ledger as L
from vmplane.store.admission import ADMISSION_LOCK
from vmplane.store.schema import utcnow

from . import stores
from .test_ha_sim import close_ha_plane, fail, ha_plane, on_h1, recovery, restarts, wait_for


@pytest.fixture
def ha(db):
    o = ha_plane(db)
    yield o
    close_ha_plane(o)


# -- minor: a host that answers mid-fence starts its silence again -----------------------------------


def test_a_host_given_back_mid_fence_is_not_declared_again_at_once(ha):
    o = ha
    o.catalog.set_setting("vmplane.ha.grace", "30")
    on_h1(o, [("a", "restart", 0)])
    o.drivers["h1"].fabric.set_fence_broken("h1", "BMC busy")
    fail(o, "h1", "network")
    with o.db.transaction() as conn:  # silent for a minute already: past the grace
        conn.execute(
            update(L.HOSTS).where(L.HOSTS.c.name == "h1").values(down_since=utcnow() - dt.timedelta(seconds=60))
        )
    assert o.ha.check(), "h1 is declared failed"
    wait_for(lambda: "fencing failed" in (o.host("h1").state_reason or ""), 10, "a failed fencing attempt")
    o.drivers["h1"].fabric.recover_host("h1")  # it answers again before it was fenced
    wait_for(lambda: recovery(o, "h1").state == "failed", 10, "the recovery to give h1 back")
    assert o.host("h1").state == "down"
    assert o.ha.check() == [], "a host that just answered is not declared failed again within the grace"
    o.check_hosts()
    assert o.host("h1").state == "enabled" and o.vm("a").state == "running" and o.vm("a").host.name == "h1"


# -- minor: a drain's dry run never touches the shared capacity index --------------------------------


def test_a_drains_dry_run_leaves_the_capacity_index_exact_meanwhile(ha):
    o = ha
    on_h1(o, [("a", "off", 0), ("b", "off", 0)])
    seen: list[list[str]] = []
    plan = o.migrator.plan

    def plan_then_audit(vm, to, **kw):  # a real admission meanwhile sees what the audit sees
        placement = plan(vm, to, **kw)
        seen.append([p for p in o.audit() if "index" in p])
        return placement

    o.migrator.plan = plan_then_audit
    result = o.maintenance.enter("h1", dry_run=True)
    assert [m["vm"] for m in result["migrations"]] == ["a", "b"] and len(seen) == 2
    assert seen == [[], []], seen
    assert o.host("h1").state == "enabled"


# -- minor: an HA restart waits for the admissions' lock, as a start does ----------------------------


@pytest.fixture
def pg_ha(postgres):
    database = Database(stores.postgres_url(migrated=True))
    o = ha_plane(database)
    yield o
    close_ha_plane(o)
    database.dispose()


def _waiting_for_admission_lock(o) -> bool:
    with o.db.read() as s:
        return bool(
            s.connection()
            .execute(
                text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND objid = :key"),
                {"key": ADMISSION_LOCK},
            )
            .scalar()
        )


def test_an_ha_restart_takes_the_admission_lock_as_starts_do(pg_ha):
    o = pg_ha
    on_h1(o, [("a", "restart", 0)])
    fail(o, "h1", "power")
    holder = o.db.engine.connect()
    tx = holder.begin()
    holder.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": ADMISSION_LOCK})  # an admission elsewhere
    try:
        threading.Thread(target=o.ha.check, daemon=True).start()
        wait_for(lambda: _waiting_for_admission_lock(o), 20, "the HA restart to wait for the admissions' lock")
        assert o.vm("a").state == "unknown" and o.vm("a").host.name == "h1"  # nothing claimed meanwhile
    finally:
        tx.rollback()
        holder.close()
    wait_for(lambda: o.vm("a").state == "running", 30, "the restart once the admission ended")
    assert o.vm("a").host.name in ("h2", "h3")


# -- N4: one exception in an HA recovery never strands its fenced host's HA VMs ----------------------


def _pass_fails_once(monkeypatch, exc: Exception) -> list[int]:
    """HostRecovery._pass raises `exc` the first time (the host is fenced by then)."""
    calls = []
    original = HostRecovery._pass

    def failing(self, op_id, host):
        calls.append(1)
        if len(calls) == 1:
            raise exc
        return original(self, op_id, host)

    monkeypatch.setattr(HostRecovery, "_pass", failing)
    return calls


def _drive_until(o, predicate, what: str, timeout: float = 30) -> None:
    """The HA controller and the host monitor, as their loops run them, until `predicate()`."""

    def step():
        o.ha.check()
        o.check_hosts()
        return predicate()

    wait_for(step, timeout, what)


def test_a_database_error_in_a_recovery_does_not_strand_its_ha_vms(ha, monkeypatch):
    o = ha
    on_h1(o, [("a", "restart", 0)])
    calls = _pass_fails_once(monkeypatch, OperationalError("SELECT 1", {}, Exception("server closed the connection")))
    fail(o, "h1", "power")
    _drive_until(o, lambda: o.vm("a").state == "running", "the HA VM to run again")
    assert o.vm("a").host.name in ("h2", "h3") and len(calls) >= 2
    assert o.host("h1").state == "fenced"
    with pytest.raises(Conflict, match="nothing is left to recover"):
        o.ha.fence("h1")
    assert o.audit() == []


def _failed_recovery(o, monkeypatch) -> None:
    """h1 fenced, its recovery ended failed by an error it could not get past; `a` unknown on it."""
    _pass_fails_once(monkeypatch, RuntimeError("a defect"))
    fail(o, "h1", "power")
    assert o.ha.declare("h1", "declared by the test")  # as check() does, without its resuming pass
    wait_for(lambda: recovery(o, "h1") is not None and recovery(o, "h1").state == "failed", 30, "the recovery to fail")
    assert o.host("h1").state == "fenced" and o.vm("a").state == "unknown" and o.vm("a").host.name == "h1"


def test_the_ha_controller_recovers_again_a_fenced_host_left_with_unknown_ha_vms(ha, monkeypatch):
    o = ha
    on_h1(o, [("a", "restart", 0)])
    _failed_recovery(o, monkeypatch)
    first = recovery(o, "h1").id
    _drive_until(o, lambda: o.vm("a").state == "running", "the HA VM to run again")
    assert recovery(o, "h1").id != first and o.vm("a").host.name in ("h2", "h3")


def test_fence_confirm_off_on_a_host_left_fenced_starts_a_recovery(ha, monkeypatch):
    o = ha
    on_h1(o, [("a", "restart", 0)])
    _failed_recovery(o, monkeypatch)
    answer = o.ha.fence("h1", confirm_off=True)
    assert answer["operation"]  # a new recovery, not a 409
    wait_for(lambda: o.vm("a").state == "running", 30, "the HA VM to run again")
    wait_for(lambda: recovery(o, "h1").state == "succeeded", 30, "the recovery to end")  # (else: "runs already")
    with pytest.raises(Conflict, match="nothing is left to recover"):
        o.ha.fence("h1", confirm_off=True)


def test_host_recover_runs_a_failed_recovery_again_and_refuses_when_nothing_is_left(ha, monkeypatch):
    from fastapi.testclient import TestClient

    from vmplane.server import create_app

    from .conftest import ADMIN_TOKEN

    o = ha
    on_h1(o, [("a", "restart", 0)])
    _failed_recovery(o, monkeypatch)
    o.catalog.ensure_admin_token("admin", ADMIN_TOKEN)
    with TestClient(create_app(o), headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as client:
        r = client.post("/api/v1/hosts/h1/recover")
    assert r.status_code == 200, r.text
    assert r.json()["operation"] and r.json()["state"] == "fenced"
    wait_for(lambda: o.vm("a").state == "running", 30, "the HA VM to run again")
    wait_for(lambda: recovery(o, "h1").state == "succeeded", 30, "the recovery to end")  # (else: "runs already")
    with pytest.raises(Conflict, match="nothing is left to recover"):
        o.ha.recover("h1")


def test_a_restart_failed_through_fail_never_leaves_its_vm_starting(ha, monkeypatch):
    """The restart variant: its final transaction fails; Orchestrator._fail asks the host."""
    o = ha
    on_h1(o, [("a", "restart", 0)])
    original = HostRecovery._record
    failed = []

    def record(conn, op_id, key, vm, value):
        if key == "restarted" and not failed:
            failed.append(1)
            raise RuntimeError("the final write failed")
        return original(conn, op_id, key, vm, value)

    monkeypatch.setattr(HostRecovery, "_record", staticmethod(record))
    fail(o, "h1", "power")
    _drive_until(o, lambda: o.vm("a").state == "running" and failed, "the HA VM to run")
    restart = restarts(o)
    assert o.vm("a").state == "running" and o.vm("a").host.name in ("h2", "h3")
    assert all(op.state in ("succeeded", "failed") for op in restart)
    assert o.audit() == []


# -- N12: an HA restart refused on a disk lock waits for the lock's release window -------------------

LOCK_HOLD_S = 4.0


def _with_shared_disk(o) -> None:
    o.catalog.create_template("disk", "tiny-linux", disk="tiny-linux")
    o.catalog.set_quota("p", storage_mib=100_000)
    o.pools.create("shared", "shared", cluster="c1")


def _ha_disk_vm_on_h1(o) -> None:
    """The HA VM `d`, its disk on the shared pool, running on h1 (the other hosts disabled meanwhile)."""
    for other in ("h2", "h3"):
        o.set_host_state(other, HostState.disabled)
    o.create_vm("d", "p", "one", "disk", start=True, pool="shared", ha_policy="restart")
    wait_for(lambda: o.vm("d").state == "running", 10, "d to run")
    for other in ("h2", "h3"):
        o.set_host_state(other, HostState.enabled)


def test_an_ha_restart_refused_on_a_lock_that_outlives_the_fence_waits_for_it(ha):
    o = ha
    _with_shared_disk(o)
    o.catalog.set_setting("vmplane.ha.max.restart", "1")  # without the window: error at the first refusal
    _ha_disk_vm_on_h1(o)
    fabric = o.drivers["h1"].fabric
    fabric.set_lock_hold("h1", LOCK_HOLD_S)  # its NFS lease: the lock outlives the power-off
    fail(o, "h1", "power")
    assert o.ha.check()
    wait_for(lambda: o.vm("d").state in ("running", "error"), 60, "the restart to end")
    assert o.vm("d").state == "running" and o.vm("d").host.name in ("h2", "h3")
    refused = [op for op in restarts(o) if op.state == "failed"]
    assert refused and all("lock" in op.message for op in refused), [op.message for op in restarts(o)]
    wait_for(lambda: recovery(o, "h1").state == "succeeded", 10, "the recovery to end")
    assert o.audit() == []


def test_past_the_lock_release_window_the_restart_spends_its_attempts(ha):
    o = ha
    _with_shared_disk(o)
    o.catalog.set_setting("vmplane.ha.max.restart", "1")
    o.catalog.set_setting("vmplane.ha.lock.release.window", "0")
    _ha_disk_vm_on_h1(o)
    o.drivers["h1"].fabric.set_lock_hold("h1", 3600)
    fail(o, "h1", "power")
    assert o.ha.check()
    wait_for(lambda: o.vm("d").state in ("running", "error"), 30, "the restart to end")
    assert o.vm("d").state == "error" and "lock" in recovery(o, "h1").result["failed"]["d"]


def test_lock_refusals_are_told_from_other_failures():
    from vmplane.controllers.harecovery import lock_refusal, within_lock_window

    assert lock_refusal('restart on h2 failed: internal error: Failed to get "write" lock')
    assert lock_refusal("resource busy: Lockspace resource '/s/d.qcow2' is locked")
    assert not lock_refusal("no host has room for 1 vCPU(s)")
    assert within_lock_window(100.0, 279.0, 180) and not within_lock_window(100.0, 280.0, 180)


# -- N3, scenario B: a restart whose start failed and whose host stumbled once on the read-back -----


def test_a_failed_restart_whose_host_stumbles_once_is_tried_again_not_left_unknown(ha, monkeypatch):
    """The restart's start fails on its new host and that host's next domain() errors once (a reconnect):
    the host is asked again, the domain is found gone there, and the recovery restarts the VM: it runs.
    Before, the VM was left `unknown` on the new host, the recovery counted it as done, and the HA VM was
    never restarted."""
    from vmplane.core.driver import DriverError
    from vmplane.hosts.drivers.sim import SimDriver

    o = ha
    on_h1(o, [("a", "restart", 0)])
    start, domain = SimDriver.start, SimDriver.domain
    broken = {"start": 1, "domain": 0}

    def failing_start(self, spec):
        if spec.name.endswith("-a") and broken["start"]:
            broken["start"] -= 1
            broken["domain"] = 1  # the read-back that follows stumbles once
            raise DriverError(self.name, "start refused")
        return start(self, spec)

    def stumbling_domain(self, name):
        if name.endswith("-a") and broken["domain"]:
            broken["domain"] -= 1
            raise DriverError(self.name, "connection reset; reconnecting")
        return domain(self, name)

    monkeypatch.setattr(SimDriver, "start", failing_start)
    monkeypatch.setattr(SimDriver, "domain", stumbling_domain)
    fail(o, "h1", "power")
    _drive_until(o, lambda: o.vm("a").state == "running", "the HA VM to run again")
    assert o.vm("a").host.name in ("h2", "h3")
    assert broken == {"start": 0, "domain": 0}, "the failure and the stumble both happened"
    assert any(op.state == "failed" for op in restarts(o)), "the first restart failed"
