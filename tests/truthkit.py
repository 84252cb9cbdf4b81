"""A truth harness: random operations under random sim faults (drivers/simfaults.py), then a quiet
period, then: is the record the truth?

One control plane (an Orchestrator with its thread pool and the loops that listen to the hosts: the
monitor, the periodic full sync, the libvirt-event loop, the migration settle loop) over a SQLite store and sim hosts in fault mode. Each round:
- faults on: a random workload (crashkit's: create/start, stop, delete, migrate, cancel, scale up and
  down incl. past a full host, drain and back, quota changes; plus CPU-cap changes, scale-downs that
  unplug DIMMs and small VMs that grow and give it back) while the hosts
  misbehave as libvirt does at its worst (transient errors, errors after a partial effect, DIMM
  unplugs completed late or never, lost connections mid-copy, post-copy failures, guests powering
  off/crashing/pausing on their own, lifecycle events late, twice or lost);
- quiet: faults off (what is under way still completes: late unplugs, copies, events, pauses), let
  the late effects land and the event loop drain, run each host loop once more (monitor, sync,
  migration settle) until nothing is in flight and no host is down, then the sync once more;
- check: nothing in flight (30 s at most), no VM between two steps, and `Orchestrator.audit()`:
  every VM's record == what its host runs, at the size (usable vCPUs, memory), CPU cap and state the
  host reports; stopped VMs run nowhere; no domain the store does not know; ledger == recomputed and
  within quota; host usage == claims == index; and the storage: no volume between two steps, each
  volume in its pool at its size and attached to the domains the store says (hot-plugs and unplugs
  under faults: detaches the guest completes late or never, disk copies that fail), storage ledger ==
  volumes, pools' used space == volumes.
HA mode (`run(..., ha=HaMode())`, issue 12): some VMs are created with `--ha restart` (and priorities), and
hosts fail during the workload: power, daemon and network failures for good (until repaired) or for a
while (shorter and longer than `vmplane.ha.grace`, set small so that recoveries really happen), fault
mode's own host_flap / host_partition / host_reboot, fence agents broken for a while, an operator pulling
the plug and confirming a host off. All along, a watch (crashkit.TwiceWatch) reads the fabric for a
domain active on two hosts at once (also after every step); at the end of each round, once the
recoveries ended: every HA restart came while its host was fenced (event order, crashkit.FenceOrder),
no VM is left charged on a fenced host (HA VMs run elsewhere or are in error; the others stopped); then
every host is repaired and the usual checks run (ledger exact, claims == what runs, audit clean).
Mutants (MUTANTS, `bench/truth.py --mutant NAME`) break one rule of the code under test by rewriting
its source at run time; the harness must then find a problem.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import logging
import random
import re
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from vmplane.drivers import base, simfabric
from vmplane.drivers.sim import SimDriver
from vmplane.drivers.simfabric import SimFabric
from vmplane.drivers.simfaults import KINDS, SimFaults
from vmplane.errors import VmplaneError
from sqlalchemy.exc import DBAPIError
from vmplane.orchestrator import Orchestrator
from vmplane.store import Database

from . import crashkit, storagetruth, stores

QUIET_S = 30.0
OPERATION_DEADLINE_S = 10      # within the quiet: the overdue loop settles what no thread carries first
HA_QUIET_S = 90.0       # a restart that finds no room is tried again after 1, 3, 10, 30, 30 s (harecovery)
MIGRATION_FAULTS = ("lost_connection", "postcopy_failed")     # settled by the migrator's rewrite (in progress)


def _scale_cap(o, rng, n):
    if names := crashkit._vms(o, "running"):
        o.scaler.scale(rng.choice(names), cpu_cap=rng.random() < 0.5)


def _scale_down(o, rng, n):
    """A scale down that unplugs DIMMs: a VM that grew past what it booted with, to an offering between
    the two (memory below the boot size can not be released live); else a VM that booted small grows
    (to be scaled down later)."""
    running = [v for v in o.vms() if v.state == "running"]
    grown = [v for v in running if v.boot_memory_mib and v.boot_memory_mib < v.memory_mib]
    if grown:
        vm = rng.choice(grown)
        fits = [name for name, _, memory in crashkit.OFFERINGS if vm.boot_memory_mib <= memory < vm.memory_mib]
        if fits:
            o.scaler.scale(vm.name, offering=rng.choice(fits))
            return
    small = [v.name for v in running if v.memory_mib == crashkit.OFFERINGS[0][2]]
    if small:
        o.scaler.scale(rng.choice(small), offering=rng.choice(crashkit.OFFERINGS[1:3])[0])


def _create_small(o, rng, n):
    """A VM that boots at the smallest size, so that what it grows by can be given back live."""
    o.create_vm(f"vm-{n}-{rng.randrange(10**6)}", rng.choice(list(crashkit.PROJECTS)), crashkit.OFFERINGS[0][0], "t",
                start=True)


# crashkit's actions, with more stops and deletes (the cluster keeps churning instead of filling its
# quotas), more volume attaches and detaches (hot-plugs that the guest completes late or never), CPU-cap
# changes, scale-downs that unplug DIMMs, and small VMs (which can give back growth)
_WEIGHTS = {crashkit._delete: 2, crashkit._migrate: 4, crashkit._attach: 3, crashkit._detach: 3}
ACTIONS = (*((a, _WEIGHTS.get(a, w)) for a, w in crashkit.ACTIONS), (_scale_cap, 2), (_scale_down, 5), (_create_small, 3))


# More detaches still: a detach the guest never completes keeps its volume attached for good, so that
# with the weights above a run of 12 rounds saw no unplug fault at all 1 time in 4 (`run(weights=...)`)
MORE_DETACHES = {crashkit._attach: 4, crashkit._detach: 8}


def workload(o: Orchestrator, rng: random.Random, steps: int, nemesis: "Nemesis | None" = None,
             weights: dict | None = None) -> None:
    mine = tuple((a, (weights or {}).get(a, w)) for a, w in ACTIONS)
    actions, odds = zip(*(mine + (nemesis.actions() if nemesis else ())))
    for n in range(steps):
        try:
            rng.choices(actions, odds)[0](o, rng, n)
        except VmplaneError:
            pass                       # refused (quota, capacity, state): as a user would be
        except DBAPIError as exc:      # PostgreSQL's deadlock victim, rolled back whole: the API's 409 "retry"
            if getattr(exc.orig, "sqlstate", None) not in ("40P01", "40001"):
                raise
        if nemesis:
            nemesis.step(o)
        time.sleep(rng.uniform(0, nemesis.mode.step_s if nemesis else 0.02))


# -- HA mode: hosts fail during the workload -----------------------------------------------------
@dataclass
class HaMode:
    """The knobs of HA mode."""
    grace_s: float = 0.7                    # vmplane.ha.grace
    modes: tuple[str, ...] = ("power", "daemon", "network")
    fail_weight: int = 3                    # weight of a host failure among the workload's actions
    for_good: float = 0.4                   # share of failures that last until repaired (else 0.1-4 s)
    fence_broken: float = 0.3               # share of failures whose fence agent is broken for 1-4 s
    max_failed: int = 2                     # hosts failed at once by the harness (of 4)
    step_s: float = 0.08                    # the workload's pace: failures last long enough to be seen
    host_faults: dict = field(default_factory=lambda: {"host_flap": 0.02, "host_partition": 0.006,
                                                       "host_reboot": 0.004})   # per driver call


class Nemesis:
    """The harness's host failures (and repairs, broken fence agents, operators confirming hosts off)."""

    def __init__(self, mode: HaMode, fabric: SimFabric):
        self.mode, self.fabric = mode, fabric
        self.counts: collections.Counter = collections.Counter()
        self._fix_fence: dict[str, float] = {}          # host -> when its fence agent works again

    def actions(self) -> tuple:
        return ((crashkit._create_ha, 6), (self.fail, self.mode.fail_weight), (self.repair, 1),
                (self.confirm_off, 1))

    def fail(self, o, rng, n):
        if len(crashkit.out_of_service(o)) >= self.mode.max_failed:
            return
        running = [v for v in o.vms() if v.state == "running" and v.host]
        ha_hosts = sorted({v.host.name for v in running if v.ha_policy == "restart"})
        healthy = sorted(set(o.drivers) - set(crashkit.out_of_service(o)))
        host = rng.choice(ha_hosts if ha_hosts and rng.random() < 0.9 else healthy)
        if host not in healthy:
            return
        mode = rng.choice(self.mode.modes)
        seconds = None if rng.random() < self.mode.for_good else rng.uniform(0.1, 4.0)
        if rng.random() < self.mode.fence_broken:
            self.fabric.set_fence_broken(host, "the BMC does not answer (harness)")
            self._fix_fence[host] = time.monotonic() + rng.uniform(1.0, 4.0)
            self.counts["fence broken"] += 1
        self.fabric.fail_host(host, mode, seconds)
        self.counts[f"{mode} {'for good' if seconds is None else 'for a while'}"] += 1
        if seconds is not None and seconds < self.mode.grace_s:
            self.counts["blips (< grace)"] += 1

    def repair(self, o, rng, n):
        """A host failed for good (or fenced) is repaired: it answers again (empty if it was off)."""
        failed = self.fabric.failed_hosts()
        fixable = sorted({h for h, st in failed.items() if st.until is None}
                         | {h.name for h in o.hosts() if h.state == "fenced"})
        if fixable:
            self.fabric.recover_host(rng.choice(fixable))
            self.counts["repairs"] += 1

    def confirm_off(self, o, rng, n):
        """An operator pulls the plug of a host whose fencing fails and says so (`host fence --confirm-off`)."""
        stuck = [h.name for h in o.hosts() if h.state == "fencing" and self.fabric.host_state(h.name).fence_broken]
        if stuck:
            host = rng.choice(stuck)
            self.fabric.fail_host(host, "power")
            o.ha.fence(host, confirm_off=True)
            self.counts["operator confirmed off"] += 1

    def step(self, o) -> None:
        now = time.monotonic()
        for host, due in list(self._fix_fence.items()):
            if due <= now:
                self.fabric.set_fence_broken(host, None)
                del self._fix_fence[host]

    def calm(self) -> None:
        """The end of the failures: every fence agent works again."""
        for host in list(self._fix_fence):
            self.fabric.set_fence_broken(host, None)
        self._fix_fence.clear()


