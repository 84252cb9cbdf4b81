"""Core SQL for storage, inside a caller's write transaction: volumes with their charge on the project's
ledger and their space on a pool, always together (one transaction, the project row locked first, as
for CPU and memory). No rule lives here: callers decide (storagerules, quota), these read and write.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import bindparam, delete, insert, select, update
from sqlalchemy.engine import Connection, Row
from sqlalchemy.sql import ColumnElement

from vmplane.core.errors import Conflict, NotFound
from vmplane.core.model import Usage
from vmplane.store import events
from vmplane.store import ledger as L
from vmplane.store.prepared import prepared
from vmplane.store.schema import Cluster, Host, Pool, Project, Template, Vm, Volume, utcnow

POOLS, VOLUMES = Pool.__table__, Volume.__table__
_PL, _VO = POOLS.c, VOLUMES.c
_H, _C, _V = Host.__table__.c, Cluster.__table__.c, Vm.__table__.c

# Compare-and-add: space on a running pool only if it still fits, atomically on any database.
_TAKE_ON_POOL = (
    update(POOLS)
    .where(_PL.id == bindparam("_id"), _PL.state == "running", _PL.used_mib + bindparam("d") <= _PL.capacity_mib)
    .values(used_mib=_PL.used_mib + bindparam("d"))
)
_ADD_TO_POOL = update(POOLS).where(_PL.id == bindparam("_id")).values(used_mib=_PL.used_mib + bindparam("d"))

POOL_ROWS = (
    select(POOLS, _C.name.label("cluster_name"), _H.name.label("host_name"))
    .join(Cluster.__table__, _C.id == _PL.cluster_id)
    .outerjoin(Host.__table__, _H.id == _PL.host_id)
)
_COPY_POOL = POOLS.alias("copy_pool")
_MOVE_POOL = POOLS.alias("move_pool")  # a `volume move` in flight (issue 32)
VOLUME_ROWS = (
    select(
        VOLUMES,
        _PL.name.label("pool_name"),
        _PL.path.label("pool_path"),
        _PL.kind.label("pool_kind"),
        _H.name.label("pool_host"),
        _V.name.label("vm_name"),
        Project.__table__.c.name.label("project"),
        _COPY_POOL.c.name.label("copy_pool_name"),
        _MOVE_POOL.c.name.label("move_pool_name"),
        _MOVE_POOL.c.path.label("move_pool_path"),
        Template.__table__.c.name.label("template"),
    )
    .join(POOLS, _PL.id == _VO.pool_id)
    .outerjoin(Host.__table__, _H.id == _PL.host_id)
    .join(Project.__table__, Project.__table__.c.id == _VO.project_id)
    .outerjoin(Vm.__table__, _V.id == _VO.vm_id)
    .outerjoin(_COPY_POOL, _COPY_POOL.c.id == _VO.copy_pool_id)
    .outerjoin(_MOVE_POOL, _MOVE_POOL.c.id == _VO.move_pool_id)
    .outerjoin(Template.__table__, Template.__table__.c.id == _VO.template_id)
)

# every start reads its VM's disks: built once (building the five-join select per call was most of it)
_VOLUMES_OF_VM = VOLUME_ROWS.where(_VO.vm_id == bindparam("vm_id")).order_by(_VO.name)


def pool_rows(conn: Connection, *where: ColumnElement[bool]) -> list[Row[Any]]:
    return list(conn.execute(POOL_ROWS.where(*where).order_by(_PL.name)).all())


def pool_row(conn: Connection, name: str) -> Row[Any]:
    row = conn.execute(POOL_ROWS.where(_PL.name == name)).first()
    if row is None:
        raise NotFound(f"pool {name!r} does not exist", field="pool")
    return row


def volume_rows(conn: Connection, *where: ColumnElement[bool]) -> list[Row[Any]]:
    return list(conn.execute(VOLUME_ROWS.where(*where).order_by(_VO.name)).all())


def volume_row(conn: Connection, name: str, lock: bool = False) -> Row[Any]:
    stmt = VOLUME_ROWS.where(_VO.name == name)
    row = conn.execute(stmt.with_for_update(of=VOLUMES) if lock else stmt).first()
    if row is None:
        raise NotFound(f"volume {name!r} does not exist", field="volume")
    return row


def vm_volumes(conn: Connection, vm_id: int) -> list[Row[Any]]:
    """A VM's disks, root first (vda), then by device."""
    rows = prepared(conn.engine, _VOLUMES_OF_VM).all_in(conn, vm_id=vm_id)  # (every start reads them)
    return sorted(rows, key=lambda r: (r.role != "root", r.device or ""))


