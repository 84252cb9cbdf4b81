"""Disk snapshots on a simulated host (issue 32), as libvirt's external disk-only snapshot does them: new
qcow2 overlays on each listed disk's file, the domain switched to them, all or none, in one transaction of
the fabric. A guest reads a disk through its chain: a marker written before the snapshot is read from the
base while the overlay holds none of its own (simstorage.read_marker)."""

from __future__ import annotations

from collections.abc import Callable
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


def chain(fabric: SimFabric, host: str, name: str, target: str) -> list[str]:
    with fabric._lock:
        storage, path = fabric._disk_file(fabric._db, host, name, target)
        return _chain(fabric._db, host, storage, path)


def _chain(db, host: str, storage: str, path: str) -> list[str]:
    out = [path]
    while True:
        row = db.execute("SELECT backing FROM files WHERE storage = ? AND path = ?", (storage, out[-1])).fetchone()
        if row is None or not row[0] or storage_of(host, row[0]) != storage or len(out) > 64:
            return out
        out.append(row[0])


def commit(fabric: SimFabric, host: str, name: str, target: str, top: str, base: str) -> None:
    """A block commit that completes at once: what `top` holds is in `base` now (a marker written into `top`
    wins), and the domain reads `base` where it read `top` (the active file: pivot; else `top`'s child is
    rebased onto `base`). `top` stays in the pool: the caller deletes it."""
    top, base = _clean(top), _clean(base)
    with fabric._tx() as db:
        if (
            db.execute(f"SELECT 1 FROM domains WHERE host = ? AND name = ? AND {_ACTIVE}", (host, name)).fetchone()
            is None
        ):
            raise SimStorageError(f"domain {name} is not running here")
        storage, active = fabric._disk_file(db, host, name, target)
        files = _chain(db, host, storage, active)
        if top not in files or base not in files or files.index(base) != files.index(top) + 1:
            raise SimStorageError(f"commit {top} into {base}: disk {target} reads {files}")
        marker = db.execute("SELECT marker FROM files WHERE storage = ? AND path = ?", (storage, top)).fetchone()[0]
        if marker is not None:
            db.execute("UPDATE files SET marker = ? WHERE storage = ? AND path = ?", (marker, storage, base))
        if top == active:
            file = base.rpartition("/")[2]
            db.execute(
                "UPDATE disks SET path = ?, volume = ? WHERE host = ? AND domain = ? AND target = ?",
                (base, file, host, name, target),
            )
        else:
            child = files[files.index(top) - 1]
            db.execute("UPDATE files SET backing = ? WHERE storage = ? AND path = ?", (base, storage, child))


def clone(fabric: SimFabric, host: str, pool: str, name: str, source: str) -> None:
    """A full copy of what `source` shows through its chain: its size, the data of every file of the chain
    (allocation), the marker a guest reads from it; on no backing file."""
    with fabric._tx() as db:
        storage, directory = fabric._pool(db, host, pool)
        src_storage = storage_of(host, source)
        files = _chain(db, host, src_storage, _clean(source))
        rows = [
            db.execute(
                "SELECT capacity_mib, allocation_mib, marker FROM files WHERE storage = ? AND path = ?",
                (src_storage, f),
            ).fetchone()
            for f in files
        ]
        if not rows or rows[0] is None:
            raise SimStorageError(f"Cannot access storage file '{source}': No such file or directory")
        if None in rows:  # as qemu-img: a chain whose backing file is gone can not be read
            missing = files[rows.index(None)]
            raise SimStorageError(f"Could not open '{source}': Could not open backing file: Could not open "
                                  f"'{missing}': No such file or directory")  # fmt: skip
        path = f"{directory}/{name}"
        if db.execute("SELECT 1 FROM files WHERE storage = ? AND path = ?", (storage, path)).fetchone():
            raise SimStorageError(f"storage volume name '{name}' already in use")
        data = sum(r[1] for r in rows if r is not None)
        if data > fabric._available(db, storage):
            raise SimStorageError(f"cannot clone {source}: No space left on device")
        marker = next((r[2] for r in rows if r is not None and r[2] is not None), None)
        db.execute(
            "INSERT INTO files (storage, path, dir, name, format, capacity_mib, allocation_mib, backing, "
            "generation, marker) VALUES (?, ?, ?, ?, 'qcow2', ?, ?, NULL, ?, ?)",
            (storage, path, directory, name, rows[0][0], data, fabric._next_generation(db), marker),
        )


def backup(
    fabric: SimFabric, host: str, name: str, disks: dict[str, tuple[str, bool]], since: str | None, checkpoint: str
) -> int:
    """A push-mode backup of several disks that completes at once: each disk's file (made beforehand in the
    backup store) receives what the disk holds (its chain's data) or, incremental `since` a checkpoint, what
    was written into the disk's file since; it carries the marker a guest reads now. Checkpoint `checkpoint`
    is taken on each disk's file. All or nothing (one transaction); the MiB transferred."""
    with fabric._tx() as db:
        if (
            db.execute(f"SELECT 1 FROM domains WHERE host = ? AND name = ? AND {_ACTIVE}", (host, name)).fetchone()
            is None
        ):
            raise SimStorageError(f"domain {name} is not running here")
        return sum(_backup_one(fabric, db, host, name, target, path, since if inc else None, checkpoint)
                   for target, (path, inc) in sorted(disks.items()))  # fmt: skip


