"""Review 2026-12-02, N9: a control-plane process frozen inside a transaction (SIGSTOP, a paused virtual machine)
holds its PostgreSQL locks: the admissions' advisory lock, the KEY SHARE of its fencing check. vmplane sets
`lock_timeout` and `idle_in_transaction_session_timeout` (a few lease periods) on each write transaction, for
that transaction alone (what PgBouncer in transaction mode keeps), tags it with its controller epoch, and ends
the session of a holder that works for a lapsed epoch: the others go on admitting and take over its work."""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, insert, select, update
from sqlalchemy.exc import DBAPIError, OperationalError

from vmplane.core.leases import session_limits
from vmplane.plane.membership import CONTROLLERS, mark_lapsed
from vmplane.server import create_app
from vmplane.store import Database, ownership, pgsessions
from vmplane.store.admission import Batcher
from vmplane.store.events import EVENTS, record

from . import stores
from .conftest import ADMIN_TOKEN, add_basics, add_sim_hosts
from .multikit import PgBouncer, Planes
from .test_multiprocess import domains, seed, settled

LEASE_S = 1.0  # the in-process tests: one try of a wait that gives way lasts a third of a second
WAIT_S = 20.0  # a bound on waits that end in well under a second (the frozen side's idle timeout: 45 s)
PLANES_LEASE_S = 3.0
TERMINAL = ("succeeded", "failed", "cancelled")
_databases = itertools.count(1)


# -- the rule --------------------------------------------------------------------------------------------------
def test_the_timeouts_are_a_few_lease_periods_and_a_frozen_holder_is_ended_before_its_waiters_give_up():
    limits = session_limits(15.0)
    assert (limits.idle_ms, limits.lock_timeout_ms, limits.give_way_ms) == (45_000, 60_000, 5_000)
    for lease_s in (0.3, 1.0, 3.0, 15.0, 60.0):
        limits = session_limits(lease_s)
        assert 2 * lease_s * 1000 <= limits.idle_ms < limits.lock_timeout_ms <= 5 * lease_s * 1000
        assert 100 <= limits.give_way_ms <= max(100, lease_s * 1000 / 3)


def test_each_write_transaction_sets_its_limits_and_its_epoch_for_itself_only():
    sql = pgsessions.begin_sql(session_limits(3.0), 42)
    assert "set_config('lock_timeout', '12000ms', true)" in sql
    assert "set_config('idle_in_transaction_session_timeout', '9000ms', true)" in sql
    assert "set_config('application_name', 'vmplane e42', true)" in sql
    assert "vmplane'" in pgsessions.begin_sql(session_limits(3.0), None)


# -- in one process, on PostgreSQL -----------------------------------------------------------------------------
def _controller(db: Database, name: str) -> int:
    with db.transaction() as conn:
        now = ownership.db_now(conn)
        return int(
            conn.execute(
                insert(CONTROLLERS).values(
                    name=name,
                    hostname="test",
                    pid=os.getpid(),
                    state="live",
                    lease_s=15.0,
                    started_at=now,
                    renewed_at=now,
                    expires_at=now + 15.0,
                )
            ).inserted_primary_key[0]
        )


def _state(db: Database, epoch: int) -> str:
    with db.read() as s:
        return s.connection().execute(select(CONTROLLERS.c.state).where(CONTROLLERS.c.epoch == epoch)).scalar_one()


