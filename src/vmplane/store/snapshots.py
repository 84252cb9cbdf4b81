"""Disk snapshots in the store (issue 32), inside a caller's transaction: snapshots, their bases, and every
volume's qcow2 chain (`volume_files`). No rule lives here: core/snapshots.py decides, these read and write.

A volume's charge (project ledger and pool) is its size for each file of its chain: a volume without
snapshots has one file; each overlay may grow to the volume's size (the larger size, as for anything not
known yet). A file's row, and so its charge, goes only once the host confirmed the file gone."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.engine import Connection, Row

from vmplane.core import snapshots as rules
from vmplane.core.model import Usage
from vmplane.store import events
from vmplane.store import ledger as L
from vmplane.store import storageledger as SL
from vmplane.store.schema import Snapshot, SnapshotFile, VolumeFile, utcnow

SNAPSHOTS, SNAPSHOT_FILES, VOLUME_FILES = Snapshot.__table__, SnapshotFile.__table__, VolumeFile.__table__
_S, _SF, _VF = SNAPSHOTS.c, SNAPSHOT_FILES.c, VOLUME_FILES.c


@dataclass(frozen=True)
class ChainFile:
    volume_id: int
    file: str
    parent: str | None
    state: str


def snapshot_rows(conn: Connection, vm_id: int) -> list[Row[Any]]:
    return list(conn.execute(select(SNAPSHOTS).where(_S.vm_id == vm_id).order_by(_S.created_at, _S.id)).all())


def snapshot_row(conn: Connection, vm_id: int, name: str) -> Row[Any] | None:
    return conn.execute(select(SNAPSHOTS).where(_S.vm_id == vm_id, _S.name == name)).first()


def bases(conn: Connection, snapshot_ids: Iterable[int]) -> dict[int, dict[int, str]]:
    """snapshot id -> {volume id: base file}."""
    out: dict[int, dict[int, str]] = {}
    ids = list(snapshot_ids)
    if not ids:
        return out
    for r in conn.execute(select(SNAPSHOT_FILES).where(_SF.snapshot_id.in_(ids))).all():
        out.setdefault(r.snapshot_id, {})[r.volume_id] = r.base
    return out


def overlays(conn: Connection, snapshot_id: int) -> dict[int, str]:
    """volume id -> the overlay snapshot `snapshot_id` put on its base when it was taken."""
    rows = conn.execute(select(SNAPSHOT_FILES).where(_SF.snapshot_id == snapshot_id)).all()
    return {r.volume_id: r.overlay for r in rows}


def chain_files(conn: Connection, volume_ids: Iterable[int] | None = None, state: str | None = None) -> list[ChainFile]:
    query = select(VOLUME_FILES)
    if volume_ids is not None:
        query = query.where(_VF.volume_id.in_(list(volume_ids)))
    if state is not None:
        query = query.where(_VF.state == state)
    return [ChainFile(r.volume_id, r.file, r.parent, r.state) for r in conn.execute(query.order_by(_VF.id)).all()]


def file_counts(conn: Connection) -> dict[int, int]:
    """volume id -> how many files its chain has (a volume missing here has one: its own)."""
    rows = conn.execute(select(_VF.volume_id, func.count()).group_by(_VF.volume_id)).all()
    return {int(volume_id): int(count) for volume_id, count in rows}


def disks(conn: Connection, volumes: list[Row[Any]], active: dict[int, str]) -> rules.Disks:
    """The rules' view of a VM's disks (keyed by volume id as text): `active` the files the volumes open."""
    parent: dict[str, str | None] = {}
    for f in chain_files(conn, [v.id for v in volumes]):
        if f.state != "deleting":
            parent[f.file] = f.parent
    for v in volumes:
        parent.setdefault(active[v.id], None)
    return rules.Disks({str(v.id): active[v.id] for v in volumes}, parent)


def ready_snapshots(conn: Connection, vm_id: int) -> list[rules.Snapshot]:
    """The VM's snapshots, and its linked clones as snapshots too (a clone reads a base of one of its volumes:
    that file is kept and never merged into, exactly as a snapshot's base is)."""
    rows = [r for r in snapshot_rows(conn, vm_id) if r.state != "taking"]
    found = bases(conn, [r.id for r in rows])
    snaps = [rules.Snapshot(r.name, {str(v): f for v, f in found.get(r.id, {}).items()}) for r in rows]
    return snaps + [rules.Snapshot(f"linked clone {c}", {str(v): f}) for c, v, f in linked_clones(conn, vm_id)]


