"""A crash harness: kill the control plane (SIGKILL) in the middle of random operations, restart it,
and check that nothing was lost, duplicated or leaked.

Each round forks a control plane (an Orchestrator with its thread pool, over the SQLite store and
the sim hosts' fabric file) that runs a random workload: create and start, stop, delete, live
migrate and cancel, live scale (growing past a full host, so that it migrates first), drain a host
and bring it back, change quotas and whether overhead counts. The round ends with a kill:
- at a named crash point (vmplane.failpoints), armed for its N-th pass, or
- at a random moment, by the harness, after 0-150 ms.
Then a new control plane starts on the same store and hosts (its start-up reconciles and resumes),
is given time to finish what was in flight, and is checked:
- every VM runs exactly once, on the host the store says, at the size the store says;
- no host runs a vmplane domain the store does not know;
- each project's ledger == the usage recomputed from its VMs, within quota;
- each host's used capacity == the sum of its claims, and its claims == what runs there;
- no operation and no migration is still in flight, and no VM is left between two steps.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import random
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from vmplane import failpoints
from vmplane.drivers import simfabric
from vmplane.drivers.sim import SimDriver
from vmplane.errors import VmplaneError
from vmplane.model import Offering, OfferingKind
from vmplane.orchestrator import InlineExecutor, Orchestrator
from vmplane.store import Database

GIB = 1024
PROJECTS = {"alpha": (12, 20 * GIB, 8), "beta": (8, 12 * GIB, 6), "gamma": (6, 10 * GIB, 5)}
OFFERINGS = (("s1", 1, 512), ("s2", 2, 1024), ("m4", 4, 2048), ("l6", 4, 6144))
HOSTS = 4
COPY_RATE_MIB_S = 12 * GIB          # a 1 GiB VM copies in ~80 ms: long enough to be killed mid-copy
SETTLE_S = 30.0


def seed_cluster(url: str) -> None:
    """Zone, cluster, four small sim hosts, offerings that scale live, three tight projects."""
    db = Database(url)
    db.migrate()
    o = Orchestrator(db, InlineExecutor())
    o.load()
    c = o.catalog
    c.create_zone("z1")
    c.create_cluster("c1", "z1")
    c.set_setting("enable.dynamic.scale.vm", "true", "zone", "z1")
    for i in range(1, HOSTS + 1):
        o.add_host(f"h{i}", "c1", "sim", 8, 2400, 8 * GIB)
    for name, vcpus, memory in OFFERINGS:
        c.create_offering(Offering(name, OfferingKind.fixed, vcpus=vcpus, memory_mib=memory, dynamic_scaling=True))
    c.create_template("t", "tiny-linux", dynamic_scaling=True)
    for name, (vcpus, memory, vms) in PROJECTS.items():
        c.create_project(name, vcpus, memory, vms, count_overhead=True)
    o.close()
    db.dispose()


# -- the workload ------------------------------------------------------------------------------
def _vms(o: Orchestrator, *states: str) -> list[str]:
    return [v.name for v in o.vms() if v.state in states]


def _create(o, rng, n):
    o.create_vm(f"vm-{n}-{rng.randrange(10**6)}", rng.choice(list(PROJECTS)), rng.choice(OFFERINGS)[0], "t",
                start=rng.random() < 0.85)


def _start(o, rng, n):
    if names := _vms(o, "stopped"):
        o.start_vm(rng.choice(names))


def _stop(o, rng, n):
    if names := _vms(o, "running"):
        o.stop_vm(rng.choice(names), force=True)


def _delete(o, rng, n):
    if names := _vms(o, "stopped"):
        o.delete_vm(rng.choice(names))


def _migrate(o, rng, n):
    if names := _vms(o, "running"):
        o.migrator.migrate(rng.choice(names), to=rng.choice([None, f"h{rng.randint(1, HOSTS)}"]))


def _scale(o, rng, n):
    if names := _vms(o, "running"):
        o.scaler.scale(rng.choice(names), offering=rng.choice(OFFERINGS)[0])


def _scale_where_full(o, rng, n):
    """Grow a VM on the fullest host to the largest offering, so that the scale has to migrate first."""
    free = {h.name: h.memory_mib - h.used_memory_mib for h in o.hosts()}
    running = [v for v in o.vms() if v.state == "running" and v.host and v.offering.name != OFFERINGS[-1][0]]
    if running:
        vm = min(running, key=lambda v: (free.get(v.host.name, 0), rng.random()))
        o.scaler.scale(vm.name, offering=OFFERINGS[-1][0])


def _drain(o, rng, n):
    host = f"h{rng.randint(1, HOSTS)}"
    if any(h.state == "maintenance" for h in o.hosts()):
        for h in o.hosts():
            if h.state == "maintenance":
                o.maintenance.exit(h.name)
    else:
        o.maintenance.enter(host)


def _cancel(o, rng, n):
    if active := o.migrator.list(active_only=True):
        o.migrator.cancel(rng.choice(active)["vm_name"])


def _quota(o, rng, n):
    """Move a project's quota (lowering below usage is refused) or flip whether overhead counts."""
    name = rng.choice(list(PROJECTS))
    vcpus, memory, vms = PROJECTS[name]
    if rng.random() < 0.3:
        o.catalog.set_quota(name, count_overhead=rng.random() < 0.7)
    else:
        o.catalog.set_quota(name, vcpus=vcpus + rng.randint(-3, 0), memory_mib=memory + rng.randint(-4, 0) * GIB)


ACTIONS = ((_create, 5), (_start, 2), (_stop, 2), (_delete, 1), (_migrate, 3), (_scale, 4), (_scale_where_full, 2), (_drain, 1),
           (_cancel, 1), (_quota, 1))


