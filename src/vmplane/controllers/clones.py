"""Clones (issue 32): `vm clone VM NEW [--snapshot S] [--full] [--start]`. A new VM of the source's offering,
template, size and project, whose root disk holds what the source's root disk showed: a stopped VM's disk
as it is, or (from a running or stopped VM) what one of its snapshots kept (its base is read-only: consistent
while the VM runs).

- **Linked** (of a snapshot, the default there): the new root disk is an empty qcow2 overlay on the snapshot's
  base, in the same pool: made at once, whatever the disk's size. The source keeps that base while a clone
  reads it (store/snapshots.linked_clones: it counts as one more snapshot: never merged into, never deleted),
  and the source VM can not be deleted before its clones. A clone on a local pool does not live-migrate.
- **Full** (`--full`, and always of a stopped VM's disk): a copy that stands alone (no backing file): it
  outlives its source and any of its snapshots.

The new VM is created (and charged) first, as `vm create` makes it; its root disk is then replaced by the
overlay or the copy made on the source disk's pool and read back; a pool that refuses deletes the new VM again.
Data volumes are not cloned (a clone has the root disk only)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vmplane.controllers.volumes import file_of, new_file_name
from vmplane.core.driver import DriverError
from vmplane.core.errors import Conflict, NotFound, VmplaneError
from vmplane.core.model import VmState
from vmplane.store import ledger as L
from vmplane.store import snapshots as S
from vmplane.store import storageledger as SL

if TYPE_CHECKING:
    from vmplane.controllers.pools import Pools
    from vmplane.controllers.vms import Vms
    from vmplane.controllers.volumes import Volumes
    from vmplane.plane.context import Plane
    from vmplane.store.reads import Reads

log = logging.getLogger("vmplane.clones")


class Clones:
    def __init__(self, plane: Plane, vms: Vms, volumes: Volumes, pools: Pools, reads: Reads):
        self.plane, self.vms, self.volumes, self.pools, self.reads = plane, vms, volumes, pools, reads

    def clone(
        self, source: str, new: str, snapshot: str | None = None, start: bool = False, project_id: int | None = None,
        full: bool = False,
    ) -> dict[str, Any]:  # fmt: skip
        """Clone `source` into a new VM `new`: linked on a snapshot's base, or a full copy."""
        with self.plane.db.read() as s:
            conn = s.connection()
            src = L.vm_row(conn, name=source)
            if project_id is not None and src.project_id != project_id:
                raise NotFound(f"vm {source!r} does not exist", field="vm")
            root = next((v for v in SL.vm_volumes(conn, src.id) if v.role == "root"), None)
            if root is None:
                raise Conflict(f"vm {source} has no root disk: there is nothing to clone", field="vm")
            busy = S.busy_problem(conn, src.id, source)
            if busy:
                raise Conflict(busy, field="vm")
            if snapshot is not None:
                snap = S.snapshot_row(conn, src.id, snapshot)
                if snap is None:
                    raise NotFound(f"vm {source} has no snapshot {snapshot!r}", field="snapshot")
                base = S.bases(conn, [snap.id]).get(snap.id, {}).get(root.id)
                if base is None:
                    raise Conflict(f"snapshot {snapshot} of vm {source} does not keep its root disk", field="snapshot")
            else:
                if src.state != VmState.stopped.value:
                    raise Conflict(
                        f"vm {source} is {src.state}: clone a stopped VM, or one of its snapshots (--snapshot)",
                        field="vm",
                    )
                base = file_of(root)
        vm = self.reads.vm(source)
        self.vms.create_vm(
            new,
            vm.project.name,
            vm.offering.name,
            vm.template.name,
            vcpus=vm.vcpus,
            memory_mib=vm.memory_mib,
            pool=root.pool_name,
            root_disk_mib=root.size_mib,
        )
        linked = snapshot is not None and not full
        if snapshot is not None and not full:
            copied = self._link(source, snapshot, new, root, base)
        else:
            copied = self.copy_into(new, f"{root.pool_path}/{base}", f"vm {source}'s {base}")
        if start:
            self.vms.start_vm(new)
        return {"vm": new, "source": source, "snapshot": snapshot, "linked": linked, "copied": copied}

    def _link(self, source: str, snapshot: str, new: str, root: Any, base: str) -> str:
        """The new VM's root disk made an empty overlay on `base` (the snapshot's base of the source's root
        disk). The link is recorded first (the source keeps `base` from then on, unmerged), checked against the
        source as it is then; the overlay is made and read back; then the disk switches to it."""
        what = f"snapshot {snapshot} of vm {source}"
        target = self.volumes.row(f"{new}-root")
        made: tuple[Any, str, str] | None = None
        try:
            with self.plane.db.transaction() as conn:
                src = L.vm_row(conn, name=source, lock=True)
                snap = S.snapshot_row(conn, src.id, snapshot)
                if snap is None or S.bases(conn, [snap.id]).get(snap.id, {}).get(root.id) != base:
                    raise Conflict(f"{what} was deleted meanwhile", field="snapshot")
                busy = S.busy_problem(conn, src.id, source)
                if busy:
                    raise Conflict(busy, field="vm")
                SL.set_volume(conn, SL.volume_row(conn, target.name, lock=True), base_file=base,
                              note=f"a linked clone of {what} (its base {base})")  # fmt: skip
            pool = self.pools.row(target.pool_name)
            file = new_file_name(target.name, "qcow2")
            driver = self.pools.driver_for(pool)
            made = (driver, pool.name, file)
            driver.create_volume(pool.name, file, target.size_mib, "qcow2", f"{root.pool_path}/{base}", "qcow2")
            if driver.volume(pool.name, file) is None:
                raise DriverError(driver.host, f"{file} is not in pool {pool.name} after it was made")
        except (DriverError, Conflict) as exc:
            if made is not None:
                self.forget(*made)  # (an overlay made, then an error)
            raise self._unmade(new, f"{what} could not be linked into vm {new}: {exc}") from None
        with self.plane.db.transaction() as conn:
            SL.set_volume(conn, SL.volume_row(conn, target.name, lock=True), file_name=file,
                          note=f"an overlay on {base} of vm {source}")  # fmt: skip
        self.forget(driver, pool.name, file_of(target))  # the template's thin overlay it was made with
        return file

    def copy_into(self, new: str, source: str, what: str) -> str:
        """Replace the new VM's root disk by a full copy of the file at `source` (a volume of a pool, or a
        backup in a store, that the hosts of the new disk's pool see), made on the new disk's pool and read
        back. A pool that refuses: the new VM is deleted again (nothing half-made)."""
        try:
            return self.copy_volume(f"{new}-root", source, what)
        except (DriverError, Conflict) as exc:
            raise self._unmade(new, f"{what} could not be copied into vm {new}: {exc}") from None

    def _unmade(self, new: str, why: str) -> Conflict:
        """The new VM deleted again (nothing half-made); the error that says so."""
        try:
            self.vms.delete_vm(new)
        except VmplaneError as undo:
            log.warning("the new vm %s was not deleted again: %s", new, undo)
        return Conflict(f"{why}; {new} was not kept", field="vm")

    def copy_volume(self, volume: str, source: str, what: str) -> str:
        """Volume `volume`'s file replaced by a full copy of the file at `source`, made on its pool and read
        back, then its former file deleted; the new file's name. DriverError/Conflict: the volume unchanged."""
        driver, pool, file = self.copy_to_pool(volume, source)
        target = self.volumes.row(volume)
        old = file_of(target)
        with self.plane.db.transaction() as conn:
            now = SL.volume_row(conn, target.name, lock=True)
            SL.set_volume(conn, now, file_name=file, note=f"a full copy of {what}")
        self.forget(driver, pool, old)  # e.g. the template's thin overlay a root disk was made with
        return file

    def copy_to_pool(self, volume: str, source: str) -> tuple[Any, str, str]:
        """A full copy of the file at `source` made on volume `volume`'s pool under a name no volume had, read
        back: (the driver that made it, the pool, the file). The volume's record is not changed."""
        target = self.volumes.row(volume)
        pool = self.pools.row(target.pool_name)
        file = new_file_name(volume, "qcow2")
        driver = self.pools.driver_for(pool)
        driver.clone_volume(pool.name, file, source)
        if driver.volume(pool.name, file) is None:
            raise DriverError(driver.host, f"{file} is not in pool {pool.name} after the copy")
        return driver, pool.name, file

    @staticmethod
    def forget(driver: Any, pool: str, file: str) -> None:
        """Delete a file no record names any more; one the pool keeps is left to the audit, named in the log."""
        try:
            driver.delete_volume(pool, file)
        except DriverError as exc:
            log.warning("%s left on pool %s (%s); the audit names it", file, pool, exc)
