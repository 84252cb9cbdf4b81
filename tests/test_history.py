"""Retention and indexes of the history tables: `vmplane.operation.history` is enforced (the oldest
finished operations go, in batches, with the events' prune; operations in flight never), and the event
log is indexed by (kind, subject), which finding an operation's cause searches by."""

from __future__ import annotations

import pytest

from vmplane.core.model import Offering, OfferingKind
from vmplane.store import events
from vmplane.store import ledger as L

from .conftest import add_sim_hosts


@pytest.fixture
def cloud(orch):
    add_sim_hosts(orch, 2, cores=16, memory_mib=65536)
    orch.catalog.create_offering(Offering("o", OfferingKind.fixed, vcpus=1, memory_mib=512))
    orch.catalog.create_template("t", "tiny-linux")
    orch.catalog.create_project("a", 32, 65536, 30)
    return orch


def test_finished_operations_beyond_the_setting_are_pruned_and_in_flight_ones_kept(cloud, monkeypatch):
    o = cloud
    o.catalog.set_setting("vmplane.operation.history", 3)
    with o.db.transaction() as conn:  # an operation in flight, older than all the others
        pending = L.new_operation(conn, "start", "ghost", None, None, step="admitted")
    monkeypatch.setattr(events, "PRUNE_EVERY", 1)
    for name in ("r1", "r2", "r3", "r4"):
        o.create_vm(name, "a", "o", "t", start=True)
        o.stop_vm(name)
    ops = o.operations(limit=100)
    finished = [op for op in ops if op.state not in ("pending", "running")]
    assert len(finished) == 3
    assert [(op.kind, op.target) for op in finished] == [("stop", "r4"), ("start", "r4"), ("stop", "r3")]
    assert pending in {op.id for op in ops}  # in flight: never pruned


def test_operation_prune_goes_in_batches_and_zero_keeps_none(cloud, monkeypatch):
    o = cloud
    for name in ("r1", "r2", "r3"):
        o.create_vm(name, "a", "o", "t", start=True)
    assert len(o.operations()) == 3
    monkeypatch.setattr(events, "PRUNE_BATCH", 2)
    with o.db.transaction() as conn:
        assert events.prune_operations(conn, keep=0) == 2
        assert events.prune_operations(conn, keep=0) == 1
        assert events.prune_operations(conn, keep=0) == 0
    assert o.operations() == []


def test_the_default_keeps_ten_thousand(cloud):
    o = cloud
    o.create_vm("r1", "a", "o", "t", start=True)
    with o.db.transaction() as conn:
        assert events.history_limit(conn, events.OPERATION_HISTORY_KEY) == 10000
        assert events.prune_operations(conn) == 0
    assert len(o.operations()) == 1


def test_finding_a_cause_by_kind_and_subject_uses_the_index(cloud):
    o = cloud
    if not o.db.is_sqlite:
        pytest.skip("the plan is read with SQLite's EXPLAIN QUERY PLAN")
    stmt = events._CAUSE.params(kind="operation", subject="x").compile(
        o.db.engine, compile_kwargs={"literal_binds": True}
    )
    with o.db.engine.connect() as conn:
        plan = conn.exec_driver_sql("EXPLAIN QUERY PLAN " + str(stmt).replace("%", "%%")).all()
    assert any("ix_events_kind_subject" in str(row) for row in plan), plan
    with o.db.engine.begin() as conn:  # without the index: a scan (the test can fail)
        conn.exec_driver_sql("DROP INDEX ix_events_kind_subject")
    o.db.engine.dispose()
    with o.db.engine.connect() as conn:
        plan = conn.exec_driver_sql("EXPLAIN QUERY PLAN " + str(stmt).replace("%", "%%")).all()
    assert not any("ix_events_kind_subject" in str(row) for row in plan), plan


def test_operation_prune_on_each_store(db_url):
    from vmplane.orchestrator import InlineExecutor, Orchestrator
    from vmplane.store import Database

    db = Database(db_url)
    db.migrate()
    o = Orchestrator(db, InlineExecutor())
    try:
        o.load()
        o.catalog.create_zone("z1")
        o.catalog.create_cluster("c1", "z1")
        add_sim_hosts(o, 1)
        o.catalog.create_offering(Offering("o", OfferingKind.fixed, vcpus=1, memory_mib=512))
        o.catalog.create_template("t", "tiny-linux")
        o.catalog.create_project("a", 32, 65536, 30)
        for name in ("r1", "r2", "r3"):
            o.create_vm(name, "a", "o", "t", start=True)
        with o.db.transaction() as conn:
            assert events.prune_operations(conn, keep=1) == 2
        assert [op.target for op in o.operations()] == ["r3"]
    finally:
        o.close()
        db.dispose()