def _ha_unsettled(o: Orchestrator) -> list[str]:
    """What HA still has to do: operations in flight, hosts fencing, down hosts holding an HA VM (charged
    there, or a migration's target). A down host holding only other VMs is not HA's to fence: its VMs stay
    unknown until it answers (it is repaired after this check)."""
    vms = o.vms()
    ha = {v.name for v in vms if v.ha_policy == "restart"}
    held = {v.host.name for v in vms if v.name in ha and v.host and v.state not in ("stopped", "error")}
    held |= {m["target"] for m in o.migrator.list(active_only=True) if m["vm_name"] in ha}
    return crashkit.in_flight(o) + [f"host {h.name} is {h.state}" for h in o.hosts()
                                    if h.state == "fencing" or (h.state == "down" and h.name in held)]


def ha_quiet(o: Orchestrator, fabric: SimFabric, faults: SimFaults, nemesis: Nemesis, order: "crashkit.FenceOrder",
             timeout_s: float = HA_QUIET_S) -> list[str]:
    """Failures stop (faults off, fence agents fixed, timed failures run out); wait until the recoveries
    ended; check what HA promises; then repair every host, so that the usual quiet and check follow.
    Returns the problems found."""
    faults.enabled = False
    nemesis.calm()
    deadline = time.monotonic() + timeout_s
    while fabric.hosts_failing_for_a_while() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(2.5)         # a host that came back is seen by the monitor, one that did not is declared
    while (left := _ha_unsettled(o)) and time.monotonic() < deadline:
        time.sleep(0.1)
    problems = [f"HA not settled after {timeout_s:.0f} s: {x}" for x in left]
    problems += crashkit.ha_problems(o) + order.check(o.db)
    for host in crashkit.out_of_service(o):
        fabric.recover_host(host)
    return problems


