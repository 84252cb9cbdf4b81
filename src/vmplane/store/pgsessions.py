"""PostgreSQL's limits on this process's transactions, and the ending of a lapsed process's sessions.

A process frozen inside a transaction (SIGSTOP, a hypervisor's pause of its machine) keeps every lock it took
until PostgreSQL ends its session. Without limits, the admissions' advisory lock held by it stalls every
admission of every process, and its fencing check's KEY SHARE stalls the takeover (controllers.mark_lapsed),
until it resumes. So every write transaction starts by setting, for itself only (set_config(..., true), the
SET LOCAL that PgBouncer in transaction pooling mode keeps, unlike a session's SET or a startup packet's
options, which a pool drops or hands to another client):
- `lock_timeout` and `idle_in_transaction_session_timeout`, a few lease periods (leases.session_limits);
- `application_name` = "vmplane e<epoch>": the controller epoch the transaction works for, so that another
  process can tell, from pg_stat_activity, a holder that belongs to a lapsed epoch.
The waits that must give way (the admissions' lock, mark_lapsed's FOR UPDATE) try for a third of a lease at a
time; between tries, a holder known to work for a lapsed epoch has its session ended (pg_terminate_backend):
its transaction rolls back whole, as it would at its idle timeout, only sooner.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from sqlalchemy import Executable, Select, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import OperationalError

from vmplane.core.leases import SessionLimits
from vmplane.store.prepared import as_sqlalchemy_error

log = logging.getLogger("vmplane.store")

T = TypeVar("T")
TAG = "vmplane e"  # application_name of a transaction working for a controller epoch
UNTAGGED = "vmplane"  # one working for none (a command of the CLI, a process not registered)
LOCK_NOT_AVAILABLE = "55P03"  # lock_timeout's SQLSTATE
_SAVEPOINT = "vmplane_wait"


def tag(epoch: int | None) -> str:
    return UNTAGGED if epoch is None else f"{TAG}{int(epoch)}"


def begin_sql(limits: SessionLimits, epoch: int | None) -> str:
    """The first statement of a write transaction: its limits and its epoch's tag, for itself only."""
    return (
        f"SELECT set_config('lock_timeout', '{limits.lock_timeout_ms}ms', true), "
        f"set_config('idle_in_transaction_session_timeout', '{limits.idle_ms}ms', true), "
        f"set_config('application_name', '{tag(epoch)}', true)"
    )


def begin(conn: Connection, limits: SessionLimits, epoch: int | None) -> None:
    """Run begin_sql on the transaction's DBAPI cursor, as ownership.check does (every write transaction runs it:
    one round trip, about 0.05-0.1 ms on a local server)."""
    _execute(conn, begin_sql(limits, epoch))


def _execute(conn: Connection, sql: str) -> None:
    cursor = conn.connection.cursor()
    try:
        cursor.execute(sql)
    except conn.dialect.loaded_dbapi.Error as exc:
        raise as_sqlalchemy_error(conn.dialect, sql, (), exc) from exc
    finally:
        cursor.close()


def lock_not_available(exc: BaseException) -> bool:
    return getattr(getattr(exc, "orig", exc), "sqlstate", None) == LOCK_NOT_AVAILABLE


def advisory_xact_lock(conn: Connection, key: int, limits: SessionLimits) -> None:
    """pg_advisory_xact_lock(key), giving way (give_way): in one round trip when it is free. On giving way,
    the holder's session is ended if it works for a lapsed epoch."""
    take = (
        f"SAVEPOINT {_SAVEPOINT}; SELECT set_config('lock_timeout', '{limits.give_way_ms}ms', true); "
        f"SELECT pg_advisory_xact_lock({int(key)}); RELEASE SAVEPOINT {_SAVEPOINT}; "
        f"SELECT set_config('lock_timeout', '{limits.lock_timeout_ms}ms', true)"
    )
    give_way(
        limits,
        lambda: _execute(conn, take),
        back=lambda: _execute(conn, f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}; RELEASE SAVEPOINT {_SAVEPOINT}"),
        clear=lambda: _end_lapsed_holders(conn, key),
        what=f"the admissions' lock ({key:#x})",
    )


