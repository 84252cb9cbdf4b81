"""Uploaded disk images in the store (issue 30): their rows, and who uses them (templates made `from_image`
point their disk_image at the image's file). The file itself is hosts/uploads.py's."""

from __future__ import annotations

from typing import Any

from sqlalchemy import delete, insert, select
from sqlalchemy.engine import Connection, Row
from sqlalchemy.exc import IntegrityError

from vmplane.core.errors import AlreadyExists, Conflict, NotFound
from vmplane.store.schema import Image, Template

IMAGES = Image.__table__
SHOWN = 5  # template names a refusal lists


def image(conn: Connection, name: str, field: str = "image", for_update: bool = False) -> Row[Any]:
    """The image named `name` (NotFound naming `field`); `for_update` locks its row (PostgreSQL) so that a
    template made from it and its deletion do not cross."""
    stmt = select(IMAGES).where(IMAGES.c.name == name)
    found = conn.execute(stmt.with_for_update() if for_update else stmt).one_or_none()
    if found is None:
        raise NotFound(f"image {name!r} does not exist", field=field)
    return found


def find(conn: Connection, name: str) -> Row[Any] | None:
    return conn.execute(select(IMAGES).where(IMAGES.c.name == name)).one_or_none()


def images(conn: Connection) -> list[Row[Any]]:
    return list(conn.execute(select(IMAGES).order_by(IMAGES.c.name)))


def register(conn: Connection, name: str, file: str, fmt: str, virtual_mib: int, sha256: str, size: int) -> Row[Any]:
    """Record an uploaded image; AlreadyExists naming `name` when another upload took the name first (the
    transaction is then spoilt on PostgreSQL: the caller reads the winner in a new one)."""
    try:
        conn.execute(
            insert(IMAGES).values(
                name=name, file=file, format=fmt, virtual_mib=virtual_mib, sha256=sha256, size_bytes=size
            )
        )
    except IntegrityError:
        raise AlreadyExists(f"image {name} exists already", field="name") from None
    return image(conn, name)


def users(conn: Connection, file: str) -> list[str]:
    """The templates whose root disk is this file."""
    t = Template.__table__.c
    return list(conn.execute(select(t.name).where(t.disk_image == file).order_by(t.name)).scalars())


def remove(conn: Connection, name: str) -> Row[Any]:
    """Delete an image's row, refused (409 naming `image`) while a template uses it; returns the row (its
    file is the caller's to delete, after the commit)."""
    row = image(conn, name, for_update=True)
    used = users(conn, row.file)
    if used:
        names = ", ".join(used[:SHOWN]) + (", ..." if len(used) > SHOWN else "")
        raise Conflict(
            f"image {name} is used by {len(used)} template{'s' if len(used) > 1 else ''} ({names}); delete them first",
            field="image",
        )
    conn.execute(delete(IMAGES).where(IMAGES.c.id == row.id))
    return row