def _copies(o: Orchestrator) -> bool:
    return any(isinstance(d, SimDriver) and d._copies for d in o.drivers.values())


def _loops_once(o: Orchestrator) -> None:
    """One pass of each loop that listens to the hosts (as their threads would run it)."""
    o.check_hosts()
    o.sync.sync()
    settle_loop = getattr(o, "migration_settle", None)
    if settle_loop is not None:
        settle_loop.run_once()
    # volumes left between two steps by a host that did not answer, copies left by migrations (the
    # workload is over: no request carries a volume step any more, so no minimum age)
    o.storage_settle.run_once(min_age_s=0)


def quiet(o: Orchestrator, fabric: SimFabric, faults: SimFaults) -> list[str]:
    """Faults off; wait for what is in flight and under way; let the events, the monitor, the sync and
    the migration settle loop bring the record to the truth. Returns what was still in flight after
    QUIET_S."""
    faults.enabled = False
    deadline = time.monotonic() + QUIET_S
    left = crashkit.settle(o, 5.0)
    while (not fabric.settled() or _copies(o)) and time.monotonic() < deadline:
        time.sleep(0.05)
    fabric.tick()
    while not o.host_events._queue.empty() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)         # the event being handled
    for _ in range(3):
        _loops_once(o)
        left = crashkit.settle(o, 1.0)
        if not left and not any(h.state == "down" for h in o.hosts()):
            break
    left = crashkit.settle(o, max(deadline - time.monotonic(), 1.0))
    _loops_once(o)          # a sync after the last operation ended
    return left


