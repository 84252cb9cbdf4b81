"""Group commit for admissions: requests that arrive while an admission transaction runs are admitted
together in the next one.

Each request is a function of the transaction's connection (the whole read-check-write of one create
or start). A batch runs its requests in arrival order in one write transaction: a request sees what the
requests before it in the batch wrote (as it would had they committed before it), and a request that
fails (quota, capacity, a duplicate name) changes nothing and gets exactly the error it would get alone.
On PostgreSQL each request runs inside its own SAVEPOINT, rolled back to when it fails. On SQLite,
where statements inside a savepoint cost more, a failed request that changed no row (quota and capacity
refuse before writing) is simply passed over; one that had written rolls the batch back: the requests
before it run again as a batch, it alone, then the rest (_Changes). The events the batch records are
written together before its
commit (events.hold). One commit then makes the batch's admissions durable together, and each caller
gets its own result or error. A batch of one runs as a plain transaction. Each request is fenced by its
own owner (ownership.check in its own context, in the batch's transaction), never by whichever thread
leads the batch.

No thread of its own: the first caller to find no batch running leads (runs the queued requests
as one batch); when it is done it hands the lead to the first request that queued meanwhile.

What the caller mirrors in memory before the commit (the capacity index, so the next request of the
batch places against it) is undone by `on_abort` if the transaction as a whole fails. A request that
the database itself refuses inside a batch (a deadlock or serialisation failure between processes on
PostgreSQL, which it would not necessarily meet alone) is run again alone after the batch.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy import select
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError, IntegrityError

from vmplane.core import failpoints
from vmplane.core.scope import Scope, vm_scope
from vmplane.store import events, ownership, pgsessions
from vmplane.store.prepared import once_per_transaction, prepared
from vmplane.store.schema import Cluster, Zone

if TYPE_CHECKING:
    from vmplane.store.db import Database

MAX_BATCH = 64  # requests admitted in one transaction at most
RETRIES = 5  # a request alone, chosen as a deadlock's victim, is run again this many times
_RETRYABLE = {"40P01", "40001"}  # PostgreSQL: deadlock detected, serialization failure


# PostgreSQL: every admission transaction takes this transaction-scoped advisory lock first (released at
# its commit or rollback, so no session state: fine behind PgBouncer in transaction mode). A batch holds
# several projects' and hosts' rows at once; without one order between admissions of different processes,
# two of them would deadlock (each holding a row the other wants, PostgreSQL breaking it after
# deadlock_timeout). SQLite's BEGIN IMMEDIATE already serialises them. Its wait gives way
# (pgsessions.advisory_xact_lock): a process frozen while it holds it (SIGSTOP, a paused virtual machine) would
# stall every admission of every process until its idle timeout, so once that process is found lapsed its
# session is ended.
ADMISSION_LOCK = 0x766D_6164  # "vmad"
# PostgreSQL: each request of a batch in a savepoint (_Savepoints), issued on the DBAPI cursor (through
# SQLAlchemy's nested transactions they cost about a sixth of an admission); one name, reused: requests run
# one after another
_SAVEPOINT, _ROLLBACK_TO, _RELEASE = (
    "SAVEPOINT admission",
    "ROLLBACK TO SAVEPOINT admission",
    "RELEASE SAVEPOINT admission",
)


def _run_as(ctx: contextvars.Context, fn: Callable[[Connection], Any], conn: Connection) -> Any:
    """fn(conn) as its caller: in its context (cause, owner), with its owner's lease checked first in this
    transaction (ownership.check), whoever's thread opened it: each request of a batch is fenced by its own."""
    ctx.run(ownership.check, conn)
    return ctx.run(fn, conn)


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, DBAPIError) and getattr(exc.orig, "sqlstate", None) in _RETRYABLE


def _held() -> threading.Lock:
    """A lock taken at once: its caller waits by taking it again, and is woken by its release (an Event's
    Condition cost a tenth of a batch's time in the threads' wake-ups)."""
    lock = threading.Lock()
    lock.acquire()
    return lock


@dataclass(eq=False)
class _Request:
    fn: Callable[[Connection], Any]
    ctx: contextvars.Context
    wake: threading.Lock = field(default_factory=_held)  # released once to wake its caller (lead, or done)
    lead: bool = False
    handed: bool = False  # made leader by the batch before it (not the first to find none running)
    done: bool = False
    result: Any = None
    error: BaseException | None = None
    alone: bool = False  # refused by the database inside a batch (or its commit failed): run again by itself

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.result


