"""Backup stores (admins) and backups (a project's members, of their own VMs) (issue 32). Each answer comes
once the hosts confirmed it: a backup once its file is written and read back (sha256), a restore once the
new VM's disk is copied."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path
from pydantic import Field

from vmplane.api.deps import Admin, AnyCaller, Orch
from vmplane.api.paging import StrictQueryRoute
from vmplane.api.schemas import INT_MAX, Name, Request
from vmplane.core.errors import Invalid

router = APIRouter(tags=["backups"], route_class=StrictQueryRoute)
BackupId = Annotated[int, Path(ge=1, le=INT_MAX, description="the backup's id")]


class StoreCreate(Request):
    name: Name
    cluster: str = Field(max_length=63, description="every host of this cluster must see the directory")
    path: str | None = Field(None, max_length=1024, description="default: under the hosts' shared storage")


class BackupCreate(Request):
    store: str | None = Field(None, max_length=63, description="default: the only store there is")
    full: bool = Field(False, description="a full backup even when an incremental one is possible")


class PruneRequest(Request):
    keep_last: int | None = Field(None, ge=1, le=10000, description="the newest N backups are kept")
    keep_daily: int | None = Field(None, ge=1, le=10000, description="the newest backup of each of the last N days")


class RestoreRequest(Request):
    name: Name | None = Field(None, description="the new VM's name (or in_place)")
    in_place: bool = Field(False, description="the backed-up VM itself (stopped, without snapshots)")
    start: bool = False
    pool: str | None = Field(None, max_length=63, description="the new root disk's pool (default: placement's)")


def _scope(who: AnyCaller) -> int | None:
    return None if who.is_admin else who.project_id


@router.post("/backup-stores", status_code=201)
def create_store(body: StoreCreate, orch: Orch, _: Admin) -> dict[str, Any]:
    """A backup store: the directory defined on every host of the cluster, refused (409, `path`) unless a
    file written through one host is seen through the others."""
    return orch.backups.create_store(body.name, body.cluster, body.path)


@router.get("/backup-stores")
def list_stores(orch: Orch, _: AnyCaller) -> list[dict[str, Any]]:
    return orch.backups.stores()


@router.delete("/backup-stores/{name}", status_code=204)
def delete_store(name: str, orch: Orch, _: Admin) -> None:
    orch.backups.delete_store(name)


@router.post("/vms/{name}/backups", status_code=201)
def create_backup(name: str, body: BackupCreate, orch: Orch, who: AnyCaller) -> dict[str, Any]:
    """Back up the running VM's disks (root disk and data volumes) in one job: each incremental on its last
    backup in the store when possible."""
    vm = orch.vm(name)
    who.check_project(vm.project_id, "vm", name)
    return orch.backups.create(name, body.store, body.full, project_id=_scope(who))


@router.get("/backups")
def list_backups(orch: Orch, who: AnyCaller, vm: str | None = None) -> list[dict[str, Any]]:
    return orch.backups.listing(vm, project_id=_scope(who))


@router.get("/backups/{backup_id}")
def show_backup(backup_id: BackupId, orch: Orch, who: AnyCaller) -> dict[str, Any]:
    return orch.backups.show(backup_id, project_id=_scope(who))


@router.post("/backups/{backup_id}/verify")
def verify_backup(backup_id: BackupId, orch: Orch, who: AnyCaller) -> dict[str, Any]:
    """Read the backup's chain back; `ok` when every file's sha256 and size are those recorded."""
    return orch.backups.verify(backup_id, project_id=_scope(who))


@router.post("/backups/{backup_id}/restore", status_code=201)
def restore_backup(backup_id: BackupId, body: RestoreRequest, orch: Orch, who: AnyCaller) -> dict[str, Any]:
    """A new VM of what the backed-up VM was, each disk a full copy of the backup's chain (a data disk a new
    volume NAME-<device>, attached); or (in_place) the backed-up VM itself, stopped, its disks replaced by
    those copies."""
    if body.in_place and body.name is None:
        return orch.backup_restores.restore_in_place(backup_id, project_id=_scope(who))
    if body.in_place or body.name is None:
        raise Invalid("give the new VM's name, or in_place (one of them)", field="name")
    return orch.backup_restores.restore(backup_id, body.name, body.start, body.pool, project_id=_scope(who))


@router.delete("/backups/{backup_id}", status_code=204)
def delete_backup(backup_id: BackupId, orch: Orch, who: AnyCaller) -> None:
    """Refused (409) while a later backup is incremental on it."""
    orch.backups.delete(backup_id, project_id=_scope(who))


@router.post("/vms/{name}/backups/prune")
def prune_backups(name: str, body: PruneRequest, orch: Orch, who: AnyCaller) -> dict[str, Any]:
    """Keep the VM's newest backups and one a day; delete the others (a kept backup built on a deleted one is
    made whole first: every backup left restores)."""
    return orch.backups.prune(name, body.keep_last, body.keep_daily, project_id=_scope(who))


class ScheduleSet(Request):
    cron: str = Field(max_length=100, description="when: 5 fields, UTC (minute hour day-of-month month day-of-week)")
    store: str | None = Field(None, max_length=63, description="default: the only store there is")
    keep_last: int | None = Field(None, ge=1, le=10000, description="after each run: keep the newest N")
    keep_daily: int | None = Field(None, ge=1, le=10000, description="after each run: one a day for N days")


@router.put("/vms/{name}/backup-schedule")
def set_vm_schedule(name: str, body: ScheduleSet, orch: Orch, who: AnyCaller) -> dict[str, Any]:
    """The VM's backups on a schedule (it replaces the one it had); each run backs it up if it runs, then
    applies the retention. Run exactly once across control-plane processes."""
    return orch.backup_schedules.set(
        body.cron, vm=name, store=body.store, keep_last=body.keep_last, keep_daily=body.keep_daily,
        project_id=_scope(who),
    )  # fmt: skip


@router.delete("/vms/{name}/backup-schedule", status_code=204)
def delete_vm_schedule(name: str, orch: Orch, who: AnyCaller) -> None:
    orch.backup_schedules.delete(vm=name, project_id=_scope(who))


@router.put("/projects/{name}/backup-schedule")
def set_project_schedule(name: str, body: ScheduleSet, orch: Orch, who: AnyCaller) -> dict[str, Any]:
    """Every running VM of the project (with a root disk) backed up on a schedule, then the retention."""
    return orch.backup_schedules.set(
        body.cron, project=name, store=body.store, keep_last=body.keep_last, keep_daily=body.keep_daily,
        project_id=_scope(who),
    )  # fmt: skip


@router.delete("/projects/{name}/backup-schedule", status_code=204)
def delete_project_schedule(name: str, orch: Orch, who: AnyCaller) -> None:
    orch.backup_schedules.delete(project=name, project_id=_scope(who))


@router.get("/backup-schedules")
def list_schedules(orch: Orch, who: AnyCaller) -> list[dict[str, Any]]:
    """Schedules with their next run and what their last one did."""
    return orch.backup_schedules.listing(project_id=_scope(who))