def clones_problem(conn: Connection, what: str, vm_id: int | None = None, volume_id: int | None = None) -> str | None:
    """Why `what` (a VM, or a volume) can not be deleted now: linked clones read a file of it."""
    clones = sorted({c for c, _v, _f in linked_clones(conn, vm_id, volume_id)})
    if clones:
        return f"{what} has linked clones ({', '.join(clones)}: they read a file of it); delete them first"
    return None


def linked_clones(
    conn: Connection, vm_id: int | None = None, volume_id: int | None = None
) -> list[tuple[str, int, str]]:
    """(clone volume, the source volume's id, the file of it the clone reads) of every linked clone of the VM's
    volumes (or of one volume)."""
    from vmplane.store.schema import Volume

    mine = Volume.__table__.alias("mine")
    clone = Volume.__table__.alias("clone")
    which = mine.c.vm_id == vm_id if volume_id is None else mine.c.id == volume_id
    files = select(_VF.volume_id.label("volume_id"), _VF.file.label("file")).union(
        select(mine.c.id, mine.c.file_name).where(which)
    ).subquery()  # fmt: skip
    q = (
        select(clone.c.name, mine.c.id, clone.c.base_file)
        .join(files, files.c.file == clone.c.base_file)
        .join(mine, (mine.c.id == files.c.volume_id) & (mine.c.pool_id == clone.c.pool_id))
        .where(which, clone.c.base_file.is_not(None), clone.c.id != mine.c.id)
        .order_by(clone.c.name)
    )
    return [(r[0], r[1], r[2]) for r in conn.execute(q)]


def insert_snapshot(conn: Connection, vm_id: int, name: str, live: bool, quiesced: bool) -> int:
    now = utcnow()
    key = conn.execute(
        insert(SNAPSHOTS).values(
            vm_id=vm_id, name=name, state="taking", live=live, quiesced=quiesced, created_at=now, step_at=now
        )
    ).inserted_primary_key
    assert key is not None
    return int(key[0])


def add_file(conn: Connection, volume: Row[Any], file: str, parent: str, state: str = "pending") -> None:
    """An overlay in `volume`'s chain, charged at the volume's size on the project's ledger from now on (the
    caller took its space on the pool first: `take_on_pool`, which may refuse)."""
    conn.execute(insert(VOLUME_FILES).values(volume_id=volume.id, file=file, parent=parent, state=state))
    L.add_to_ledger(conn, volume.project_id, Usage(storage_mib=volume.size_mib))


def first_file(conn: Connection, volume: Row[Any], file: str) -> None:
    """The volume's own file as the first of its chain (its charge is the volume's): once, before an overlay."""
    have = conn.execute(select(_VF.id).where(_VF.volume_id == volume.id, _VF.file == file)).first()
    if have is None:
        conn.execute(insert(VOLUME_FILES).values(volume_id=volume.id, file=file, parent=None, state="live"))


def set_file_state(conn: Connection, volume_id: int, file: str, state: str) -> None:
    conn.execute(update(VOLUME_FILES).where(_VF.volume_id == volume_id, _VF.file == file).values(state=state))


def drop_file(conn: Connection, volume: Row[Any], file: str) -> None:
    """The host confirmed `file` gone: its row and its charge go (the volume's first file is the volume's)."""
    row = conn.execute(select(VOLUME_FILES).where(_VF.volume_id == volume.id, _VF.file == file)).first()
    if row is None:
        return
    conn.execute(delete(VOLUME_FILES).where(_VF.id == row.id))
    if row.parent is not None:  # the volume's first file is charged with the volume itself
        L.add_to_ledger(conn, volume.project_id, Usage(storage_mib=-volume.size_mib))
        SL.add_to_pool(conn, volume.pool_id, -volume.size_mib)


def extra_files(conn: Connection, volume_id: int) -> int:
    """How many files a volume's chain has beyond its first (each charged at the volume's size)."""
    return int(
        conn.execute(select(func.count()).where(_VF.volume_id == volume_id, _VF.parent.is_not(None))).scalar() or 0
    )


def forget_volume(conn: Connection, volume_id: int) -> None:
    """A volume that is gone (every file of its chain confirmed deleted): its chain's rows and its snapshots'
    bases on it."""
    conn.execute(delete(VOLUME_FILES).where(_VF.volume_id == volume_id))
    conn.execute(delete(SNAPSHOT_FILES).where(_SF.volume_id == volume_id))


