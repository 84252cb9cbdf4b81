"""The event log: every state change of a VM, host, migration or operation, with its cause.

An event is written in the same transaction as the change it records, so the log never says
something happened that the store does not hold (nor misses what it holds). Causes are plain words:
`user alice (token ci)`, `libvirt event`, `sync`, `recovery`, `monitor`, `operation <id>`.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager

from sqlalchemy import insert
from sqlalchemy.engine import Connection

from .store.schema import Event, utcnow

EVENTS = Event.__table__

# Who or what is acting in this thread/task; the API sets it per request, background loops set their own.
_cause: contextvars.ContextVar[str] = contextvars.ContextVar("vmplane_cause", default="vmplane")


def current_cause() -> str:
    return _cause.get()


@contextmanager
def acting_as(cause: str):
    """Events recorded inside this block name `cause` (a request's user, a loop's name)."""
    token = _cause.set(cause)
    try:
        yield
    finally:
        _cause.reset(token)


def record(conn: Connection, kind: str, subject: str, *, old_state: str | None = None,
           new_state: str | None = None, message: str = "", vm: str | None = None, host: str | None = None,
           project_id: int | None = None, cause: str | None = None) -> None:
    """Write one event inside the caller's transaction (`conn` is the transaction's connection)."""
    conn.execute(insert(EVENTS).values(
        at=utcnow(), kind=kind, subject=subject, project_id=project_id, vm=vm, host=host,
        old_state=old_state, new_state=new_state, cause=(cause or current_cause())[:128], message=message))
