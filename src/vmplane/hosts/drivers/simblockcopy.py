"""Disk moves on simulated hosts (issue 32, `volume move`): a live block copy of a running domain's disk into a
new standalone qcow2 file (what the guest reads through its chain, its marker included) and the switch to it,
in one transaction of the fabric; and the copy of a volume's file from another host's pool (its bytes as they
are: an overlay keeps its backing path, which must be there on the target host).

Nasty on purpose: `fabric` traps (kept in the fabric's SQLite file, so they outlive a killed control plane),
set by `fail_block_copy(fabric, host, mode)`, make the next copy on `host` stop midway: a partial file is left
at the destination, the domain stays on its old file, and the copy fails (`job`: the block job failed) or the
host stops answering (`daemon`, `network`, `power`: simhosts.fail_host)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vmplane.core.driver import DriverError
from vmplane.hosts.drivers.simsnapshots import _chain, _visible_marker
from vmplane.hosts.drivers.simstorage import QCOW2_OVERHEAD_MIB, SimStorageError, _clean, storage_of

if TYPE_CHECKING:
    from vmplane.hosts.drivers.simfabric import SimFabric

_ACTIVE = "state NOT IN ('shutoff', 'crashed', 'nostate')"
_TRAPS = "CREATE TABLE IF NOT EXISTS copy_traps (host TEXT PRIMARY KEY, mode TEXT NOT NULL)"


def fail_block_copy(fabric: SimFabric, host: str, mode: str = "job") -> None:
    """The next copy made on `host` (a live block copy, or a volume copied into its pool) stops midway."""
    with fabric._tx() as db:
        db.execute(_TRAPS)
        db.execute("INSERT OR REPLACE INTO copy_traps (host, mode) VALUES (?, ?)", (host, mode))


def _take_trap(db, host: str) -> str | None:
    db.execute(_TRAPS)
    row = db.execute("SELECT mode FROM copy_traps WHERE host = ?", (host,)).fetchone()
    if row is not None:
        db.execute("DELETE FROM copy_traps WHERE host = ?", (host,))
    return None if row is None else str(row[0])


def _insert(db, fabric: SimFabric, storage: str, path: str, fields: tuple) -> None:
    directory, _, name = path.rpartition("/")
    format, capacity, allocation, backing, marker, written = fields
    db.execute(
        "INSERT INTO files (storage, path, dir, name, format, capacity_mib, allocation_mib, backing, generation, "
        "marker, written_mib) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            storage,
            path,
            directory,
            name,
            format,
            capacity,
            allocation,
            backing,
            fabric._next_generation(db),
            marker,
            written,
        ),
    )


def block_copy(fabric: SimFabric, host: str, name: str, target: str, dest: str) -> str | None:
    """Copy disk `target` of running domain `name` into `dest` and switch the domain to it. Returns the trap's
    mode when the copy stopped midway (a partial `dest` is left; the domain reads its old file)."""
    dest = _clean(dest)
    with fabric._tx() as db:
        if (
            db.execute(f"SELECT 1 FROM domains WHERE host = ? AND name = ? AND {_ACTIVE}", (host, name)).fetchone()
            is None
        ):
            raise SimStorageError(f"domain {name} is not running here")
        storage, active = fabric._disk_file(db, host, name, target)
        if active == dest:
            return None  # switched already (a retry)
        dest_storage = storage_of(host, dest)
        if db.execute("SELECT 1 FROM files WHERE storage = ? AND path = ?", (dest_storage, dest)).fetchone():
            raise SimStorageError(f"Requested operation is not valid: file '{dest}' exists already")
        files = _chain(db, host, storage, active)
        rows = [
            db.execute(
                "SELECT capacity_mib, allocation_mib FROM files WHERE storage = ? AND path = ?", (storage, f)
            ).fetchone()
            for f in files
        ]
        capacity = rows[0][0]
        data = sum(r[1] for r in rows if r is not None)
        room = fabric._available(db, dest_storage)
        trap = _take_trap(db, host)
        if trap is not None or data > room:
            partial = max(QCOW2_OVERHEAD_MIB, min(data // 2, room))
            _insert(db, fabric, dest_storage, dest, ("qcow2", capacity, partial, None, None, 0))
            trap = trap or "nospace"
        else:
            marker = _visible_marker(db, host, storage, active)
            _insert(db, fabric, dest_storage, dest, ("qcow2", capacity, data, None, marker, 0))
            db.execute(
                "UPDATE disks SET storage = ?, path = ?, volume = ? WHERE host = ? AND domain = ? AND target = ?",
                (dest_storage, dest, dest.rpartition("/")[2], host, name, target),
            )
    return trap


def copy_file(
    fabric: SimFabric, src_host: str, src_pool: str, src_name: str, host: str, pool: str, name: str
) -> str | None:
    """Volume `src_name` of `src_pool` on `src_host`, as it is, into a new volume `name` of `pool` on `host`.
    Returns the trap's mode when the copy stopped midway (a partial file is left)."""
    with fabric._tx() as db:
        src_storage, src_dir = fabric._pool(db, src_host, src_pool)
        row = db.execute(
            "SELECT format, capacity_mib, allocation_mib, backing, marker, written_mib FROM files "
            "WHERE storage = ? AND path = ?",
            (src_storage, f"{src_dir}/{src_name}"),
        ).fetchone()
        if row is None:
            raise SimStorageError(f"Storage volume not found: no storage vol with matching name '{src_name}'")
        storage, directory = fabric._pool(db, host, pool)
        path = f"{directory}/{name}"
        if db.execute("SELECT 1 FROM files WHERE storage = ? AND path = ?", (storage, path)).fetchone():
            raise SimStorageError(f"storage volume name '{name}' already in use")
        backing = row[3]
        if (
            backing
            and not db.execute(
                "SELECT 1 FROM files WHERE storage = ? AND path = ?", (storage_of(host, backing), backing)
            ).fetchone()
        ):
            raise SimStorageError(f"Cannot access backing file '{backing}' on {host}: No such file or directory")
        room = fabric._available(db, storage)
        trap = _take_trap(db, host)
        if trap is not None or row[2] > room:
            partial = max(QCOW2_OVERHEAD_MIB, min(row[2] // 2, room))
            _insert(db, fabric, storage, path, (row[0], row[1], partial, backing, None, 0))
            return trap or "nospace"
        _insert(db, fabric, storage, path, tuple(row))
    return None


class SimBlockCopyMixin:
    if TYPE_CHECKING:
        host: str
        fabric: Any

        def _call(self, what: str) -> None: ...
        def _partial(self, what: str) -> None: ...

    def copy_disk(self, name: str, target: str, dest: str, timeout_s: float = 3600.0) -> None:
        what = f"copy {name}'s {target} to {dest}"
        self._call(what)
        try:
            trap = block_copy(self.fabric, self.host, name, target, dest)
        except SimStorageError as exc:
            raise DriverError(self.host, f"{what}: {exc}") from None
        self._stopped_midway(trap, what)
        self._partial(what)

    def abort_disk_copy(self, name: str, target: str) -> None:
        self._call(f"abort the block job of {name}'s {target}")  # (a sim copy ends at once: no job is left)

    def copy_volume_from(self, pool: str, name: str, source: Any, source_pool: str, source_name: str) -> Any:
        what = f"copy {source_name} of {source.host} into {name}"
        source._call(f"download volume {source_name} of pool {source_pool}")
        self._call(what)
        try:
            trap = copy_file(self.fabric, source.host, source_pool, source_name, self.host, pool, name)
        except SimStorageError as exc:
            raise DriverError(self.host, f"{what}: {exc}") from None
        self._stopped_midway(trap, what)
        self._partial(what)
        return self.fabric.volume(self.host, pool, name)

    def _stopped_midway(self, trap: str | None, what: str) -> None:
        if trap is None:
            return
        if trap == "nospace":
            raise DriverError(self.host, f"{what}: No space left on device (a partial copy is left)")
        if trap != "job":
            self.fabric.fail_host(self.host, trap)
            raise DriverError(self.host, f"{what}: cannot connect to the hypervisor midway ({trap})")
        raise DriverError(self.host, f"{what}: the block job failed midway: Input/output error")