def forget_vm(conn: Connection, vm_id: int) -> None:
    ids = [r.id for r in snapshot_rows(conn, vm_id)]
    if ids:
        conn.execute(delete(SNAPSHOT_FILES).where(_SF.snapshot_id.in_(ids)))
        conn.execute(delete(SNAPSHOTS).where(_S.id.in_(ids)))


def set_snapshot(conn: Connection, snapshot_id: int, **fields: Any) -> None:
    if "state" in fields:
        fields["step_at"] = utcnow()
    conn.execute(update(SNAPSHOTS).where(_S.id == snapshot_id).values(**fields))


def add_base(conn: Connection, snapshot_id: int, volume_id: int, base: str, overlay: str) -> None:
    conn.execute(
        insert(SNAPSHOT_FILES).values(snapshot_id=snapshot_id, volume_id=volume_id, base=base, overlay=overlay)
    )


def remove_snapshot(conn: Connection, snapshot_id: int) -> None:
    conn.execute(delete(SNAPSHOT_FILES).where(_SF.snapshot_id == snapshot_id))
    conn.execute(delete(SNAPSHOTS).where(_S.id == snapshot_id))


def unfinished(conn: Connection) -> list[Row[Any]]:
    """Snapshots a crash may have left in a step (taking, reverting, deleting)."""
    return list(conn.execute(select(SNAPSHOTS).where(_S.state != "ready")).all())


def event(conn: Connection, vm: str, snapshot: str, old: str | None, new: str, project_id: int, note: str) -> None:
    events.record(
        conn, "snapshot", f"{vm}/{snapshot}", old_state=old, new_state=new, message=note, vm=vm, project_id=project_id
    )


def busy_problem(conn: Connection, vm_id: int, vm: str) -> str | None:
    """Why the VM can not start, migrate or snapshot now: a snapshot step is in flight, a merge, or a backup
    being written (of a stopped VM: its disks are read as they are)."""
    for r in snapshot_rows(conn, vm_id):
        if r.state != "ready":
            return f"vm {vm}'s snapshot {r.name} is {r.state}; retry once it is settled"
    from vmplane.store.schema import Volume

    merging = conn.execute(
        select(_VF.file)
        .join(Volume.__table__, Volume.__table__.c.id == _VF.volume_id)
        .where(Volume.__table__.c.vm_id == vm_id, _VF.state == "merging")
        .limit(1)
    ).first()
    if merging is not None:
        return f"vm {vm}'s disk file {merging[0]} is being merged (a snapshot deleted); retry in a moment"
    from vmplane.store.schema import Backup

    backup = conn.execute(select(Backup.id).where(Backup.vm_id == vm_id, Backup.state == "running").limit(1)).first()
    if backup is not None:
        return f"vm {vm}'s backup {backup[0]} is being written; retry once it is done"
    return None


def migration_problem(conn: Connection, vm_id: int, volumes: list[Row[Any]]) -> str | None:
    """Why the VM can not live-migrate now (core/snapshots.migration_problem): a snapshot step in flight, or
    a chain on a local pool (a linked clone's overlay on another volume's file is one)."""
    local = [v for v in volumes if v.pool_kind == "local"]
    extra = sum(extra_files(conn, v.id) + (1 if v.base_file else 0) for v in local)
    return rules.migration_problem(bool(local), extra)


def reparent(conn: Connection, volume_id: int, old: str, new: str) -> None:
    """`old` was merged into `new` (its parent): its children read `new` now, and a snapshot that kept `old`
    keeps `new` (which holds exactly what `old` showed)."""
    conn.execute(update(VOLUME_FILES).where(_VF.volume_id == volume_id, _VF.parent == old).values(parent=new))
    conn.execute(update(SNAPSHOT_FILES).where(_SF.volume_id == volume_id, _SF.base == old).values(base=new))


def chained_vms(conn: Connection) -> list[int]:
    """VMs whose disks are chains (an overlay beyond a disk's first file): those a merge may shorten."""
    from vmplane.store.schema import Volume

    rows = conn.execute(
        select(Volume.vm_id).join(VOLUME_FILES, _VF.volume_id == Volume.id).where(_VF.parent.is_not(None)).distinct()
    ).all()
    return [r[0] for r in rows if r[0] is not None]