def select_for_update(
    conn: Connection, stmt: Select[Any], limits: SessionLimits, lapsed: Callable[[], Iterable[int]], what: str
) -> list[Any]:
    """The rows of `stmt` (a SELECT ... FOR UPDATE), giving way (give_way): on giving way, the sessions working
    for the epochs lapsed() names are ended."""

    def attempt() -> list[Any]:
        with conn.begin_nested():  # (rolled back to, its short lock_timeout with it, when the try times out)
            _execute(conn, f"SELECT set_config('lock_timeout', '{limits.give_way_ms}ms', true)")
            rows = list(conn.execute(stmt).all())
        _execute(conn, f"SELECT set_config('lock_timeout', '{limits.lock_timeout_ms}ms', true)")
        return rows

    return give_way(limits, attempt, back=lambda: None, clear=lambda: end_epochs(conn, lapsed()), what=what)


def give_way(
    limits: SessionLimits, attempt: Callable[[], T], back: Callable[[], None], clear: Callable[[], int], what: str
) -> T:
    """attempt() (a lock's wait of at most limits.give_way_ms, in a savepoint), again until it gets the lock.
    When a try times out: back() to the savepoint, then clear() (end the sessions of lapsed holders; how many).
    The lock timeout is raised once the tries have waited limits.lock_timeout_ms and none was cleared."""
    started = time.monotonic()
    while True:
        try:
            return attempt()
        except OperationalError as exc:
            if not lock_not_available(exc):
                raise
            back()
            ended = clear()
            waited = time.monotonic() - started
            if ended:
                log.warning("%s: ended %d session(s) of lapsed control-plane processes that held it", what, ended)
            elif waited * 1000 >= limits.lock_timeout_ms:
                raise
            else:
                log.info("%s: still held after %.1f s; waiting again", what, waited)


def _end_lapsed_holders(conn: Connection, key: int) -> int:
    """End the sessions that hold the advisory lock `key` for an epoch marked lapsed."""
    return _count(
        conn,
        text(f"""
        SELECT count(pg_terminate_backend(a.pid)) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
        WHERE l.locktype = 'advisory' AND l.granted AND l.classid = :high AND l.objid = :low AND l.objsubid = 1
          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
          AND a.pid <> pg_backend_pid() AND {_MAY_END}
          AND EXISTS (SELECT 1 FROM controllers c WHERE c.state = 'lapsed' AND '{TAG}' || c.epoch = a.application_name)
        """),
        high=key >> 32,
        low=key & 0xFFFFFFFF,
    )


def end_epochs(conn: Connection, epochs: Iterable[int]) -> int:
    """End the sessions of the transactions working for `epochs` (judged lapsed by the caller)."""
    tags = [tag(e) for e in epochs]
    if not tags:
        return 0
    return _count(
        conn,
        text(f"""
        SELECT count(pg_terminate_backend(a.pid)) FROM pg_stat_activity a
        WHERE a.application_name = ANY(:tags) AND a.pid <> pg_backend_pid() AND {_MAY_END}
        """),
        tags=tags,
    )


# sessions this role may end (its own role's, or any with pg_signal_backend; a superuser's only as superuser):
# pg_terminate_backend raises, and would abort the caller's transaction, for any other
_MAY_END = (
    "(pg_has_role(a.usesysid, 'MEMBER') OR pg_has_role('pg_signal_backend', 'MEMBER')) "
    "AND (NOT (SELECT rolsuper FROM pg_roles WHERE oid = a.usesysid) "
    "OR (SELECT rolsuper FROM pg_roles WHERE rolname = current_user))"
)


def _count(conn: Connection, stmt: Executable, **params: Any) -> int:
    return int(conn.execute(stmt, params).scalar_one())
