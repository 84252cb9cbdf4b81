"""Prepared statements: Core statements compiled once for the engine's dialect, run on the DBAPI connection.

Writes (PreparedWrite, `write(conn, stmt, params)`): the inserts and updates of the hottest paths (an
admission writes its ledger, host, operation, claim and two events; every state change an event), run
on the DBAPI connection under `conn`, inside its transaction: through the SQLAlchemy Connection each
cost ~4-5x the statement itself (~65 us against ~15 us on SQLite, measured). The column types' bind
processors still run (SQLite's datetimes, JSON). An insert must name every column that has a Python-side
default, and an update every column that has an `onupdate` (those are SQLAlchemy's to fill, not the
database's): refused when it is prepared.

Reads (PreparedRead):
For the reads every API request makes (its token, GET /vms/{name}). Through a SQLAlchemy Connection
each costs ~4x the query itself on SQLite (the connection wrapper, the BEGIN our `begin` listener
emits, result set-up, the rollback at close); here it is a pool checkout, one cursor execute and the
column types' own result processors (SQLite's text times to datetimes, 0/1 to booleans). One
statement, no transaction of its own: on SQLite it reads in autocommit; on PostgreSQL the driver's
implicit transaction ends when the pool resets the connection (rollback), as for any checkout.
Parameters are passed as they are (no bind processors): strings and integers only.
"""

from __future__ import annotations

import collections
import operator
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

from sqlalchemy import Insert, Select
from sqlalchemy.engine import Connection, Dialect, Engine, Row
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql import TableClause
from sqlalchemy.sql.dml import UpdateBase


def as_sqlalchemy_error(dialect: Dialect, sql: str, args: Any, exc: Exception) -> DBAPIError:
    """The driver's error `exc` as SQLAlchemy raises it (IntegrityError, OperationalError...): callers catch
    those, and a deadlock's or serialization failure's sqlstate is read from them (admission retries, API 409)."""
    error = DBAPIError.instance(sql, args, exc, dialect.loaded_dbapi.Error, dialect=dialect)
    assert isinstance(error, DBAPIError)  # (instance() wraps a DBAPI error: `exc` is one)
    return error


_cache: weakref.WeakKeyDictionary[Engine, dict[Select[Any], PreparedRead]] = weakref.WeakKeyDictionary()


class PreparedRead:
    def __init__(self, engine: Engine, stmt: Select[Any]):
        dialect = engine.dialect
        compiled = stmt.compile(dialect=dialect)
        self.engine = engine
        self.sql = str(compiled)
        self.positions = tuple(compiled.positiontup or ()) if compiled.positional else None
        self.keys = tuple(stmt.selected_columns.keys())
        self._types = tuple(col.type.dialect_impl(dialect) for col in stmt.selected_columns)
        self.processors: tuple[Any, ...] | None = None  # by the driver's type codes, at the first execution
        self._processed: tuple[Any, ...] = ()  # (column, processor) of the columns that have one
        self._args = _getter(self.positions)
        self.tuple_type = _row_type(self.keys)  # (row_in)

    def first(self, **params: Any) -> dict[str, Any] | None:
        """The first row as {column: value}, or None."""
        conn = self.engine.raw_connection()
        try:
            return self._first(conn, params)
        finally:
            conn.close()  # back to the pool (which resets it)

    def first_in(self, conn: Connection, **params: Any) -> dict[str, Any] | None:
        """first(), inside `conn`'s transaction (on its DBAPI connection: no checkout of its own)."""
        return self._first(conn.connection, params)

    def row_in(self, conn: Connection, **params: Any) -> Row[Any] | None:
        """first_in(), as a named tuple (its columns as attributes, as SQLAlchemy's rows have them)."""
        rows = self._fetch(conn.connection, params, one=True)
        # (typed as the Row it stands in for: its readers use attributes and indexes only)
        return cast("Row[Any]", self.tuple_type(*rows[0])) if rows else None

    def all_in(self, conn: Connection, **params: Any) -> list[Row[Any]]:
        """Every row, as named tuples (as row_in), inside `conn`'s transaction."""
        rows = [self.tuple_type(*row) for row in self._fetch(conn.connection, params, one=False)]
        return cast("list[Row[Any]]", rows)  # (as row_in)

    def _first(self, dbapi_conn: DBAPIConnection, params: dict[str, Any]) -> dict[str, Any] | None:
        rows = self._fetch(dbapi_conn, params, one=True)
        return dict(zip(self.keys, rows[0])) if rows else None

    def _fetch(self, dbapi_conn: DBAPIConnection, params: dict[str, Any], one: bool) -> Sequence[tuple[Any, ...]]:
        args = self._args(params)
        cursor = dbapi_conn.cursor()
        try:
            cursor.execute(self.sql, args)
            if self.processors is None:  # (as SQLAlchemy does: PostgreSQL's numerics depend on the type code)
                dialect = self.engine.dialect
                processors = tuple(t.result_processor(dialect, d[1]) for t, d in zip(self._types, cursor.description))
                # _processed first: a thread that finds `processors` set must find it set too
                self._processed = tuple((i, p) for i, p in enumerate(processors) if p is not None)
                self.processors = processors
            rows = ([row] if (row := cursor.fetchone()) is not None else []) if one else cursor.fetchall()
        except self.engine.dialect.loaded_dbapi.Error as exc:
            raise as_sqlalchemy_error(self.engine.dialect, self.sql, args, exc) from exc
        finally:
            cursor.close()
        if not self._processed:
            return rows
        processed = []
        for row in rows:
            row = list(row)
            for i, proc in self._processed:
                if row[i] is not None:
                    row[i] = proc(row[i])
            processed.append(tuple(row))
        return processed


