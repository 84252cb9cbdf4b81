"""Operations left in flight that no thread carries: what this process's threads carry, and the loop
that settles this process's own operations left past their deadline (review 2026-12-02, N5).

An operation's thread ends it, or its failure path does (Operations.settle_failed). When that failure
path meets the same error (a database outage: its first read fails too), the thread ends and the
operation stays `running` under its live owner: no takeover claims it (its owner is live), and its VM stays
`stopping`/`starting`/`scaling`, blocking every other operation on it. So each process registers the
operations its threads carry (`carrying`), and every few seconds looks at its own in-flight operations:
one whose record has not changed for `vmplane.operation.deadline` seconds and that no thread here carries
is settled by its failure path (which asks the host: a stop whose domain went ends stopped), retried with
backoff until that lands. A recovery (kind `recover`) is run again instead: it resumes from its step.
Until then `audit` names each such operation with what clears it (`problems`).
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from sqlalchemy import select

from vmplane.core.errors import VmplaneError
from vmplane.core.model import IN_FLIGHT_OPERATION_VALUES as IN_FLIGHT
from vmplane.plane.carried import carried, carrying
from vmplane.plane.loops import every
from vmplane.store import ledger as L
from vmplane.store.schema import utcnow

if TYPE_CHECKING:
    from vmplane.plane.context import Plane

log = logging.getLogger("vmplane.overdue")
DEADLINE_KEY = "vmplane.operation.deadline"
BACKOFF_S = (1, 2, 5, 10, 30, 60)


def queued_ops(executor) -> frozenset[str]:
    """The operations handed to `executor` that wait for a thread (`executor.submit(ops.run, op_id, ...)`):
    carried too, only later. Read from a ThreadPoolExecutor's queue; nothing for other executors."""
    queue = getattr(getattr(executor, "_work_queue", None), "queue", None)
    if queue is None:
        return frozenset()
    found: set[str] = set()
    for item in list(queue):
        args = getattr(item, "args", None) or ()
        found.update(a for a in args[:1] if isinstance(a, str))
    return frozenset(found)


@dataclass(frozen=True)
class InFlight:
    id: str
    kind: str
    target: str
    step: str
    updated_at: dt.datetime
    owner: int | None


def overdue(ops: list[InFlight], now: dt.datetime, deadline_s: float, carried_ids: frozenset[str]) -> list[InFlight]:
    """(pure) The operations whose record has not changed for `deadline_s` and that no thread carries."""
    return [op for op in ops if op.id not in carried_ids and (now - op.updated_at).total_seconds() >= deadline_s]


def backoff(attempt: int) -> float:
    """(pure) Seconds before the `attempt`-th retry (0-based) of a failure path that did not land."""
    return float(BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)])


def clears(op: InFlight) -> str:
    """(pure) What settles an overdue operation now, in words (with the command)."""
    if op.kind == "recover":
        return (
            f"its process runs it again within seconds; or `vmplane host recover {op.target}` once no recovery "
            f"of {op.target} is in flight"
        )
    return (
        "its process retries its failure path with backoff (asking the host); if it stays, restart that "
        "control-plane process (`vmplane controllers` names it): its start-up recovery resumes it"
    )


def deadline_of(conn) -> float:
    """The global `vmplane.operation.deadline`, read from the store (audit has no catalog)."""
    from vmplane.core.settings import KEYS, typed
    from vmplane.store.schema import Setting

    raw = conn.execute(select(Setting.value).where(Setting.key == DEADLINE_KEY, Setting.scope == "global")).scalar()
    value = typed(DEADLINE_KEY, raw) if raw is not None else KEYS[DEADLINE_KEY].default
    return float(value) if isinstance(value, (int, float)) else float(KEYS[DEADLINE_KEY].default)