def _backup_one(fabric: SimFabric, db, host: str, name: str, target: str, path: str, since: str | None,
                checkpoint: str) -> int:  # fmt: skip
    storage, active = fabric._disk_file(db, host, name, target)
    written = db.execute("SELECT written_mib FROM files WHERE storage = ? AND path = ?", (storage, active)).fetchone()[
        0
    ]
    if since is not None:
        bitmap = db.execute(
            "SELECT written_mib FROM bitmaps WHERE storage = ? AND path = ? AND name = ?", (storage, active, since)
        ).fetchone()
        if bitmap is None:
            raise SimStorageError(f"missing or broken bitmap '{since}' for disk '{target}'")
        data = written - bitmap[0]
    else:
        files = _chain(db, host, storage, active)
        q = "SELECT allocation_mib FROM files WHERE storage = ? AND path = ?"
        data = sum(db.execute(q, (storage, f)).fetchone()[0] for f in files)
    target_storage = storage_of(host, path)
    row = db.execute("SELECT 1 FROM files WHERE storage = ? AND path = ?", (target_storage, _clean(path))).fetchone()
    if row is None:
        raise SimStorageError(f"Unable to open resource {path}: No such file or directory")
    if data > fabric._available(db, target_storage):
        raise SimStorageError(f"backup of disk {target}: No space left on device")
    marker = _visible_marker(db, host, storage, active)
    db.execute(
        "UPDATE files SET allocation_mib = allocation_mib + ?, marker = ? WHERE storage = ? AND path = ?",
        (data, marker, target_storage, _clean(path)),
    )
    db.execute(
        "INSERT OR REPLACE INTO bitmaps (storage, path, name, written_mib) VALUES (?, ?, ?, ?)",
        (storage, active, checkpoint, written),
    )
    return int(data)


def _visible_marker(db, host: str, storage: str, path: str) -> str | None:
    for f in _chain(db, host, storage, path):
        row = db.execute("SELECT marker FROM files WHERE storage = ? AND path = ?", (storage, f)).fetchone()
        if row is not None and row[0] is not None:
            return row[0]
    return None


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

    def domain_chain(self, name: str, target: str) -> list[str]:
        self._call(f"read the chain of {name}'s {target}")
        try:
            return chain(self.fabric, self.host, name, target)
        except SimStorageError as exc:
            raise DriverError(self.host, f"read the chain of {name}'s {target}: {exc}") from None

    def commit_disk(self, name: str, target: str, top: str, base: str, timeout_s: float = 600.0) -> None:
        self._call(f"commit {top} into {base}")
        try:
            commit(self.fabric, self.host, name, target, top, base)
        except SimStorageError as exc:
            raise DriverError(self.host, f"commit {top} into {base}: {exc}") from None
        self._partial(f"commit {top} into {base}")

    def clone_volume(self, pool: str, name: str, source: str) -> Any:
        self._call(f"clone {source} into {name}")
        try:
            clone(self.fabric, self.host, pool, name, source)
        except SimStorageError as exc:
            raise DriverError(self.host, f"clone {source} into {name}: {exc}") from None
        self._partial(f"clone {source} into {name}")
        return self.fabric.volume(self.host, pool, name)

    def backup_disks(
        self, name: str, disks: dict[str, tuple[str, bool]], since: str | None, checkpoint: str,
        timeout_s: float = 3600.0, on_progress: Callable[[int, int], None] | None = None,
    ) -> int:  # fmt: skip
        self._call(f"back up {name}'s disks")
        if on_progress is not None:
            on_progress(0, 1)  # (the sim's job completes at once: its start is all there is to see)
        try:
            mib = backup(self.fabric, self.host, name, disks, since, checkpoint)
        except SimStorageError as exc:
            raise DriverError(self.host, f"backup of {name}: {exc}") from None
        self._partial(f"back up {name}'s disks")
        return mib << 20

    def checkpoint_xml(self, name: str, checkpoint: str) -> str:
        self._call(f"read checkpoint {checkpoint} of {name}")
        return f"<domaincheckpoint><name>{checkpoint}</name></domaincheckpoint>"

    def define_checkpoints(self, name: str, xmls: list[str]) -> None:
        self._call(f"define the checkpoints of {name}")  # (the sim's bitmaps live in its files: nothing to do)

    def volume_sha256(self, pool: str, name: str) -> tuple[str, int]:
        import hashlib

        self._call(f"read volume {name} of pool {pool}")
        with self.fabric._lock:
            storage, directory = self.fabric._pool(self.fabric._db, self.host, pool)
            row = self.fabric._db.execute(
                "SELECT generation, marker, allocation_mib, backing FROM files WHERE storage = ? AND path = ?",
                (storage, f"{directory}/{name}"),
            ).fetchone()
        if row is None:
            raise DriverError(self.host, f"volume {name} is not in pool {pool}")
        return hashlib.sha256(repr(tuple(row)).encode()).hexdigest(), row[2] << 20

    def abort_backup(self, name: str, checkpoint: str) -> None:
        self._call(f"abort the backup of {name}")
        with self.fabric._tx() as db:
            db.execute("DELETE FROM bitmaps WHERE name = ?", (checkpoint,))