def _row_type(keys: tuple[str, ...]) -> Callable[..., tuple[Any, ...]]:
    """A named tuple of the statement's columns (renamed where a name is no identifier)."""
    return collections.namedtuple("Row", keys, rename=True)


def _getter(positions: tuple[str, ...] | None) -> Callable[[dict[str, Any]], Any]:
    """The statement's arguments from a dict of parameters: a tuple in `positions` order (qmark and
    format styles), else the dict itself (named styles)."""
    if positions is None:
        return lambda params: params
    if not positions:
        return lambda params: ()
    if len(positions) == 1:
        name = positions[0]
        return lambda params: (params[name],)
    return operator.itemgetter(*positions)


def prepared(engine: Engine, stmt: Select[Any]) -> PreparedRead:
    """`stmt` prepared for `engine`, once per engine."""
    by_stmt = _cache.get(engine)
    if by_stmt is None:
        by_stmt = _cache[engine] = {}
    read = by_stmt.get(stmt)
    if read is None:
        read = by_stmt[stmt] = PreparedRead(engine, stmt)
    return read


class PreparedWrite:
    def __init__(self, dialect: Dialect, stmt: UpdateBase, keys: frozenset[str]):
        if isinstance(stmt, Insert):
            missing = sorted(c.name for c in stmt.table.columns if c.default is not None and c.name not in keys)
            if missing:
                raise ValueError(
                    f"a prepared insert into {stmt.table.name} must set {', '.join(missing)} "
                    f"(their defaults are filled by SQLAlchemy, not the database)"
                )
        else:
            assert isinstance(stmt.table, TableClause)  # (an update of one table, never of a join)
            missing = sorted(c.name for c in stmt.table.columns if c.onupdate is not None and c.name not in keys)
            if missing:
                raise ValueError(
                    f"a prepared update of {stmt.table.name} must set {', '.join(missing)} (set on "
                    f"update by SQLAlchemy, not the database)"
                )
        compiled = stmt.compile(dialect=dialect, column_keys=sorted(keys) if isinstance(stmt, Insert) else None)
        self.sql = str(compiled)
        self.positions = tuple(compiled.positiontup or ()) if compiled.positional else None
        binds = compiled.binds
        self.fixed = {name: b.value for name, b in binds.items() if not b.required}  # literals of the statement
        self.processors = {
            name: processor
            for name, b in binds.items()
            if (processor := b.type.dialect_impl(dialect).bind_processor(dialect)) is not None
        }
        self._args = _getter(self.positions)

    def _bound(self, params: dict[str, Any]) -> Any:
        """The statement's arguments: its literals and `params`, through the column types' bind processors."""
        values = {**self.fixed, **params}
        for name, processor in self.processors.items():
            if name in values:  # None too, as SQLAlchemy does (JSON writes it as 'null')
                values[name] = processor(values[name])
        return self._args(values)

    def run_many(self, conn: Connection, rows: list[dict[str, Any]]) -> None:
        """run() for each of `rows` (all with the same keys) as one executemany: one statement's overhead."""
        args = [self._bound(params) for params in rows]
        cursor = conn.connection.cursor()
        try:
            cursor.executemany(self.sql, args)
        except conn.dialect.loaded_dbapi.Error as exc:
            raise as_sqlalchemy_error(conn.dialect, self.sql, args[0], exc) from exc
        finally:
            cursor.close()

    def run(self, conn: Connection, params: dict[str, Any], new_id: bool = False) -> int:
        """Execute inside `conn`'s transaction; the number of rows it changed, or with `new_id` (an insert
        prepared with its primary key returned, see insert_for_id) the new row's id."""
        args = self._bound(params)
        cursor = conn.connection.cursor()
        try:
            cursor.execute(self.sql, args)
            if not new_id:
                return cursor.rowcount
            if conn.dialect.name == "sqlite":
                return cursor.lastrowid
            returned = cursor.fetchone()
            assert returned is not None  # (RETURNING of a one-row insert)
            key: int = returned[0]
            return key
        except conn.dialect.loaded_dbapi.Error as exc:
            raise as_sqlalchemy_error(conn.dialect, self.sql, args, exc) from exc
        finally:
            cursor.close()


