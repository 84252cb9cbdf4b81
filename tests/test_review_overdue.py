"""Review 2026-12-02, N5: an operation whose failure path meets the same database outage is settled by its
own process past `vmplane.operation.deadline` (retried with backoff until it lands); until then `audit`
names it with what clears it. Each test fails without its fix."""

from __future__ import annotations

import contextlib
import datetime as dt
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy.exc import OperationalError

from vmplane.core import failpoints
from vmplane.core.model import Offering, OfferingKind
from vmplane.orchestrator import Orchestrator
from vmplane.plane.overdue import InFlight, backoff, overdue
from vmplane.store import ledger as L

from .conftest import add_sim_hosts
from .test_ha_sim import wait_for

OUTAGE_S = 2.0


@pytest.fixture
def plane(db):
    o = Orchestrator(db, ThreadPoolExecutor(4, thread_name_prefix="test-op"))
    o.load()
    o.catalog.create_zone("z1")
    o.catalog.create_cluster("c1", "z1")
    add_sim_hosts(o, 2, cores=4, memory_mib=8192)
    o.catalog.create_offering(Offering("one", OfferingKind.fixed, vcpus=1, memory_mib=1024))
    o.catalog.create_template("t", "tiny-linux")
    o.catalog.create_project("p", 8, 16384, 10)
    o.catalog.set_setting("vmplane.operation.deadline", "1")
    o.catalog.set_setting("vmplane.vm.shutdown.timeout", "0")
    yield o
    o.close()


def _outage_from_stop_after_domain(o, monkeypatch) -> threading.Event:
    """Every transaction raises OperationalError for OUTAGE_S, from the stop's point `stop.after-domain`
    (its domain is gone there; its release not yet written). Returns an event set when the outage ends."""
    until = [None]
    over = threading.Event()
    transaction, hit = o.db.transaction, failpoints.hit

    @contextlib.contextmanager
    def failing_transaction(*args, **kwargs):
        if until[0] is not None:
            if time.monotonic() < until[0]:
                raise OperationalError("BEGIN", {}, Exception("the database system is shutting down"))
            over.set()
        with transaction(*args, **kwargs) as conn:
            yield conn

    def point(name):
        if name == "stop.after-domain" and until[0] is None:
            until[0] = time.monotonic() + OUTAGE_S
        hit(name)

    monkeypatch.setattr(o.db, "transaction", failing_transaction)
    monkeypatch.setattr(failpoints, "hit", point)
    return over


def _stop_meets_the_outage(o, monkeypatch) -> str:
    o.create_vm("v", "p", "one", "t", start=True)
    wait_for(lambda: o.vm("v").state == "running", 10, "v to run")
    over = _outage_from_stop_after_domain(o, monkeypatch)
    op_id = o.stop_vm("v").operation_id
    wait_for(over.is_set, 30, "the outage to end")
    return op_id


def _op(o, op_id):
    with o.db.read() as s:
        return L.operation_row(s.connection(), op_id)


def test_a_stop_whose_failure_path_met_the_outage_ends_stopped(plane, monkeypatch):
    o = plane
    op_id = _stop_meets_the_outage(o, monkeypatch)
    o.overdue.start()  # as every process runs it (start_monitor)
    wait_for(lambda: o.vm("v").state == "stopped", 60, "the stop to end")
    assert _op(o, op_id).state == "failed" and "past its deadline" in _op(o, op_id).message
    assert o.vm("v").host is None and o.project_usage("p")["ledger"].vcpus == 0
    assert o.audit() == []


def test_audit_names_an_operation_left_in_flight_until_it_is_settled(plane, monkeypatch):
    o = plane
    op_id = _stop_meets_the_outage(o, monkeypatch)
    assert o.vm("v").state == "stopping" and _op(o, op_id).state == "running"
    wait_for(lambda: any(op_id in p for p in o.audit()), 30, "the audit to name the operation")
    found = [p for p in o.audit() if op_id in p]
    assert "stop of v" in found[0] and "vmplane controllers" in found[0], found
    assert o.overdue.run_once() == [op_id]
    assert o.vm("v").state == "stopped" and o.audit() == []


def test_overdue_is_the_uncarried_past_their_deadline():
    now = dt.datetime(2026, 12, 2, 12, 0, 0)
    ops = [
        InFlight("a", "stop", "v", "stopping-domain", now - dt.timedelta(seconds=10), 1),
        InFlight("b", "stop", "w", "stopping-domain", now - dt.timedelta(seconds=2), 1),
        InFlight("c", "scale", "x", "resizing", now - dt.timedelta(seconds=60), 1),
    ]
    assert [op.id for op in overdue(ops, now, 5, frozenset({"c"}))] == ["a"]
    assert [backoff(n) for n in range(8)] == [1, 2, 5, 10, 30, 60, 60, 60]
