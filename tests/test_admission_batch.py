"""Admissions batched into one transaction (admission.Batcher): each request of a batch is checked in
arrival order against quota and capacity, a refused one changes nothing and gets exactly the error it
gets alone, the ledger stays exact, and each request's events name its own caller."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import insert, select

from vmplane.core.errors import Conflict, VmplaneError
from vmplane.orchestrator import InlineExecutor, Orchestrator
from vmplane.plane.membership import CONTROLLERS
from vmplane.store import Database, events, ownership
from vmplane.store.admission import Batcher
from vmplane.store.schema import Event, Zone

from .conftest import add_basics, add_sim_hosts
from .stores import store_url


def _orchestrator(folder: Path, name: str) -> Orchestrator:
    db = Database(store_url(folder, name, migrated=True))
    db.migrate()
    o = Orchestrator(db, InlineExecutor())
    o.load()
    o.catalog.create_zone("z1")
    o.catalog.create_cluster("c1", "z1")
    add_sim_hosts(o, 2, cores=4, memory_mib=65536)  # 8 vCPUs in all: capacity refuses too
    add_basics(o)
    o.catalog.create_project("p", 6, 1 << 20, 5)
    o.catalog.create_project("q", 100, 1 << 20, 100)
    return o


def _create(o: Orchestrator, req: tuple[str, str, str]) -> str:
    """What one create-and-start request gets: 'admitted' or its error's code and message."""
    name, project, offering = req
    try:
        o.create_vm(name, project, offering, "tiny", start=True)
        return "admitted"
    except VmplaneError as exc:
        return f"{exc.code}: {exc.message}"


def _batched(o: Orchestrator, requests: list[tuple[str, str, str]]) -> list[str]:
    """The requests from one thread each, queued in this order behind a transaction that is held open
    (the orchestrator's lock held by this thread), then released: they are admitted as one batch."""
    outcomes: list[str | None] = [None] * len(requests)

    def call(i: int) -> None:
        with events.acting_as(f"user u{i}"):
            outcomes[i] = _create(o, requests[i])

    threads = []
    with o.capacity.lock:
        first = threading.Thread(target=call, args=(0,))
        first.start()  # the leader: it took the queue (itself) and waits for the lock
        threads.append(first)
        _wait_for(lambda: o.admissions._busy and not o.admissions._queue)
        for i in range(1, len(requests)):
            t = threading.Thread(target=call, args=(i,))
            t.start()
            threads.append(t)
            _wait_for(lambda i=i: len(o.admissions._queue) == i)  # queued in order
    for t in threads:
        t.join(60)
    return outcomes  # type: ignore[return-value]


