"""Start operations run in batches (starts.Starts): one transaction for the batch's steps, the hosts asked,
one for the confirmations. Each start keeps its own cause, one whose host fails ends alone (its VM's
charge given back, or kept while its host can not say), and a batch transaction that fails runs again for
each start alone."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path

from sqlalchemy import select

from vmplane.hosts.drivers.simfabric import SimFabric
from vmplane.orchestrator import Orchestrator
from vmplane.store import Database, events
from vmplane.store.schema import Event, Operation

from .conftest import add_basics, add_sim_hosts, ledger_usage
from .stores import store_url
from .test_admission_batch import _failing
from .test_controllers import Held


def _plane(folder: Path, executor: Executor) -> Orchestrator:
    """Two sim hosts (spread), the basic offerings, project p."""
    db = Database(store_url(folder, migrated=True))
    db.migrate()
    o = Orchestrator(db, executor)
    o.load()
    o.catalog.create_zone("z1")
    o.catalog.create_cluster("c1", "z1")
    add_sim_hosts(o, 2, cores=8, memory_mib=65536)
    add_basics(o)
    o.catalog.set_setting("vmplane.placement.strategy", "spread", "cluster", "c1")
    o.catalog.create_project("p", 100, 1 << 20, 100)
    return o


def _cluster(folder: Path) -> tuple[Orchestrator, Held]:
    """The starts queue up in a Held executor until its run_all()."""
    held = Held()
    return _plane(folder, held), held


def _create(o: Orchestrator, names: list[str]) -> dict[str, str]:
    ops = {}
    for name in names:
        with events.acting_as(f"user {name}-owner"):
            ops[name] = o.create_vm(name, "p", "small", "tiny", start=True).operation_id
    return ops


def _log(o: Orchestrator, kind: str) -> list[tuple[str, str | None, str]]:
    with o.db.read() as s:
        return [
            tuple(r)
            for r in s.execute(
                select(Event.subject, Event.new_state, Event.cause).where(Event.kind == kind).order_by(Event.id)
            )
        ]


def test_queued_starts_run_as_one_batch_and_each_keeps_its_own_cause(tmp_path):
    o, held = _cluster(tmp_path)
    try:
        ops = _create(o, ["a1", "a2", "a3", "a4"])
        assert len(held.queue) == 1  # one drain for the four
        assert {v.name: v.state for v in o.vms()} == dict.fromkeys(ops, "starting")
        held.run_all()
        assert {v.name: v.state for v in o.vms()} == dict.fromkeys(ops, "running")
        assert {op: o.operation(op).state for op in ops.values()} == dict.fromkeys(ops.values(), "succeeded")
        fabric = SimFabric.for_store(o.db.url)
        assert sorted(d.name for h in ("h1", "h2") for d in fabric.domains(h)) == [f"vmplane-{n}" for n in ops]
        # every step is in the log before any confirmation: the batch's two transactions
        steps = [(s, c) for s, st, c in _log(o, "operation") if st == "running"]
        assert steps == [(ops[n], f"user {n}-owner") for n in ops]
        running = [(s, c) for s, st, c in _log(o, "vm") if st == "running"]
        assert running == [(n, f"user {n}-owner") for n in ops]
        states = [st for _, st, _ in _log(o, "operation") if st in ("running", "succeeded")]
        assert states == ["running"] * 4 + ["succeeded"] * 4
        ledger_usage(o, "p")
        assert o.audit() == []
    finally:
        o.close()


def test_a_start_whose_host_does_not_answer_ends_alone_and_stays_charged(tmp_path):
    o, held = _cluster(tmp_path)
    try:
        ops = _create(o, ["b1", "b2", "b3", "b4"])  # spread: b1, b3 on one host, b2, b4 on the other
        hosts = {v.name: v.host.name for v in o.vms()}
        down = hosts["b1"]
        SimFabric.for_store(o.db.url).fail_host(down, "daemon")
        held.run_all()
        states = {v.name: v.state for v in o.vms()}
        for name in ops:
            if hosts[name] == down:  # nobody can tell whether it runs: unknown, charged and claimed
                assert states[name] == "unknown" and o.operation(ops[name]).state == "failed"
            else:
                assert states[name] == "running" and o.operation(ops[name]).state == "succeeded"
        assert ledger_usage(o, "p").vms == 4
    finally:
        o.close()


def test_a_batch_whose_confirmation_fails_to_commit_confirms_each_start_alone(tmp_path, monkeypatch):
    o, held = _cluster(tmp_path)
    try:
        ops = _create(o, ["c1", "c2", "c3"])
        real = o.db.transaction
        calls = []

        def flaky():  # the second transaction (the batch's confirmations) fails at its commit
            calls.append(1)
            return _failing(real) if len(calls) == 2 else real()

        monkeypatch.setattr(o.db, "transaction", flaky)
        held.run_all()
        assert len(calls) == 5  # the steps; the confirmations (failed); each of the three again alone
        assert {v.name: v.state for v in o.vms()} == dict.fromkeys(ops, "running")
        assert {o.operation(op).state for op in ops.values()} == {"succeeded"}
        assert o.audit() == []
    finally:
        o.close()


def test_a_start_another_process_owns_is_not_run_here(tmp_path):
    o, held = _cluster(tmp_path)
    try:
        ops = _create(o, ["d1", "d2"])
        with o.db.transaction() as conn:  # d2's start was taken over by another process
            conn.execute(Operation.__table__.update().where(Operation.id == ops["d2"]).values(owner=10**6))
        held.run_all()
        assert o.operation(ops["d1"]).state == "succeeded"
        assert (o.operation(ops["d2"]).state, o.operation(ops["d2"]).step) == ("pending", "claimed")
        assert SimFabric.for_store(o.db.url).hosts_of("vmplane-d2") == []
    finally:
        o.close()


def test_a_start_queued_again_while_its_host_is_asked_runs_once(tmp_path):
    """A takeover can hand a process its own start back while the start's host is being asked: the start
    is not run a second time at once (it waits for the first run, which ends it)."""
    o, release, calls = _threaded(tmp_path)
    try:
        op = _create(o, ["e1"])["e1"]
        _wait(lambda: calls, "the host asked")
        o.starts.submit(op, "recovery")  # handed back while its host is being asked
        time.sleep(0.3)  # (a second run would ask the host now)
        release.set()
        _wait(lambda: o.operation(op).state == "succeeded", "the start ended")
        time.sleep(0.3)
        assert calls == ["vmplane-e1"]  # its host asked once
        assert [st for s, st, _ in _log(o, "operation") if s == op] == ["pending", "running", "succeeded"]
        assert o.audit() == []
    finally:
        release.set()
        o.close()
        o.db.dispose()


def test_a_late_failure_of_a_start_that_ended_changes_nothing(tmp_path):
    """A second run of a start (handed back by a takeover) that fails after the first one ended must not
    fail it again: no charge given back twice, no VM released under a later operation."""
    o, held = _cluster(tmp_path)
    try:
        op = _create(o, ["h1vm"])["h1vm"]
        held.run_all()
        before = (o.vm("h1vm").state, ledger_usage(o, "p"))
        o.ops.fail(op, RuntimeError("database is locked"))
        assert o.operation(op).state == "succeeded"
        assert (o.vm("h1vm").state, ledger_usage(o, "p")) == before
        assert o.audit() == []
    finally:
        o.close()


def test_a_failure_while_ending_one_start_leaves_the_others_of_its_batch_to_end(tmp_path, monkeypatch):
    o, held = _cluster(tmp_path)
    try:
        ops = _create(o, ["f1", "f2", "f3", "f4"])  # spread: f1, f3 on one host, f2, f4 on the other
        hosts = {v.name: v.host.name for v in o.vms()}
        SimFabric.for_store(o.db.url).fail_host(hosts["f1"], "daemon")
        real = o.ops.fail

        def fail(op_id, exc):
            if op_id == ops["f1"]:
                raise RuntimeError("database is locked")
            return real(op_id, exc)

        monkeypatch.setattr(o.ops, "fail", fail)
        held.run_all()
        states = {v.name: v.state for v in o.vms()}
        assert states["f1"] == "starting"  # left at its step (resumed at the next start-up)
        assert (states["f3"], o.operation(ops["f3"]).state) == ("unknown", "failed")
        assert states["f2"] == states["f4"] == "running"
    finally:
        o.close()


def _threaded(folder: Path) -> tuple[Orchestrator, threading.Event, list[str]]:
    """A cluster whose executor runs in threads, with sim drivers that behave as libvirt's (their calls
    wait on a daemon: blocking_calls); h1's starts wait until the event is set, and are listed."""
    o = _plane(folder, ThreadPoolExecutor(4))
    release, calls = threading.Event(), []
    for d in o.drivers.values():
        d.blocking_calls = True
    slow = o.drivers["h1"]
    real_start = slow.start

    def hung(spec):
        calls.append(spec.name)
        release.wait(30)
        return real_start(spec)

    slow.start = hung
    return o, release, calls


def _wait(ok, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.05)


def test_a_host_slow_to_start_holds_up_only_its_own_starts(tmp_path):
    """Hosts whose calls wait on a daemon (libvirt) are asked by a pool, each start confirmed alone: a hung
    host does not hold up the starts on the others (sim drivers made to behave so)."""
    o, release, _ = _threaded(tmp_path)
    try:
        ops = _create(o, ["g1", "g2", "g3", "g4"])
        on_h1 = [v.name for v in o.vms() if v.host.name == "h1"]
        others = [n for n in ops if n not in on_h1]
        _wait(lambda: {o.vm(n).state for n in others} == {"running"}, "the starts on h2")
        assert {o.vm(n).state for n in on_h1} == {"starting"}
        release.set()
        _wait(lambda: {v.state for v in o.vms()} == {"running"}, "the starts on h1")
        assert o.audit() == []
    finally:
        release.set()
        o.close()
        o.db.dispose()
