"""Disk snapshots on a simulated host (issue 32), as libvirt's external disk-only snapshot does them: new
qcow2 overlays on each listed disk's file, the domain switched to them, all or none, in one transaction of
the fabric. A guest reads a disk through its chain: a marker written before the snapshot is read from the
base while the overlay holds none of its own (simstorage.read_marker)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vmplane.core.driver import DriverError
from vmplane.hosts.drivers.simstorage import QCOW2_OVERHEAD_MIB, SimStorageError, _clean, storage_of

if TYPE_CHECKING:
    from vmplane.hosts.drivers.simfabric import SimFabric

_ACTIVE = "state NOT IN ('shutoff', 'crashed', 'nostate')"


def snapshot_disks(fabric: SimFabric, host: str, name: str, overlays: dict[str, str]) -> None:
    with fabric._tx() as db:
        if (
            db.execute(f"SELECT 1 FROM domains WHERE host = ? AND name = ? AND {_ACTIVE}", (host, name)).fetchone()
            is None
        ):
            raise SimStorageError(f"domain {name} is not running here")
        for target, overlay in overlays.items():
            storage, path = fabric._disk_file(db, host, name, target)
            if storage_of(host, overlay) != storage:
                raise SimStorageError(f"overlay {overlay} of disk {target} is not on the disk's storage")
            if db.execute("SELECT 1 FROM files WHERE storage = ? AND path = ?", (storage, _clean(overlay))).fetchone():
                raise SimStorageError(f"external snapshot file for disk {target} already exists: {overlay}")
            size = db.execute(
                "SELECT capacity_mib FROM files WHERE storage = ? AND path = ?", (storage, path)
            ).fetchone()
            if fabric._available(db, storage) < QCOW2_OVERHEAD_MIB:
                raise SimStorageError(f"cannot create {overlay}: No space left on device")
            directory, _, file = _clean(overlay).rpartition("/")
            db.execute(
                "INSERT INTO files (storage, path, dir, name, format, capacity_mib, allocation_mib, backing, "
                "generation) VALUES (?, ?, ?, ?, 'qcow2', ?, ?, ?, ?)",
                (
                    storage,
                    _clean(overlay),
                    directory,
                    file,
                    size[0],
                    QCOW2_OVERHEAD_MIB,
                    path,
                    fabric._next_generation(db),
                ),
            )
            db.execute(
                "UPDATE disks SET path = ?, volume = ? WHERE host = ? AND domain = ? AND target = ?",
                (_clean(overlay), file, host, name, target),
            )


class SimSnapshotMixin:
    if TYPE_CHECKING:
        host: str
        fabric: Any

        def _call(self, what: str) -> None: ...
        def _partial(self, what: str) -> None: ...

    def snapshot_disks(self, name: str, overlays: dict[str, str]) -> None:
        self._call(f"snapshot the disks of {name}")
        try:
            snapshot_disks(self.fabric, self.host, name, overlays)
        except SimStorageError as exc:
            raise DriverError(self.host, f"snapshot the disks of {name}: {exc}") from None
        self._partial(f"snapshot the disks of {name}")
