"""Prepared writes (store/prepared.py) write exactly what the same statement through SQLAlchemy writes:
the rows compared column by column, types included (datetimes, JSON, booleans), on each store
(`pytest --db postgresql` runs this file on PostgreSQL)."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import insert, select, update

from vmplane.store import prepared
from vmplane.store.schema import Event, Operation, Project, Vm

EVENTS, OPERATIONS, PROJECTS = Event.__table__, Operation.__table__, Project.__table__


def _project(conn, name: str) -> int:
    return conn.execute(
        insert(PROJECTS).values(
            name=name,
            quota_vcpus=10,
            quota_memory_mib=1000,
            quota_vms=5,
            quota_storage_mib=0,
            used_vcpus=1,
            used_memory_mib=2,
            used_vms=3,
            used_storage_mib=4,
        )
    ).inserted_primary_key[0]


def _rows(conn, table, key, values) -> list[dict]:
    return [dict(r._mapping) for r in conn.execute(select(table).where(key.in_(values)).order_by(key))]


def test_an_insert_writes_the_same_row_as_sqlalchemy(db):
    at = dt.datetime(2026, 12, 1, 9, 30, 15, 123456)
    with db.transaction() as conn:
        through_sqlalchemy, prepared_write = (
            (lambda stmt, p: conn.execute(stmt, p)),
            (lambda stmt, p: prepared.write(conn, stmt, p)),
        )
        for i, write in enumerate((through_sqlalchemy, prepared_write)):
            write(
                insert(EVENTS),
                {
                    "at": at,
                    "kind": "vm",
                    "subject": f"s{i}",
                    "project_id": None,
                    "vm": "v",
                    "host": None,
                    "old_state": None,
                    "new_state": "running",
                    "cause": "c",
                    "message": "é ünïcode",
                },
            )
            write(
                insert(OPERATIONS),
                {
                    "id": f"op-{i}",
                    "kind": "start",
                    "target": "v",
                    "vm_id": None,
                    "project_id": None,
                    "state": "pending",
                    "step": "claimed",
                    "progress": 10,
                    "message": "m",
                    "result": {"host": "h1", "n": [1, 2]} if i < 2 else None,
                    "created_at": at,
                    "updated_at": at,
                    "owner": None,
                },
            )
            write(
                insert(OPERATIONS),
                {
                    "id": f"none-{i}",
                    "kind": "start",
                    "target": "v",
                    "vm_id": None,
                    "project_id": None,
                    "state": "pending",
                    "step": "claimed",
                    "progress": 10,
                    "message": "m",
                    "result": None,
                    "created_at": at,
                    "updated_at": at,
                    "owner": 7,
                },
            )
    with db.transaction() as conn:
        by_sqlalchemy, by_prepared = (_rows(conn, EVENTS, EVENTS.c.subject, [f"s{i}"]) for i in (0, 1))
        assert by_prepared[0]["at"] == at and by_prepared[0]["message"] == "é ünïcode"
        assert {k: v for k, v in by_sqlalchemy[0].items() if k not in ("id", "subject")} == {
            k: v for k, v in by_prepared[0].items() if k not in ("id", "subject")
        }
        for prefix in ("op-", "none-"):
            a, b = (_rows(conn, OPERATIONS, OPERATIONS.c.id, [f"{prefix}{i}"])[0] for i in (0, 1))
            assert {k: v for k, v in a.items() if k != "id"} == {k: v for k, v in b.items() if k != "id"}
        assert _rows(conn, OPERATIONS, OPERATIONS.c.id, ["op-1"])[0]["result"] == {"host": "h1", "n": [1, 2]}
        # a JSON None is stored as SQLAlchemy stores it (JSON null, not SQL NULL): the same query finds both
        nulls = conn.execute(select(OPERATIONS.c.id).where(OPERATIONS.c.result.is_(None))).scalars().all()
        assert ("none-0" in nulls) == ("none-1" in nulls)


def test_an_update_changes_the_same_rows_and_says_how_many(db):
    stmt = (
        update(PROJECTS)
        .where(PROJECTS.c.name == "p", PROJECTS.c.used_vcpus + 5 <= PROJECTS.c.quota_vcpus)
        .values(used_vcpus=PROJECTS.c.used_vcpus + 5)
    )
    with db.transaction() as conn:
        _project(conn, "p")
        assert prepared.write(conn, stmt, {}) == 1  # 1 + 5 <= 10
        assert prepared.write(conn, stmt, {}) == 0  # 6 + 5 > 10: a literal of the statement kept
    with db.transaction() as conn:
        assert conn.execute(select(PROJECTS.c.used_vcpus).where(PROJECTS.c.name == "p")).scalar() == 6


def test_a_write_that_would_lose_a_default_is_refused_when_prepared(db):
    with db.transaction() as conn:
        with pytest.raises(ValueError, match="must set at, message"):
            prepared.write(conn, insert(EVENTS), {"kind": "vm", "subject": "s", "cause": "c"})
        with pytest.raises(ValueError, match="must set updated_at"):
            prepared.write(conn, update(Vm.__table__).values(state="running"), {})


def test_an_operations_update_binds_by_the_columns_types(db):
    """ledger.set_operation writes through a prepared update: its JSON result and its time are bound as
    SQLAlchemy binds them (read back equal through SQLAlchemy), and its state change is an event."""
    from vmplane.store import ledger as L

    at = dt.datetime(2026, 12, 1, 9, 30, 15, 250000)
    with db.transaction() as conn:
        prepared.write(
            conn,
            insert(OPERATIONS),
            {
                "id": "op-u",
                "kind": "start",
                "target": "v",
                "vm_id": None,
                "project_id": None,
                "state": "pending",
                "step": "claimed",
                "progress": 10,
                "message": "m",
                "result": None,
                "created_at": at,
                "updated_at": at,
                "owner": None,
            },
        )
        L.set_operation(conn, "op-u", state="running", result={"host": "h1", "sizes": [1, 2]}, progress=30)
    with db.transaction() as conn:
        row = L.operation_row(conn, "op-u")
        kinds = conn.execute(select(EVENTS.c.old_state, EVENTS.c.new_state).where(EVENTS.c.subject == "op-u")).all()
    assert (row.state, row.progress, row.result) == ("running", 30, {"host": "h1", "sizes": [1, 2]})
    assert isinstance(row.updated_at, dt.datetime) and row.updated_at > at
    assert [tuple(k) for k in kinds] == [("pending", "running")]


def test_a_prepared_write_rolls_back_with_its_transaction(db):
    with pytest.raises(RuntimeError), db.transaction() as conn:
        _project(conn, "q")
        prepared.write(conn, update(PROJECTS).where(PROJECTS.c.name == "q").values(used_vms=5), {})
        raise RuntimeError("the caller fails after the write")
    with db.transaction() as conn:
        assert conn.execute(select(PROJECTS.c.id).where(PROJECTS.c.name == "q")).first() is None


def test_a_prepared_write_that_the_database_refuses_raises_as_sqlalchemy_would(db):
    """Callers catch SQLAlchemy's errors (a duplicate as IntegrityError; a deadlock's sqlstate, read from
    OperationalError, is retried by admissions and answered 409 by the API): a prepared write raises the same."""
    from sqlalchemy.exc import IntegrityError

    at = dt.datetime(2026, 12, 1, 9, 30)
    row = {
        "id": "op-1",
        "kind": "start",
        "target": "v",
        "vm_id": None,
        "project_id": None,
        "state": "pending",
        "step": "claimed",
        "progress": 10,
        "message": "m",
        "result": None,
        "created_at": at,
        "updated_at": at,
        "owner": None,
    }
    with pytest.raises(IntegrityError) as refused, db.transaction() as conn:
        prepared.write(conn, insert(OPERATIONS), row)
        prepared.write(conn, insert(OPERATIONS), row)
    assert type(refused.value.orig).__name__ in ("IntegrityError", "UniqueViolation")  # the driver's own, kept