def in_flight(conn, owner: int | None = None, any_owner: bool = True) -> list[InFlight]:
    op = L.OPERATIONS.c
    query = select(op.id, op.kind, op.target, op.step, op.updated_at, op.owner).where(op.state.in_(IN_FLIGHT))
    if not any_owner:
        query = query.where(op.owner.is_(None) if owner is None else op.owner == owner)
    return [InFlight(*r) for r in conn.execute(query.order_by(op.updated_at))]


def problems(conn) -> list[str]:
    """For audit: each in-flight operation past its deadline that no thread of this process carries, with
    what clears it."""
    deadline = deadline_of(conn)
    out = []
    for op in overdue(in_flight(conn), utcnow(), deadline, carried()):
        age = (utcnow() - op.updated_at).total_seconds()
        out.append(
            f"operation {op.id} ({op.kind} of {op.target}, at step {op.step}): in flight, unchanged for "
            f"{age:.0f} s (deadline {deadline:g} s) and no thread carries it; {clears(op)}"
        )
    return out


class Overdue(VmplaneError):
    """The reason an overdue operation is failed with."""


class OverdueOperations:
    """The loop of one process over its own overdue operations (every process runs one)."""

    def __init__(self, plane: Plane):
        self.plane = plane
        self._stop = threading.Event()
        self._tries: dict[str, tuple[int, float]] = {}  # op id -> (failed tries, monotonic time of the next)
        self._lock = threading.Lock()

    def start(self) -> None:
        every(self._interval, self.run_once, self._stop, "overdue", log)

    def stop(self) -> None:
        self._stop.set()

    def _interval(self) -> float:
        return min(max(float(cast(float, self.plane.catalog.effective(DEADLINE_KEY))) / 5, 0.5), 10.0)

    def _mine(self) -> list[InFlight]:
        epoch = self.plane.membership.epoch
        with self.plane.db.read() as s:
            ops = in_flight(s.connection(), epoch, any_owner=False)
        queued = self.plane.ops.carried() | queued_ops(self.plane.executor)
        deadline = float(cast(float, self.plane.catalog.effective(DEADLINE_KEY)))
        return overdue(ops, utcnow(), deadline, carried() | queued)

    def run_once(self) -> list[str]:
        """Settle what is due now; returns the ids of the operations that ended."""
        ended = []
        now = time.monotonic()
        for op in self._mine():
            with self._lock:
                tries, due = self._tries.get(op.id, (0, 0.0))
            if now < due:
                continue
            if self._settle(op):
                ended.append(op.id)
                with self._lock:
                    self._tries.pop(op.id, None)
            else:
                with self._lock:
                    self._tries[op.id] = (tries + 1, time.monotonic() + backoff(tries))
        return ended

    def _settle(self, op: InFlight) -> bool:
        """Its failure path (a recovery: run again), in this thread; True once it is no longer in flight."""
        plane = self.plane
        reason = (
            f"{op.kind} left in flight at step {op.step}, unchanged past its deadline, with no thread "
            f"carrying it (its own failure path had failed)"
        )
        log.warning("operation %s: %s; settling it", op.id, reason)
        try:
            if op.kind == "recover":
                plane.executor.submit(self._rerun, op.id)
                return True  # carried from now on by the executor's thread (or its next pass)
            plane.ops.run(op.id, _raiser(Overdue(reason)))
        except Exception as exc:  # noqa: BLE001 - the database still out: again after the backoff
            log.warning("operation %s: its failure path failed again (%s); retried with backoff", op.id, exc)
            return False
        with plane.db.read() as s:
            row = L.operation_row(s.connection(), op.id)
        return row.state not in IN_FLIGHT

    def _rerun(self, op_id: str) -> None:
        """A recovery run again, unless a thread of this process already carries it."""
        with carrying(op_id, alone=True) as mine:
            body = self.plane.ops.body("recover")
            if mine and body is not None:
                self.plane.ops.run(op_id, body, "ha")


def _raiser(exc: Exception):
    def body(op_id: str):
        raise exc

    return body
