"""The event log: every state change of a VM, host, migration or operation, with its cause.

An event is written in the same transaction as the change it records, so the log never says
something happened that the store does not hold (nor misses what it holds). Causes are plain words:
`user <token name>` (an API request, and the work it leaves to executor threads and queues), `monitor`,
`recovery`, `sync`, `libvirt event` (background loops: wrap their work in `acting_as(word)`).

Work that runs later in another thread (an operation, a migration's copy) takes the cause of the
request that created it: cause_of() finds it (remembered by this process, else the subject's first
event in the log), since contextvars do not cross an executor by themselves.
"""

from __future__ import annotations

import contextvars
import datetime as dt
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from sqlalchemy import bindparam, delete, func, insert, select
from sqlalchemy.engine import Connection

from vmplane.store import prepared
from vmplane.store.schema import Event, utcnow

if TYPE_CHECKING:
    from vmplane.store.db import Database
    from vmplane.store.listing import Page

EVENTS = Event.__table__

# Who or what is acting in this thread/task; the API sets it per request, background loops set their own.
_cause: contextvars.ContextVar[str] = contextvars.ContextVar("vmplane_cause", default="vmplane")


def current_cause() -> str:
    return _cause.get()


@contextmanager
def acting_as(cause: str) -> Iterator[None]:
    """Events recorded inside this block name `cause` (a request's user, a loop's name)."""
    token = _cause.set(cause)
    try:
        yield
    finally:
        _cause.reset(token)


def user_cause(token_name: str) -> str:
    """The cause of what an API request does: the token it was made with."""
    return f"user {token_name}"


def record(
    conn: Connection,
    kind: str,
    subject: str,
    *,
    old_state: str | None = None,
    new_state: str | None = None,
    message: str = "",
    vm: str | None = None,
    host: str | None = None,
    project_id: int | None = None,
    cause: str | None = None,
) -> None:
    """Write one event inside the caller's transaction (`conn` is the transaction's connection).
    Every PRUNE_EVERY events this process writes, the oldest beyond `vmplane.event.history` go."""
    global _written
    row = {
        "at": utcnow(),
        "kind": kind,
        "subject": subject[:63],
        "project_id": project_id,
        "vm": vm,
        "host": host,
        "old_state": old_state,
        "new_state": new_state,
        "cause": (cause or current_cause())[:128],
        "message": message,
    }
    held = conn.info.get(_HELD)
    if held is not None:
        held.append(row)
    else:
        prepared.write(conn, _INSERT, row)
    if old_state is None and kind in ("operation", "migration"):  # created: its work runs later
        _remember(subject, (cause or current_cause())[:128])
    _written += 1
    if _written % PRUNE_EVERY == 0:
        if held is not None:
            conn.info[_PRUNE_DUE] = True  # once the held events are written (they count)
        else:
            _prune_both(conn)


def _prune_both(conn: Connection) -> None:
    prune(conn)
    prune_operations(conn)


# -- events held back in a transaction, to be written together ---------------------------------------
# An admission batch (admission.Batcher) writes about two events per request: held on its connection and
# written as one executemany just before its commit, they cost a statement per batch, not two per request.
# Nothing in an admission reads the log back, and a request that fails drops its own.
_HELD = "vmplane_held_events"
_PRUNE_DUE = "vmplane_prune_due"


def hold(conn: Connection) -> None:
    """From now on, events recorded on `conn` are held (until write_held or drop_held)."""
    conn.info[_HELD] = []


def held_count(conn: Connection) -> int:
    return len(conn.info[_HELD])


def drop_held(conn: Connection, keep: int | None = None) -> None:
    """Forget the held events after the first `keep` (those of a request that failed);
    with None, all of them, and stop holding (the connection goes back to the pool as it came)."""
    if keep is None:
        conn.info.pop(_HELD, None)
        conn.info.pop(_PRUNE_DUE, None)
    else:
        del conn.info[_HELD][keep:]


def write_held(conn: Connection) -> None:
    """Write the held events, in the order they were recorded, and stop holding (then prune, if a
    prune came due meanwhile)."""
    prepared.write_many(conn, _INSERT, conn.info.pop(_HELD))
    if conn.info.pop(_PRUNE_DUE, False):
        _prune_both(conn)


def cause_of(conn: Connection, kind: str, subject: str, vm: str | None = None, host: str | None = None) -> str | None:
    """The cause of the first event of a subject (the request that created an operation or a migration),
    for work that runs later elsewhere (an executor thread, a queue); None if it has none (pruned).
    This process remembers the recent ones; others (another process, a restart) are read from the log."""
    known = remembered(subject)
    if known is not None:
        return known
    stmt = _CAUSE_BY_VM if vm is not None else _CAUSE_BY_HOST if host is not None else _CAUSE
    return conn.execute(stmt, {"kind": kind, "subject": subject, "vm": vm, "host": host}).scalar()


def first_causes(db: Database, kind: str, subjects: list[str]) -> dict[str, str]:
    """Who asked for each of a page of operations or migrations: the cause of each subject's first event
    (one query; a subject whose first event was pruned is left out)."""
    if not subjects:
        return {}
    first = (
        select(func.min(_E.id)).where(_E.kind == kind, _E.subject.in_(subjects)).group_by(_E.subject).scalar_subquery()
    )
    with db.read() as s:
        return {r.subject: r.cause for r in s.execute(select(_E.subject, _E.cause).where(_E.id.in_(first)))}


