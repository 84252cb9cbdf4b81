"""Storage of sim hosts: pools, volumes, domain disks, and the disk part of a migration.

The model (kept in the fabric's SQLite file, so it outlives a killed control plane and is shared by
every process of a store, as the domains are):
- A *file* is keyed by (storage, path). The storage of a path, as a host sees it (`storage_of`): a
  path under SHARED_ROOT (`/var/lib/vmplane/shared/`; env VMPLANE_SIM_SHARED_ROOT) is on the one
  storage that every sim host of the fabric mounts there (SHARED, the model of an NFS export); any
  other path is on that host's own disk (storage = the host's name). So two hosts that define a pool
  at the same shared path see the same files; at the same local path, different files.
- A *pool* is per (host, pool name), with a path and a state ("running", or what a test set). Its
  volumes are the files directly under its path in the host's view (a file put there behind the
  pool's back is a volume too, as after a libvirt pool refresh). Like a libvirt `dir` pool, a pool
  reports its file system: capacity, allocation and available are those of the whole storage (every
  pool on a host's local disk reports the same numbers).
- Capacity per storage: `fabric.local_capacity_mib` (default 1 TiB, env VMPLANE_SIM_LOCAL_POOL_MIB)
  for each host's disk, `fabric.shared_capacity_mib` (10 TiB, env VMPLANE_SIM_SHARED_POOL_MIB) for
  the shared one; `fabric.set_capacity(host or SHARED, mib)` sets one storage's (persisted).
- Allocation: a qcow2 volume allocates QCOW2_OVERHEAD_MIB (1 MiB) + what the guest wrote into it
  (`SimDriver.guest_write`), at most its capacity; a raw volume allocates its capacity; an uploaded
  one the source file's size. Creating or growing past the storage's available space is refused
  (ENOSPC), a guest write past it pauses the domain (I/O error), a disk copy past it fails.
- A domain's disks are rows beside the domain, moved with it by a migration. The lock (libvirt's
  lockd with a lockspace every host sees): a file is open for writing by at most one active domain
  in the whole fabric; read-only disks and backing files take no lease.
- A migration copying disks (MigrationParams.copy_disks: VIR_MIGRATE_NON_SHARED_INC) needs the
  overlay on the target already (same path, format and size, its backing there), copies the source
  overlay's allocation at `disk_copy_rate_mib_s` (driver, else fabric: 200 MiB/s, env
  VMPLANE_SIM_DISK_COPY_RATE_MIB_S; capped by the migration bandwidth, as libvirt caps the NBD
  mirror), before the memory. A copy that stops (abort, a fault, ENOSPC) leaves the target overlay
  partly written. A disk on a path that is not shared and not copied: the migration is refused.
- What a disk holds (review N2): each file has a `generation`, a number no other file of the fabric
  ever had (a file deleted and made again at the same path is a new generation), and a `marker`, the
  data a guest wrote into it (`SimDriver.guest_write_marker`; None: the file reads as zeros). A disk
  copy carries the source's marker to the target once it completed. `file_facts` reads both, so a test
  tells a fresh file from one an earlier volume left behind.
- A file left behind (review N2): `fabric.fail_at_delete(host, mode)` makes the host fail (as
  `fail_host`) when it is next asked to delete a volume, before the delete: the copy a migration left
  there stays, as when a host dies between a migration's end and the copy's cleanup.
"""

from __future__ import annotations

import contextlib
import math
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

from vmplane.core import driver as base
from vmplane.core.driver import DiskSpec, DomainSpec, DriverError, MigrationParams, PoolInfo, PoolSpec, VolumeInfo
from vmplane.hosts.drivers.simevents import SUSPENDED, SUSPENDED_IOERROR
from vmplane.hosts.drivers.volumefiles import same_volume

if TYPE_CHECKING:
    from vmplane.hosts.drivers.simfaults import SimFaults

SHARED_ROOT = os.environ.get("VMPLANE_SIM_SHARED_ROOT", "/var/lib/vmplane/shared/").rstrip("/") + "/"
SHARED = "(shared)"  # the storage key of every path under SHARED_ROOT
QCOW2_OVERHEAD_MIB = 1  # what a fresh qcow2 file takes (header, tables)
MIB = 1 << 20
_ACTIVE = "state NOT IN ('shutoff', 'crashed', 'nostate')"
_M_ACTIVE = "m.state NOT IN ('shutoff', 'crashed', 'nostate')"  # (domains AS m)