class Batcher:
    """Runs admission functions in shared write transactions (see the module's docstring).

    `lock`: held while a batch runs (the orchestrator's lock over its admissions and capacity index);
    a caller that already holds it runs alone, at once (it could not wait for a leader that needs it).
    `on_abort`: called (under `lock`) when a transaction in which requests had succeeded fails as a
    whole, to undo what they mirrored in memory."""

    def __init__(
        self,
        db: Database,
        lock: AbstractContextManager[Any],
        on_abort: Callable[[], None] = lambda: None,
        max_batch: int = MAX_BATCH,
    ):
        self.db = db
        self.lock = lock
        self.on_abort = on_abort
        self.max_batch = max_batch
        self._mutex = threading.Lock()
        self._queue: list[_Request] = []
        self._busy = False
        self._last = 0  # requests in the last batch
        self.batches = 0  # transactions run, and requests admitted through them (for benchmarks)
        self.requests = 0

    def run(self, fn: Callable[[Connection], Any]) -> Any:
        """fn(conn) inside a write transaction, alone or in a batch; its result, or its exception."""
        owned = getattr(self.lock, "_is_owned", None)
        if owned is not None and owned():
            return self._alone(fn, contextvars.copy_context())
        req = _Request(fn, contextvars.copy_context())
        with self._mutex:
            self._queue.append(req)
            if not self._busy:
                self._busy = True
                req.lead = True
        while True:
            if req.lead:
                req.lead = False
                self._lead(req)
            if req.done:
                return req.outcome()
            req.wake.acquire()

    def _lead(self, leader: _Request) -> None:
        """Run the queued requests (`leader` first among them) as one batch, then hand the lead on. Each
        request's wake lock is released once: to lead, or when done by another's batch; never the leader's
        own (a request made leader before it waited would find its lock released twice)."""
        if leader.handed or self._last > 1:  # others are at work: let those about to queue (waiting
            time.sleep(0)  # for the GIL) do so, or every other batch is of one
        with self._mutex:
            batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
        self._last = len(batch)
        try:
            self._execute(batch)
            for r in batch:
                if r.alone:
                    r.error, r.result = None, None
                    try:
                        r.result = self._alone(r.fn, r.ctx)
                    except BaseException as exc:  # noqa: BLE001 - handed to its caller
                        r.error = exc
        finally:
            with self._mutex:
                if self._queue:
                    nxt = self._queue[0]
                    nxt.lead = nxt.handed = True
                    nxt.wake.release()
                else:
                    self._busy = False
            for r in batch:
                r.done = True
                if r is not leader:
                    r.wake.release()

    def _alone(self, fn: Callable[[Connection], Any], ctx: contextvars.Context) -> Any:
        """fn in a transaction of its own; run again (up to RETRIES times) if the database chose it as a
        deadlock's victim or refused it for serialisation (PostgreSQL, between processes): it was rolled
        back whole, so running it again is running it for the first time."""
        for attempt in range(RETRIES + 1):
            with self.lock:
                ran = False
                try:
                    with ownership.owned(None), self.db.transaction() as conn:
                        self.serialise(conn)
                        result = _run_as(ctx, fn, conn)
                        ran = True
                except BaseException as exc:
                    if ran:  # it had mirrored its effect; the commit failed
                        self.on_abort()
                    if attempt < RETRIES and _retryable(exc):
                        continue
                    raise
                self.batches += 1
                self.requests += 1
                return result
        raise AssertionError("unreachable")

    def serialise(self, conn: Connection) -> None:
        """First in every transaction that takes quota or host capacity (here, and a scale's or a migration's
        admission): one order between them across processes, so none waits for another in a cycle."""
        if not self.db.is_sqlite:
            pgsessions.advisory_xact_lock(conn, ADMISSION_LOCK, self.db.limits)
        failpoints.hit("admission.serialised")

    def _execute(self, batch: list[_Request]) -> None:
        if len(batch) == 1:
            r = batch[0]
            try:
                r.result = self._alone(r.fn, r.ctx)
            except BaseException as exc:  # noqa: BLE001 - handed to its caller
                r.error = exc
            return
        with self.lock:
            admitted = 0
            try:
                with ownership.owned(None), self.db.transaction() as conn:
                    self.serialise(conn)
                    undo = _Changes(conn) if self.db.is_sqlite else _Savepoints(conn)
                    events.hold(conn)
                    try:
                        for i, r in enumerate(batch):  # noqa: B007 (i names the failed request after the loop)
                            undo.mark()
                            held = events.held_count(conn)
                            try:
                                r.result = _run_as(r.ctx, r.fn, conn)
                            except BaseException as exc:  # noqa: BLE001 - this request only
                                undo.back(exc)  # (_Partial: request i can not be undone alone)
                                events.drop_held(conn, keep=held)
                                if isinstance(exc, DBAPIError) and not isinstance(exc, IntegrityError):
                                    r.alone = True
                                else:
                                    r.error = exc
                                continue
                            undo.keep()
                            admitted += 1
                        events.write_held(conn)
                    finally:
                        events.drop_held(conn)
                        undo.close()
            except _Partial:  # nobody was admitted; the requests before the one that wrote and
                if admitted:  # failed (request i) run again as a batch, it alone, then the rest
                    self.on_abort()  # as a batch (in order: each gets its own outcome)
                for r in batch:
                    r.alone, r.error, r.result = False, None, None
                failed = i
            except BaseException:  # noqa: BLE001 - the commit failed: nobody was admitted
                if admitted:
                    self.on_abort()
                for r in batch:  # each tried again alone, in order: each gets its own outcome
                    r.alone, r.error, r.result = True, None, None
                return
            else:
                self.batches += 1
                self.requests += admitted
                return
        for part in (batch[:failed], batch[failed : failed + 1], batch[failed + 1 :]):
            if part:
                self._execute(part)


