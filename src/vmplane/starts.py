"""The start controller: this process's start operations, run together.

A create or a start admits its VM (admission.py) and hands the start here. The controller takes what is
queued, up to MAX_BATCH at once, in one executor thread, and runs them in three steps:

1. one transaction persists each start's step (`starting-domain`: before any host is asked) and reads
   its VM and disks;
2. each VM's host is asked to start its domain (one call after another for in-process drivers, in
   parallel when a call waits on a daemon: Driver.blocking_calls);
3. one transaction records each start its host confirmed (`running`, `succeeded`).

Each start keeps its own cause (its events name the request that made it) and is fenced by this process's
lease (the transactions run as its owner; a start another process owns now is left to it). A start whose
host call failed ends alone, as it always did (Orchestrator._fail asks the host whether the domain is
there). A transaction that fails for the batch runs again for each start alone, so one start's bad row
never fails the others. Recovery hands interrupted starts here too, with the cause `recovery`.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable

from sqlalchemy.engine import Connection, Row

from . import events, failpoints, metrics, ownership
from .errors import Interrupted, NotFound
from .model import OperationState, VmState
from .store import ledger as L
from .store import storageledger as SL

log = logging.getLogger("vmplane.starts")
MAX_BATCH = 64              # starts per pair of transactions
PARALLEL_CALLS = 8          # host calls at once, for drivers whose calls wait on a daemon
IN_FLIGHT = (OperationState.pending.value, OperationState.running.value)


@dataclass
class _Start:
    op_id: str
    cause: str
    vm: Row
    disks: list[Row]
    error: Exception | None = None


class Starts:
    def __init__(self, o):
        self.o = o
        self._queue: deque[tuple[str, str | None]] = deque()
        self._lock = threading.Lock()
        self._draining = False
        self._calls: ThreadPoolExecutor | None = None

    def submit(self, op_id: str, cause: str | None = None) -> None:
        """Queue a start (`cause`: None, the request's that created it); one executor job drains the queue."""
        with self._lock:
            self._queue.append((op_id, cause))
            if self._draining:
                return          # the running drain takes it (it looks at the queue under this lock)
            self._draining = True
        try:
            self.o.executor.submit(self._drain)
        except BaseException:   # an executor shut down: nothing drains
            with self._lock:
                self._draining = False
            raise

    def close(self) -> None:
        if self._calls is not None:
            self._calls.shutdown(wait=True)

    def _drain(self) -> None:
        try:
            while True:
                with self._lock:
                    if not self._queue:
                        self._draining = False
                        return
                    batch = [self._queue.popleft() for _ in range(min(len(self._queue), MAX_BATCH))]
                try:
                    self.run(batch)
                except Exception:  # noqa: BLE001 - a defect; its starts are resumed at the next start-up
                    log.exception("starts %s", [op for op, _ in batch])
        except BaseException:
            with self._lock:
                self._draining = False
            raise

    def run(self, batch: list[tuple[str, str | None]]) -> None:
        epoch = self.o.controllers.epoch
        try:
            with ownership.owned(epoch):
                starts = self._together(batch, self._step, lambda item, exc: self._failed(item[0], item[1], exc))
            self._ask(starts)
            with ownership.owned(epoch):
                done = self._together([s for s in starts if s.error is None], self._confirm,
                                      lambda s, exc: self._failed(s.op_id, s.cause, exc))
        except Interrupted as exc:      # Fenced: this process's lease lapsed; the starts are another's now
            log.info("starts %s left at their step for the process that takes them over: %s",
                     [op for op, _ in batch], exc)
            return
        for s in done:
            metrics.OPERATIONS.labels("start", "succeeded").inc()
        for s in starts:
            if s.error is not None:
                self._failed(s.op_id, s.cause, s.error)

    def _together(self, items: list, one: Callable[[Connection, object], object | None],
                  failed: Callable[[object, Exception], None]) -> list:
        """`one(conn, item)` for each item in one transaction (its events held and written together);
        returns the non-None results. If the transaction fails, each item runs again in a transaction of
        its own (`failed` for one that fails alone). Interrupted (fenced) is raised: nothing of this
        process lands any more."""
        if not items:
            return []
        try:
            with self.o.db.transaction() as conn:
                events.hold(conn)       # the batch's events: one executemany before the commit
                try:
                    results = [r for r in (one(conn, item) for item in items) if r is not None]
                    events.write_held(conn)
                finally:
                    events.drop_held(conn)
                return results
        except Interrupted:
            raise
        except Exception as exc:  # noqa: BLE001 - each again alone
            if len(items) == 1:
                failed(items[0], exc)
                return []
            log.info("starts: a batch transaction failed (%s); each start again alone", exc)
        results = []
        for item in items:
            try:
                with self.o.db.transaction() as conn:
                    r = one(conn, item)
            except Interrupted:
                raise
            except Exception as exc:  # noqa: BLE001 - its own failure
                failed(item, exc)
                continue
            if r is not None:
                results.append(r)
        return results

    def _step(self, conn: Connection, item: tuple[str, str | None]) -> _Start | None:
        """Persist that the start enters `starting-domain`; its VM and disks. None: not this one's to run."""
        op_id, cause = item
        try:
            op = L.operation_row(conn, op_id, lock=True)
        except NotFound:
            return None         # ended and pruned
        if op.owner is not None and op.owner != self.o.controllers.epoch:
            log.warning("operation %s is owned by controller %s now, not by this one (%s): not run here",
                        op_id, op.owner, self.o.controllers.epoch)
            return None
        if op.state not in IN_FLIGHT:
            return None
        cause = (cause or events.remembered(op_id) or events.cause_of(conn, "operation", op_id, vm=op.target)
                 or events.current_cause())
        with events.acting_as(cause):
            L.set_operation(conn, op_id, before=op, state=OperationState.running, step="starting-domain",
                            progress=30)
        vm = L.vm_row(conn, op.vm_id)
        return _Start(op_id, cause, vm, SL.vm_volumes(conn, vm.id))

    def _ask(self, starts: list[_Start]) -> None:
        blocking = any(getattr(self.o.drivers.get(s.vm.host_name), "blocking_calls", True) for s in starts)
        if len(starts) > 1 and blocking:
            if self._calls is None:
                self._calls = ThreadPoolExecutor(PARALLEL_CALLS, thread_name_prefix="vmplane-start")
            list(self._calls.map(self._start_domain, starts))
        else:
            for s in starts:
                self._start_domain(s)

    def _start_domain(self, s: _Start) -> None:
        """Ask the VM's host to run its domain (a paused or running one is not started twice). Its disks'
        writes (a root disk still to make) are this start's: its cause, fenced by this process's lease."""
        o = self.o
        try:
            with ownership.owned(o.controllers.epoch), events.acting_as(s.cause):
                self._start_on_host(s)
        except Exception as exc:  # noqa: BLE001 - its operation fails (or waits) alone
            s.error = exc

    def _start_on_host(self, s: _Start) -> None:
        o = self.o
        spec = replace(o._spec(s.vm), disks=o.volumes.for_start(s.vm, s.disks))
        driver = o.drivers[s.vm.host_name]
        failpoints.hit("start.before-domain")
        current = driver.domain(spec.name)
        if current is None or not current.active:
            driver.start(spec)
        failpoints.hit("start.after-domain")

    @staticmethod
    def _confirm(conn: Connection, s: _Start) -> _Start:
        with events.acting_as(s.cause):
            L.set_vm(conn, s.vm.id, state=VmState.running)
            L.set_operation(conn, s.op_id, state=OperationState.succeeded, step="done", progress=100,
                            message=f"running on {s.vm.host_name}")
        return s

    def _failed(self, op_id: str, cause: str, exc: Exception) -> None:
        with ownership.owned(self.o.controllers.epoch), events.acting_as(cause or events.current_cause()):
            self.o._settle_failed(op_id, exc)
