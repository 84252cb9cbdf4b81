"""The start controller: this process's start operations, run together.

A create or a start admits its VM (admission.py) and hands the start here. The controller takes what is
queued, up to MAX_BATCH at once, in one executor thread:

1. one transaction persists each start's step (`starting-domain`: before any host is asked) and reads
   its VM and disks;
2. each VM's host is asked to start its domain;
3. the starts their hosts confirmed are recorded (`running`, `succeeded`).

For in-process drivers (the sim: Driver.blocking_calls False) steps 2 and 3 run in the drain, one call
after another, then one transaction for all confirmations. A call to a libvirt host waits on its daemon
(and a hung one, for its keepalive): each such start is handed to a pool of PARALLEL_CALLS threads, which
asks its host and records its confirmation alone, while the drain goes on with the next batch. So one
slow host holds up only its own starts.

Each start keeps its own cause (its events name the request that made it) and is fenced by the lease the
process held when its batch began (an epoch read once: a process that lapsed and registered again does
not carry on its old batch under its new lease; a start another process owns now is left to it). A start
whose host call failed ends alone, as it always did (Operations.fail, with its failure hook
Vms.fail_start_stop, asks the host whether the domain is there). A transaction that fails for the batch
runs again for each start alone, so one start's bad row never fails the others. A start already being
run here is not run twice at once: one queued again meanwhile (a takeover handing back this process's own
start) waits until the first run ended. Recovery hands interrupted starts here too, with the cause
`recovery`.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeVar

from sqlalchemy.engine import Connection, Row

from vmplane.core import failpoints
from vmplane.core.domain import cpu_model_of, spec_of
from vmplane.core.driver import NicSpec
from vmplane.core.errors import Interrupted, NotFound
from vmplane.core.model import OperationState, VmState
from vmplane.plane import metrics
from vmplane.store import events, netview, ownership
from vmplane.store import ledger as L
from vmplane.store import storageledger as SL

if TYPE_CHECKING:
    from vmplane.controllers.networking import Networking
    from vmplane.controllers.seeds import Seeds
    from vmplane.controllers.volumes import Volumes
    from vmplane.plane.context import Plane

log = logging.getLogger("vmplane.starts")
_Item = TypeVar("_Item")
_Result = TypeVar("_Result")
MAX_BATCH = 64  # starts per step transaction
PARALLEL_CALLS = 16  # starts on hosts whose calls wait on a daemon, at once (as the executor had)
IN_FLIGHT = (OperationState.pending.value, OperationState.running.value)


@dataclass
class _Start:
    op_id: str
    cause: str
    epoch: int | None  # the lease its batch runs under
    vm: Row
    disks: list[Row]
    nics: tuple[NicSpec, ...] = ()
    error: Exception | None = None


class Starts:
    def __init__(self, plane: Plane, volumes: Volumes, networking: Networking, seeds: Seeds):
        self.plane = plane
        self.volumes = volumes
        self.networking = networking
        self.seeds = seeds
        self._queue: deque[tuple[str, str | None]] = deque()
        self._active: set[str] = set()  # op ids being run here (taken from the queue, not ended)
        self._lock = threading.Lock()
        self._draining = False
        self._closed = False
        self._calls: ThreadPoolExecutor | None = None

    def submit(self, op_id: str, cause: str | None = None) -> None:
        """Queue a start (`cause`: None, the request's that created it); one executor job drains the queue."""
        with self._lock:
            self._queue.append((op_id, cause))
        self._kick()

    def carried(self) -> frozenset[str]:
        """The starts queued or being run here: carried, not left in flight (overdue.py)."""
        with self._lock:
            return frozenset(self._active) | frozenset(op for op, _ in self._queue)

    def close(self) -> None:
        """After the executor: waits for the starts handed to the pool."""
        with self._lock:
            self._closed, calls = True, self._calls
        if calls is not None:
            calls.shutdown(wait=True)

    def _kick(self) -> None:
        """Start a drain unless one runs (it looks at the queue under the lock before it ends)."""
        with self._lock:
            if self._draining or not self._queue:
                return
            self._draining = True
        try:
            self.plane.executor.submit(self._drain)
        except BaseException:  # an executor shut down: nothing drains
            with self._lock:
                self._draining = False
            raise

    def _take(self) -> list[tuple[str, str | None]]:
        """Under the lock: up to MAX_BATCH queued starts, in order, not being run here already (those stay
        queued, at the front)."""
        batch: list[tuple[str, str | None]] = []
        skipped: list[tuple[str, str | None]] = []
        taken: set[str] = set()
        while self._queue and len(batch) < MAX_BATCH:
            item = self._queue.popleft()
            if item[0] in self._active or item[0] in taken:
                skipped.append(item)
            else:
                batch.append(item)
                taken.add(item[0])
        self._queue.extendleft(reversed(skipped))
        self._active |= taken
        return batch

    def _ended(self, op_ids: list[str]) -> None:
        with self._lock:
            self._active.difference_update(op_ids)
        try:
            self._kick()  # a start queued again while it ran can go now
        except RuntimeError as exc:  # the executor shut down: the process is stopping
            log.info("starts: %s", exc)

    def _drain(self) -> None:
        try:
            while True:
                with self._lock:
                    batch = self._take()
                    if not batch:
                        self._draining = False
                        return
                handed: list[str] = []  # filled as starts go to the pool (kept if run raises)
                try:
                    self.run(batch, handed)
                except Exception:
                    log.exception("starts %s", [op for op, _ in batch])
                with self._lock:
                    self._active.difference_update(op for op, _ in batch if op not in handed)
        except BaseException:
            with self._lock:
                self._draining = False
            raise

    def run(self, batch: list[tuple[str, str | None]], handed: list[str]) -> None:
        """Run a batch; `handed` gets the op ids handed to the pool (still being run there)."""
        epoch = self.plane.membership.epoch
        try:
            with ownership.owned(epoch):
                starts = self._together(
                    batch,
                    lambda conn, item: self._step(conn, item, epoch),
                    lambda item, exc: self._failed(item[0], item[1], epoch, exc),
                )
        except Interrupted as exc:  # Fenced: this process's lease lapsed; the starts are another's now
            log.info(
                "starts %s left at their step for the process that takes them over: %s", [op for op, _ in batch], exc
            )
            return
        remote: list[_Start] = []
        local: list[_Start] = []
        for s in starts:
            (remote if getattr(self.plane.drivers.get(s.vm.host_name), "blocking_calls", True) else local).append(s)
        self._hand_over(remote, handed)
        for s in local:
            self._start_domain(s)
        self._confirm_all([s for s in local if s.error is None], epoch)
        for s in local:
            if s.error is not None:
                self._failed(s.op_id, s.cause, epoch, s.error)

    def _hand_over(self, remote: list[_Start], handed: list[str]) -> None:
        """Each start on a host whose calls wait, to the pool (run here at once when this is closed, or
        when the executor runs everything in its caller's thread: InlineExecutor)."""
        inline = getattr(self.plane.executor, "runs_inline", False)
        for s in remote:
            with self._lock:
                if not self._closed and not inline and self._calls is None:
                    self._calls = ThreadPoolExecutor(PARALLEL_CALLS, thread_name_prefix="vmplane-start")
                pool = None if self._closed or inline else self._calls
            if pool is None:
                self._alone(s)
                continue
            handed.append(s.op_id)
            try:
                pool.submit(self._alone_then_end, s)
            except RuntimeError:  # the pool shut down meanwhile (closing): asked here, at once
                handed.pop()
                self._alone(s)

    def _alone_then_end(self, s: _Start) -> None:
        try:
            self._alone(s)
        finally:
            self._ended([s.op_id])

    def _alone(self, s: _Start) -> None:
        """One start: its host asked, its confirmation in a transaction of its own."""
        try:
            self._start_domain(s)
            if s.error is None:
                self._confirm_all([s], s.epoch)
            else:
                self._failed(s.op_id, s.cause, s.epoch, s.error)
        except Exception:
            log.exception("start %s", s.op_id)

    def _confirm_all(self, done: list[_Start], epoch: int | None) -> None:
        try:
            with ownership.owned(epoch):
                confirmed = self._together(
                    done, self._confirm, lambda s, exc: self._failed(s.op_id, s.cause, epoch, exc)
                )
        except Interrupted as exc:
            log.info(
                "starts %s left at their step for the process that takes them over: %s", [s.op_id for s in done], exc
            )
            return
        for _ in confirmed:
            metrics.OPERATIONS.labels("start", "succeeded").inc()

    def _together(
        self,
        items: list[_Item],
        one: Callable[[Connection, _Item], _Result | None],
        failed: Callable[[_Item, Exception], None],
    ) -> list[_Result]:
        """`one(conn, item)` for each item in one transaction (its events held and written together);
        returns the non-None results. If the transaction fails, each item runs again in a transaction of
        its own (`failed` for one that fails alone). Interrupted (fenced) is raised: nothing of this
        process lands any more."""
        if not items:
            return []
        try:
            with self.plane.db.transaction() as conn:
                events.hold(conn)  # the batch's events: one executemany before the commit
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
                with self.plane.db.transaction() as conn:
                    r = one(conn, item)
            except Interrupted:
                raise
            except Exception as exc:  # noqa: BLE001 - its own failure
                failed(item, exc)
                continue
            if r is not None:
                results.append(r)
        return results

    def _step(self, conn: Connection, item: tuple[str, str | None], epoch: int | None) -> _Start | None:
        """Persist that the start enters `starting-domain`; its VM and disks. None: not this one's to run."""
        op_id, cause = item
        try:
            op = L.operation_row(conn, op_id, lock=True)
        except NotFound:
            return None  # ended and pruned
        if op.owner is not None and op.owner != epoch:
            log.warning(
                "operation %s is owned by controller %s now, not by this one (%s): not run here", op_id, op.owner, epoch
            )
            return None
        if op.state not in IN_FLIGHT:
            return None
        cause = (
            cause
            or events.remembered(op_id)
            or events.cause_of(conn, "operation", op_id, vm=op.target)
            or events.current_cause()
        )
        with events.acting_as(cause):
            L.set_operation(conn, op_id, before=op, state=OperationState.running, step="starting-domain", progress=30)
        vm = L.vm_row(conn, op.vm_id)
        return _Start(op_id, cause, epoch, vm, SL.vm_volumes(conn, vm.id), netview.nic_specs(conn, vm.id))

    def _start_domain(self, s: _Start) -> None:
        """Ask the VM's host to run its domain (a paused or running one is not started twice). Its disks'
        writes (a root disk still to make) are this start's: its cause, fenced by its batch's lease."""
        try:
            with ownership.owned(s.epoch), events.acting_as(s.cause):
                self._start_on_host(s)
        except Exception as exc:  # noqa: BLE001 - its operation fails (or waits) alone
            s.error = exc

    def _start_on_host(self, s: _Start) -> None:
        seed = self.seeds.disk_for(s.vm.id, s.vm.host_name)  # (its cloud-init seed, made on the host first)
        disks = self.volumes.for_start(s.vm, s.disks) + ((seed,) if seed else ())
        spec = replace(spec_of(s.vm), disks=disks, nics=s.nics)
        driver = self.plane.drivers[s.vm.host_name]
        if s.nics:
            self.networking.ensure(s.vm.host_name)  # its bridges and its NICs' filter, before the domain
        failpoints.hit("start.before-domain")
        current = driver.domain(spec.name)
        if current is None or not current.active:
            driver.start(spec)
        failpoints.hit("start.after-domain")

    @staticmethod
    def _confirm(conn: Connection, s: _Start) -> _Start:
        with events.acting_as(s.cause):
            L.set_vm(conn, s.vm.id, state=VmState.running, cpu_model=cpu_model_of(s.vm))
            L.set_operation(
                conn,
                s.op_id,
                state=OperationState.succeeded,
                step="done",
                progress=100,
                message=f"running on {s.vm.host_name}",
            )
        return s

    def _failed(self, op_id: str, cause: str | None, epoch: int | None, exc: Exception) -> None:
        """End one start as failed (Operations.settle_failed), under its batch's lease and its own cause;
        whatever goes wrong there stays with this start (logged; resumed at the next start-up)."""
        try:
            if cause is None:
                cause = events.remembered(op_id)
            if cause is None:
                with self.plane.db.read() as s:
                    cause = events.cause_of(s.connection(), "operation", op_id)
            with ownership.owned(epoch), events.acting_as(cause or events.current_cause()):
                self.plane.ops.settle_failed(op_id, exc)
        except Exception:
            log.exception("start %s: ending it as failed (%s)", op_id, exc)
