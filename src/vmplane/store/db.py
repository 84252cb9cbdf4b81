"""The database handle: engine, sessions, and write transactions that serialise on SQLite."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session, sessionmaker

from vmplane.core.leases import DEFAULT_LEASE_S, SessionLimits, session_limits
from vmplane.store import ownership, pgsessions
from vmplane.store.prepared import as_sqlalchemy_error

DEFAULT_DB_URL = "sqlite:///var/vmplane.db"


def _sqlite_file(url: str) -> Path | None:
    prefix = "sqlite:///"
    if url.startswith(prefix) and url != "sqlite:///:memory:":
        return Path(url[len(prefix) :])
    return None


_BEGIN = {mode: f"BEGIN {mode}" for mode in ("DEFERRED", "IMMEDIATE", "EXCLUSIVE")}


class Database:
    """One engine per URL. `write()` opens a transaction that holds the database's write lock
    from its first statement on SQLite (BEGIN IMMEDIATE), so a read-then-write admission can not
    interleave with another writer; on PostgreSQL admissions rely on conditional UPDATEs."""

    def __init__(self, url: str = DEFAULT_DB_URL):
        self.url = url
        path = _sqlite_file(url)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        self.is_sqlite = url.startswith("sqlite")
        # PostgreSQL: each write transaction's lock and idle timeouts (pgsessions), from the process's lease
        self.limits: SessionLimits = session_limits(DEFAULT_LEASE_S)
        # connections kept for the API's request threads and the operations' workers: past the pool's size each
        # checkout opens a new connection (on SQLite its pragmas too) and closes it at checkin
        kwargs: dict[str, Any] = {"pool_size": 20, "max_overflow": 20} if path is not None or not self.is_sqlite else {}
        if self.is_sqlite:
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
        else:
            # no server-side prepared statements: they are session state, which PgBouncer in transaction
            # pooling mode does not keep (each transaction may run on another server connection)
            kwargs["connect_args"] = {"prepare_threshold": None}
        self.engine: Engine = create_engine(url, **kwargs)
        # the lease's renewal (controllers.py) on a pool of its own: never behind requests waiting for a connection
        in_memory = self.is_sqlite and path is None
        self._lease_engine: Engine = (
            self.engine if in_memory else create_engine(url, **{**kwargs, "pool_size": 1, "max_overflow": 1})
        )
        if self.is_sqlite:
            self._configure_sqlite(self.engine)
            if self._lease_engine is not self.engine:
                self._configure_sqlite(self._lease_engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    def use_lease(self, lease_s: float) -> None:
        """Derive the write transactions' timeouts from this process's lease period (controllers.py)."""
        self.limits = session_limits(lease_s)

    def _begin(self, conn: Connection) -> None:
        """First in every write transaction, before its fencing check: on PostgreSQL its timeouts and the epoch it
        works for, set for it alone (pgsessions: what PgBouncer in transaction mode keeps)."""
        if not self.is_sqlite:
            pgsessions.begin(conn, self.limits, ownership.current() or getattr(self.engine, "vmplane_controller", None))

    @staticmethod
    def _configure_sqlite(engine: Engine) -> None:
        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: object) -> None:
            # pysqlite's own transaction handling is disabled so that BEGIN is ours to emit.
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        @event.listens_for(engine, "begin")
        def _begin(conn: Connection) -> None:
            # on the DBAPI connection: through exec_driver_sql it cost about a sixth of a start's transaction
            sql = _BEGIN[conn.get_execution_options().get("sqlite_begin", "DEFERRED")]
            try:
                sqlite: Any = conn.connection.dbapi_connection  # (pysqlite's: SQLAlchemy types the DBAPI's)
                sqlite.execute(sql)
            except sqlite3.Error as exc:  # raised as SQLAlchemy would (a locked database's retries read it)
                raise as_sqlalchemy_error(conn.dialect, sql, (), exc) from exc

    @contextlib.contextmanager
    def read(self) -> Iterator[Session]:
        # close() ends the transaction without expiring loaded objects (rollback() would).
        with self._sessions() as session:
            yield session

    @contextlib.contextmanager
    def write(self) -> Iterator[Session]:
        """A transaction that commits on success and rolls back on any exception. Under `ownership.owned`
        its first statement checks the owner's lease (ownership.Fenced if it lapsed)."""
        session = self._sessions()
        if self.is_sqlite:
            session.connection(execution_options={"sqlite_begin": "IMMEDIATE"})
        try:
            self._begin(session.connection())
            ownership.check(session.connection())
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise
        finally:
            session.close()

    def transaction(self) -> contextlib.AbstractContextManager[Connection]:
        """Like write(), for Core statements on a plain connection (the admission hot path)."""
        return self._transaction(self.engine, fenced=True)

    def lease_transaction(self) -> contextlib.AbstractContextManager[Connection]:
        """A short write transaction on the lease's own connection, unfenced (the renewal of a lease)."""
        return self._transaction(self._lease_engine, fenced=False)

    @contextlib.contextmanager
    def _transaction(self, engine: Engine, fenced: bool) -> Iterator[Connection]:
        with engine.connect() as conn:
            if self.is_sqlite:
                conn = conn.execution_options(sqlite_begin="IMMEDIATE")
            with conn.begin():
                self._begin(conn)
                if fenced:
                    ownership.check(conn)
                yield conn

    def migrate(self) -> None:
        from vmplane.store.migrate import upgrade_to_head

        upgrade_to_head(self.engine)

    def dispose(self) -> None:
        self.engine.dispose()
        if self._lease_engine is not self.engine:
            self._lease_engine.dispose()