STORAGE_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS storages (key TEXT PRIMARY KEY, capacity_mib INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS pools (host TEXT NOT NULL, name TEXT NOT NULL, path TEXT NOT NULL, "
    "state TEXT NOT NULL DEFAULT 'running', PRIMARY KEY (host, name))",
    "CREATE TABLE IF NOT EXISTS files (storage TEXT NOT NULL, path TEXT NOT NULL, dir TEXT NOT NULL, "
    "name TEXT NOT NULL, format TEXT NOT NULL, capacity_mib INTEGER NOT NULL, allocation_mib INTEGER NOT NULL, "
    "backing TEXT, PRIMARY KEY (storage, path))",
    "CREATE INDEX IF NOT EXISTS files_dir ON files (storage, dir)",
    "CREATE TABLE IF NOT EXISTS generations (key TEXT PRIMARY KEY, n INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS delete_traps (host TEXT PRIMARY KEY, mode TEXT NOT NULL)",
    "CREATE INDEX IF NOT EXISTS files_backing ON files (backing)",
    "CREATE TABLE IF NOT EXISTS disks (host TEXT NOT NULL, domain TEXT NOT NULL, target TEXT NOT NULL, "
    "position INTEGER NOT NULL, storage TEXT NOT NULL, path TEXT NOT NULL, pool TEXT NOT NULL, "
    "volume TEXT NOT NULL, format TEXT NOT NULL, readonly INTEGER NOT NULL, PRIMARY KEY (host, domain, target))",
    "CREATE INDEX IF NOT EXISTS disks_file ON disks (storage, path)",
    # write locks of a powered-off host that outlive it on the shared storage (an NFS lease): simhosts.py
    "CREATE TABLE IF NOT EXISTS held_locks (storage TEXT NOT NULL, path TEXT NOT NULL, host TEXT NOT NULL, "
    "until REAL NOT NULL)",
    # what each storage's files allocate, kept by triggers (a pool's numbers at thousands of files)
    "CREATE TABLE IF NOT EXISTS used (storage TEXT PRIMARY KEY, mib INTEGER NOT NULL)",
    # a file's persistent dirty bitmaps (issue 32: backups' checkpoints): what had been written into the file
    # when each was taken (files.written_mib then); they live in the file, as a qcow2 bitmap does
    "CREATE TABLE IF NOT EXISTS bitmaps (storage TEXT NOT NULL, path TEXT NOT NULL, name TEXT NOT NULL, "
    "written_mib INTEGER NOT NULL, PRIMARY KEY (storage, path, name))",
    "CREATE TRIGGER IF NOT EXISTS files_insert AFTER INSERT ON files BEGIN "
    "INSERT INTO used (storage, mib) VALUES (NEW.storage, NEW.allocation_mib) "
    "ON CONFLICT (storage) DO UPDATE SET mib = mib + NEW.allocation_mib; END",
    "CREATE TRIGGER IF NOT EXISTS files_delete AFTER DELETE ON files BEGIN "
    "UPDATE used SET mib = mib - OLD.allocation_mib WHERE storage = OLD.storage; END",
    "CREATE TRIGGER IF NOT EXISTS files_update AFTER UPDATE OF allocation_mib, storage ON files BEGIN "
    "UPDATE used SET mib = mib - OLD.allocation_mib WHERE storage = OLD.storage; "
    "INSERT INTO used (storage, mib) VALUES (NEW.storage, NEW.allocation_mib) "
    "ON CONFLICT (storage) DO UPDATE SET mib = mib + NEW.allocation_mib; END",
)


class SimStorageError(Exception):
    """Refused by the sim's storage (the driver raises it as a DriverError naming the host)."""


def storage_of(host: str, path: str) -> str:
    """Which storage `host` reaches at `path`: SHARED under SHARED_ROOT, else the host's own disk."""
    return SHARED if (path.rstrip("/") + "/").startswith(SHARED_ROOT) else host


def _env_number(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


def image_size(source: str) -> tuple[int, int]:
    """(virtual size, file size) in MiB of an image file: a qcow2's virtual size is in its header."""
    size = os.stat(source).st_size
    virtual = size
    with open(source, "rb") as f:
        header = f.read(32)
    if len(header) == 32 and header[:4] == b"QFI\xfb":
        virtual = int.from_bytes(header[24:32], "big")
    return max(1, math.ceil(virtual / MIB)), max(1, math.ceil(size / MIB))


@dataclass
class DiskCopy:
    """One disk a migration copies: `mib` of the source overlay onto the target's file at `path`."""

    target: str
    path: str
    storage: str  # the target's storage of the file
    mib: int  # the source overlay's allocation: what is copied
    initial_mib: int  # the target file's allocation before the copy
    marker: str | None = None  # what the guest wrote into the source (the target holds it once copied)


@dataclass
class CopyPlan:
    copies: list[DiskCopy]
    fail_at_mib: float | None = None  # the copy fails after this much (ENOSPC, or `fault`)
    fault: bool = False  # fault mode: an I/O error mid-copy (else ENOSPC)

    @property
    def mib(self) -> int:
        return sum(c.mib for c in self.copies)


class StorageFabric:
    """The storage half of SimFabric (a mixin: it uses the fabric's `_db` and `_lock`)."""

    if TYPE_CHECKING:  # what SimFabric (this and HostFabric mixed) gives the methods here
        _db: sqlite3.Connection
        _lock: threading.Lock

        def fail_host(self, host: str, mode: str, seconds: float | None = None) -> Any: ...
        def spec(self, host: str, name: str, active: bool = True) -> DomainSpec | None: ...
        def set_state(self, host: str, name: str, state: str, reason: str) -> bool: ...

    def _init_storage(self) -> None:
        self.local_capacity_mib = int(_env_number("VMPLANE_SIM_LOCAL_POOL_MIB", 1 << 20))  # 1 TiB
        self.shared_capacity_mib = int(_env_number("VMPLANE_SIM_SHARED_POOL_MIB", 10 << 20))  # 10 TiB
        rate = _env_number("VMPLANE_SIM_DISK_COPY_RATE_MIB_S", 200.0)
        self.disk_copy_rate_mib_s: float | None = rate or None  # None: disks copy at once
        self._detaches: dict[tuple[str, str, str], float | None] = {}  # (host, domain, target) -> due|never
        self._db.execute("BEGIN IMMEDIATE")
        for statement in STORAGE_SCHEMA:
            self._db.execute(statement)
        have = {row[1] for row in self._db.execute("PRAGMA table_info(files)")}
        for column in ("generation INTEGER", "marker TEXT", "written_mib INTEGER NOT NULL DEFAULT 0"):
            if column.split()[0] not in have:
                self._db.execute(f"ALTER TABLE files ADD COLUMN {column}")
        self._db.execute("DELETE FROM used")  # recounted: the triggers keep it from here
        self._db.execute(
            "INSERT INTO used (storage, mib) SELECT storage, SUM(allocation_mib) FROM files GROUP BY storage"
        )
        self._db.execute("COMMIT")

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (across processes: BEGIN IMMEDIATE takes the file's write lock)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # -- capacity ----------------------------------------------------------------------------------
    def set_capacity(self, storage: str, capacity_mib: int) -> None:
        """The capacity of one storage: a host's own disk (its name) or SHARED."""
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO storages (key, capacity_mib) VALUES (?, ?)", (storage, capacity_mib)
            )

    def _capacity(self, db, storage: str) -> int:
        row = db.execute("SELECT capacity_mib FROM storages WHERE key = ?", (storage,)).fetchone()
        if row is not None:
            return row[0]
        return self.shared_capacity_mib if storage == SHARED else self.local_capacity_mib

    def _used(self, db, storage: str) -> int:
        row = db.execute("SELECT mib FROM used WHERE storage = ?", (storage,)).fetchone()
        return row[0] if row else 0

    def _available(self, db, storage: str) -> int:
        return max(0, self._capacity(db, storage) - self._used(db, storage))

    # -- pools ---------------------------------------------------------------------------------------
    def _pool_info(self, db, host: str, name: str) -> PoolInfo | None:
        row = db.execute("SELECT path, state FROM pools WHERE host = ? AND name = ?", (host, name)).fetchone()
        if row is None:
            return None
        path, state = row
        storage = storage_of(host, path)
        capacity, used = self._capacity(db, storage), self._used(db, storage)
        return PoolInfo(name, path, state, capacity, min(used, capacity), max(0, capacity - used))

    def pool_info(self, host: str, name: str) -> PoolInfo | None:
        with self._lock:
            return self._pool_info(self._db, host, name)

    def define_pool(self, host: str, name: str, path: str) -> PoolInfo:
        path = _clean(path)
        with self._tx() as db:
            row = db.execute("SELECT path FROM pools WHERE host = ? AND name = ?", (host, name)).fetchone()
            if row is not None and row[0] != path:
                raise SimStorageError(f"operation failed: pool '{name}' is already defined with path {row[0]}")
            other = db.execute(
                "SELECT name FROM pools WHERE host = ? AND path = ? AND name != ?", (host, path, name)
            ).fetchone()
            if other is not None:
                raise SimStorageError(f"operation failed: Storage source conflict with pool: '{other[0]}'")
            db.execute(
                "INSERT INTO pools (host, name, path, state) VALUES (?, ?, ?, 'running') "
                "ON CONFLICT (host, name) DO UPDATE SET state = 'running'",
                (host, name, path),
            )
            info = self._pool_info(db, host, name)
            assert info is not None  # (just written)
            return info

    def remove_pool(self, host: str, name: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM pools WHERE host = ? AND name = ?", (host, name))

    def set_pool_state(self, host: str, name: str, state: str) -> bool:
        """A pool that went inactive or inaccessible (behind vmplane's back); its volumes are refused."""
        with self._lock:
            return (
                self._db.execute("UPDATE pools SET state = ? WHERE host = ? AND name = ?", (state, host, name)).rowcount
                == 1
            )

    def _pool(self, db, host: str, pool: str) -> tuple[str, str]:
        """(storage, path) of a running pool of the host."""
        row = db.execute("SELECT path, state FROM pools WHERE host = ? AND name = ?", (host, pool)).fetchone()
        if row is None:
            raise SimStorageError(f"Storage pool not found: no storage pool with matching name '{pool}'")
        if row[1] != "running":
            raise SimStorageError(f"Requested operation is not valid: storage pool '{pool}' is not active ({row[1]})")
        return storage_of(host, row[0]), row[0]

    # -- volumes -------------------------------------------------------------------------------------
    @staticmethod
    def _volume(pool: str, row) -> VolumeInfo:
        path, name, format, capacity, allocation, backing = row
        return VolumeInfo(pool, name, path, format, capacity, allocation, backing)

    _VOLUME = "path, name, format, capacity_mib, allocation_mib, backing"

    def volumes(self, host: str, pool: str) -> list[VolumeInfo]:
        with self._lock:
            storage, path = self._pool(self._db, host, pool)
            rows = self._db.execute(
                f"SELECT {self._VOLUME} FROM files WHERE storage = ? AND dir = ? ORDER BY name", (storage, path)
            ).fetchall()
        return [self._volume(pool, r) for r in rows]

    def volume(self, host: str, pool: str, name: str) -> VolumeInfo | None:
        with self._lock:
            storage, path = self._pool(self._db, host, pool)
            row = self._db.execute(
                f"SELECT {self._VOLUME} FROM files WHERE storage = ? AND path = ?", (storage, f"{path}/{name}")
            ).fetchone()
        return None if row is None else self._volume(pool, row)

    def file(self, host: str, path: str) -> VolumeInfo | None:
        """The file at `path` in the host's view (pool "" : not looked up through a pool)."""
        with self._lock:
            row = self._db.execute(
                f"SELECT {self._VOLUME} FROM files WHERE storage = ? AND path = ?",
                (storage_of(host, path), _clean(path)),
            ).fetchone()
        return None if row is None else self._volume("", row)

    def create_volume(
        self,
        host: str,
        pool: str,
        name: str,
        capacity_mib: int,
        format: str = "qcow2",
        backing: str | None = None,
        backing_format: str | None = None,
        allocation_mib: int | None = None,
    ) -> VolumeInfo:
        """A new file in the pool; one of that name already there is returned as it is if it has the format
        and backing asked for (a create retried; the caller compares the size), else refused."""
        _check_name(name)
        if format not in ("qcow2", "raw"):
            raise SimStorageError(f"unsupported volume format '{format}'")
        if backing and format != "qcow2":
            raise SimStorageError(f"a {format} volume can not have a backing file")
        if capacity_mib <= 0:
            raise SimStorageError(f"invalid capacity {capacity_mib} MiB")
        with self._tx() as db:
            storage, dir = self._pool(db, host, pool)
            path = f"{dir}/{name}"
            row = db.execute(
                f"SELECT {self._VOLUME} FROM files WHERE storage = ? AND path = ?", (storage, path)
            ).fetchone()
            if row is not None:  # a retried create: only the file asked for is returned
                found = self._volume(pool, row)
                if not same_volume(found, format, _clean(backing) if backing else None):
                    raise SimStorageError(
                        f"storage volume '{name}' exists already as {found.format} on "
                        f"{found.backing}: not the volume asked for"
                    )
                return found
            if backing:
                base = db.execute(
                    "SELECT format FROM files WHERE storage = ? AND path = ?",
                    (storage_of(host, backing), _clean(backing)),
                ).fetchone()
                if base is None:
                    raise SimStorageError(f"Cannot access backing file '{backing}': No such file or directory")
                if backing_format and backing_format != base[0]:
                    raise SimStorageError(f"backing file '{backing}' is {base[0]}, not {backing_format}")
            if allocation_mib is None:
                allocation_mib = QCOW2_OVERHEAD_MIB if format == "qcow2" else capacity_mib
            if allocation_mib > self._available(db, storage):
                raise SimStorageError(
                    f"cannot allocate {allocation_mib} MiB for volume '{name}' in pool '{pool}': "
                    f"No space left on device ({self._available(db, storage)} MiB available)"
                )
            db.execute(
                "INSERT INTO files (storage, path, dir, name, format, capacity_mib, allocation_mib, backing, "
                "generation) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    storage,
                    path,
                    dir,
                    name,
                    format,
                    capacity_mib,
                    allocation_mib,
                    _clean(backing) if backing else None,
                    self._next_generation(db),
                ),
            )
            return VolumeInfo(
                pool, name, path, format, capacity_mib, allocation_mib, _clean(backing) if backing else None
            )

    @staticmethod
    def _next_generation(db) -> int:
        """A number no file of the fabric had before (kept apart from the files: a deleted file's is not reused)."""
        db.execute("INSERT INTO generations (key, n) VALUES ('files', 1) ON CONFLICT (key) DO UPDATE SET n = n + 1")
        return db.execute("SELECT n FROM generations WHERE key = 'files'").fetchone()[0]

    def file_facts(self, host: str, path: str) -> tuple[int | None, str | None] | None:
        """(generation, marker) of the file at `path` in the host's view; None: no such file."""
        with self._lock:
            row = self._db.execute(
                "SELECT generation, marker FROM files WHERE storage = ? AND path = ?",
                (storage_of(host, path), _clean(path)),
            ).fetchone()
        return None if row is None else (row[0], row[1])

    def write_marker(self, host: str, name: str, target: str, marker: str) -> None:
        """The guest of domain `name` writes `marker` into its disk `target` (its file holds it)."""
        with self._tx() as db:
            storage, path = self._disk_file(db, host, name, target)
            db.execute("UPDATE files SET marker = ? WHERE storage = ? AND path = ?", (marker, storage, path))

    def read_marker(self, host: str, name: str, target: str) -> str | None:
        """What the guest of domain `name` reads from its disk `target`: the marker written into its file
        (None: nothing was, it reads as zeros)."""
        with self._lock:
            storage, path = self._disk_file(self._db, host, name, target)
            first = path
            while True:  # down the qcow2 chain while a file holds nothing of its own (an overlay)
                row = self._db.execute(
                    "SELECT marker, backing FROM files WHERE storage = ? AND path = ?", (storage, path)
                ).fetchone()
                if row is None:
                    raise SimStorageError(f"Cannot access storage file '{path}' (disk {target} of {name}, on {first})")
                if row[0] is not None or not row[1] or storage_of(host, row[1]) != storage:
                    return row[0]
                path = row[1]

    def fail_at_delete(self, host: str, mode: str = "daemon") -> None:
        """The next time `host` is asked to delete a volume, it fails first (`fail_host(host, mode)`), and
        the file stays: the trigger of a copy left behind on a pool."""
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO delete_traps (host, mode) VALUES (?, ?)", (host, mode))

    def spring_delete_trap(self, host: str) -> None:
        """(the driver, before a delete) a trap set on the host fails it now, once."""
        with self._lock:  # (a read first: no write transaction on every delete)
            row = self._db.execute("SELECT mode FROM delete_traps WHERE host = ?", (host,)).fetchone()
        if row is None:
            return
        with self._tx() as db:
            taken = db.execute("DELETE FROM delete_traps WHERE host = ?", (host,)).rowcount == 1
        if taken:
            self.fail_host(host, row[0])

    def upload_volume(self, host: str, pool: str, name: str, source: str, format: str) -> VolumeInfo:
        try:
            capacity, size = image_size(source)
        except OSError as e:
            raise SimStorageError(f"cannot read '{source}': {e.strerror}") from None
        if self.volume(host, pool, name) is not None:
            raise SimStorageError(f"storage volume name '{name}' already in use")
        return self.create_volume(host, pool, name, capacity, format, allocation_mib=size)

    def _users(
        self, db, storage: str, path: str, exclude: tuple[str, str] | None = None, writers: bool = False
    ) -> list[tuple[str, str]]:
        """(host, domain) of every active domain that has the file open (as a writer)."""
        rows = db.execute(
            f"SELECT d.host, d.domain FROM disks d JOIN domains m ON m.host = d.host AND "
            f"m.name = d.domain WHERE d.storage = ? AND d.path = ? AND {_M_ACTIVE}"
            + (" AND d.readonly = 0" if writers else ""),
            (storage, path),
        ).fetchall()
        return [tuple(r) for r in rows if tuple(r) != exclude]

    def _chain_users(self, db, storage: str, path: str, depth: int = 0) -> list[tuple[str, str]]:
        """Active domains that use the file, directly or as a backing file of their disk's chain."""
        users = self._users(db, storage, path)
        if depth > 16:
            return users
        for o_storage, o_path in db.execute("SELECT storage, path FROM files WHERE backing = ?", (path,)).fetchall():
            users += [
                (h, d) for h, d in self._chain_users(db, o_storage, o_path, depth + 1) if storage_of(h, path) == storage
            ]
        return users

    def delete_volume(self, host: str, pool: str, name: str) -> bool:
        """Delete; whether it was there. Refused while an active domain uses it (or a chain on it)."""
        with self._tx() as db:
            storage, dir = self._pool(db, host, pool)
            path = f"{dir}/{name}"
            users = self._chain_users(db, storage, path)
            if users:
                raise SimStorageError(
                    f"volume '{name}' of pool '{pool}' is in use by domain {users[0][1]} on {users[0][0]}"
                )
            return db.execute("DELETE FROM files WHERE storage = ? AND path = ?", (storage, path)).rowcount == 1

    def resize_volume(self, host: str, pool: str, name: str, capacity_mib: int) -> VolumeInfo:
        with self._tx() as db:
            storage, dir = self._pool(db, host, pool)
            path = f"{dir}/{name}"
            users = self._users(db, storage, path)
            if users:
                raise SimStorageError(
                    f"volume '{name}' is in use by running domain {users[0][1]} on {users[0][0]}: "
                    f"grow it through the domain (blockResize)"
                )
            self._grow(db, storage, path, capacity_mib, f"volume '{name}'")
            row = db.execute(
                f"SELECT {self._VOLUME} FROM files WHERE storage = ? AND path = ?", (storage, path)
            ).fetchone()
        return self._volume(pool, row)

    def _grow(self, db, storage: str, path: str, capacity_mib: int, what: str) -> None:
        row = db.execute(
            "SELECT format, capacity_mib, allocation_mib FROM files WHERE storage = ? AND path = ?", (storage, path)
        ).fetchone()
        if row is None:
            raise SimStorageError(f"Storage volume not found: no storage volume with matching path '{path}'")
        format, capacity, allocation = row
        if capacity_mib < capacity:
            raise SimStorageError(f"invalid argument: can't shrink {what} from {capacity} to {capacity_mib} MiB")
        new_allocation = capacity_mib if format == "raw" else allocation
        if new_allocation - allocation > self._available(db, storage):
            raise SimStorageError(f"cannot grow {what} to {capacity_mib} MiB: No space left on device")
        db.execute(
            "UPDATE files SET capacity_mib = ?, allocation_mib = ? WHERE storage = ? AND path = ?",
            (capacity_mib, new_allocation, storage, path),
        )

    # -- a domain's disks ----------------------------------------------------------------------------
    def disks(self, host: str, name: str) -> tuple[DiskSpec, ...]:
        with self._lock:
            return self._disks(self._db, host, name)

    @staticmethod
    def _disks(db, host: str, name: str) -> tuple[DiskSpec, ...]:
        rows = db.execute(
            "SELECT pool, volume, path, target, format, readonly FROM disks WHERE host = ? AND "
            "domain = ? ORDER BY position",
            (host, name),
        ).fetchall()
        return tuple(
            DiskSpec(p, v, path, t, f, bool(r), "cdrom" if t.startswith("sd") else "disk")
            for p, v, path, t, f, r in rows
        )

    def _check_disk(self, db, host: str, name: str, disk: DiskSpec) -> None:
        storage, path = storage_of(host, disk.path), _clean(disk.path)
        row = db.execute("SELECT format, backing FROM files WHERE storage = ? AND path = ?", (storage, path)).fetchone()
        if row is None:
            raise SimStorageError(
                f"Cannot access storage file '{disk.path}' (disk {disk.target}): No such file or directory"
            )
        if row[0] != disk.format:
            raise SimStorageError(f"disk {disk.target}: '{disk.path}' is {row[0]}, not {disk.format}")
        if (
            row[1]
            and db.execute(
                "SELECT 1 FROM files WHERE storage = ? AND path = ?", (storage_of(host, row[1]), row[1])
            ).fetchone()
            is None
        ):
            raise SimStorageError(f"Cannot access backing file '{row[1]}' of '{disk.path}': No such file or directory")
        if not disk.readonly:
            holders = self._users(db, storage, path, exclude=(host, name), writers=True)
            if holders:
                raise SimStorageError(
                    f"resource busy: Lockspace resource '{disk.path}' is locked (disk {disk.target} "
                    f"is open in domain {holders[0][1]} on {holders[0][0]})"
                )
            held = db.execute(
                "SELECT host, until FROM held_locks WHERE storage = ? AND path = ? AND host != ? AND until > ? LIMIT 1",
                (storage, path, host, time.time()),
            ).fetchone()
            if held:  # a powered-off host's lock, until its lease on the shared storage expires
                raise SimStorageError(
                    f"Failed to get \"write\" lock: resource busy: '{disk.path}' (disk {disk.target}) "
                    f"is still locked by {held[0]}, powered off; its lease on the storage expires in "
                    f"{held[1] - time.time():.0f} s"
                )

    def put_disks(self, db, host: str, name: str, disks: tuple[DiskSpec, ...]) -> None:
        """Check (files there, lease free) and record a starting domain's disks (in the caller's tx)."""
        targets, paths = set(), set()
        for disk in disks:
            if disk.target in targets or _clean(disk.path) in paths:
                raise SimStorageError(f"disk {disk.target} ({disk.path}) is given twice")
            targets.add(disk.target)
            paths.add(_clean(disk.path))
            self._check_disk(db, host, name, disk)
        db.execute("DELETE FROM disks WHERE host = ? AND domain = ?", (host, name))
        for position, disk in enumerate(disks):
            self._insert_disk(db, host, name, position, disk)

    @staticmethod
    def _insert_disk(db, host: str, name: str, position: int, disk: DiskSpec) -> None:
        db.execute(
            "INSERT INTO disks (host, domain, target, position, storage, path, pool, volume, format, readonly) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                host,
                name,
                disk.target,
                position,
                storage_of(host, disk.path),
                _clean(disk.path),
                disk.pool,
                disk.volume,
                disk.format,
                int(disk.readonly),
            ),
        )

    def attach(self, host: str, name: str, disk: DiskSpec) -> None:
        with self._tx() as db:
            if (
                db.execute(f"SELECT 1 FROM domains WHERE host = ? AND name = ? AND {_ACTIVE}", (host, name)).fetchone()
                is None
            ):
                raise SimStorageError(f"domain {name} is not running here")
            for other in self._disks(db, host, name):
                if other.target == disk.target:
                    raise SimStorageError(f"target {disk.target} already exists")
                if _clean(other.path) == _clean(disk.path):
                    raise SimStorageError(
                        f"'{disk.path}' is already disk {other.target} of {name}: Failed to get \"write\" lock"
                    )
            self._check_disk(db, host, name, disk)
            position = db.execute(
                "SELECT COALESCE(MAX(position), -1) + 1 FROM disks WHERE host = ? AND domain = ?", (host, name)
            ).fetchone()[0]
            self._insert_disk(db, host, name, position, disk)

    def detach(self, host: str, name: str, target: str) -> bool:
        with self._lock:
            self._detaches.pop((host, name, target), None)
            return (
                self._db.execute(
                    "DELETE FROM disks WHERE host = ? AND domain = ? AND target = ?", (host, name, target)
                ).rowcount
                == 1
            )

    def request_detach(self, host: str, name: str, target: str, delay_s: float | None) -> None:
        """A detach the guest completes after `delay_s` (None: never, until asked again)."""
        with self._lock:
            self._detaches[(host, name, target)] = None if delay_s is None else time.monotonic() + delay_s

    def pending_detach(self, host: str, name: str, target: str) -> bool:
        """Whether a sent detach of that disk will complete on its own."""
        with self._lock:
            return self._detaches.get((host, name, target), None) is not None

    def _tick_detaches(self, now: float) -> None:
        """(under the lock) complete the detaches that are due."""
        for key, due in list(self._detaches.items()):
            if due is not None and due <= now:
                del self._detaches[key]
                self._db.execute("DELETE FROM disks WHERE host = ? AND domain = ? AND target = ?", key)

    def _forget_detaches(self, host: str, name: str, to: str | None = None) -> None:
        """(under the lock) the domain left `host`: its pending detaches go (or follow it to `to`)."""
        for key in [k for k in self._detaches if k[:2] == (host, name)]:
            due = self._detaches.pop(key)
            if to is not None:
                self._detaches[(to, name, key[2])] = due

    def disk_file(self, host: str, name: str, target: str) -> tuple[str, str]:
        with self._lock:
            return self._disk_file(self._db, host, name, target)

    @staticmethod
    def _disk_file(db, host: str, name: str, target: str) -> tuple[str, str]:
        row = db.execute(
            "SELECT storage, path FROM disks WHERE host = ? AND domain = ? AND target = ?", (host, name, target)
        ).fetchone()
        if row is None:
            raise SimStorageError(f"domain {name} has no disk {target}")
        return row

    def grow_disk(self, host: str, name: str, target: str, capacity_mib: int) -> None:
        with self._tx() as db:
            if (
                db.execute(f"SELECT 1 FROM domains WHERE host = ? AND name = ? AND {_ACTIVE}", (host, name)).fetchone()
                is None
            ):
                raise SimStorageError(f"domain {name} is not running here")
            storage, path = self._disk_file(db, host, name, target)
            self._grow(db, storage, path, capacity_mib, f"disk {target} of {name}")

    def write(self, host: str, name: str, target: str, mib: int) -> tuple[int, bool]:
        """The guest writes `mib` of new data into a disk: (MiB written, whether the storage was full)."""
        with self._tx() as db:
            storage, path = self._disk_file(db, host, name, target)
            format, capacity, allocation = db.execute(
                "SELECT format, capacity_mib, allocation_mib FROM files WHERE storage = ? AND path = ?", (storage, path)
            ).fetchone()
            if format == "raw":
                return mib, False
            room = max(0, capacity + QCOW2_OVERHEAD_MIB - allocation)
            wanted = min(mib, room)
            written = min(wanted, self._available(db, storage))
            db.execute(
                "UPDATE files SET allocation_mib = allocation_mib + ?, written_mib = written_mib + ? "
                "WHERE storage = ? AND path = ?",
                (written, written, storage, path),
            )
        return written, written < wanted

    # -- migration -----------------------------------------------------------------------------------
    def plan_copy(self, disks: tuple[DiskSpec, ...], source: str, target: str, params: MigrationParams) -> CopyPlan:
        """What a migration of a domain with these disks copies, or SimStorageError (libvirt's refusals)."""
        known = {d.target for d in disks}
        unknown = [t for t in params.copy_disks if t not in known]
        if unknown:
            raise SimStorageError(f"invalid argument: domain has no disk {unknown[0]} to copy")
        copies, needed_here = [], []
        with self._lock:
            db = self._db
            for disk in disks:
                path = _clean(disk.path)
                shared = storage_of(source, path) == storage_of(target, path)
                if disk.target in params.copy_disks:
                    if shared:
                        raise SimStorageError(
                            f"disk {disk.target} ('{disk.path}') is on storage both hosts share: "
                            f"copying it would copy it onto itself"
                        )
                    copies.append(self._copy_of(db, disk, source, target))
                elif shared:
                    continue
                elif disk.readonly:  # libvirt copies no read-only disk: the target must have it
                    needed_here.append(disk)
                elif params.shared_disks:
                    raise SimStorageError(
                        f"disk {disk.target} ('{disk.path}') is not on storage {source} and "
                        f"{target} share: the target would open another file"
                    )
                else:
                    raise SimStorageError(
                        f"Unsafe migration: Migration without shared storage is unsafe "
                        f"(disk {disk.target}, '{disk.path}', is neither shared nor copied)"
                    )
            for disk in needed_here:
                if (
                    db.execute(
                        "SELECT 1 FROM files WHERE storage = ? AND path = ?", (target, _clean(disk.path))
                    ).fetchone()
                    is None
                ):
                    raise SimStorageError(
                        f"Cannot access storage file '{disk.path}' on {target}: No such file or directory"
                    )
            plan = CopyPlan(copies)
            room, done = self._available(db, target), 0
            for c in copies:
                grow = max(0, c.mib - c.initial_mib)
                if grow > room:
                    plan.fail_at_mib = done + c.initial_mib + room
                    break
                room -= grow
                done += c.mib
        return plan

    def _copy_of(self, db, disk: DiskSpec, source: str, target: str) -> DiskCopy:
        path = _clean(disk.path)
        src = db.execute(
            "SELECT format, capacity_mib, allocation_mib FROM files WHERE storage = ? AND path = ?",
            (storage_of(source, path), path),
        ).fetchone()
        if src is None:
            raise SimStorageError(f"Cannot access storage file '{disk.path}' (disk {disk.target})")
        dst = db.execute(
            "SELECT format, capacity_mib, allocation_mib, backing FROM files WHERE storage = ? AND path = ?",
            (target, path),
        ).fetchone()
        marker = db.execute(
            "SELECT marker FROM files WHERE storage = ? AND path = ?", (storage_of(source, path), path)
        ).fetchone()[0]
        if dst is None:
            raise SimStorageError(
                f"Cannot access storage file '{disk.path}' on {target}: No such file or directory "
                f"(create the overlay of disk {disk.target} there first)"
            )
        if dst[0] != src[0]:
            raise SimStorageError(f"disk {disk.target}: the target's '{disk.path}' is {dst[0]}, the source's {src[0]}")
        if dst[1] != src[1]:
            raise SimStorageError(
                f"disk {disk.target}: Source and target image have different sizes ({src[1]} and {dst[1]} MiB)"
            )
        if (
            dst[3]
            and db.execute(
                "SELECT 1 FROM files WHERE storage = ? AND path = ?", (storage_of(target, dst[3]), dst[3])
            ).fetchone()
            is None
        ):
            raise SimStorageError(f"Cannot access backing file '{dst[3]}' on {target}: No such file or directory")
        holders = self._users(db, target, path, writers=True)
        if holders:
            raise SimStorageError(f"resource busy: '{disk.path}' on {target} is open in domain {holders[0][1]}")
        return DiskCopy(disk.target, path, target, src[2], dst[2], marker)

    def copied(self, plan: CopyPlan, mib: float) -> None:
        """The first `mib` of the plan were written to the targets' files (in order, disk after disk)."""
        left = mib
        with self._lock:
            for c in plan.copies:
                if left <= 0:
                    break
                done = min(left, c.mib)
                allocation = c.mib if done >= c.mib else max(c.initial_mib, int(done))
                self._db.execute(
                    "UPDATE files SET allocation_mib = ? WHERE storage = ? AND path = ?",
                    (allocation, c.storage, c.path),
                )
                if done >= c.mib:  # the whole overlay is there: what the guest wrote too
                    self._db.execute(
                        "UPDATE files SET marker = ? WHERE storage = ? AND path = ?", (c.marker, c.storage, c.path)
                    )
                left -= c.mib

    def move_disks(self, db, name: str, source: str, target: str, copy: bool = False) -> None:
        """(in the caller's lock) the domain's disks follow it (or, `copy`, exist on both)."""
        if copy:
            db.execute("DELETE FROM disks WHERE host = ? AND domain = ?", (target, name))
            db.execute(
                "INSERT INTO disks (host, domain, target, position, storage, path, pool, volume, format, "
                "readonly) SELECT ?, domain, target, position, CASE WHEN storage = ? THEN ? ELSE storage END, "
                "path, pool, volume, format, readonly FROM disks WHERE host = ? AND domain = ?",
                (target, source, target, source, name),
            )
        else:
            db.execute("DELETE FROM disks WHERE host = ? AND domain = ?", (target, name))
            db.execute(
                "UPDATE disks SET host = ?, storage = CASE WHEN storage = ? THEN ? ELSE storage END "
                "WHERE host = ? AND domain = ?",
                (target, source, target, source, name),
            )

    def drop_disks(self, db, host: str, name: str) -> None:
        db.execute("DELETE FROM disks WHERE host = ? AND domain = ?", (host, name))


def _clean(path: str) -> str:
    return str(PurePosixPath(path))


def _check_name(name: str) -> None:
    if not name or "/" in name or name in (".", ".."):
        raise SimStorageError(f"invalid volume name '{name}'")


class SimStorageDriver:
    """The storage methods of SimDriver (a mixin: it uses the driver's host, fabric and fault mode)."""

    host: str
    disk_copy_rate_mib_s: float | None = None  # None: the fabric's (fabric.disk_copy_rate_mib_s)

    if TYPE_CHECKING:  # what SimDriver gives the methods here
        fabric: StorageFabric
        UNPLUG_TRIES: int
        UNPLUG_WAIT_S: float

        def _call(self, what: str) -> None: ...
        def _partial(self, what: str) -> None: ...
        def _chance(self, kind: str) -> bool: ...
        def _emit(self, name: str, event: int, detail: int) -> None: ...
        @property
        def _faults(self) -> SimFaults | None: ...

    @contextlib.contextmanager
    def _refused(self, what: str):
        try:
            yield
        except SimStorageError as e:
            raise DriverError(self.host, f"{what}: {e}") from None

    def define_pool(self, spec: PoolSpec) -> PoolInfo:
        self._call(f"define pool {spec.name}")
        with self._refused(f"define pool {spec.name}"):
            info = self.fabric.define_pool(self.host, spec.name, spec.path)
        self._partial(f"start pool {spec.name}")
        return info

    def pool_info(self, name: str) -> PoolInfo | None:
        self._call(f"look up pool {name}")
        return self.fabric.pool_info(self.host, name)

    def remove_pool(self, name: str) -> None:
        self._call(f"remove pool {name}")
        self.fabric.remove_pool(self.host, name)

    def volumes(self, pool: str) -> list[VolumeInfo]:
        self._call(f"list the volumes of pool {pool}")
        with self._refused(f"list the volumes of pool {pool}"):
            return self.fabric.volumes(self.host, pool)

    def volume(self, pool: str, name: str) -> VolumeInfo | None:
        self._call(f"look up volume {name} of pool {pool}")
        with self._refused(f"look up volume {name}"):
            return self.fabric.volume(self.host, pool, name)

    def create_volume(
        self,
        pool: str,
        name: str,
        capacity_mib: int,
        format: str = "qcow2",
        backing: str | None = None,
        backing_format: str | None = None,
    ) -> VolumeInfo:
        self._call(f"create volume {name} in pool {pool}")
        with self._refused(f"create volume {name} in pool {pool}"):
            info = self.fabric.create_volume(self.host, pool, name, capacity_mib, format, backing, backing_format)
        self._partial(f"create volume {name}")
        return info

    def delete_volume(self, pool: str, name: str) -> None:
        self.fabric.spring_delete_trap(self.host)
        self._call(f"delete volume {name} of pool {pool}")
        with self._refused(f"delete volume {name} of pool {pool}"):
            deleted = self.fabric.delete_volume(self.host, pool, name)
        if deleted:
            self._partial(f"delete volume {name}")

    def resize_volume(self, pool: str, name: str, capacity_mib: int) -> VolumeInfo:
        self._call(f"resize volume {name} of pool {pool}")
        with self._refused(f"resize volume {name} of pool {pool}"):
            self.fabric.resize_volume(self.host, pool, name, capacity_mib)
        self._partial(f"resize volume {name}")
        info = self.fabric.volume(self.host, pool, name)
        assert info is not None  # (resized above: a missing volume was refused there)
        return info

    def upload_volume(self, pool: str, name: str, source: str, format: str) -> VolumeInfo:
        self._call(f"upload volume {name} to pool {pool}")
        with self._refused(f"upload volume {name} to pool {pool}"):
            info = self.fabric.upload_volume(self.host, pool, name, source, format)
        self._partial(f"upload volume {name}")
        return info

    def attach_disk(self, name: str, disk: DiskSpec) -> None:
        self._call(f"attach disk {disk.target} to {name}")
        with self._refused(f"attach disk {disk.target} to {name}"):
            self.fabric.attach(self.host, name, disk)
        self._partial(f"attach disk {disk.target}")

    def detach_disk(self, name: str, target: str) -> None:
        """An unplug request the guest completes at once, late or never (fault mode), confirmed by reading
        the domain back (base.confirm_unplug, as a DIMM unplug)."""
        self._call(f"detach disk {target} from {name}")
        if target not in self._disk_targets(name):
            raise DriverError(self.host, f"detach disk {target} from {name}: the domain has no such disk")

        def request() -> str | None:
            if self.fabric.pending_detach(self.host, name, target):
                return "a detach of this disk is still in progress"
            if self._chance("detach_never"):
                self.fabric.request_detach(self.host, name, target, None)
            elif self._chance("detach_late"):
                f = self._faults
                assert f is not None  # (a fault only happens in fault mode)
                self.fabric.request_detach(self.host, name, target, f.delay(f.unplug_delay_s))
            else:
                self.fabric.detach(self.host, name, target)
            return None

        def gone() -> bool:
            return target not in self._disk_targets(name)

        base.confirm_unplug(self.host, f"disk {target} of {name}", request, gone, self.UNPLUG_TRIES, self.UNPLUG_WAIT_S)
        self._partial(f"read {name} after the detach of {target}")

    def _disk_targets(self, name: str) -> set[str]:
        spec = self.fabric.spec(self.host, name)
        if spec is None:
            raise DriverError(self.host, f"domain {name} is not running here")
        return {d.target for d in spec.disks}

    def domain_disks(self, name: str) -> dict[str, str]:
        self._call(f"list the disks of {name}")
        spec = self.fabric.spec(self.host, name, active=False)
        if spec is None:
            raise DriverError(self.host, f"domain {name} is not defined here")
        return {d.target: d.path for d in spec.disks if d.device == "disk"}  # (a CD-ROM, the seed, is no volume)

    def grow_disk(self, name: str, target: str, capacity_mib: int) -> None:
        self._call(f"grow disk {target} of {name}")
        with self._refused(f"grow disk {target} of {name}"):
            self.fabric.grow_disk(self.host, name, target, capacity_mib)
        self._partial(f"grow disk {target}")

    def guest_write(self, name: str, target: str, mib: int) -> int:
        """The sim's guest writes `mib` of new data into disk `target` (the overlay grows); a storage that
        fills up pauses the domain (an I/O error: libvirt's werror=stop). Returns the MiB written."""
        with self._refused(f"write into disk {target} of {name}"):
            written, full = self.fabric.write(self.host, name, target, mib)
        if full:
            self.fabric.set_state(self.host, name, "paused", "ioerror")
            self._emit(name, SUSPENDED, SUSPENDED_IOERROR)
        return written

    def guest_write_marker(self, name: str, target: str, marker: str) -> None:
        """The sim's guest writes `marker` into disk `target` (what a later reader of the file finds)."""
        with self._refused(f"write into disk {target} of {name}"):
            self.fabric.write_marker(self.host, name, target, marker)

    def guest_read_marker(self, name: str, target: str) -> str | None:
        """What the sim's guest reads from disk `target`: a marker written into the file, or None (zeros)."""
        with self._refused(f"read disk {target} of {name}"):
            return self.fabric.read_marker(self.host, name, target)

    # -- migration with disks ------------------------------------------------------------------------
    def _disk_rate(self, params: MigrationParams) -> float | None:
        rate = self.disk_copy_rate_mib_s or self.fabric.disk_copy_rate_mib_s
        if params.bandwidth_mib_s:  # libvirt caps the NBD mirror at the migration bandwidth
            rate = min(rate, params.bandwidth_mib_s) if rate else params.bandwidth_mib_s
        return rate

    def _plan_copy(self, name: str, disks: tuple[DiskSpec, ...], target: str, params: MigrationParams) -> CopyPlan:
        with self._refused(f"migrate {name} to {target}"):
            plan = self.fabric.plan_copy(disks, self.host, target, params)
        if plan.mib and self._chance("disk_copy_error"):
            f = self._faults
            assert f is not None  # (a fault only happens in fault mode)
            at = plan.mib * f.delay((0.05, 0.95))
            plan.fail_at_mib = at if plan.fail_at_mib is None else min(at, plan.fail_at_mib)
            plan.fault = True
        return plan
