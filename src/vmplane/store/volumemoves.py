"""Volume moves in the store (issue 32), inside a caller's transaction: a move's claim on its target pool,
the switch of a volume to its new file, and the leftover files (a moved volume's old file, a failed move's
partial copy) whose space stays taken on their pool until the pool confirms them deleted. No rule lives
here: core/volumemoves.py decides, these read and write."""

from __future__ import annotations

from typing import Any

from sqlalchemy import delete, func, insert, select
from sqlalchemy.engine import Connection, Row

from vmplane.core import storagerules as R
from vmplane.store import storageledger as SL
from vmplane.store.schema import LeftoverFile, Pool, utcnow

LEFTOVERS = LeftoverFile.__table__
_LF, _PL = LEFTOVERS.c, Pool.__table__.c


def begin(conn: Connection, volume: Row[Any], pool_id: int, file: str, kind: str, note: str) -> None:
    """The move is admitted (its target's space already taken: take_on_pool): the volume is `moving`."""
    SL.set_volume(conn, volume, state="moving", move_pool_id=pool_id, move_file=file, move_kind=kind, note=note)


def rest_state(volume: Row[Any]) -> str:
    return "attached" if volume.vm_id is not None else "available"


def switch(conn: Connection, volume: Row[Any], note: str, standalone: bool) -> None:
    """The copy was read back on the target pool: the volume is its new file now (`standalone`: a full copy
    on no backing image, so no template stands under it any more). The old file becomes a leftover (its
    space stays taken on the old pool until it is confirmed deleted). The project's charge is unchanged."""
    old = volume.file_name or R.volume_file(volume.name, volume.format)  # (a row made before 0010: its name's)
    add_leftover(conn, volume.pool_id, old, volume.size_mib, volume.name, "moved away")
    fields: dict[str, Any] = dict(
        state=rest_state(volume),
        pool_id=volume.move_pool_id,
        file_name=volume.move_file,
        move_pool_id=None,
        move_file=None,
        move_kind=None,
    )
    if standalone:
        fields["template_id"] = None
    SL.set_volume(conn, volume, note=note, **fields)


def undo(conn: Connection, volume: Row[Any], note: str, partial_left: bool) -> None:
    """The move did not happen: the volume stays where it was. Its target's space is given back, unless a
    partial copy is left there (`partial_left`: a leftover, deleted by the settle pass, keeps it)."""
    if partial_left:
        add_leftover(conn, volume.move_pool_id, volume.move_file, volume.size_mib, volume.name, "a move's partial copy")
    else:
        SL.add_to_pool(conn, volume.move_pool_id, -volume.size_mib)
    SL.set_volume(conn, volume, state=rest_state(volume), move_pool_id=None, move_file=None, move_kind=None, note=note)


def add_leftover(conn: Connection, pool_id: int, file: str, size_mib: int, volume: str, why: str) -> None:
    """A file whose space (already taken on its pool) stays taken until it is confirmed deleted."""
    conn.execute(
        insert(LEFTOVERS).values(
            pool_id=pool_id, file=file, size_mib=size_mib, volume=volume, why=why, created_at=utcnow()
        )
    )


def leftovers(conn: Connection) -> list[Row[Any]]:
    return list(
        conn.execute(
            select(LEFTOVERS, _PL.name.label("pool_name"), _PL.path.label("pool_path"))
            .join(Pool.__table__, _PL.id == _LF.pool_id)
            .order_by(_LF.id)
        ).all()
    )


def drop_leftover(conn: Connection, leftover_id: int) -> bool:
    """The pool confirmed the file gone: its row and its space on the pool go."""
    row = conn.execute(select(LEFTOVERS).where(_LF.id == leftover_id)).first()
    if row is None:
        return False
    conn.execute(delete(LEFTOVERS).where(_LF.id == leftover_id))
    SL.add_to_pool(conn, row.pool_id, -row.size_mib)
    return True


def leftover_mib(conn: Connection) -> dict[int, int]:
    """pool id -> the MiB its leftover files still take."""
    rows = conn.execute(select(_LF.pool_id, func.sum(_LF.size_mib)).group_by(_LF.pool_id)).all()
    return {int(pool_id): int(mib) for pool_id, mib in rows}


def leftover_files(conn: Connection, pool_id: int) -> set[str]:
    return set(conn.execute(select(_LF.file).where(_LF.pool_id == pool_id)).scalars())
