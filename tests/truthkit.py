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
Mutants (MUTANTS, `bench/truth.py --mutant NAME`) break one rule of the code under test by rewriting
its source at run time; the harness must then find a problem.
"""

from __future__ import annotations

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
from vmplane.orchestrator import Orchestrator
from vmplane.store import Database

from . import crashkit

QUIET_S = 30.0
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
# quotas), more volume attaches and detaches (hot-plugs that the guest completes late or never), CPU-cap changes, scale-downs that unplug DIMMs, and small VMs (which can give back growth)
_WEIGHTS = {crashkit._delete: 2, crashkit._migrate: 4, crashkit._attach: 3, crashkit._detach: 3}
ACTIONS = (*((a, _WEIGHTS.get(a, w)) for a, w in crashkit.ACTIONS), (_scale_cap, 2), (_scale_down, 5), (_create_small, 3))


def workload(o: Orchestrator, rng: random.Random, steps: int) -> None:
    actions, weights = zip(*ACTIONS)
    for n in range(steps):
        try:
            rng.choices(actions, weights)[0](o, rng, n)
        except VmplaneError:
            pass                       # refused (quota, capacity, state): as a user would be
        time.sleep(rng.uniform(0, 0.02))


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
    problems += [f"vm {v.name} left {v.state}" for v in o.vms()
                 if v.state in ("starting", "stopping", "migrating", "scaling")]
    return problems + crashkit.storage_problems(o) + o.audit()


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


MUTANTS = {"no-unplug-wait": _no_unplug_wait, "no-unplug-wait-only": _no_unplug_wait_only, "unknown-is-absent": _unknown_is_absent,
           "copy-error-stays": _copy_error_stays}
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


@dataclass
class Report:
    rounds: list[Round] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)       # injected faults by kind

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
        stop_at_problem: bool = True, storage: bool = True) -> Report:
    """`rounds` rounds (workload under faults, quiet, check) on one cluster; `mutant` names a rule to
    break (MUTANTS). Migration faults (lost connection, post-copy failure) are off unless asked for;
    `faults` overrides rates of SimFaults.nasty (x `fault_scale`); `storage`: pools, disks and volumes
    (crashkit.seed_cluster)."""
    url = f"sqlite:///{home / 'vmplane.db'}"
    crashkit.seed_cluster(url, storage=storage)
    simfabric.forget_shared()
    logging.getLogger("vmplane").setLevel(logging.CRITICAL)
    rng = random.Random(seed)
    overrides = faults
    faults = make_faults(seed, migration_faults, fault_scale, overrides)
    report = Report()
    with MUTANTS[mutant]() if mutant else contextlib.nullcontext():
        db = Database(url)
        o = Orchestrator(db, ThreadPoolExecutor(4))
        try:
            o.load()
            o.catalog.set_setting("vmplane.host.sync.interval", 1)
            o.catalog.set_setting("vmplane.host.check.interval", 1)
            fabric = SimFabric.for_store(url)
            for d in o.drivers.values():
                d.copy_rate_mib_s = crashkit.COPY_RATE_MIB_S
            o.start_monitor()       # the host monitor, the full sync, the event loop, the migration settle loop
            fabric.faults = faults
            for number in range(rounds):
                before = faults.total()
                faults.enabled = True
                workload(o, random.Random(rng.randrange(2**32)), steps)
                problems = check(o, quiet(o, fabric, faults))
                vms = len(o.vms())
                report.rounds.append(Round(number, problems, vms, faults.total() - before))
                log(f"round {number}: {vms} VMs, {faults.total() - before} faults, {len(problems)} problem(s)"
                    + (f": {problems[:3]}" if problems else ""))
                if problems and stop_at_problem:
                    break
        finally:
            fabric_ = SimFabric.for_store(url)
            fabric_.faults = None
            o.close()
            db.dispose()
            simfabric.forget_shared()
    report.counts = {k: faults.counts.get(k, 0) for k in KINDS}
    return report