_writes: dict[tuple[str, UpdateBase, frozenset[str], bool], PreparedWrite] = {}


def insert_for_id(conn: Connection, stmt: Insert, params: dict[str, Any]) -> int:
    """write() of a one-row insert; the new row's primary key (SQLite's lastrowid, else RETURNING)."""
    key = (conn.dialect.name, stmt, frozenset(params), True)
    prepared_write = _writes.get(key)
    if prepared_write is None:
        returning = stmt if conn.dialect.name == "sqlite" else stmt.returning(*stmt.table.primary_key)
        prepared_write = _writes[key] = PreparedWrite(conn.dialect, returning, key[2])
    return prepared_write.run(conn, params, new_id=True)


def _prepared_write(conn: Connection, stmt: UpdateBase, params: dict[str, Any]) -> PreparedWrite:
    key = (conn.dialect.name, stmt, frozenset(params), False)
    prepared_write = _writes.get(key)
    if prepared_write is None:
        prepared_write = _writes[key] = PreparedWrite(conn.dialect, stmt, key[2])
    return prepared_write


def write(conn: Connection, stmt: UpdateBase, params: dict[str, Any]) -> int:
    """`stmt` with `params` in `conn`'s transaction, prepared once per dialect and set of parameters; the
    number of rows it changed (the rowcount)."""
    return _prepared_write(conn, stmt, params).run(conn, params)


def write_many(conn: Connection, stmt: UpdateBase, rows: list[dict[str, Any]]) -> None:
    """write() of each of `rows` (all with the same keys), as one executemany."""
    if rows:
        _prepared_write(conn, stmt, rows[0]).run_many(conn, rows)


_MEMO = "vmplane_transaction_memo"


def once_per_transaction(conn: Connection, key: Any, read: Callable[[], Any]) -> Any:
    """read() the first time `key` is asked in `conn`'s transaction, its result after that: for the reads an
    admission batch repeats for each of its requests (zones and clusters, an offering's row), whose answer
    can not change inside the transaction that already read it but by its own writes. Kept on the DBAPI
    connection's info, tagged with the transaction (a later transaction starts afresh)."""
    transaction = conn.get_transaction()
    memo = conn.info.get(_MEMO)
    if memo is None or memo[0] is not transaction:
        memo = conn.info[_MEMO] = (transaction, {})
    if key not in memo[1]:
        memo[1][key] = read()
    return memo[1][key]