def remembered(subject: str) -> str | None:
    """The cause this process recorded when `subject` (an operation or migration id) was created."""
    with _causes_lock:
        return _causes.get(subject)


def _remember(subject: str, cause: str) -> None:
    with _causes_lock:
        _causes[subject] = cause
        while len(_causes) > REMEMBERED:
            _causes.popitem(last=False)


REMEMBERED = 4096  # causes of recently created operations and migrations kept in memory
_causes: OrderedDict[str, str] = OrderedDict()
_causes_lock = threading.Lock()
_E = EVENTS.c
_CAUSE = (
    select(_E.cause).where(_E.kind == bindparam("kind"), _E.subject == bindparam("subject")).order_by(_E.id).limit(1)
)
_CAUSE_BY_VM = _CAUSE.where(_E.vm == bindparam("vm"))  # the indexed columns narrow the search
_CAUSE_BY_HOST = _CAUSE.where(_E.host == bindparam("host"))


# -- reading -------------------------------------------------------------------------------------------
def page(
    db: Database,
    page: Page,
    vm: str | None = None,
    host: str | None = None,
    kind: str | None = None,
    since: int | dt.datetime | None = None,
    project_id: int | None = None,
) -> tuple[list[dict[str, Any]], int]:
    """Events filtered, sorted (newest first by default) and paged in SQL, with their project's name, and
    their total. `since`: an event id (those after it) or a timestamp (those at or after it).
    `project_id` limits them to one project's (a member's view)."""
    from vmplane.store.listing import order_by, run_page
    from vmplane.store.schema import Project

    e = EVENTS.c
    conds = []
    for column, value in ((e.vm, vm), (e.host, host), (e.kind, kind), (e.project_id, project_id)):
        if value is not None:
            conds.append(column == value)
    if isinstance(since, int):
        conds.append(e.id > since)
    elif since is not None:
        if since.tzinfo is not None:  # the store keeps naive UTC
            since = since.astimezone(dt.UTC).replace(tzinfo=None)
        conds.append(e.at >= since)
    fields = {"id": e.id, "at": e.at, "kind": e.kind, "subject": e.subject}
    stmt = select(
        e.id,
        e.at,
        e.kind,
        e.subject,
        e.vm,
        e.host,
        Project.name.label("project"),
        e.old_state,
        e.new_state,
        e.cause,
        e.message,
    ).outerjoin(Project, Project.id == e.project_id)
    with db.read() as s:
        return run_page(s, stmt, e.id, conds, order_by(page.sort, fields, "-id", e.id), page, scalars=False)


# -- retention ---------------------------------------------------------------------------------------
PRUNE_EVERY = 500  # events written by this process between two prunes (a test sets 1)
PRUNE_BATCH = 10_000  # at most this many deleted by one prune: the writer's transaction stays short
HISTORY_KEY = "vmplane.event.history"
OPERATION_HISTORY_KEY = "vmplane.operation.history"
_INSERT = insert(EVENTS)
_written = 0


def history_limit(conn: Connection, key: str = HISTORY_KEY) -> int:
    """`vmplane.event.history` (or another global history `key`) as set, else its default."""
    from vmplane.core import settings as settings_rules
    from vmplane.store.schema import Setting

    raw = conn.execute(select(Setting.value).where(Setting.key == key, Setting.scope == "global")).scalar()
    value = settings_rules.typed(key, raw) if raw is not None else None
    default = settings_rules.KEYS[key].default
    return value if isinstance(value, int) else int(default)


def prune(conn: Connection, keep: int | None = None) -> int:
    """Delete the oldest events beyond the newest `keep` (by id; the setting when None), at most
    PRUNE_BATCH of them; returns how many went."""
    keep = history_limit(conn) if keep is None else keep
    e = EVENTS.c
    newest, oldest = conn.execute(select(func.max(e.id), func.min(e.id))).one()
    if newest is None or newest - oldest < keep:
        return 0
    below = min(newest - keep + 1, oldest + PRUNE_BATCH)  # ids below this go
    return conn.execute(delete(EVENTS).where(e.id < below)).rowcount


def prune_operations(conn: Connection, keep: int | None = None) -> int:
    """Delete the oldest finished operations (succeeded, failed, cancelled; by creation time) beyond the
    newest `keep` finished ones (`vmplane.operation.history` when None), at most PRUNE_BATCH of them;
    operations in flight are never deleted. Returns how many went. Called with the events' prune."""
    from vmplane.core.model import IN_FLIGHT_OPERATION_STATES
    from vmplane.store.schema import Operation

    keep = history_limit(conn, OPERATION_HISTORY_KEY) if keep is None else keep
    ops = Operation.__table__
    o = ops.c
    finished = o.state.not_in([st.value for st in IN_FLIGHT_OPERATION_STATES])
    count = conn.execute(select(func.count()).select_from(ops).where(finished)).scalar() or 0
    if count <= keep:
        return 0
    oldest = select(o.id).where(finished).order_by(o.created_at, o.id).limit(min(count - keep, PRUNE_BATCH))
    return conn.execute(delete(ops).where(o.id.in_(oldest))).rowcount
