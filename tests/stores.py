"""Where a test's store lives: `pytest --db sqlite` (the default) a SQLite file in the test's folder,
`pytest --db postgresql` a fresh database on this process's PostgreSQL server (one server per pytest
process, so per pytest-xdist worker: its own folder and socket; started at the first store, stopped at the
end of the session).

Every test or helper that makes a store gets its URL from `store_url(folder)`; `sim_hosts_env(folder)` is
the environment a control plane in another process (or a forked one, or one restarted after
`simfabric.forget_shared()`) needs for its sim hosts to be the same as this process's: on SQLite they are
in a file beside the store; on PostgreSQL they would be in process memory, so `VMPLANE_SIM_HOSTS` names a
file in the test's folder."""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

KINDS = ("sqlite", "postgresql")
kind = "sqlite"  # set by conftest from --db

_server = None
_admin = None
_numbers = itertools.count(1)
_created: list[str] = []  # databases made so far, in order (conftest drops a test's own after it)


def is_postgres() -> bool:
    return kind == "postgresql"


def server():
    """This process's PostgreSQL server (started at the first call), or a pytest skip that says why there
    is none."""
    global _server
    if _server is None:
        import pytest

        from .pg import Postgres, unavailable_reason

        reason = unavailable_reason()
        if reason:
            pytest.skip(reason)
        _server = Postgres().start()
        atexit.register(stop)  # (also when pytest_unconfigure is not reached)
    return _server


def _admin_conn():
    global _admin
    if _admin is None or _admin.closed:
        import psycopg

        s = server()
        _admin = psycopg.connect(host=s.sock, port=s.port, user=s.user, dbname="postgres", autocommit=True)
    return _admin


_MIGRATED = "migrated_template"
_migrated_ready = False


def _url(name: str) -> str:
    s = server()
    return f"postgresql+psycopg://{s.user}@/{name}?host={s.sock}&port={s.port}"


def _migrated_template() -> str:
    """A database migrated to head once per process: a copy of it is a migrated store at once (running the
    migrations on PostgreSQL takes a second or two per store)."""
    global _migrated_ready
    if not _migrated_ready:
        from vmplane.store import Database

        _admin_conn().execute(f'DROP DATABASE IF EXISTS "{_MIGRATED}"')
        _admin_conn().execute(f'CREATE DATABASE "{_MIGRATED}"')
        db = Database(_url(_MIGRATED))
        try:
            db.migrate()
        finally:
            db.dispose()
        _migrated_ready = True
    return _MIGRATED


def postgres_url(migrated: bool = False) -> str:
    """A fresh database on this process's server (unique by worker and number): empty, or with `migrated`
    already at the schema's head."""
    server()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    name = f"t_{worker}_{next(_numbers)}"
    template = f' TEMPLATE "{_migrated_template()}"' if migrated else ""
    if _admin_conn().info.server_version >= 150000:
        template += " STRATEGY FILE_COPY"  # (a copy of the files, no fsync: twice as fast as WAL_LOG)
    _admin_conn().execute(f'CREATE DATABASE "{name}"{template}')
    _created.append(name)
    return _url(name)


def store_url(folder: Path | str, name: str = "vmplane.db", migrated: bool = False) -> str:
    """The URL of a new store for a test: `folder/name` on SQLite, a fresh database on PostgreSQL; with
    `migrated`, already at the schema's head (its `migrate()` has nothing to do): on SQLite a copy of a file
    this process migrated once (every migration run for every test cost ~0.25 s of the suite's fixtures)."""
    if is_postgres():
        return postgres_url(migrated)
    path = Path(folder) / name
    if migrated and not path.exists():
        shutil.copyfile(_sqlite_template(), path)
    return f"sqlite:///{path}"


_SQLITE_TEMPLATE: Path | None = None


def _sqlite_template() -> Path:
    """A SQLite store this process migrated to the head once (removed at exit)."""
    global _SQLITE_TEMPLATE
    if _SQLITE_TEMPLATE is None:
        from vmplane.store import Database

        folder = Path(tempfile.mkdtemp(prefix="vmplane-template-"))
        atexit.register(shutil.rmtree, folder, True)
        database = Database(f"sqlite:///{folder / 'migrated.db'}")
        database.migrate()
        database.dispose()
        _SQLITE_TEMPLATE = folder / "migrated.db"
    return _SQLITE_TEMPLATE


def sim_hosts_file(folder: Path | str, name: str = "vmplane.db") -> Path | None:
    """On PostgreSQL, the file that holds the sim hosts of the store made for `folder/name`; None on SQLite
    (they are beside the store file)."""
    return Path(folder) / f"{name}.sim-hosts" if is_postgres() else None


@contextlib.contextmanager
def sim_hosts_env(folder: Path | str, name: str = "vmplane.db") -> Iterator[None]:
    """Within: `VMPLANE_SIM_HOSTS` set (on PostgreSQL) so that this process, its forks and its
    subprocesses share one sim fabric file, as they do beside a SQLite store."""
    with env("VMPLANE_SIM_HOSTS", sim_hosts_file(folder, name)):
        yield


@contextlib.contextmanager
def env(name: str, value) -> Iterator[None]:
    """Within: the environment variable `name` set to `value` (None: left as it is)."""
    if value is None:
        yield
        return
    old = os.environ.get(name)
    os.environ[name] = str(value)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def mark() -> int:
    return len(_created)


def drop_since(mark_: int) -> None:
    """Drop the databases made since `mark_` (a test's own; WITH (FORCE) ends connections it left open)."""
    if _server is None:
        return
    names = _created[mark_:]
    del _created[mark_:]
    for name in names:
        with contextlib.suppress(Exception):
            _admin_conn().execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def stop() -> None:
    global _server, _admin
    if _admin is not None:
        with contextlib.suppress(Exception):
            _admin.close()
        _admin = None
    if _server is not None:
        _server.stop()
        _server = None