def workload(o: Orchestrator, rng: random.Random, steps: int, focus: str = "") -> None:
    """Random actions; with a crash point armed (`focus`), the actions that reach it are made likelier."""
    boost = {"scale.migrating": _scale_where_full, "scale.after-migration": _scale_where_full,
             "drain.mid": _drain}.get(focus)
    actions, weights = zip(*((a, w * 3 if a is boost else w) for a, w in ACTIONS))
    for n in range(steps):
        try:
            rng.choices(actions, weights)[0](o, rng, n)
        except VmplaneError:
            pass                       # refused (quota, capacity, state): as a user would be
        time.sleep(rng.uniform(0, 0.01))


def _control_plane(url: str, seed: int, armed: dict[str, int], steps: int) -> None:
    """A forked control plane: start up (recovering), run the workload, wait for its operations."""
    simfabric.forget_shared()
    logging.disable(logging.CRITICAL)
    failpoints.arm(armed)
    db = Database(url)
    o = Orchestrator(db, ThreadPoolExecutor(4))
    o.load()
    for d in o.drivers.values():
        if isinstance(d, SimDriver):
            d.copy_rate_mib_s = COPY_RATE_MIB_S
    workload(o, random.Random(seed), steps, focus=next(iter(armed), ""))
    settle(o, 20.0)
    os._exit(0)


# -- after the crash ---------------------------------------------------------------------------
def in_flight(o: Orchestrator) -> list[str]:
    ops = [f"operation {op.kind} {op.target} ({op.step})" for st in ("pending", "running")
           for op in o.operations(state=st)]
    migs = [f"migration of {m['vm_name']} ({m['state']})" for m in o.migrator.list(active_only=True)]
    return ops + migs


def settle(o: Orchestrator, timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := in_flight(o)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def check(o: Orchestrator) -> list[str]:
    """Every invariant the harness promises, in words (empty when all hold)."""
    problems = [f"still in flight after {SETTLE_S:.0f} s: {x}" for x in settle(o, SETTLE_S)]
    problems += [f"vm {v.name} left {v.state}" for v in o.vms()
                 if v.state in ("starting", "stopping", "migrating", "scaling")]
    return problems + o.audit()


@dataclass
class Round:
    number: int
    kill: str                     # the failpoint, or "timed"
    killed: bool                  # the control plane died by SIGKILL (not: finished its workload)
    problems: list[str]
    vms: int


@dataclass
class Report:
    rounds: list[Round] = field(default_factory=list)

    @property
    def kills(self) -> list[Round]:
        return [r for r in self.rounds if r.killed]

    def points_hit(self) -> set[str]:
        return {r.kill for r in self.kills if r.kill != "timed"}

    def problems(self) -> list[str]:
        return [f"round {r.number} (kill {r.kill}): {p}" for r in self.rounds for p in r.problems]


def run(home: Path, rounds: int, seed: int, steps: int = 60, timed_share: float = 0.4, unchecked_share: float = 0.25,
        log=lambda line: None, stop_at_problem: bool = True) -> Report:
    """`rounds` crash-and-restart rounds on one cluster; failpoints are cycled so each is armed. After
    a share of the kills the next control plane starts without a check in between, so that its own
    start-up (the recovery) runs with a crash point armed too."""
    url = f"sqlite:///{home / 'vmplane.db'}"
    seed_cluster(url)
    simfabric.forget_shared()
    logging.getLogger("vmplane").setLevel(logging.CRITICAL)     # recoveries log what they undo; rounds say it
    rng = random.Random(seed)
    ctx = multiprocessing.get_context("fork")
    report = Report()
    points, next_point, misses = list(failpoints.POINTS), 0, 0
    for number in range(rounds):
        timed = rng.random() < timed_share
        armed = {} if timed else {points[next_point % len(points)]: rng.randint(1, 2)}
        child = ctx.Process(target=_control_plane, args=(url, rng.randrange(2**32), armed, steps))
        child.start()
        if timed:
            child.join(rng.uniform(0.0, 0.15))
            if child.exitcode is None:
                os.kill(child.pid, signal.SIGKILL)
        child.join(60)
        hung = child.exitcode is None      # its workload and 20 s of settling are long over: a finding
        if hung:
            os.kill(child.pid, signal.SIGKILL)
            child.join()
        killed = child.exitcode == -signal.SIGKILL and not hung
        kill = "timed" if timed else next(iter(armed))
        if not timed:       # a point the workload did not reach is armed again, a few times
            misses = 0 if killed else misses + 1
            if killed or misses >= 8:
                next_point, misses = next_point + 1, 0
        if killed and number < rounds - 1 and rng.random() < unchecked_share:
            report.rounds.append(Round(number, kill, killed, [], -1))
            log(f"round {number}: kill {kill} (killed), restarted without a check")
            continue
        db = Database(url)
        o = Orchestrator(db, ThreadPoolExecutor(4))
        try:
            o.load()
            problems = ["the control plane hung for 60 s"] * hung + check(o)
            vms = len(o.vms())
        finally:
            o.close()
            db.dispose()
            simfabric.forget_shared()
        report.rounds.append(Round(number, kill, killed, problems, vms))
        log(f"round {number}: kill {kill} {'(killed)' if killed else '(not reached)'}, {vms} VMs, "
            f"{len(problems)} problem(s)" + (f": {problems[:3]}" if problems else ""))
        if problems and stop_at_problem:      # the store is left as the check found it, to be looked at
            break
        if problems and not any(r.problems for r in report.rounds[:-1]):
            keep = home / f"first-problem-round-{number}"     # the store as the first problem left it
            keep.mkdir()
            for f in home.glob("vmplane.db*"):
                shutil.copy(f, keep / f.name)
    return report
