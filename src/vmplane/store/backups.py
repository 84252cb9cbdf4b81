"""Backups in the store (issue 32), inside a caller's transaction: backup stores, backups, and the backup
charge on a project (quota_backup_mib / used_backup_mib). No rule lives here: core/backups.py decides."""

from __future__ import annotations

from typing import Any

from sqlalchemy import delete, insert, select, update
from sqlalchemy.engine import Connection, Row

from vmplane.core.errors import NotFound
from vmplane.core.names import check_name
from vmplane.store import events
from vmplane.store.schema import Backup, BackupDisk, BackupSchedule, BackupStore, Cluster, Project, Vm, utcnow

STORES, BACKUPS, PROJECTS = BackupStore.__table__, Backup.__table__, Project.__table__
SCHEDULES, DISKS = BackupSchedule.__table__, BackupDisk.__table__
_BS, _B, _P, _S, _D = STORES.c, BACKUPS.c, PROJECTS.c, SCHEDULES.c, DISKS.c

STORE_ROWS = select(STORES, Cluster.__table__.c.name.label("cluster")).join(
    Cluster.__table__, Cluster.__table__.c.id == _BS.cluster_id
)
BACKUP_ROWS = (
    select(BACKUPS, _BS.name.label("store"), _BS.path.label("store_path"), _P.name.label("project"))
    .join(STORES, _BS.id == _B.store_id)
    .join(PROJECTS, _P.id == _B.project_id)
)


def store_rows(conn: Connection) -> list[Row[Any]]:
    return list(conn.execute(STORE_ROWS.order_by(_BS.name)).all())


def store_row(conn: Connection, name: str) -> Row[Any]:
    row = conn.execute(STORE_ROWS.where(_BS.name == name)).first()
    if row is None:
        raise NotFound(f"backup store {name!r} does not exist", field="store")
    return row


def insert_store(conn: Connection, name: str, path: str, cluster_id: int) -> None:
    check_name(name)
    conn.execute(insert(STORES).values(name=name, path=path, cluster_id=cluster_id, created_at=utcnow()))
    events.record(conn, "backup-store", name, new_state="ready", message=f"at {path}")


def delete_store(conn: Connection, store_id: int, name: str) -> None:
    conn.execute(delete(STORES).where(_BS.id == store_id))
    events.record(conn, "backup-store", name, old_state="ready", new_state="deleted")


def backup_rows(
    conn: Connection,
    vm: str | None = None,
    project_id: int | None = None,
    store_id: int | None = None,
    states: tuple[str, ...] | None = None,
) -> list[Row[Any]]:
    q = BACKUP_ROWS
    if states is not None:
        q = q.where(_B.state.in_(states))
    if vm is not None:
        q = q.where(_B.vm_name == vm)
    if project_id is not None:
        q = q.where(_B.project_id == project_id)
    if store_id is not None:
        q = q.where(_B.store_id == store_id)
    return list(conn.execute(q.order_by(_B.id)).all())


def backup_row(conn: Connection, backup_id: int, project_id: int | None = None) -> Row[Any]:
    row = conn.execute(BACKUP_ROWS.where(_B.id == backup_id)).first()
    if row is None or (project_id is not None and row.project_id != project_id):
        raise NotFound(f"backup {backup_id} does not exist", field="backup")
    return row


def children(conn: Connection, backup_id: int) -> list[int]:
    return [r[0] for r in conn.execute(select(_B.id).where(_B.parent_id == backup_id)).all()]


def last_ready(conn: Connection, vm_id: int, store_id: int) -> Row[Any] | None:
    """The VM's last ready backup in the store that has a checkpoint (a backup of the stopped VM has none: the
    next one builds on the one before it, whose bitmaps saw every write since, none happening while stopped)."""
    return conn.execute(
        select(BACKUPS)
        .where(_B.vm_id == vm_id, _B.store_id == store_id, _B.state == "ready", _B.checkpoint_xml.is_not(None))
        .order_by(_B.id.desc())
        .limit(1)
    ).first()


def chain_checkpoints(conn: Connection, vm_id: int, active_files: list[str]) -> list[str]:
    """The checkpoint XMLs of the VM's ready backups whose bitmaps are still in one of the disks' active files
    (a snapshot or a restore since put another file on top of a disk), oldest first: defined again where the
    VM runs."""
    rows = conn.execute(
        select(_B.checkpoint_xml)
        .where(
            _B.vm_id == vm_id,
            _B.state == "ready",
            _B.checkpoint_xml.is_not(None),
            _B.id.in_(select(_D.backup_id).where(_D.disk_file.in_(active_files))),
        )
        .order_by(_B.id)
    ).all()
    return [r[0] for r in rows]


def disk_rows(conn: Connection, backup_ids: list[int]) -> dict[int, list[Row[Any]]]:
    """Each backup's disks, root first then by device."""
    out: dict[int, list[Row[Any]]] = {b: [] for b in backup_ids}
    rows = conn.execute(
        select(DISKS).where(_D.backup_id.in_(backup_ids)).order_by(_D.backup_id, _D.role != "root", _D.device)
    )
    for r in rows:
        out[r.backup_id].append(r)
    return out


