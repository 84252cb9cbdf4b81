"""Fencing tokens: a background write lands only while the process that makes it still holds its lease.

Each control-plane process registers a row in `controllers` (controllers.py); its `epoch` (monotonic,
given by the database) is its fencing token. Work a process owns (an operation or migration it runs, a
loop it runs because it holds a lease) runs under `owned(epoch)`. Every write transaction opened under
it (Database.write / transaction) first checks, in the same transaction, that this epoch's row is still
`live`, and raises `Fenced` if not: a paused or partitioned ex-owner changes nothing once another process
has found its lease lapsed (controllers.py), whatever its threads were in the middle of. Nothing is taken
from an owner before that, so no clock decides this check (a wall clock that steps lapses nobody).

The check takes a KEY SHARE lock on the row (PostgreSQL; SQLite's writers are serial anyway), and a
takeover starts by marking the lapsed row `lapsed` after locking it FOR UPDATE (controllers.mark_lapsed),
which waits for those: a write that passed its check commits before the takeover sees anything. The
renewal, an UPDATE of no key column, does not conflict with KEY SHARE: a process's own writes waiting on
other locks never hold its lease back. A write frozen after its check (its process stopped inside the
transaction) holds the takeover only until the wait gives way: its session is then ended (store/pgsessions.py).
No session state: no advisory locks, nothing that a
connection pool (or PgBouncer in transaction mode) could lose between two transactions.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from sqlalchemy import text
from sqlalchemy.engine import Connection

from vmplane.core.errors import Interrupted

_OWNER: contextvars.ContextVar[int | None] = contextvars.ContextVar("vmplane_owner", default=None)
_LIVE: dict[str, str] = {}  # check()'s SQL, by dialect


class Fenced(Interrupted):
    """This process's lease lapsed: the write did not land, and the work is someone else's now. An
    operation that meets it stays at its persisted step for the process that took it over."""


@contextlib.contextmanager
def owned(epoch: int | None) -> Iterator[None]:
    """Run the block as the owner `epoch`: its writes are fenced by it (None: not fenced)."""
    token = _OWNER.set(epoch)
    try:
        yield
    finally:
        _OWNER.reset(token)


def current() -> int | None:
    return _OWNER.get()


def now_sql(conn: Connection) -> str:
    """The database's clock, in seconds since 1970, as SQL (every process compares leases with one clock)."""
    if conn.dialect.name == "sqlite":
        return "((julianday('now') - 2440587.5) * 86400.0)"
    return "extract(epoch from clock_timestamp())"


def db_now(conn: Connection) -> float:
    return float(conn.execute(text(f"SELECT {now_sql(conn)}")).scalar_one())


def check(conn: Connection) -> None:
    """Inside a write transaction: raise Fenced unless the current owner's lease is live (no owner: no check).
    Run on the transaction's DBAPI cursor: it opens every owned write, and through SQLAlchemy's
    execution it cost about three times the query."""
    epoch = _OWNER.get()
    if epoch is None:
        return
    dialect = conn.dialect
    sql = _LIVE.get(dialect.name)
    if sql is None:
        lock = "" if dialect.name == "sqlite" else " FOR KEY SHARE"
        mark = "?" if dialect.paramstyle == "qmark" else "%(e)s"
        sql = _LIVE[dialect.name] = f"SELECT 1 FROM controllers WHERE epoch = {mark} AND state = 'live'{lock}"
    args = (epoch,) if dialect.paramstyle == "qmark" else {"e": epoch}
    cursor = conn.connection.cursor()
    try:
        cursor.execute(sql, args)
        live = cursor.fetchone() is not None
    except dialect.loaded_dbapi.Error as exc:
        from vmplane.store.prepared import as_sqlalchemy_error  # (the store imports this module)

        raise as_sqlalchemy_error(dialect, sql, args, exc) from exc
    finally:
        cursor.close()
    if not live:
        raise Fenced(f"controller {epoch}'s lease has lapsed: this write did not land")


def owner_of(conn: Connection) -> int | None:
    """The controller new operations and migrations are owned by: the one running the block, else this
    store's process (set on the engine by plane.membership.Membership)."""
    return _OWNER.get() or getattr(conn.engine, "vmplane_controller", None)