def _wait_for(cond, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def _state(o: Orchestrator) -> tuple:
    return (
        sorted((v.name, v.state, v.vcpus, v.host.name if v.host else None) for v in o.vms()),
        {p: o.project_usage(p)["ledger"] for p in ("p", "q")},
        sorted((h.name, h.used_vcpus, h.used_memory_mib) for h in o.hosts()),
    )


def test_a_batch_admits_in_order_and_a_refused_request_changes_nothing(tmp_path):
    o, alone = _orchestrator(tmp_path, "batched.db"), _orchestrator(tmp_path, "alone.db")
    try:
        requests = [
            ("a1", "p", "small"),
            ("a2", "p", "large"),
            ("a3", "p", "large"),  # a3: quota (1+4+4 > 6)
            ("a4", "p", "small"),
            ("a1", "q", "small"),  # a1 again: duplicate
            ("a5", "q", "large"),
            ("a6", "p", "small"),
        ]  # a5: capacity; a6: quota
        before = o.admissions.batches
        got = _batched(o, requests)
        expected = [_create(alone, r) for r in requests]  # the same requests, one after the other
        assert got == expected
        assert got[0] == "admitted" and got[2].startswith("quota_exceeded") and got[4].startswith("already_exists")
        if not o.db.is_sqlite:  # the leader alone, then the other six together (a savepoint each)
            assert o.admissions.batches - before == 2
        else:  # no savepoints: the duplicate had written (its host, its ledger) when its name was refused, so
            assert o.admissions.batches - before == 3  # the batch ran again: the three before it, the two after
        assert _state(o) == _state(alone)
        assert o.audit() == [] and alone.audit() == []
        # each admitted request's events name its own caller, not the thread that ran the batch
        with o.db.read() as s:
            causes = dict(s.execute(select(Event.subject, Event.cause).where(Event.kind == "vm")).all())
        for i, (name, _, _) in enumerate(requests):
            if got[i] == "admitted":
                assert causes[name] == f"user u{i}"
        assert set(causes) == {"a1", "a2", "a4"}  # none of a refused request's events is kept
    finally:
        o.close()
        alone.close()


def test_requests_refused_before_they_write_leave_the_batch_whole(tmp_path):
    """Quota and capacity refuse before anything is written: the batch goes on without them (on SQLite
    without a savepoint: nothing to undo), and only the admitted requests' rows and events are kept."""
    o, alone = _orchestrator(tmp_path, "batched.db"), _orchestrator(tmp_path, "alone.db")
    try:
        for each in (o, alone):  # 1 GiB of memory: a small VM fits it, not with its overhead counted
            each.catalog.create_project("m", 10, 1024, 5, count_overhead=True)
        requests = [
            ("c1", "p", "small"),
            ("c2", "p", "large"),
            ("c3", "p", "large"),  # c3: quota
            ("c7", "m", "small"),  # c7: quota, known once its host (and overhead) is chosen
            ("c4", "q", "large"),
            ("c5", "q", "small"),
            ("c6", "p", "small"),
        ]  # c4: capacity
        before = o.admissions.batches
        got = _batched(o, requests)
        assert got == [_create(alone, r) for r in requests]
        assert [g.split(":")[0] for g in got] == [
            "admitted",
            "admitted",
            "quota_exceeded",
            "quota_exceeded",
            "insufficient_capacity",
            "admitted",
            "admitted",
        ]
        assert o.admissions.batches - before == 2  # the leader alone, then the other six together
        assert _state(o) == _state(alone) and o.audit() == []
        with o.db.read() as s:
            vm_events = sorted(set(s.execute(select(Event.subject).where(Event.kind == "vm")).scalars()))
        assert vm_events == ["c1", "c2", "c5", "c6"]
    finally:
        o.close()
        alone.close()


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["b1", "b2", "b3", "b4", "b5", "b6"]),
            st.sampled_from(["p", "q"]),
            st.sampled_from(["small", "large"]),
        ),
        min_size=2,
        max_size=9,
    )
)
def test_batched_outcomes_equal_one_at_a_time(tmp_path_factory, requests):
    folder = tmp_path_factory.mktemp("batch")
    o, alone = _orchestrator(folder, "batched.db"), _orchestrator(folder, "alone.db")
    try:
        assert _batched(o, requests) == [_create(alone, r) for r in requests]
        assert _state(o) == _state(alone)
        for p in ("p", "q"):
            usage = o.project_usage(p)
            assert usage["ledger"] == usage["recomputed"]
            assert usage["ledger"].vcpus <= usage["quota"].vcpus and usage["ledger"].vms <= usage["quota"].vms
        assert o.audit() == []
    finally:
        o.close()
        alone.close()


def test_a_failed_commit_retries_each_request_alone_and_the_index_follows_the_store(tmp_path, monkeypatch):
    o = _orchestrator(tmp_path, "vmplane.db")
    try:
        o.plane.executor = _Parked()  # the starts are not run: only admissions open transactions
        real = o.db.transaction
        calls = []

        def flaky():  # the second transaction (the batch after the leader's) fails at its commit
            calls.append(1)
            return _failing(real) if len(calls) == 2 else real()

        monkeypatch.setattr(o.db, "transaction", flaky)
        got = _batched(o, [("c1", "q", "small"), ("c2", "q", "small"), ("c3", "q", "small")])
        assert got == ["admitted"] * 3
        assert len(calls) == 4  # the leader; the batch of two (failed); each of the two again alone
        assert o.audit() == []  # the index was rebuilt from the store, then follows it
        assert sorted(v.name for v in o.vms()) == ["c1", "c2", "c3"]
        assert o.project_usage("q")["ledger"].vcpus == 3
    finally:
        o.close()


def _failing(real):
    import contextlib

    @contextlib.contextmanager
    def tx():
        with real() as conn:
            yield conn
            raise RuntimeError("commit failed")

    return tx()


class _Parked(InlineExecutor):
    def submit(self, fn, /, *args, **kwargs):  # type: ignore[override]
        pass


