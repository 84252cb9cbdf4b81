"""Restores of backups (issue 32): `backup restore ID --to NEW` and `--in-place`.

A restore copies each of the backup's disks out of the store whole (its chain read through: `qemu-img
convert` by libvirt's `createXMLFrom`), onto a pool the hosts of the store see, and reads the copy back before
any record names it. `--to NEW` makes a new VM of what the backed-up VM was (offering, template, vCPUs, memory):
its root disk is the backup's, and each data disk a new volume `NEW-<device>` attached to it; a copy a pool
refuses deletes what the restore made (nothing half-made). `--in-place` gives the stopped VM itself its disks
back as the backup saw them: every copy made first, then all its volumes switched in one transaction, then
their former files deleted. Its next backup is full (a copy holds no bitmap)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vmplane.controllers.backups import Backups
from vmplane.controllers.volumes import file_of
from vmplane.core.driver import DriverError
from vmplane.core.errors import Conflict, NotFound, VmplaneError
from vmplane.core.model import VmState
from vmplane.store import backups as B
from vmplane.store import ledger as L
from vmplane.store import snapshots as S
from vmplane.store import storageledger as SL

if TYPE_CHECKING:
    from vmplane.controllers.clones import Clones
    from vmplane.controllers.pools import Pools
    from vmplane.controllers.vms import Vms
    from vmplane.controllers.volumes import Volumes
    from vmplane.plane.context import Plane

log = logging.getLogger("vmplane.backuprestores")


class BackupRestores:
    def __init__(self, plane: Plane, backups: Backups, vms: Vms, volumes: Volumes, pools: Pools, clones: Clones):
        self.plane, self.backups, self.vms, self.volumes, self.pools, self.clones = (
            plane, backups, vms, volumes, pools, clones,
        )  # fmt: skip

    def _ready(self, backup_id: int, project_id: int | None) -> tuple[Any, list[Any]]:
        with self.plane.db.read() as s:
            conn = s.connection()
            b = B.backup_row(conn, backup_id, project_id)
            disks = B.disk_rows(conn, [backup_id])[backup_id]
        if b.state != "ready":
            raise Conflict(f"backup {backup_id} is {b.state}; only a ready backup is restored", field="backup")
        return b, disks

    def restore(self, backup_id: int, to: str, start: bool = False, pool: str | None = None,
                project_id: int | None = None) -> dict[str, Any]:  # fmt: skip
        """A new VM `to` of what the backed-up VM was, each of its disks a full copy of the backup's."""
        b, disks = self._ready(backup_id, project_id)
        root = next((d for d in disks if d.role == "root"), None)
        if root is None:
            raise Conflict(f"backup {backup_id} holds no root disk to make a VM of", field="backup")
        self.vms.create_vm(
            to, b.project, b.offering, b.template, vcpus=b.vcpus, memory_mib=b.memory_mib,
            root_disk_mib=root.size_mib, pool=pool,
        )  # fmt: skip
        copied = {root.device: self.clones.copy_into(to, f"{b.store_path}/{root.file}", f"backup {backup_id}")}
        made: list[str] = []
        try:
            for d in disks:
                if d.role == "root":
                    continue
                name = f"{to}-{d.device}"
                self.volumes.create(name, b.project, d.size_mib, pool=pool or self._pool_if_any(d.pool))
                made.append(name)
                copied[d.device] = self.clones.copy_volume(
                    name, f"{b.store_path}/{d.file}", f"backup {backup_id}'s {d.device}"
                )
                self.volumes.attach(name, to)
        except (VmplaneError, DriverError) as exc:
            self._unmake(to, made)
            raise Conflict(
                f"backup {backup_id} could not be restored into vm {to}: {exc}; {to} was not kept", field="vm"
            ) from None
        if start:
            self.vms.start_vm(to)
        return {"backup": backup_id, "vm": to, "copied": copied[root.device], "disks": copied}

    def _pool_if_any(self, name: str) -> str | None:
        try:
            self.pools.row(name)
        except NotFound:
            return None  # gone since: the volume goes where a new one would
        return name

    def _unmake(self, vm: str, volumes: list[str]) -> None:
        """What a restore that failed made: the new VM (its root disk with it), then its new volumes."""
        try:
            self.vms.delete_vm(vm)
        except VmplaneError as exc:
            log.warning("a failed restore's vm %s was not deleted: %s", vm, exc)
        for name in volumes:
            try:
                self.volumes.delete(name)
            except VmplaneError as exc:
                log.warning("a failed restore's volume %s was not deleted: %s", name, exc)

    def restore_in_place(self, backup_id: int, project_id: int | None = None) -> dict[str, Any]:
        """The backed-up VM itself (stopped, without snapshots) gets each of its disks back as the backup saw
        it: full copies made on the disks' pools and read back, then every volume switched at once and the
        former files deleted."""
        b, disks = self._ready(backup_id, project_id)
        with self.plane.db.read() as s:
            conn = s.connection()
            if b.vm_id is None:
                raise Conflict(f"vm {b.vm_name} is gone: restore backup {backup_id} to a new VM (--to)", field="vm")
            vm = L.vm_row(conn, vm_id=b.vm_id)
            if vm.state != VmState.stopped.value:
                raise Conflict(f"vm {vm.name} is {vm.state}; stop it before restoring it in place", field="vm")
            if S.snapshot_rows(conn, vm.id) or S.busy_problem(conn, vm.id, vm.name):
                raise Conflict(f"vm {vm.name} has snapshots; delete them before restoring it in place", field="vm")
            mine = {v.name: v for v in SL.vm_volumes(conn, vm.id)}
            for d in disks:
                v = mine.get(d.volume)
                if v is None:
                    raise Conflict(
                        f"volume {d.volume} ({d.device} in backup {backup_id}) is no longer vm {vm.name}'s: "
                        "attach it again, or restore to a new VM (--to)",
                        field="vm",
                    )
                if S.extra_files(conn, v.id):
                    raise Conflict(f"vm {vm.name}'s {d.volume} is a chain of files; restore to a new VM (--to)",
                                   field="vm")  # fmt: skip
        copies: dict[str, tuple[Any, str, str]] = {}
        try:
            for d in disks:
                copies[d.volume] = self.clones.copy_to_pool(d.volume, f"{b.store_path}/{d.file}")
        except (DriverError, Conflict) as exc:
            for driver, pool, file in copies.values():
                self.clones.forget(driver, pool, file)
            raise Conflict(
                f"backup {backup_id} was not restored into vm {vm.name}: {exc}; it is unchanged", field="vm"
            ) from None
        with self.plane.db.transaction() as conn:
            now = L.vm_row(conn, vm_id=vm.id, lock=True)
            if now.state != VmState.stopped.value:  # started meanwhile: the copies go, the VM keeps its disks
                for driver, pool, file in copies.values():
                    self.clones.forget(driver, pool, file)
                raise Conflict(f"vm {vm.name} was started meanwhile; nothing was restored", field="vm")
            for volume, (_driver, _pool, file) in copies.items():
                SL.set_volume(conn, SL.volume_row(conn, volume, lock=True), file_name=file,
                              note=f"restored from backup {backup_id}")  # fmt: skip
            B.event(conn, b, "ready", "ready", f"restored in place into vm {vm.name} ({len(copies)} disk(s))")
        for volume, (driver, pool, _file) in copies.items():
            self.clones.forget(driver, pool, file_of(mine[volume]))
        return {"backup": backup_id, "vm": vm.name, "copied": copies[disks[0].volume][2],
                "disks": {d.device: copies[d.volume][2] for d in disks}}  # fmt: skip