def _in_thread(fn) -> tuple[threading.Event, dict]:
    done, out = threading.Event(), {}

    def run():
        try:
            out["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - read by the test
            out["error"] = exc
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done, out


@pytest.fixture
def two_dbs(postgres):
    """The same store through two handles: `frozen` keeps the default lease (its own idle timeout, 45 s, never
    ends it within a test's wait), `db` has a short one."""
    url = stores.postgres_url(migrated=True)
    frozen, db = Database(url), Database(url)
    db.use_lease(LEASE_S)
    yield frozen, db
    frozen.dispose()
    db.dispose()


def test_on_postgresql_a_takeover_ends_the_session_of_a_lapsed_writer_frozen_in_its_transaction(two_dbs):
    """mark_lapsed waits for writes that passed their fencing check; one frozen there (its process stopped) is
    ended once the wait gave way, and the row is marked: what it wrote never lands."""
    frozen, db = two_dbs
    epoch = _controller(db, "frozen")

    def take_over():
        with db.transaction() as conn:
            mark_lapsed(conn, CONTROLLERS.c.epoch == epoch, db.limits)

    with (
        pytest.raises(DBAPIError),  # its commit: the session was ended
        ownership.owned(epoch),
        frozen.transaction() as conn,  # the check passed: it holds KEY SHARE
    ):
        record(conn, "vm", "frozen-write", message="written under the frozen process's lease")
        marked, out = _in_thread(take_over)
        assert marked.wait(WAIT_S), "the takeover is still waiting for the frozen transaction"
        assert "error" not in out, out
    assert _state(db, epoch) == "lapsed"
    with db.read() as s:
        assert (
            s.connection()
            .execute(select(func.count()).select_from(EVENTS).where(EVENTS.c.subject == "frozen-write"))
            .scalar_one()
            == 0
        )


def test_on_postgresql_an_admission_ends_the_session_of_a_lapsed_process_frozen_with_the_admissions_lock(two_dbs):
    frozen, db = two_dbs
    epoch = _controller(db, "frozen")
    with pytest.raises(DBAPIError), ownership.owned(epoch), frozen.transaction() as conn:
        Batcher(frozen, threading.RLock()).serialise(conn)  # holds the admissions' lock; then stops
        admitted, out = _in_thread(lambda: Batcher(db, threading.RLock()).run(lambda c: "admitted"))
        with db.transaction() as other:  # another process finds it lapsed
            other.execute(update(CONTROLLERS).where(CONTROLLERS.c.epoch == epoch).values(state="lapsed"))
        assert admitted.wait(WAIT_S), "the admission is still waiting for the frozen process's lock"
        assert out == {"result": "admitted"}, out


def test_on_postgresql_a_live_holder_of_the_admissions_lock_is_waited_for_never_ended(two_dbs):
    """Only a holder known to work for a lapsed epoch is ended; a live one is waited for, up to lock_timeout,
    and then the admission fails (nothing changed) while the holder commits."""
    frozen, db = two_dbs
    epoch = _controller(db, "slow")
    with ownership.owned(epoch), frozen.transaction() as conn:
        Batcher(frozen, threading.RLock()).serialise(conn)
        record(conn, "vm", "slow-write", message="written by a live, slow process")
        gave_up, out = _in_thread(lambda: Batcher(db, threading.RLock()).run(lambda c: "admitted"))
        assert gave_up.wait(WAIT_S)
        assert isinstance(out.get("error"), OperationalError) and pgsessions.lock_not_available(out["error"]), out
    assert _state(db, epoch) == "live"
    with db.read() as s:
        assert (
            s.connection()
            .execute(select(func.count()).select_from(EVENTS).where(EVENTS.c.subject == "slow-write"))
            .scalar_one()
            == 1
        )


def test_on_postgresql_a_request_that_finds_the_admissions_lock_held_past_lock_timeout_gets_409_and_changes_nothing(
    pg_orch,
):
    o = pg_orch
    o.db.use_lease(0.5)  # lock_timeout 2 s
    add_sim_hosts(o, 2)
    add_basics(o)
    o.catalog.create_project("p", 8, 1 << 20, 10)
    o.catalog.ensure_admin_token("admin", ADMIN_TOKEN)
    holder = Database(o.db.url)
    epoch = _controller(holder, "slow")
    body = {"name": "v1", "project": "p", "offering": "small", "template": "tiny", "start": True}
    try:
        with TestClient(create_app(o), headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as api:
            with ownership.owned(epoch), holder.transaction() as conn:  # a live process holds it
                Batcher(holder, threading.RLock()).serialise(conn)
                answer = api.post("/api/v1/vms", json=body)
            assert answer.status_code == 409 and "nothing changed, retry" in answer.json()["message"], answer.text
            assert api.get("/api/v1/vms/v1").status_code == 404
            assert api.post("/api/v1/vms", json=body).status_code in (201, 202)
    finally:
        holder.dispose()


# -- several `vmplane serve` processes -------------------------------------------------------------------------
def _wait(what: str, check, limit_s: float, planes: Planes):
    deadline = time.monotonic() + limit_s
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, f"{what}: not within {limit_s:.0f} s\n{planes.logs()[-6000:]}"
        time.sleep(0.1)


@pytest.mark.parametrize("through", ["postgresql", "pgbouncer"])
def test_a_process_frozen_inside_an_admission_stalls_no_other_admission_and_its_work_is_taken_over(
    tmp_path, postgres, through
):
    bouncer = None
    name = f"frozen{os.getpid()}x{next(_databases)}"
    url = postgres.create_database(name)
    if through == "pgbouncer":
        reason = PgBouncer.available()
        if reason:
            pytest.skip(reason)
        bouncer = PgBouncer(tmp_path, postgres).start()
        url = bouncer.url(name)
    lease = PLANES_LEASE_S
    # plane-1 stops itself inside its second admission (the first: a migration it then copies, slowly)
    planes = Planes(
        tmp_path,
        url,
        count=3,
        lease_s=lease,
        hosts=4,
        failpoints={1: "admission.serialised=2"},
        extra_env={"VMPLANE_FAILPOINT_SIGNAL": "STOP", "VMPLANE_SIM_COPY_RATE_MIB_S": "64"},
    )
    try:
        planes.start()
        seed(planes, {"big": (64, 1 << 20, 50)}, stopped_per_project=0)
        with planes[0].client() as c:
            for vm, start in (("m1", True), ("a1", False), ("a2", False)):
                c.post(
                    "/vms", json={"name": vm, "project": "big", "offering": "one", "template": "t", "start": start}
                ).raise_for_status()
        settled(planes)
        frozen_epoch = next(r["epoch"] for r in planes.controllers() if r["name"] == "plane-1" and r["state"] == "live")
        with planes[1].client() as c1:
            c1.post("/vms/m1/migrate", json={}).raise_for_status()  # plane-1 copies it (about 16 s)

        def start_through_the_frozen_one():
            try:
                with planes[1].client(timeout=10 * lease) as c1:
                    c1.post("/vms/a1/start")
            except httpx.TransportError:
                pass

        threading.Thread(target=start_through_the_frozen_one, daemon=True).start()
        assert planes[1].stopped_by_itself(), "plane-1 did not stop at its failpoint"
        frozen_at = time.monotonic()
        with planes[0].client() as c:
            mig = c.get("/migrations", params={"vm": "m1"}).json()[0]
            assert mig["state"] not in TERMINAL, mig  # its work in flight
        # a few lease periods: found lapsed within about one, then its session is ended (its idle timeout: 3)
        with planes[2].client(timeout=6 * lease) as c2:  # (it waits while the admissions' lock is held)
            answer = c2.post("/vms/a2/start")
            assert answer.status_code == 202, answer.text
            admitted = time.monotonic() - frozen_at
            op = answer.json()["operation"]["id"]
            _wait("a2's start", lambda: c2.get(f"/operations/{op}").json()["state"] == "succeeded", 4 * lease, planes)
        with planes[0].client() as c:
            limits = session_limits(lease)  # two lease periods, plus the timeouts
            _wait(
                "the frozen process's migration settled by another",
                lambda: c.get(f"/migrations/{mig['id']}").json()["state"] in TERMINAL,
                2 * lease + (limits.idle_ms + limits.give_way_ms) / 1000,
                planes,
            )
            taken_over = time.monotonic() - frozen_at

            def handed_over():
                rows = c.get("/controllers").json()
                gone = next(r for r in rows if r["epoch"] == frozen_epoch)
                live_hosts = [h for r in rows if r["state"] == "live" for h in r["hosts"]]
                once_each = sorted(live_hosts) == sorted(set(live_hosts)) and len(live_hosts) == 4
                return gone["state"] == "lapsed" and not gone["hosts"] and once_each

            _wait("plane-1's hosts held by the others", handed_over, 2 * lease, planes)
        planes[1].signal(signal.SIGCONT)  # it resumes: its session was ended, its epoch lapsed
        with planes[0].client() as c:
            _wait(
                "plane-1 registered again",
                lambda: any(
                    r["name"] == "plane-1" and r["state"] == "live" and r["epoch"] > frozen_epoch
                    for r in c.get("/controllers").json()
                ),
                4 * lease,
                planes,
            )
            settled(planes)
            # (each process's capacity index learns the others' claims at its next beat)
            _wait(
                "a consistent record", lambda: c.get("/audit").json() == {"ok": True, "problems": []}, 2 * lease, planes
            )
            for vm in ("m1", "a1", "a2"):
                row = c.get(f"/vms/{vm}").json()
                where = [d[0] for d in domains(tmp_path, vm)]
                assert where == ([row["host"]] if row["state"] == "running" else []), (row, where)
            assert c.get("/vms/a2").json()["state"] == "running"
        print(
            f"through {through}, lease {lease:g} s: another process admitted {admitted:.1f} s after the freeze; "
            f"the frozen one's migration was settled after {taken_over:.1f} s"
        )
    finally:
        planes.stop()
        if bouncer is not None:
            bouncer.stop()