def rewrites(conn: Connection, before: Any) -> list[int]:
    """Backups with a disk whose file is being rewritten whole since before `before` (a prune a crash cut short,
    or one still in progress in another process: the caller's `before` leaves it time)."""
    q = select(_D.backup_id).where(_D.whole_file.is_not(None), _D.whole_at < before).distinct().order_by(_D.backup_id)
    return [r[0] for r in conn.execute(q)]


def insert_disk(conn: Connection, **fields: Any) -> None:
    conn.execute(insert(DISKS).values(**fields))


def set_disk(conn: Connection, disk_id: int, **fields: Any) -> None:
    conn.execute(update(DISKS).where(_D.id == disk_id).values(**fields))


def insert_backup(conn: Connection, **fields: Any) -> int:
    key = conn.execute(insert(BACKUPS).values(state="running", created_at=utcnow(), **fields)).inserted_primary_key
    assert key is not None
    return int(key[0])


def set_backup(conn: Connection, backup_id: int, **fields: Any) -> None:
    conn.execute(update(BACKUPS).where(_B.id == backup_id).values(**fields))


def remove_backup(conn: Connection, row: Row[Any], note: str) -> None:
    conn.execute(delete(DISKS).where(_D.backup_id == row.id))
    conn.execute(delete(BACKUPS).where(_B.id == row.id))
    charge(conn, row.project_id, -row.charged_mib)
    event(conn, row, row.state, "deleted", note)


def charge(conn: Connection, project_id: int, mib: int) -> None:
    conn.execute(update(PROJECTS).where(_P.id == project_id).values(used_backup_mib=_P.used_backup_mib + mib))


def quota(conn: Connection, project_id: int, lock: bool = False) -> tuple[str, int, int]:
    """(name, quota, used) of a project's backup charge."""
    q = select(_P.name, _P.quota_backup_mib, _P.used_backup_mib).where(_P.id == project_id)
    row = conn.execute(q.with_for_update() if lock else q).one()
    return row[0], row[1], row[2]


def recomputed(conn: Connection, project_id: int) -> int:
    return sum(r[0] for r in conn.execute(select(_B.charged_mib).where(_B.project_id == project_id)).all())


def event(conn: Connection, row: Any, old: str | None, new: str, note: str) -> None:
    events.record(
        conn,
        "backup",
        f"{row.vm_name}/{row.id}",
        old_state=old,
        new_state=new,
        message=note,
        vm=row.vm_name,
        project_id=row.project_id,
    )


# -- schedules ----------------------------------------------------------------------------------------
SCHEDULE_ROWS = (
    select(SCHEDULES, Vm.__table__.c.name.label("vm"), _P.name.label("project"), _BS.name.label("store"))
    .outerjoin(Vm.__table__, Vm.__table__.c.id == _S.vm_id)
    .outerjoin(PROJECTS, _P.id == _S.project_id)
    .join(STORES, _BS.id == _S.store_id)
)


def schedule_rows(conn: Connection, project_id: int | None = None) -> list[Row[Any]]:
    q = SCHEDULE_ROWS.order_by(_S.id)
    if project_id is not None:
        q = q.where((_S.project_id == project_id) | (Vm.__table__.c.project_id == project_id))
    return list(conn.execute(q).all())


def set_schedule(conn: Connection, vm_id: int | None, project_id: int | None, **fields: Any) -> None:
    """The VM's (or the project's) schedule, made or replaced."""
    where = _S.vm_id == vm_id if vm_id is not None else _S.project_id == project_id
    if conn.execute(update(SCHEDULES).where(where).values(**fields)).rowcount == 0:
        conn.execute(insert(SCHEDULES).values(vm_id=vm_id, project_id=project_id, **fields))


def delete_schedule(conn: Connection, vm_id: int | None, project_id: int | None) -> bool:
    where = _S.vm_id == vm_id if vm_id is not None else _S.project_id == project_id
    return conn.execute(delete(SCHEDULES).where(where)).rowcount == 1


def due(conn: Connection, now: Any) -> list[Row[Any]]:
    return list(conn.execute(SCHEDULE_ROWS.where(_S.next_run_at <= now).order_by(_S.next_run_at)).all())


def claim_run(conn: Connection, schedule_id: int, was: Any, nxt: Any, now: Any) -> bool:
    """Compare-and-set: this process runs the schedule's due run only if no other process moved it on first."""
    return (
        conn.execute(
            update(SCHEDULES)
            .where(_S.id == schedule_id, _S.next_run_at == was)
            .values(next_run_at=nxt, last_run_at=now)
        ).rowcount
        == 1
    )


def record_run(conn: Connection, schedule_id: int, result: str) -> None:
    conn.execute(update(SCHEDULES).where(_S.id == schedule_id).values(last_result=result[:2000]))


def forget_vm(conn: Connection, vm_id: int) -> None:
    """A deleted VM: its backups stay (a restore makes a new VM of what it was), no longer tied to its id (a new
    VM must never build an incremental on them); its schedule goes."""
    conn.execute(update(BACKUPS).where(_B.vm_id == vm_id).values(vm_id=None))
    conn.execute(delete(SCHEDULES).where(_S.vm_id == vm_id))