def check(o: Orchestrator, left: list[str]) -> list[str]:
    problems = [f"still in flight after {QUIET_S:.0f} s: {x}" for x in left]
    problems += [f"host {h.name} left {h.state}" for h in o.hosts() if h.state in ("down", "fencing", "fenced")]
    problems += [f"vm {v.name} left {v.state}" for v in o.vms()
                 if v.state in ("starting", "stopping", "migrating", "scaling")]
    problems += unknown_left(o)
    problems += storagetruth.unowned_pool_files(o)      # a pool file no volume owns (review N2)
    return problems + crashkit.storage_problems(o) + o.audit()


def unknown_left(o: Orchestrator) -> list[str]:
    """`unknown` VMs whose host answers (review N3), still there once the running monitor had the time to
    settle them: its settle interval and a host check, twice over (waited for only while there are some).
    Each is a finding."""
    interval = float(o.catalog.effective("vmplane.unknown.settle.interval"))
    deadline = time.monotonic() + 2 * (interval + float(o.catalog.effective("vmplane.host.check.interval"))) + 2
    waited = False
    while (left := crashkit.unknown_on_answering_hosts(o)) and time.monotonic() < deadline:
        waited = True
        time.sleep(0.1)
    if waited:      # what the settled VMs leave to the other loops (a size the sync adopts, a volume left
        _loops_once(o)      # attaching to a VM now stopped): one pass of each, as after the quiet period's last one
    return [f"vm {vm} left unknown on {host}, which answers, after the monitor's settle interval ({interval:g} s)"
            for vm, host in left]


# -- mutants: one rule of the code under test broken, by rewriting its source ----------------------
def _rewrite(fn, old: str, new: str, count: int = 1):
    """`fn` (a function or method) recompiled with `old` replaced by `new` (a regex) in its source."""
    src = textwrap.dedent(inspect.getsource(fn))
    mutated, n = re.subn(old, new, src, count=count, flags=re.S)
    if n == 0:
        raise RuntimeError(f"mutant: {old!r} not found in {fn.__qualname__}: the code changed, update the mutant")
    module = inspect.getmodule(fn)
    namespace = dict(vars(module))
    exec(compile(mutated, inspect.getsourcefile(fn), "exec"), namespace)
    return namespace[fn.__name__]


@contextlib.contextmanager
def _patched(*targets):
    """targets: (object, attribute, new value); restored afterwards."""
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in targets]
    for obj, attr, value in targets:
        setattr(obj, attr, value)
    try:
        yield
    finally:
        for obj, attr, value in saved:
            setattr(obj, attr, value)


def _no_wait(fn=None):
    return _rewrite(base.confirm_unplug, r"        while True:.*?pause\(min\(0\.2, wait_s / 4\)\)\n", "        return\n")


def _no_unplug_wait():
    """The DIMM unplug is taken as done once asked: no wait for DEVICE_REMOVED / the DIMM gone, and the
    size asked for reported (what the libvirt driver did before issue 10)."""
    set_memory = _rewrite(SimDriver.set_memory, r'return self\._read_back\(name, "dimm-unplug"\)',
                          'return Resized("dimm-unplug", spec.vcpus, memory_mib, spec.cpu_cap, spec.vcpus)')
    return _patched((base, "confirm_unplug", _no_wait()), (SimDriver, "set_memory", set_memory))


