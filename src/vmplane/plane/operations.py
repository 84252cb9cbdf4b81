"""The operation runner: runs an operation's body under its cause and owner, and ends it failed when
the body raises, as Nova's conductor tasks have `execute` and `rollback`.

The runner knows no kind. Each kind registers with it (`register`): its body (what a resumed or
queued operation of that kind runs), an optional failure hook (settles the kind's VM inside the
transaction that ends the operation failed: a start or stop asks the host first, a scale settles at
its larger size), an optional `take_failure` (a kind that ends its own failures, an HA restart), an
optional `resume` (a kind with its own queue, a start) and `carried` (the ids its own threads carry).
Every step of an operation is persisted before it is acted on (`begin_step`); a failure gives back
exactly what was charged and claimed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol

from sqlalchemy import bindparam, select
from sqlalchemy.engine import Connection, Row

from vmplane.core.errors import Conflict, Interrupted, VmplaneError
from vmplane.core.model import IN_FLIGHT_OPERATION_STATES, UNREACHABLE_HOST_STATES, OperationState, VmState
from vmplane.plane import metrics
from vmplane.plane.capacity import Capacity, Freed
from vmplane.plane.carried import carrying
from vmplane.plane.membership import Membership
from vmplane.store import Database, events, ownership
from vmplane.store import ledger as L
from vmplane.store.prepared import prepared

log = logging.getLogger("vmplane.orchestrator")

IN_FLIGHT = {st.value for st in IN_FLIGHT_OPERATION_STATES}
UNREACHABLE = {st.value for st in UNREACHABLE_HOST_STATES}
# VM states whose operation can not tell what a host that does not answer did
HELD_BY_AN_OPERATION = (VmState.starting.value, VmState.stopping.value, VmState.scaling.value)

_OP = L.OPERATIONS.c
_OPERATION_TO_RUN = select(_OP.kind, _OP.target, _OP.vm_id, _OP.owner).where(_OP.id == bindparam("id"))

Body = Callable[[str], Any]


@dataclass
class Failed:
    """What a failure hook settled: claims released (given back to the index once the transaction
    commits) and capacity given back on a host."""

    freed: Freed = field(default_factory=list)
    given: tuple[str, int, int] | None = None


@dataclass(frozen=True)
class FailureContext:
    """What a failure hook is told, inside the transaction that ends the operation failed."""

    conn: Connection
    op: Row  # locked, in flight
    vm: Row | None  # locked
    reason: str
    host_down: bool  # the VM is held by the operation and its host does not answer
    before: Any  # what the kind's `before_fail` asked before the transaction (or None)


FailureHook = Callable[[FailureContext], Failed | None]


@dataclass(frozen=True)
class Kind:
    body: Body | None = None
    on_fail: FailureHook | None = None
    before_fail: Callable[[str, Row], Any] | None = None
    take_failure: Callable[[str, Exception], bool] | None = None
    resume: Callable[[str], None] | None = None
    carried: Callable[[], AbstractSet[str]] | None = None


class Runtime(Protocol):
    """What the runner uses of the Plane (context.Plane is one): read when an operation runs, so that a
    test may hand the Plane another executor."""

    db: Database
    membership: Membership
    capacity: Capacity
    executor: Executor


class Operations:
    def __init__(self, plane: Runtime, settle_after: Callable[[str], object]):
        self.plane = plane
        self._settle_after = settle_after  # settle.after_failed_operation: the VM from its host, now
        self._kinds: dict[str, Kind] = {}

    def register(
        self,
        kind: str,
        body: Body | None = None,
        *,
        on_fail: FailureHook | None = None,
        before_fail: Callable[[str, Row], Any] | None = None,
        take_failure: Callable[[str, Exception], bool] | None = None,
        resume: Callable[[str], None] | None = None,
        carried: Callable[[], AbstractSet[str]] | None = None,
    ) -> None:
        self._kinds[kind] = Kind(body, on_fail, before_fail, take_failure, resume, carried)

    def body(self, kind: str) -> Body | None:
        found = self._kinds.get(kind)
        return found.body if found else None

    def carried(self) -> set[str]:
        """The operations the kinds' own queues carry (not waiting in the executor)."""
        out: set[str] = set()
        for kind in self._kinds.values():
            if kind.carried is not None:
                out |= kind.carried()
        return out

    # -- running ---------------------------------------------------------------------------------
    def submit(self, op_id: str, body: Body, cause: str | None = None) -> None:
        """Run `body` for the operation in an executor thread."""
        self.plane.executor.submit(self.run, op_id, body, cause)

    def run(self, op_id: str, body: Body, cause: str | None = None) -> None:
        """Run an operation's body (in an executor thread, or later) under `cause`, by default the cause of
        the request that created it: its events name that user, not whoever's thread happens to run it."""
        db, membership = self.plane.db, self.plane.membership
        op = prepared(db.engine, _OPERATION_TO_RUN).first(id=op_id)  # one read, no transaction
        if cause is None:
            cause = events.remembered(op_id)  # this process created it: no need to ask the store
        if cause is None and op is not None:
            with db.read() as s:
                cause = events.cause_of(
                    s.connection(),
                    "operation",
                    op_id,
                    vm=op["target"] if op["vm_id"] is not None else None,
                    host=op["target"] if op["kind"] == "drain" else None,
                )
        owner = op["owner"] if op is not None else None
        if owner is not None and owner != membership.epoch:
            log.warning(
                "operation %s is owned by controller %s now, not by this one (%s): not run here",
                op_id,
                owner,
                membership.epoch,
            )
            return
        # its writes land only while its owner's lease holds (ownership.py): a lapsed owner changes nothing
        with ownership.owned(owner), events.acting_as(cause or events.current_cause()):
            self._run_body(op_id, body)

    def _run_body(self, op_id: str, body: Body) -> None:
        """`body(op_id)`; one that returns OperationState.succeeded ended its operation so itself, and has
        no failure to settle (not read back). Carried by this thread meanwhile (overdue.py)."""
        with carrying(op_id):
            try:
                if body(op_id) is OperationState.succeeded:
                    return
            except Exception as exc:  # noqa: BLE001 - an operation must end, whatever happened
                self.settle_failed(op_id, exc)
                return
            self.settle_after(op_id)

    def settle_failed(self, op_id: str, exc: Exception) -> None:
        """An operation's body raised `exc`: it ends failed (Interrupted: left at its step for the next
        start, or for the process that takes it over)."""
        if isinstance(exc, Interrupted):
            log.info("operation %s left at its step for the next start", op_id)
            return
        log.warning("operation %s failed: %s", op_id, exc)
        try:
            self.fail(op_id, exc)
        except Interrupted:
            log.info("operation %s left at its step for the next start", op_id)
            return
        self.settle_after(op_id)

    def settle_after(self, op_id: str) -> None:
        try:  # a failure path that put the VM back to running is checked against its host
            self._settle_after(op_id)
        except Exception:
            log.exception("operation %s: settling its VM after the failure", op_id)

    def begin_step(self, op_id: str, step: str) -> Row | None:
        """Persist that an in-flight operation enters `step`; returns its VM, or None if it already ended."""
        with self.plane.db.transaction() as conn:
            return self.enter_step(conn, op_id, step)

    @staticmethod
    def enter_step(conn: Connection, op_id: str, step: str) -> Row | None:
        op = L.operation_row(conn, op_id, lock=True)
        if op.state not in IN_FLIGHT:
            return None
        L.set_operation(conn, op_id, before=op, state=OperationState.running, step=step, progress=30)
        return L.vm_row(conn, op.vm_id)

    # -- failing ---------------------------------------------------------------------------------
    def fail(self, op_id: str, exc: Exception) -> None:
        """End an operation as failed, giving back what its kind's failure hook says it held. One that
        already ended (by its own run, or a run of it handed over meanwhile) is left as it ended: nothing
        is given back twice."""
        reason = exc.message if isinstance(exc, VmplaneError) else str(exc) or type(exc).__name__
        db = self.plane.db
        with db.read() as s:
            first = L.operation_row(s.connection(), op_id)
        kind = self._kinds.get(first.kind, Kind())
        if kind.take_failure is not None and kind.take_failure(op_id, exc):
            return
        before = kind.before_fail(op_id, first) if kind.before_fail is not None else None
        settled: Failed | None = None
        with db.transaction() as conn:
            op = L.operation_row(conn, op_id, lock=True)
            if op.state not in IN_FLIGHT:
                log.info("operation %s already %s; not failed again (%s)", op_id, op.state, reason)
                return
            vm = L.vm_row(conn, op.vm_id, lock=True) if op.vm_id is not None else None
            down = vm is not None and vm.state in HELD_BY_AN_OPERATION and self._host_down(conn, vm.host_id)
            if kind.on_fail is not None:
                settled = kind.on_fail(FailureContext(conn, op, vm, reason, down, before))
            elif down and vm is not None:  # (down: its VM is known)
                self.held_unknown(conn, op, vm, reason)
            L.set_operation(
                conn,
                op_id,
                state=OperationState.failed,
                progress=100,
                message=f"{op.kind} failed at step {op.step}: {reason}",
            )
        metrics.OPERATIONS.labels(op.kind, "failed").inc()
        if settled is not None:
            if settled.given is not None:
                host, vcpus, memory = settled.given
                self.plane.capacity.add(host, -vcpus, -memory)
            self.plane.capacity.give_back(settled.freed)

    @staticmethod
    def held_unknown(conn: Connection, op: Row, vm: Row, reason: str, **fields: Any) -> None:
        """Nobody can tell what the VM's host did: kept charged and claimed until the host answers
        (hostmonitor settles it then), never put back to running/stopped unasked."""
        L.set_vm(
            conn,
            vm.id,
            note=f"{op.kind} failed and its host {vm.host_name} does not answer: {reason}",
            state=VmState.unknown,
            **fields,
        )

    @staticmethod
    def _host_down(conn: Connection, host_id: int | None) -> bool:
        return (
            host_id is not None
            and conn.execute(select(L.HOSTS.c.state).where(L.HOSTS.c.id == host_id)).scalar() in UNREACHABLE
        )

    # -- after a restart or a take-over ----------------------------------------------------------
    def resume(self, pending: list[tuple[str, str]]) -> None:
        """Operations interrupted by a restart (or of a lapsed process) are driven to their end from their
        persisted step by their kind's body; a kind with none can not be resumed and is failed."""
        for op_id, kind_name in pending:
            kind = self._kinds.get(kind_name)
            if kind is not None and kind.resume is not None:
                kind.resume(op_id)
            elif kind is None or kind.body is None:
                self.fail(op_id, Conflict(f"interrupted {kind_name} cannot be resumed"))
            else:
                self.submit(op_id, kind.body, "recovery")
