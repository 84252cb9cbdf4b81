"""The database handle: engine, sessions, and write transactions that serialise on SQLite."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session, sessionmaker

DEFAULT_DB_URL = "sqlite:///var/vmplane.db"


def _sqlite_file(url: str) -> Path | None:
    prefix = "sqlite:///"
    if url.startswith(prefix) and url != "sqlite:///:memory:":
        return Path(url[len(prefix):])
    return None


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
        kwargs: dict = {}
        if self.is_sqlite:
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
        else:
            kwargs["pool_size"] = 20
            kwargs["max_overflow"] = 20
        self.engine: Engine = create_engine(url, **kwargs)
        if self.is_sqlite:
            self._configure_sqlite(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @staticmethod
    def _configure_sqlite(engine: Engine) -> None:
        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record):
            # pysqlite's own transaction handling is disabled so that BEGIN is ours to emit.
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        @event.listens_for(engine, "begin")
        def _begin(conn):
            mode = conn.get_execution_options().get("sqlite_begin", "DEFERRED")
            conn.exec_driver_sql(f"BEGIN {mode}")

    @contextlib.contextmanager
    def read(self) -> Iterator[Session]:
        # close() ends the transaction without expiring loaded objects (rollback() would).
        with self._sessions() as session:
            yield session

    @contextlib.contextmanager
    def write(self) -> Iterator[Session]:
        """A transaction that commits on success and rolls back on any exception."""
        session = self._sessions()
        if self.is_sqlite:
            session.connection(execution_options={"sqlite_begin": "IMMEDIATE"})
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise
        finally:
            session.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Connection]:
        """Like write(), for Core statements on a plain connection (the admission hot path)."""
        with self.engine.connect() as conn:
            if self.is_sqlite:
                conn = conn.execution_options(sqlite_begin="IMMEDIATE")
            with conn.begin():
                yield conn

    def migrate(self) -> None:
        from .migrate import upgrade_to_head

        upgrade_to_head(self.engine)

    def dispose(self) -> None:
        self.engine.dispose()
