"""Several control planes on one store (controllers.py, ownership.py): leases shared out, a paused owner
fenced, its work taken over once its lease lapsed. In one test process, each control plane with a
name of its own (as `vmplane serve --name`); tests/test_multiprocess.py does the same with processes.
How soon a takeover comes (about two lease periods) is measured by bench/timing.py, not asserted here."""

import threading
import time
from concurrent.futures import Executor

import pytest
from sqlalchemy import create_engine, func, select, update

from vmplane.orchestrator import InlineExecutor, Orchestrator
from vmplane.plane.membership import CONTROLLERS, mark_lapsed
from vmplane.store import Database, ownership
from vmplane.store import ledger as L
from vmplane.store.events import EVENTS, record

from . import stores
from .conftest import add_basics, add_sim_hosts, ledger_usage, store_url
from .rowlocks import Probe

LEASE_S = 2.0  # beats every 0.67 s; a lapse needs a renewal late by 1.3 s
WAIT_S = 60.0  # a bounded wait for what comes within a few lease periods (a loaded machine is slow)


def wait_for(predicate, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"still waiting after {timeout_s:g} s for {what}"
        time.sleep(0.05)


class Held(Executor):
    """Operations wait here until released: a process paused right after it admitted them."""

    def __init__(self):
        self.queue = []

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[override]
        self.queue.append((fn, args, kwargs))

    def run_all(self) -> None:
        while self.queue:
            fn, args, kwargs = self.queue.pop(0)
            fn(*args, **kwargs)


def plane(url: str, name: str, executor: Executor | None = None) -> Orchestrator:
    db = Database(url)
    db.migrate()
    o = Orchestrator(db, executor or InlineExecutor(), name=name, lease_s=LEASE_S)
    o.load()
    return o


@pytest.fixture
def two(tmp_path):
    url = store_url(tmp_path, "two.db")
    held = Held()
    a = plane(url, "a", held)
    a.catalog.create_zone("z1")
    a.catalog.create_cluster("c1", "z1")
    add_sim_hosts(a, 6)
    add_basics(a)
    a.catalog.create_project("p", 8, 10**6, 10)
    b = plane(url, "b")
    for o in (a, b):
        o.controllers.balance()  # both see both, and share the hosts out
    a.controllers.balance()
    yield a, b, held
    for o in (b, a):
        o.close()
        o.db.dispose()


def snapshot(o: Orchestrator) -> tuple:
    with o.db.read() as s:
        conn = s.connection()
        return (
            conn.execute(
                select(L.VMS.c.name, L.VMS.c.state, L.VMS.c.host_id, L.VMS.c.vcpus).order_by(L.VMS.c.name)
            ).all(),
            conn.execute(
                select(L.OPERATIONS.c.id, L.OPERATIONS.c.state, L.OPERATIONS.c.step, L.OPERATIONS.c.owner).order_by(
                    L.OPERATIONS.c.id
                )
            ).all(),
            conn.execute(select(func.count()).select_from(EVENTS)).scalar_one(),
            conn.execute(select(L.HOSTS.c.name, L.HOSTS.c.used_vcpus).order_by(L.HOSTS.c.name)).all(),
        )


def test_two_control_planes_share_the_hosts_and_one_coordinates(two):
    a, b, _ = two
    rows = {r["name"]: r for r in b.controllers.rows()}
    assert {rows["a"]["state"], rows["b"]["state"]} == {"live"}
    hosts_a, hosts_b = set(rows["a"]["hosts"]), set(rows["b"]["hosts"])
    assert hosts_a | hosts_b == {f"h{i}" for i in range(1, 7)} and not hosts_a & hosts_b
    assert hosts_a and hosts_b  # rendezvous over 6 hosts gives each a share
    assert [rows["a"]["coordinator"], rows["b"]["coordinator"]].count(True) == 1
    assert rows["a"]["epoch"] < rows["b"]["epoch"]
    for name, o in (("a", a), ("b", b)):  # each listens to its own hosts only
        assert {h for h in o.drivers if o.controllers.owns_host(h)} == set(rows[name]["hosts"])


def test_a_paused_owner_is_fenced_and_its_operation_finished_by_the_other_once_its_lease_lapsed(two):
    """Speed: bench/timing.py ('lease takeover, in one process') measures pause -> finished by the other."""
    a, b, held = two
    a.create_vm("v1", "p", "small", "tiny", start=True)  # admitted by a; its start waits in a
    op = a.operations()[0]
    assert op.owner == a.controllers.epoch and a.vm("v1").state == "starting"
    old_epoch = a.controllers.epoch
    a.controllers._stop.set()  # a stops renewing: paused
    wait_for(lambda: b.vm("v1").state == "running", "b to take the start over and finish it")
    assert b.operation(op.id).state == "succeeded" and b.operation(op.id).owner == b.controllers.epoch
    rows = {r["epoch"]: r for r in b.controllers.rows()}
    # taken over because its lease lapsed (its renewals stopped), not handed over by a stop
    assert rows[old_epoch]["state"] == "lapsed" and rows[b.controllers.epoch]["coordinator"]
    assert set(rows[b.controllers.epoch]["hosts"]) == {f"h{i}" for i in range(1, 7)}
    before = snapshot(b)
    held.run_all()  # a resumes where it was: its start runs now
    with pytest.raises(ownership.Fenced), ownership.owned(old_epoch), a.db.write() as s:
        s.execute(select(1))
    assert snapshot(b) == before  # none of its writes landed
    domain = b.domain_name("v1")
    assert [h for h, d in b.drivers.items() if d.domain(domain) is not None] == [b.vm("v1").host.name]  # once
    ledger_usage(b, "p")
    assert b.audit() == []
    a.controllers._stop.clear()
    a.controllers.renew()  # its next renewal finds its lease lapsed: a new incarnation
    assert a.controllers.epoch > b.controllers.epoch > old_epoch


def test_a_wall_clock_that_steps_forward_lapses_nobody(two):
    """NTP stepping the clock, or a virtual machine resumed, makes every lease look expired by the clock at
    once. Only renewals that stop lapse a lease, timed by the other processes' own monotonic clocks."""
    a, b, _ = two
    epochs = (a.controllers.epoch, b.controllers.epoch)
    with a.db.transaction() as conn:  # every lease as the clock sees it after a step of an hour
        conn.execute(
            update(CONTROLLERS).values(
                expires_at=CONTROLLERS.c.expires_at - 3600, renewed_at=CONTROLLERS.c.renewed_at - 3600
            )
        )
    for o in (b, a, b):
        o.controllers.balance()
    for o in (a, b):  # the writes of both still land
        with ownership.owned(o.controllers.epoch), o.db.write() as s:
            s.execute(select(1))
    assert (a.controllers.epoch, b.controllers.epoch) == epochs
    assert all(r["state"] != "lapsed" for r in b.controllers.rows() if r["epoch"] in epochs)


def test_a_stopped_control_plane_hands_its_leases_over_at_once(two):
    a, b, _ = two
    a.controllers.stop()
    b.controllers.balance()
    rows = {r["name"]: r for r in b.controllers.rows()}
    assert rows["a"]["state"] == "stopped" and not rows["a"]["hosts"] and not rows["a"]["coordinator"]
    assert rows["b"]["coordinator"] and len(rows["b"]["hosts"]) == 6


def test_a_restart_under_the_same_name_takes_over_its_previous_incarnation_at_once(tmp_path):
    url = store_url(tmp_path, "restart.db")
    first = plane(url, "same")
    first.controllers._stop.set()
    second = plane(url, "same")
    try:
        rows = {r["epoch"]: r for r in second.controllers.rows()}
        assert rows[first.controllers.epoch]["state"] == "lapsed"
        assert rows[second.controllers.epoch]["coordinator"]
    finally:
        second.close()
        first.db.dispose()


def renewed_at(o: Orchestrator, epoch: int) -> float:
    with o.db.read() as s:
        return s.connection().execute(select(CONTROLLERS.c.renewed_at).where(CONTROLLERS.c.epoch == epoch)).scalar_one()


def test_on_postgresql_a_takeover_waits_for_a_fenced_write_in_flight_and_the_renewal_does_not(postgres):
    """A write that passed its fencing check lands before a takeover marks its owner lapsed; and while it
    is open, its own process's lease is renewed: it is not held back by it."""
    url = stores.postgres_url()
    a, b = plane(url, "a"), plane(url, "b")
    epoch, took_over = a.controllers.epoch, threading.Event()

    def take_over():
        with b.db.transaction() as conn:
            mark_lapsed(conn, CONTROLLERS.c.epoch == epoch)
        took_over.set()

    try:
        with ownership.owned(epoch), a.db.transaction() as conn:  # the check passed: it holds KEY SHARE
            record(conn, "vm", "fenced-write", message="written under a's lease")
            first = renewed_at(b, epoch)
            wait_for(lambda: renewed_at(b, epoch) > first, "a renewal of a's lease while its write is open")
            row = next(r for r in b.controllers.rows() if r["epoch"] == epoch)
            assert row["state"] == "live" and row["expires_in_s"] > 0, row  # renewed meanwhile
            taker = threading.Thread(target=take_over, daemon=True)
            taker.start()
            watcher = create_engine(url)
            try:
                Probe(watcher).wait_for_a_waiter(WAIT_S)  # the takeover queues behind the write ...
            finally:
                watcher.dispose()
            assert not took_over.is_set(), "the takeover did not wait for the write that passed its check"
        assert took_over.wait(WAIT_S)  # ... and goes on once it committed
        with b.db.read() as s:
            assert (
                s.connection()
                .execute(select(func.count()).select_from(EVENTS).where(EVENTS.c.subject == "fenced-write"))
                .scalar_one()
                == 1
            )
        assert next(r for r in b.controllers.rows() if r["epoch"] == epoch)["state"] == "lapsed"
        with pytest.raises(ownership.Fenced), ownership.owned(epoch), a.db.transaction():
            pass
    finally:
        for o in (b, a):
            o.close()
            o.db.dispose()


def test_a_live_process_whose_name_another_takes_registers_again_under_a_name_of_its_own(tmp_path):
    """Two processes given one --name: the second takes the first's place (as a restart would). The first,
    alive, must not register again under that name (both live under one name, the hosts assigned by name
    to whichever took them first): it registers as NAME#EPOCH (its old epoch), and the hosts are shared out
    between the two."""
    url = store_url(tmp_path, "twice.db")
    first = plane(url, "same")
    first.catalog.create_zone("z1")
    first.catalog.create_cluster("c1", "z1")
    add_sim_hosts(first, 6)
    first.controllers.balance()
    old_epoch = first.controllers.epoch
    second = plane(url, "same")
    try:
        assert not first.controllers.renew()  # its place is taken: a new incarnation, a new name
        assert first.controllers.name == f"same#{old_epoch}" and first.controllers.epoch > second.controllers.epoch
        for o in (first, second, first, second):
            o.controllers.balance()
        rows = [r for r in second.controllers.rows() if r["state"] == "live"]
        assert sorted(r["name"] for r in rows) == sorted(["same", f"same#{old_epoch}"])
        hosts = [set(r["hosts"]) for r in rows]
        assert all(hosts) and not hosts[0] & hosts[1] and hosts[0] | hosts[1] == {f"h{i}" for i in range(1, 7)}
        assert {r["epoch"]: r for r in second.controllers.rows()}[old_epoch]["state"] == "lapsed"
    finally:
        second.close()
        first.close()
        first.db.dispose()
