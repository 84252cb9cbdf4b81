"""Backup schedules (issue 32): a VM's, or a project's (every running VM of it with a root disk), cron
expression, run exactly once across control-plane processes: a due run is taken by the process whose
compare-and-set moves `next_run_at` on first (store/backups.claim_run), then its backups are taken and the
schedule's retention applied (`keep_last`, `keep_daily`); what happened is kept as the schedule's last result."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from vmplane.core import backups as rules
from vmplane.core.errors import Invalid, NotFound, VmplaneError
from vmplane.core.model import VmState
from vmplane.plane.loops import every
from vmplane.store import backups as B
from vmplane.store import ledger as L
from vmplane.store.schema import utcnow

if TYPE_CHECKING:
    import datetime as dt

    from vmplane.controllers.backups import Backups
    from vmplane.plane.context import Plane

log = logging.getLogger("vmplane.backupschedules")
PASS_S = 30.0


class BackupSchedules:
    def __init__(self, plane: Plane, backups: Backups):
        self.plane, self.backups = plane, backups
        self._stop = threading.Event()

    def start(self) -> None:
        every(lambda: PASS_S, self.run_due, self._stop, "backup-schedules", log)

    def stop(self) -> None:
        self._stop.set()

    def set(
        self,
        cron: str,
        vm: str | None = None,
        project: str | None = None,
        store: str | None = None,
        keep_last: int | None = None,
        keep_daily: int | None = None,
        project_id: int | None = None,
    ) -> dict[str, Any]:
        if (vm is None) == (project is None):
            raise Invalid("name a VM or a project (one of them)", field="vm")
        for name, value in (("keep_last", keep_last), ("keep_daily", keep_daily)):
            if value is not None and value < 1:
                raise Invalid(f"{name} must be 1 or more, got {value}", field=name)
        now = utcnow()
        try:
            nxt = rules.next_run(cron, now)
        except ValueError as exc:
            raise Invalid(str(exc), field="cron") from None
        with self.plane.db.transaction() as conn:
            vm_id = project_row = None
            if vm is not None:
                row = L.vm_row(conn, name=vm)
                if project_id is not None and row.project_id != project_id:
                    raise NotFound(f"vm {vm!r} does not exist", field="vm")
                vm_id = row.id
            else:
                project_row = L.lock_project(conn, name=project)
                if project_id is not None and project_row.id != project_id:
                    raise NotFound(f"project {project!r} does not exist", field="project")
            st = self.backups.store_for(conn, store)
            B.set_schedule(
                conn,
                vm_id,
                project_row.id if project_row is not None else None,
                cron=cron,
                store_id=st.id,
                keep_last=keep_last,
                keep_daily=keep_daily,
                next_run_at=nxt,
            )
        return next(s for s in self.listing() if s["vm"] == vm and s["project"] == (project if vm is None else None))

    def listing(self, project_id: int | None = None) -> list[dict[str, Any]]:
        with self.plane.db.read() as s:
            return [
                {
                    "vm": r.vm,
                    "project": r.project,
                    "cron": r.cron,
                    "store": r.store,
                    "keep_last": r.keep_last,
                    "keep_daily": r.keep_daily,
                    "next_run_at": r.next_run_at.isoformat() + "Z",
                    "last_run_at": r.last_run_at.isoformat() + "Z" if r.last_run_at else None,
                    "last_result": r.last_result,
                }
                for r in B.schedule_rows(s.connection(), project_id)
            ]

    def delete(self, vm: str | None = None, project: str | None = None, project_id: int | None = None) -> None:
        with self.plane.db.transaction() as conn:
            if vm is not None:
                row = L.vm_row(conn, name=vm)
                if project_id is not None and row.project_id != project_id:
                    raise NotFound(f"vm {vm!r} does not exist", field="vm")
                gone = B.delete_schedule(conn, row.id, None)
            else:
                p = L.lock_project(conn, name=project)
                if project_id is not None and p.id != project_id:
                    raise NotFound(f"project {project!r} does not exist", field="project")
                gone = B.delete_schedule(conn, None, p.id)
        if not gone:
            raise NotFound(f"{'vm ' + vm if vm else 'project ' + str(project)} has no backup schedule", field="vm")

    def run_due(self, now: dt.datetime | None = None) -> int:
        """Take each due run this process wins; how many it ran."""
        now = now or utcnow()
        with self.plane.db.read() as s:
            due = B.due(s.connection(), now)
        ran = 0
        for sched in due:
            nxt = rules.next_run(sched.cron, now)
            with self.plane.db.transaction() as conn:
                if not B.claim_run(conn, sched.id, sched.next_run_at, nxt, now):
                    continue  # another process took it
            ran += 1
            result = self._run(sched)
            with self.plane.db.transaction() as conn:
                B.record_run(conn, sched.id, result)
        return ran

    def _run(self, sched) -> str:
        with self.plane.db.read() as s:
            conn = s.connection()
            if sched.vm_id is not None:
                vms = [L.vm_row(conn, vm_id=sched.vm_id)]
            else:
                from sqlalchemy import select

                from vmplane.store.schema import Vm

                ids = [
                    r[0] for r in conn.execute(select(Vm.id).where(Vm.project_id == sched.project_id).order_by(Vm.id))
                ]
                vms = [L.vm_row(conn, vm_id=i) for i in ids]
        done, failed = [], []
        for vm in vms:
            if vm.state != VmState.running.value:
                continue
            try:
                b = self.backups.create(vm.name, sched.store)
                done.append(f"{vm.name}: backup {b['id']} ({b['kind']})")
                if sched.keep_last or sched.keep_daily:
                    self.backups.prune(vm.name, sched.keep_last, sched.keep_daily)
            except VmplaneError as exc:
                failed.append(f"{vm.name}: {exc.message}")
                log.warning("scheduled backup of %s: %s", vm.name, exc.message)
        return "; ".join(done + [f"FAILED {f}" for f in failed]) or "no running VM"
