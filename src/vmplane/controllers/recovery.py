"""Start-up recovery, in the background: the API answers while it runs.

After a restart the control plane finishes what was in flight (docs/design/crash-safety.md): running VMs
are compared with their hosts (`reconcile.reconcile`), copying migrations are settled by asking both
hosts (`Migrator.recover`, which may wait for a copy libvirtd still carries), interrupted operations are
resumed, queued migrations started. That can take minutes, so it runs in a thread; until it is done, the
VMs it concerns are listed (`status()`: /healthz shows the counts, `GET /api/v1/recovery` the VMs) and
operations on them are refused with 409 saying why.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from sqlalchemy import select

from vmplane.controllers.storagesettle import MIN_AGE_S
from vmplane.core.migration import MigrationState
from vmplane.core.model import IN_FLIGHT_OPERATION_STATES, VmState
from vmplane.store import ledger as L
from vmplane.store.events import acting_as
from vmplane.store.ownership import owned

if TYPE_CHECKING:
    from vmplane.controllers.migrator import Migrator
    from vmplane.controllers.storagesettle import StorageSettle
    from vmplane.plane.context import Plane

log = logging.getLogger("vmplane.recovery")

IN_FLIGHT = [st.value for st in IN_FLIGHT_OPERATION_STATES]
SETTLING = [MigrationState.copying.value, MigrationState.checking.value, MigrationState.postcopy_failed.value]


class Recovery:
    """What start-up recovery still has to do, per VM; runs it once per `run()`."""

    def __init__(
        self, plane: Plane, migrator: Migrator, storage_settle: StorageSettle, reconcile: Callable[[], object]
    ):
        self.plane = plane
        self.migrator, self.storage_settle, self.reconcile = migrator, storage_settle, reconcile
        self._lock = threading.Lock()
        self._pending = plane.recovering  # vm name -> (phase, why), read by settle and the API
        self._done = threading.Event()
        self._done.set()
        self.phase = "done"
        self.error: str | None = None
        self.started = False  # take_over() waits for the first run()

    # -- what is recovered ---------------------------------------------------------------------
    def _plan(self) -> dict[str, tuple[str, str]]:
        with self.plane.db.read() as s:
            conn = s.connection()
            v, h, m, op = L.VMS.c, L.HOSTS.c, L.MIGRATIONS.c, L.OPERATIONS.c
            running = conn.execute(
                select(v.name, h.name).join(L.HOSTS, h.id == v.host_id).where(v.state == VmState.running.value)
            ).all()
            migrations = conn.execute(select(m.vm_name, m.id, m.source, m.target).where(m.state.in_(SETTLING))).all()
            operations = conn.execute(
                select(op.target, op.kind, op.id).where(op.state.in_(IN_FLIGHT), op.vm_id.is_not(None))
            ).all()
        plan = {name: ("reconcile", f"comparing it with what {host} runs") for name, host in running}
        plan.update(
            {
                name: ("operations", f"resuming its interrupted {kind} (operation {op_id[:8]})")
                for name, kind, op_id in operations
            }
        )
        plan.update(
            {
                name: (
                    "migrations",
                    f"settling its migration {mig_id[:8]} from {source} to {target} by asking both hosts",
                )
                for name, mig_id, source, target in migrations
            }
        )
        return plan

    def run(self, background: bool) -> None:
        """Recover now (in this thread) or in a background thread; `wait()` waits for the end."""
        with self._lock:
            self.started = True
            self._pending.replace(self._plan())
            self.phase, self.error = "reconcile", None
            self._done.clear()
        if background:
            threading.Thread(target=self._run, name="vmplane-recovery", daemon=True).start()
        else:
            self._run()

    def take_over(self) -> bool:
        """The coordinator's part when another control-plane process lapsed (controllers.py): its
        migrations are settled and its operations resumed or rolled back here, as after a restart,
        without the reconcile pass (the hosts' own listeners keep running VMs true). False if a
        recovery runs already (it takes them too)."""
        with self._lock:
            if not self._done.is_set() or not self.started:
                return False  # recovering already (it takes them too), or not yet started (`vmplane up`)
            self.phase, self.error = "migrations", None
            self._done.clear()
        log.info("taking over the work of lapsed control-plane processes")
        threading.Thread(target=self._run, args=(False,), name="vmplane-takeover", daemon=True).start()
        return True

    def _run(self, reconcile: bool = True) -> None:
        membership = self.plane.membership
        try:
            with acting_as("recovery"), owned(membership.epoch):
                if reconcile:
                    self.reconcile()
                self._finish_phase("reconcile", "migrations")
                self.migrator.recover()
                self._finish_phase("migrations", "operations")
                # those whose owner is not live, now this one's: driven to their end from their step
                self.plane.ops.resume(membership.claim_operations())
                # volumes left between two steps, stale copies; at once only when no other process
                # may be between two steps right now
                self.storage_settle.run_once(min_age_s=0 if membership.alone() else MIN_AGE_S)
                self._finish_phase("operations", "migration queue")
                self.migrator.pump()
        except Exception as exc:  # what is left is retried by the loops and the next start
            log.exception("start-up recovery")
            self.error = str(exc) or type(exc).__name__
        finally:
            with self._lock:
                self._pending.clear()
                self.phase = "done"
            self._done.set()
            log.info("start-up recovery done%s", f" with an error: {self.error}" if self.error else "")

    def _finish_phase(self, phase: str, next_phase: str) -> None:
        with self._lock:
            self._pending.finish_phase(phase)
            self.phase = next_phase

    # -- what others ask -----------------------------------------------------------------------
    def busy(self, vm: str) -> bool:
        return self._pending.busy(vm)

    def check(self, vm: str) -> None:
        """Refuse (409) an operation on a VM that start-up recovery has not finished with."""
        self._pending.check(vm)

    def status(self, vms: bool = True) -> dict:
        with self._lock:
            out: dict = {"done": self._done.is_set(), "phase": self.phase, "pending_vms": len(self._pending)}
            if vms:
                out["vms"] = self._pending.why()
        if self.error:
            out["error"] = self.error
        return out

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)