def take_on_pool(conn: Connection, pool_id: int, mib: int) -> bool:
    return conn.execute(_TAKE_ON_POOL, {"_id": pool_id, "d": mib}).rowcount == 1


def add_to_pool(conn: Connection, pool_id: int, mib: int) -> None:
    conn.execute(_ADD_TO_POOL, {"_id": pool_id, "d": mib})


def insert_volume(conn: Connection, note: str = "", charge: bool = True, **fields: Any) -> int:
    """A new volume's row (state creating), its charge on the project's ledger (unless the caller's
    admission already put it there) and its space on the pool (already taken with take_on_pool), and
    its event."""
    now = utcnow()
    fields = {"state": "creating", "created_at": now, "updated_at": now, **fields}
    key = conn.execute(insert(VOLUMES), fields).inserted_primary_key
    assert key is not None  # (a one-row insert)
    volume_id: int = key[0]
    if charge:
        L.add_to_ledger(conn, fields["project_id"], Usage(storage_mib=fields["size_mib"]))
    _event(conn, fields["name"], None, fields["state"], fields["project_id"], note)
    return volume_id


def set_volume(conn: Connection, volume: Row[Any], note: str = "", **fields: Any) -> None:
    """Update a volume; a change of state is recorded in the event log in the same transaction."""
    vm = fields.pop("vm_name", None) or volume.vm_name
    conn.execute(update(VOLUMES).where(_VO.id == volume.id).values(**fields, updated_at=utcnow()))
    if "state" in fields and fields["state"] != volume.state:
        _event(conn, volume.name, volume.state, fields["state"], volume.project_id, note, vm=vm)


def remove_volume(conn: Connection, volume: Row[Any], note: str = "") -> None:
    """The volume is gone from its pool (confirmed): its row, its charge and its pool space go. A volume
    with a migration's copy is refused (the row is what remembers the copy's file: keep_for_copy)."""
    if volume.copy_pool_id is not None:
        raise Conflict(
            f"volume {volume.name} still has a copy on pool {volume.copy_pool_name}; it is deleted first",
            field="volume",
        )
    conn.execute(delete(VOLUMES).where(_VO.id == volume.id))
    L.add_to_ledger(conn, volume.project_id, Usage(storage_mib=-volume.size_mib))
    add_to_pool(conn, volume.pool_id, -volume.size_mib)
    _event(conn, volume.name, volume.state, "deleted", volume.project_id, note, vm=volume.vm_name)


def keep_for_copy(conn: Connection, volume: Row[Any], note: str = "") -> None:
    """The volume's file is gone from its pool (confirmed), its copy is not: the row stands for the copy
    now (on the copy's pool, still `deleting` and charged), and the first pool's space goes."""
    conn.execute(
        update(VOLUMES)
        .where(_VO.id == volume.id)
        .values(pool_id=volume.copy_pool_id, copy_pool_id=None, updated_at=utcnow())
    )
    add_to_pool(conn, volume.pool_id, -volume.size_mib)
    _event(conn, volume.name, volume.state, volume.state, volume.project_id, note, vm=volume.vm_name)


def file_event(conn: Connection, volume: Row[Any], note: str) -> None:
    """Something done to a volume's files that changes no state (a leftover removed): in the event log."""
    _event(conn, volume.name, volume.state, volume.state, volume.project_id, note, vm=volume.vm_name)


def _event(
    conn: Connection, name: str, old: str | None, new: str, project_id: int, note: str, vm: str | None = None
) -> None:
    events.record(conn, "volume", name, old_state=old, new_state=new, message=note, vm=vm, project_id=project_id)