def _no_unplug_wait_only():
    """Only the wait removed; the driver still reads the domain back (the scale then fails and records
    the larger size; the sync adopts the late unplug): the record stays true, so this is not caught."""
    return _patched((base, "confirm_unplug", _no_wait()))


def _unknown_is_absent():
    """A DriverError on a lookup taken as "the domain is gone" (settle and a failed start/stop)."""
    from vmplane import hostevents, hostmonitor, hostsync, settle

    settle_vm = _rewrite(settle.settle_vm, r"(except DriverError as exc:\n\s+)log\.info\(.*?\n\s+return None",
                         r"\1info = None")
    presence = _rewrite(Orchestrator._domain_presence, r'return "unknown"', 'return "gone"')
    targets = [(settle, "settle_vm", settle_vm), (Orchestrator, "_domain_presence", presence)]
    targets += [(m, "settle_vm", settle_vm) for m in (hostevents, hostsync, hostmonitor) if hasattr(m, "settle_vm")]
    return _patched(*targets)


def _copy_error_stays():
    """A copy that raised is taken as "the VM stayed on its source": no settle step, the target claim given
    back unasked (what the migrator did before its failure path asked both hosts)."""
    from vmplane.migrator import Migrator

    run = _rewrite(Migrator._run, r"self\.settle\(migration_id, why=str\(exc\), wait_s=SETTLE_WAIT_S\)",
                   'self._finish(migration_id, "copy-failed", reason=str(exc))')
    return _patched((Migrator, "_run", run))


def _ha_no_fence():
    """A failed host is taken as fenced without asking its agent: its HA VMs restart while a host whose
    daemon died or that is cut off still runs them (caught by the running-twice watch)."""
    from vmplane.harecovery import HostRecovery

    fence = _rewrite(HostRecovery._fence, r"fenced, errors = self\._try_agents\(host, row\)",
                     "return self._fenced(op_id, host, None)")
    return _patched((HostRecovery, "_fence", fence))


MUTANTS = {"no-unplug-wait": _no_unplug_wait, "no-unplug-wait-only": _no_unplug_wait_only, "unknown-is-absent": _unknown_is_absent,
           "copy-error-stays": _copy_error_stays, "ha-no-fence": _ha_no_fence}
# the HA mode a mutant needs to be seen (guests that run on while their host does not answer)
MUTANT_HA = {"ha-no-fence": HaMode(modes=("daemon", "network"), fence_broken=0.0, for_good=1.0, fail_weight=5)}
# the faults a mutant needs to be seen (the others may stay off)
MUTANT_FAULTS = {"copy-error-stays": MIGRATION_FAULTS}
# rates that make a mutant show sooner (the suite's quick check; bench/truth.py runs the plain rates too)
MUTANT_RATES = {"no-unplug-wait": {"unplug_never": 0.8}, "unknown-is-absent": {"transient": 0.15}}


# -- the run -------------------------------------------------------------------------------------
@dataclass
class Round:
    number: int
    problems: list[str]
    vms: int
    faults: int                     # injected during this round
    failures: int = 0               # host failures by the harness (HA mode)


@dataclass
class Report:
    rounds: list[Round] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)       # injected faults by kind
    ha: dict[str, int] = field(default_factory=dict)           # HA mode: failures, repairs, fences, restarts, samples
    lost: list[str] = field(default_factory=list)              # HA VMs settled stopped (their host back without them)

    @property
    def faults(self) -> int:
        return sum(self.counts.values())

    def problems(self) -> list[str]:
        return [f"round {r.number}: {p}" for r in self.rounds for p in r.problems]

    def first_caught(self) -> int | None:
        return next((r.number for r in self.rounds if r.problems), None)


def make_faults(seed: int, migration_faults: bool, scale: float = 1.0, overrides: dict | None = None) -> SimFaults:
    off = {k: 0.0 for k in MIGRATION_FAULTS} if not migration_faults else {}
    return SimFaults.nasty(seed, scale, **(off | (overrides or {})))