class _Partial(Exception):
    """A request of a batch failed after it had changed rows (or ended the transaction), and it has no
    savepoint to go back to."""


class _Savepoints:
    """Each request of a batch in a SAVEPOINT, rolled back to when it fails (PostgreSQL)."""

    def __init__(self, conn: Connection):
        self.cursor = conn.connection.cursor()

    def mark(self) -> None:
        self.cursor.execute(_SAVEPOINT)

    def back(self, exc: BaseException) -> None:
        self.cursor.execute(_ROLLBACK_TO)
        self.cursor.execute(_RELEASE)

    def keep(self) -> None:
        self.cursor.execute(_RELEASE)

    def close(self) -> None:
        self.cursor.close()


class _Changes:
    """SQLite: no savepoints (every statement inside one cost SQLite more: the batch admitted a tenth
    fewer requests per second, measured). Most requests that fail (quota, capacity, a retired offering)
    fail before they write; one that changed no row changed nothing, and the batch goes on. One that had
    changed rows (a duplicate name, found when its VM is inserted; a root disk's pool that refuses) can not
    be undone by itself: it raises _Partial, the batch is rolled back whole, and runs again in three parts
    (those before it, it alone, those after it)."""

    def __init__(self, conn: Connection):
        self.sqlite: Any = conn.connection.dbapi_connection  # (sqlite3's: total_changes, in_transaction)
        self.changes = 0

    def mark(self) -> None:
        self.changes = self.sqlite.total_changes

    def back(self, exc: BaseException) -> None:
        # (an error that made SQLite roll back the whole transaction, such as SQLITE_FULL or an I/O error,
        # leaves total_changes as it was: the transaction's end is what tells it)
        if self.sqlite.total_changes != self.changes or not self.sqlite.in_transaction:
            raise _Partial("a request of the batch failed after it had written") from exc

    def keep(self) -> None:
        pass

    def close(self) -> None:
        pass


_Z, _CL = Zone.__table__.c, Cluster.__table__.c
_ZONES_AND_CLUSTERS = select(_Z.id, _Z.name, _CL.id, _CL.name).select_from(
    Zone.__table__.outerjoin(Cluster.__table__, _CL.zone_id == _Z.id)
)


def scope_of(conn: Connection, zone: str | None, cluster: str | None) -> tuple[Scope, int | None, int | None]:
    """A new VM's zone and cluster (scope.vm_scope) with their ids, read in the admission's transaction
    (one statement built once: building it per request cost a quarter of an admission; and read once
    per batch)."""
    zones, ids = once_per_transaction(conn, _ZONES_AND_CLUSTERS, lambda: _zones_and_clusters(conn))
    scope = vm_scope(zones, zone, cluster)
    return scope, ids.get(("zone", scope.zone)), ids.get(("cluster", scope.cluster))


def clusters_of(conn: Connection, scope: Scope) -> frozenset[str]:
    """The clusters a VM of `scope` may be in: its cluster, or every cluster of its zone."""
    if scope.cluster is not None:
        return frozenset({scope.cluster})
    zones, _ids = once_per_transaction(conn, _ZONES_AND_CLUSTERS, lambda: _zones_and_clusters(conn))
    return frozenset(zones.get(scope.zone or "", []))


def _zones_and_clusters(conn: Connection) -> tuple[dict[str, list[str]], dict[tuple[str, str], int]]:
    zones: dict[str, list[str]] = {}
    ids: dict[tuple[str, str], int] = {}
    for zone_id, zone_name, cluster_id, cluster_name in prepared(conn.engine, _ZONES_AND_CLUSTERS).all_in(conn):
        zones.setdefault(zone_name, [])
        ids["zone", zone_name] = zone_id
        if cluster_name is not None:
            zones[zone_name].append(cluster_name)
            ids["cluster", cluster_name] = cluster_id
    return zones, ids