def test_each_request_of_a_batch_is_fenced_by_its_own_owner_not_by_the_thread_that_leads_it(tmp_path):
    o = _orchestrator(tmp_path, "fenced.db")
    try:
        live = o.controllers.epoch
        with o.db.transaction() as conn:  # a process whose lease lapsed
            lapsed = conn.execute(
                insert(CONTROLLERS).values(
                    name="gone",
                    hostname="h",
                    pid=1,
                    state="lapsed",
                    lease_s=1.0,
                    started_at=0.0,
                    renewed_at=0.0,
                    expires_at=0.0,
                )
            ).inserted_primary_key[0]
        batcher = Batcher(o.db, threading.RLock())
        outcomes: dict[str, str] = {}

        def write(tag: str, owner: int | None) -> None:
            def fn(conn):
                events.record(conn, "vm", tag, message="written")
                return "landed"

            with ownership.owned(owner):
                try:
                    outcomes[tag] = batcher.run(fn)
                except ownership.Fenced:
                    outcomes[tag] = "fenced"

        requests = [("first", None), ("gone-1", lapsed), ("live", live), ("none", None), ("gone-2", lapsed)]
        threads = []
        with batcher.lock:  # the first leads and waits; the others queue behind it, in order
            for i, (tag, owner) in enumerate(requests):
                threads.append(threading.Thread(target=write, args=(tag, owner)))
                threads[-1].start()
                _wait_for(lambda i=i: batcher._busy and len(batcher._queue) == i)
        for t in threads:
            t.join(60)
        assert batcher.batches == 2  # the first alone, then the four led by a lapsed owner's request
        assert outcomes == {
            "first": "landed",
            "gone-1": "fenced",
            "live": "landed",
            "none": "landed",
            "gone-2": "fenced",
        }
        with o.db.read() as s:
            written = set(s.execute(select(Event.subject).where(Event.message == "written")).scalars())
        assert written == {"first", "live", "none"}
    finally:
        o.close()


def _requests(*fns) -> list:
    import contextvars

    from vmplane.store.admission import _Request

    return [_Request(fn, contextvars.copy_context()) for fn in fns]


def _zones_and_events(db: Database) -> tuple[list[str], list[str]]:
    with db.read() as s:
        return (
            sorted(s.execute(select(Zone.name)).scalars()),
            sorted(s.execute(select(Event.subject).where(Event.kind == "test")).scalars()),
        )


def _adds_zone(tag: str):
    def fn(conn):
        conn.execute(insert(Zone).values(name=tag))
        events.record(conn, "test", tag, message="added")
        return tag

    return fn


def test_a_refused_requests_events_are_dropped_and_the_batch_keeps_the_others(tmp_path):
    """A request that records an event and is then refused, having written nothing: its event never
    reaches the log; the requests around it keep their rows and events, in one transaction."""
    db = Database(store_url(tmp_path, "events.db"))
    db.migrate()
    try:

        def refused(conn):
            events.record(conn, "test", "refused", message="recorded, then refused")
            raise Conflict("refused after recording an event", field="x")

        batch = _requests(_adds_zone("z1"), refused, _adds_zone("z3"))
        batcher = Batcher(db, threading.RLock())
        batcher._execute(batch)
        assert [r.result for r in batch] == ["z1", None, "z3"] and isinstance(batch[1].error, Conflict)
        assert batcher.batches == 1
        assert _zones_and_events(db) == (["z1", "z3"], ["z1", "z3"])
    finally:
        db.dispose()


def test_a_request_that_wrote_then_failed_reruns_its_batch_in_three_parts(tmp_path):
    """On SQLite (no savepoints) a request that fails after writing can not be undone alone; and one whose
    error ended the transaction (SQLite rolls back on a full disk or an I/O error) leaves no change counted.
    Either way the batch rolls back, and the requests before it run again as a batch, it alone, the rest
    as a batch: each keeps exactly its own outcome, and nothing is reported admitted that was lost."""
    db = Database(store_url(tmp_path, "partial.db"))
    db.migrate()
    try:

        def wrote_then_failed(conn):
            conn.execute(insert(Zone).values(name="lost"))
            raise Conflict("failed after writing", field="x")

        def ended_the_transaction(conn):
            if db.is_sqlite:
                conn.connection.dbapi_connection.execute("ROLLBACK")
            raise Conflict("failed, its transaction rolled back by the database", field="x")

        for name, failing in (("wrote", wrote_then_failed), ("ended", ended_the_transaction)):
            batch = _requests(_adds_zone(f"{name}1"), _adds_zone(f"{name}2"), failing, _adds_zone(f"{name}4"))
            batcher = Batcher(db, threading.RLock())
            batcher._execute(batch)
            assert [r.result for r in batch] == [f"{name}1", f"{name}2", None, f"{name}4"], name
            assert isinstance(batch[2].error, Conflict)
            assert batcher.requests == 3, name
        zones, logged = _zones_and_events(db)
        assert zones == logged == ["ended1", "ended2", "ended4", "wrote1", "wrote2", "wrote4"]
    finally:
        db.dispose()