def run(home: Path, rounds: int, seed: int, steps: int = 60, migration_faults: bool = False,
        mutant: str | None = None, fault_scale: float = 3.0, faults: dict | None = None, log=lambda line: None,
        stop_at_problem: bool = True, storage: bool = True, ha: HaMode | None = None,
        weights: dict | None = None) -> Report:
    """`rounds` rounds (workload under faults, quiet, check) on one cluster; `mutant` names a rule to
    break (MUTANTS). Migration faults (lost connection, post-copy failure) are off unless asked for;
    `faults` overrides rates of SimFaults.nasty (x `fault_scale`); `storage`: pools, disks and volumes
    (crashkit.seed_cluster); `ha`: HA mode (HaMode: HA VMs, hosts failing, the HA checks);
    `stop_at_problem`: stop after the first round with a problem (or, a callable, with problems it accepts);
    `weights`: other weights for some of the workload's actions (MORE_DETACHES)."""
    with stores.sim_hosts_env(home):        # (PostgreSQL: sim hosts in a file, as beside a SQLite store)
        return _run(home, rounds, seed, steps, migration_faults, mutant, fault_scale, faults, log, stop_at_problem,
                    storage, ha, weights)


def _run(home, rounds, seed, steps, migration_faults, mutant, fault_scale, faults, log, stop_at_problem, storage,
         ha, weights) -> Report:
    url = stores.store_url(home)
    crashkit.seed_cluster(url, storage=storage)
    simfabric.forget_shared()
    logging.getLogger("vmplane").setLevel(logging.CRITICAL)
    rng = random.Random(seed)
    overrides = (ha.host_faults if ha else {}) | (faults or {})
    faults = make_faults(seed, migration_faults, fault_scale, overrides)
    report = Report()
    nemesis, order, watch = None, crashkit.FenceOrder(), None
    with MUTANTS[mutant]() if mutant else contextlib.nullcontext():
        db = Database(url)
        o = Orchestrator(db, ThreadPoolExecutor(4))
        try:
            o.load()
            o.catalog.set_setting("vmplane.host.sync.interval", 1)
            o.catalog.set_setting("vmplane.host.check.interval", 1)
            # an operation left in flight (no thread carries it) is settled by its process past this; one still
            # in flight past it after the quiet is an audit finding (review N5)
            o.catalog.set_setting("vmplane.operation.deadline", OPERATION_DEADLINE_S)
            fabric = SimFabric.for_store(url)
            fabric.incoming_linger_s = crashkit.INCOMING_LINGER_S
            for d in o.drivers.values():
                d.copy_rate_mib_s = crashkit.COPY_RATE_MIB_S
            if ha:
                o.catalog.set_setting("vmplane.ha.grace", str(ha.grace_s))
                nemesis = Nemesis(ha, fabric)
                watch = crashkit.TwiceWatch(fabric.path).__enter__()
                order.check(db)                 # from now on
            o.start_monitor()       # the host monitor, the full sync, the event loop, the migration settle loop
            fabric.faults = faults
            for number in range(rounds):
                before, failed_before = faults.total(), sum(nemesis.counts.values()) if nemesis else 0
                faults.enabled = True
                workload(o, random.Random(rng.randrange(2**32)), steps, nemesis, weights)
                problems = ha_quiet(o, fabric, faults, nemesis, order) if nemesis else []
                problems += check(o, quiet(o, fabric, faults))
                if watch:
                    watch.sample()
                    problems += [f"running twice: {p}" for p in watch.take()]
                vms = len(o.vms())
                failures = sum(nemesis.counts.values()) - failed_before if nemesis else 0
                report.rounds.append(Round(number, problems, vms, faults.total() - before, failures))
                log(f"round {number}: {vms} VMs, {faults.total() - before} faults"
                    + (f", {failures} host failures/repairs, {order.fences} fences, {order.restarts} HA restarts so "
                       f"far" if nemesis else "") + f", {len(problems)} problem(s)" + (f": {problems[:3]}" if problems else ""))
                if problems and (stop_at_problem(problems) if callable(stop_at_problem) else stop_at_problem):
                    break
        finally:
            if watch:
                watch.__exit__()
            fabric_ = SimFabric.for_store(url)
            fabric_.faults = None
            o.close()
            db.dispose()
            simfabric.forget_shared()
    report.counts = {k: faults.counts.get(k, 0) for k in KINDS}
    if nemesis:
        report.ha = {**nemesis.counts, "fences": order.fences, "HA restarts": order.restarts,
                     "running-twice samples": watch.samples, "HA VMs stopped, not restarted": len(order.lost)}
        report.lost = order.lost
    return report
