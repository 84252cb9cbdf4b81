"""A crash harness: kill the control plane (SIGKILL) in the middle of random operations, restart it,
and check that nothing was lost, duplicated or leaked.

Each round forks a control plane (an Orchestrator with its thread pool, over the SQLite store and
the sim hosts' fabric file) that runs a random workload: create and start, stop, delete, live
migrate and cancel, live scale (growing past a full host, so that it migrates first), drain a host
and bring it back, change quotas and whether overhead counts; with storage (the default), VMs with
root disks on small local and shared pools, and volumes created, attached (hot-plugged into running VMs),
detached, grown and deleted against small storage quotas; with HA (the default), VMs with `--ha restart`
and hosts failing (power, daemon, network; `vmplane.ha.grace` 0, so each is declared, fenced and its HA
VMs restarted at once: the ha.* crash points) and repaired later. The round ends with a kill:
- at a named crash point (vmplane.failpoints), armed for its N-th pass, or
- at a random moment, by the harness, after 0-150 ms.
Then a new control plane starts on the same store and hosts (its start-up reconciles and resumes),
is given time to finish what was in flight, and is checked:
- every VM runs exactly once, on the host the store says, at the size the store says;
- no host runs a vmplane domain the store does not know;
- each project's ledger == the usage recomputed from its VMs, within quota;
- each host's used capacity == the sum of its claims, and its claims == what runs there;
- no operation and no migration is still in flight, and no VM is left between two steps;
- no volume is left between two steps (start-up recovery settled them), no migration's copy is left
  claimed, each project's storage ledger == its volumes (within quota), each pool's used space == the
  volumes on it, and the storage audit (every volume in its pool at its size, attached where the store
  says, no unknown vmplane file in a pool) has no finding (a volume on the local pool of a host still
  out of service waits for it);
- with HA: the checking control plane first looks at its hosts (as its monitor and HA loops would), so a
  recovery the kill interrupted is resumed and one not yet declared is; then no VM is left charged on a
  fenced host (each HA VM runs exactly once elsewhere, or is in error), every HA restart in the event log
  came after its host was fenced, and a watch that read the fabric file every 5 ms during the whole run
  (killed control planes included) never saw a domain running on two hosts.
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing
import os
import random
import shutil
import re
import signal
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from vmplane import failpoints
from vmplane.drivers import simfabric
from vmplane.drivers.sim import SimDriver
from vmplane.drivers.simstorage import SHARED
from vmplane.errors import VmplaneError
from vmplane.events import EVENTS
from vmplane.model import Offering, OfferingKind
from vmplane.orchestrator import InlineExecutor, Orchestrator
from sqlalchemy import select

from vmplane.store import Database

from . import stores

GIB = 1024
PROJECTS = {"alpha": (12, 20 * GIB, 8), "beta": (8, 12 * GIB, 6), "gamma": (6, 10 * GIB, 5)}
OFFERINGS = (("s1", 1, 512), ("s2", 2, 1024), ("m4", 4, 2048), ("l6", 4, 6144))
HOSTS = 4
STORAGE_MIB = {"alpha": 3 * GIB, "beta": 2 * GIB, "gamma": 1536}     # storage quota per project
LOCAL_POOL_MIB, SHARED_POOL_MIB = 2 * GIB, 3 * GIB                   # small pools: they fill up
POOLS = (None, "shared", *(f"local-h{i}" for i in range(1, HOSTS + 1)))
# the crash points of the volume steps (failpoints.POINTS may not list them yet)
VOLUME_POINTS = ("volume.before-create", "volume.after-create", "volume.before-attach", "volume.before-detach",
                 "volume.before-delete")
COPY_RATE_MIB_S = 12 * GIB          # a 1 GiB VM copies in ~80 ms: long enough to be killed mid-copy
SETTLE_S = 30.0


def crash_points(ha: bool = True) -> tuple[str, ...]:
    points = failpoints.POINTS + tuple(p for p in VOLUME_POINTS if p not in failpoints.POINTS)
    return points if ha else tuple(p for p in points if not p.startswith("ha."))


def seed_cluster(url: str, storage: bool = True, ha_grace: float | None = None) -> None:
    """Zone, cluster, four small sim hosts, offerings that scale live, three tight projects; with
    `storage`: a small local pool per host, a small shared pool, a template with a disk image and
    storage quotas."""
    if storage:
        fabric = simfabric.SimFabric.for_store(url)
        for i in range(1, HOSTS + 1):
            fabric.set_capacity(f"h{i}", LOCAL_POOL_MIB)
        fabric.set_capacity(SHARED, SHARED_POOL_MIB)
    db = Database(url)
    db.migrate()
    o = Orchestrator(db, InlineExecutor())
    o.load()
    c = o.catalog
    c.create_zone("z1")
    c.create_cluster("c1", "z1")
    c.set_setting("enable.dynamic.scale.vm", "true", "zone", "z1")
    if ha_grace is not None:        # the crash harness: 0, a failed host is declared at once
        c.set_setting("vmplane.ha.grace", str(ha_grace))
    for i in range(1, HOSTS + 1):
        o.add_host(f"h{i}", "c1", "sim", 8, 2400, 8 * GIB)
    for name, vcpus, memory in OFFERINGS:
        c.create_offering(Offering(name, OfferingKind.fixed, vcpus=vcpus, memory_mib=memory, dynamic_scaling=True))
    c.create_template("t", "tiny-linux", dynamic_scaling=True)
    for name, (vcpus, memory, vms) in PROJECTS.items():
        c.create_project(name, vcpus, memory, vms, count_overhead=True,
                         **({"storage_mib": STORAGE_MIB[name]} if storage else {}))
    if storage:
        c.create_template("disk", "tiny-linux", disk="tiny-linux", dynamic_scaling=True)
        for i in range(1, HOSTS + 1):
            o.pools.create(f"local-h{i}", "local", host=f"h{i}")
        o.pools.create("shared", "shared", cluster="c1")
    o.close()
    db.dispose()


# -- the workload ------------------------------------------------------------------------------
def _vms(o: Orchestrator, *states: str) -> list[str]:
    return [v.name for v in o.vms() if v.state in states]


def _create(o, rng, n):
    """A VM; half of them (when the cluster has storage) with a root disk on a random pool."""
    disk = _has_storage(o) and rng.random() < 0.5
    o.create_vm(f"vm-{n}-{rng.randrange(10**6)}", rng.choice(list(PROJECTS)), rng.choice(OFFERINGS)[0],
                "disk" if disk else "t", start=rng.random() < 0.85, pool=rng.choice(POOLS) if disk else None)


def _has_storage(o) -> bool:
    return bool(o.pools.rows())


def _volumes(o, *states: str, role: str | None = None) -> list:
    return [v for v in o.volumes.rows() if v.state in states and (role is None or v.role == role)]


def _create_volume(o, rng, n):
    if _has_storage(o):
        o.volumes.create(f"vol-{n}-{rng.randrange(10**6)}", rng.choice(list(PROJECTS)), rng.choice((64, 128, 512)),
                         pool=rng.choice(POOLS))


def _attach(o, rng, n):
    """An available volume to a VM of its project (a running one mostly: hot-plugged)."""
    if not (free := _volumes(o, "available")):
        return
    v = rng.choice(free)
    vms = [x for x in o.vms() if x.project.name == v.project and x.state in ("running", "stopped")]
    running = [x for x in vms if x.state == "running"]
    if pick := (running if running and rng.random() < 0.8 else vms):
        o.volumes.attach(v.name, rng.choice(pick).name)


def _detach(o, rng, n):
    """A data volume from its VM (a running one mostly: unplugged live)."""
    attached = _volumes(o, "attached", role="data")
    running = set(_vms(o, "running"))
    live = [v for v in attached if v.vm_name in running]
    if pick := (live if live and rng.random() < 0.8 else attached):
        o.volumes.detach(rng.choice(pick).name)


def _delete_volume(o, rng, n):
    if free := _volumes(o, "available"):
        o.volumes.delete(rng.choice(free).name)


def _resize_volume(o, rng, n):
    if vols := _volumes(o, "available", "attached"):
        v = rng.choice(vols)
        o.volumes.resize(v.name, v.size_mib + rng.choice((1, 64, 256)))


def _start(o, rng, n):
    if names := _vms(o, "stopped"):
        o.start_vm(rng.choice(names))


def _stop(o, rng, n):
    if names := _vms(o, "running"):
        o.stop_vm(rng.choice(names), force=True)


def _delete(o, rng, n):
    if names := _vms(o, "stopped"):
        o.delete_vm(rng.choice(names), keep_disk=rng.random() < 0.3)


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
        storage = {"storage_mib": STORAGE_MIB[name] - rng.randint(0, 2) * 256} if _has_storage(o) else {}
        o.catalog.set_quota(name, vcpus=vcpus + rng.randint(-3, 0), memory_mib=memory + rng.randint(-4, 0) * GIB,
                            **storage)


ACTIONS = ((_create, 5), (_start, 2), (_stop, 2), (_delete, 1), (_migrate, 3), (_scale, 4), (_scale_where_full, 2), (_drain, 1),
           (_cancel, 1), (_quota, 1), (_create_volume, 2), (_attach, 2), (_detach, 1), (_delete_volume, 1),
           (_resize_volume, 1))


# -- high availability (issue 12) -------------------------------------------------------------
HA_POINTS = ("ha.before-fenced", "ha.fenced", "ha.claimed", "ha.before-domain")
HA_MODES = ("power", "daemon", "network")
# a post-copy failure's two paused halves, and a migration's incoming domain on its target (paused, reason
# `migration`: a QEMU that has not run the guest yet, drivers/simfabric.py begin_incoming) are not a VM running twice
_ACTIVE_SQL = ("state NOT IN ('shutoff', 'crashed', 'nostate') AND NOT (state = 'paused' AND reason IN "
               "('postcopy-failed', 'migration'))")


def fabric_of(o: Orchestrator):
    return next(d.fabric for d in o.drivers.values() if isinstance(d, SimDriver))


def _create_ha(o, rng, n):
    """A VM restarted elsewhere when its host fails (no disk mostly: nothing but fencing keeps it from
    running twice; else its root disk on the shared pool), with a priority."""
    disk = _has_storage(o) and rng.random() < 0.3
    o.create_vm(f"ha-{n}-{rng.randrange(10**6)}", rng.choice(list(PROJECTS)), rng.choice(OFFERINGS[:3])[0],
                "disk" if disk else "t", start=True, pool="shared" if disk else None, ha_policy="restart",
                ha_priority=rng.randint(0, 5))


def out_of_service(o: Orchestrator) -> list[str]:
    """Hosts failed in the fabric, or not back in the store (down, fencing, fenced)."""
    failed = set(fabric_of(o).failed_hosts())
    return sorted(failed | {h.name for h in o.hosts() if h.state in ("down", "fencing", "fenced")})


def _fail_host(o, rng, n):
    """A host fails (power, daemon or network; a host with HA VMs mostly) and the monitor and HA see it
    at once (grace 0 in this cluster: declared, fenced, its HA VMs restarted). With a host already out of
    service, that one is repaired instead (one failed host at a time: the others have room)."""
    fabric = fabric_of(o)
    if out := out_of_service(o):
        repair(o, rng.choice(out))
        return
    ha_hosts = sorted({v.host.name for v in o.vms() if v.ha_policy == "restart" and v.state == "running" and v.host})
    host = rng.choice(ha_hosts) if ha_hosts and rng.random() < 0.9 else f"h{rng.randint(1, HOSTS)}"
    fabric.fail_host(host, rng.choice(HA_MODES))
    o.check_hosts()
    o.ha.check()


def repair(o: Orchestrator, host: str) -> None:
    """The host answers again (repaired, powered on: empty after a power failure or a fence); the monitor
    brings it back."""
    fabric_of(o).recover_host(host)
    o.check_hosts()


HA_ACTIONS = ((_create_ha, 3), (_fail_host, 1))


def running_twice(path) -> list[str]:
    """Every domain active on more than one host of the fabric file, read directly (a host the control
    plane can not reach included; a post-copy failure's two paused halves excluded)."""
    conn = sqlite3.connect(str(path), timeout=30)
    try:
        rows = conn.execute(f"SELECT name, GROUP_CONCAT(host, ', ') FROM domains WHERE {_ACTIVE_SQL} GROUP BY name "
                            f"HAVING COUNT(*) > 1").fetchall()
    finally:
        conn.close()
    return [f"domain {name} runs on {hosts} at once" for name, hosts in rows]


class TwiceWatch:
    """Samples the fabric file every `every_s` from a thread of its own, for the whole run: any domain
    active on two hosts at once is a finding (the audit can not see it: it asks hosts through their
    daemons, and a failed host's guests run on unseen)."""

    def __init__(self, path, every_s: float = 0.005):
        self.path, self.every_s = path, every_s
        self.found: dict[str, int] = {}         # finding -> times seen
        self.samples = 0
        self._stop = threading.Event()
        self._busy = threading.Lock()       # held while sampling: a fork waits for it (paused())
        self._thread = threading.Thread(target=self._loop, name="twice-watch", daemon=True)

    def __enter__(self) -> "TwiceWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def paused(self):
        """Hold while forking: a fork taken while this thread is inside SQLite would copy SQLite's lock held
        into the child, which then hangs at its first connect."""
        return self._busy

    def sample(self) -> list[str]:
        try:
            with self._busy:
                found = running_twice(self.path)
        except sqlite3.Error:
            return []                           # the file is being created or locked: the next sample
        self.samples += 1
        for f in found:
            self.found[f] = self.found.get(f, 0) + 1
        return found

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def take(self) -> list[str]:
        """Findings since the last take."""
        found, self.found = self.found, {}
        return [f"{f} (seen in {n} sample(s))" for f, n in sorted(found.items())]


_RESTART = re.compile(r"HA restart after (\S+) failed")


class FenceOrder:
    """Reads the event log forward (by id: the order of commits): each HA restart (the VM's event "HA
    restart after H failed", it moving to its new host) must come after H was fenced since it last went
    down (fenced, or repaired after it was fenced: powered off either way, its old guests gone), never
    while H is down or fencing, nor after it failed again and was not fenced again; and never while H is
    in another state than fenced and enabled (a drain of a fenced host is a finding). Counts fences and
    restarts."""

    def __init__(self):
        self.last_id = 0
        self.hosts: dict[str, str] = {}
        self.fenced: dict[str, bool] = {}       # fenced since it last went down
        self.fences = 0
        self.restarts = 0
        self.lost: list[str] = []       # HA VMs (named ha-*) settled stopped from unknown: not restarted

    def check(self, db) -> list[str]:
        e = EVENTS.c
        with db.read() as s:
            rows = s.connection().execute(select(e.id, e.kind, e.subject, e.vm, e.old_state, e.new_state, e.message)
                                          .where(e.id > self.last_id).order_by(e.id)).all()
        problems = []
        for row in rows:
            self.last_id = row.id
            if row.kind == "host" and row.new_state:
                self.hosts[row.subject] = row.new_state
                self.fences += row.new_state == "fenced"
                if row.new_state in ("down", "fenced"):
                    self.fenced[row.subject] = row.new_state == "fenced"
            elif row.kind == "vm" and row.new_state == "stopped" and (row.vm or "").startswith("ha-") and \
                    row.old_state == "unknown" and "not restarted after" not in (row.message or ""):
                self.lost.append(f"{row.vm} (event {row.id}: {row.message})")
            elif row.kind == "vm" and (m := _RESTART.search(row.message or "")):
                self.restarts += 1
                host = m.group(1)
                state = self.hosts.get(host, "enabled")
                if not self.fenced.get(host) or state not in ("fenced", "enabled"):
                    problems.append(f"vm {row.vm}: restarted by HA (event {row.id}) while its host {host} was "
                                    f"{state}, not fenced since it went down")
        return problems


def ha_problems(o: Orchestrator) -> list[str]:
    """After the recoveries ended: no VM charged on a fenced host (its HA VMs run elsewhere or are in
    error, the others stopped), no HA VM left starting/unknown on one."""
    fenced = {h.name for h in o.hosts() if h.state == "fenced"}
    return [f"vm {v.name} (ha {v.ha_policy}) is {v.state} on the fenced host {v.host.name}" for v in o.vms()
            if v.host and v.host.name in fenced and v.state not in ("stopped", "error")]


def workload(o: Orchestrator, rng: random.Random, steps: int, focus: str = "", ha: bool = False) -> None:
    """Random actions; with a crash point armed (`focus`), the actions that reach it are made likelier;
    `ha`: HA VMs are created and hosts fail (HA_ACTIONS)."""
    # a volume step needs a volume in the state before it: what makes one is made likelier too (a run missed
    # volume.before-detach in all 8 rounds armed for it, no data volume attached at the right time)
    boost = {"scale.migrating": (_scale_where_full,), "scale.after-migration": (_scale_where_full,),
             "drain.mid": (_drain,), "volume.before-create": (_create_volume,),
             "volume.after-create": (_create_volume,), "volume.before-attach": (_create_volume, _attach),
             "volume.before-detach": (_attach, _detach),
             "volume.before-delete": (_detach, _delete_volume)}.get(focus, ())
    boost = (_create_ha, _fail_host) if focus.startswith("ha.") else boost
    actions, weights = zip(*((a, w * 3 if a in boost else w) for a, w in ACTIONS + (HA_ACTIONS if ha else ())))
    for n in range(steps):
        try:
            rng.choices(actions, weights)[0](o, rng, n)
        except VmplaneError:
            pass                       # refused (quota, capacity, state): as a user would be
        time.sleep(rng.uniform(0, 0.01))


def _control_plane(url: str, seed: int, armed: dict[str, int], steps: int, ha: bool = False) -> None:
    """A forked control plane: start up (recovering), run the workload, wait for its operations. With `ha`,
    it first looks at its hosts as its monitor and HA loops would (a host that failed before the last
    one was killed is declared now)."""
    simfabric.forget_shared()
    logging.disable(logging.CRITICAL)
    failpoints.arm(armed)
    # a control plane still alive after 55 s (the harness kills it at 60: "hung") says where each thread is
    folder = Path(os.environ.get("VMPLANE_SIM_HOSTS") or url.removeprefix("sqlite:///")).parent   # (PostgreSQL: the sim hosts file's)
    stacks = open(folder / f"hung-{os.getpid()}.txt", "w")   # noqa: SIM115
    faulthandler.dump_traceback_later(55, file=stacks)
    db = Database(url)
    o = Orchestrator(db, ThreadPoolExecutor(4))
    o.load()
    for d in o.drivers.values():
        if isinstance(d, SimDriver):
            d.copy_rate_mib_s = COPY_RATE_MIB_S
    if ha:
        o.check_hosts()
        o.ha.check()
    workload(o, random.Random(seed), steps, focus=next(iter(armed), ""), ha=ha)
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
    """Every invariant the harness promises, in words (empty when all hold). A host left `down` (it holds
    no HA VM, so HA does not fence it) is repaired first: until it answers, a migration into or out of it
    can not be settled (unknown is not absent), as the README says."""
    down = [h.name for h in o.hosts() if h.state == "down"]
    for host in down:
        repair(o, host)
    if down:        # what waited for them, settled now that they answer (the loops do it every few s)
        o.migration_settle.run_once()
        o.storage_settle.run_once(min_age_s=0)
    problems = [f"still in flight after {SETTLE_S:.0f} s: {x}" for x in settle(o, SETTLE_S)]
    # the storage-settle loop's pass (every 10 s), run as it would: it settles a volume the start-up
    # recovery could not (its VM's host did not answer then, was fenced since and its VM restarted
    # elsewhere) and deletes a migration's second disk copy whose deletion a kill interrupted (recovery
    # skips the VMs still migrating then). What it can not settle or delete stays a finding.
    o.storage_settle.run_once(min_age_s=0)
    problems += [f"vm {v.name} left {v.state}" for v in o.vms()
                 if v.state in ("starting", "stopping", "migrating", "scaling")]
    problems += unknown_left(o)
    return problems + storage_problems(o, waiting_for=out_of_service(o)) + o.audit()


def answering_hosts(o: Orchestrator) -> list[str]:
    """The hosts recorded in service (not down, fencing or fenced) whose hypervisor answers now."""
    from vmplane.hostmonitor import probe

    return [h.name for h in o.hosts() if h.state not in ("down", "fencing", "fenced") and h.name in o.drivers
            and probe(o.drivers[h.name]) is None]


def unknown_on_answering_hosts(o: Orchestrator) -> list[tuple[str, str]]:
    """(vm, host) of every `unknown` VM whose host answers (review N3: nothing settles it but the monitor's
    pass; the audit names it)."""
    answering = set(answering_hosts(o))
    return [(v.name, v.host.name) for v in o.vms() if v.state == "unknown" and v.host and v.host.name in answering]


def unknown_left(o: Orchestrator) -> list[str]:
    """After the settling: the monitor's pass over unknown VMs (hostmonitor.settle_unknown), run once as its
    loop would; an `unknown` VM whose host answers left after it is a finding."""
    if o.monitor.settle_unknown(answering_hosts(o)):     # what they leave to the other loops, as those would
        o.sync.sync()
        o.storage_settle.run_once(min_age_s=0)
    return [f"vm {vm} left unknown on {host}, which answers" for vm, host in unknown_on_answering_hosts(o)]


def _volume_story(o: Orchestrator, v) -> str:
    """What a finding about a volume needs to be understood: its VM now, and its last events."""
    vm = next((x for x in o.vms() if x.name == v.vm_name), None) if v.vm_name else None
    with o.db.read() as s:
        last = s.execute(select(EVENTS.c.old_state, EVENTS.c.new_state, EVENTS.c.cause, EVENTS.c.message)
                         .where(EVENTS.c.kind == "volume", EVENTS.c.subject == v.name)
                         .order_by(EVENTS.c.id.desc()).limit(4)).all()
    where = f"vm {vm.name} {vm.state} on {vm.host.name if vm.host else None}" if vm else f"vm {v.vm_name}"
    return where + "; last events: " + " | ".join(f"{r.old_state}->{r.new_state} by {r.cause}: {r.message}"
                                                  for r in reversed(last))


def storage_problems(o: Orchestrator, waiting_for: list[str] = ()) -> list[str]:
    """No volume between two steps (recovery settled them), no copy left claimed, each project's storage
    ledger == its volumes and within quota (the pools' used space == volumes: in the audit). A volume on
    the local pool of a host that does not answer (`waiting_for`: failed, fenced) waits for it: not a
    finding."""
    waiting = {f"local-{h}" for h in waiting_for}
    problems = [f"volume {v.name} left {v.state} ({_volume_story(o, v)})" for v in o.volumes.rows()
                if v.state in ("creating", "attaching", "detaching", "deleting") and v.pool_name not in waiting]
    problems += [f"volume {v.name} still has a copy on {v.copy_pool_name}" for v in o.volumes.rows()
                 if v.copy_pool_name and v.copy_pool_name not in waiting]
    for project in PROJECTS:
        u = o.project_usage(project)
        if u["ledger"].storage_mib != u["recomputed"].storage_mib:
            problems.append(f"project {project}: storage ledger {u['ledger'].storage_mib} MiB, recomputed "
                            f"{u['recomputed'].storage_mib} MiB")
        if u["quota"].storage_mib is not None and u["ledger"].storage_mib > u["quota"].storage_mib:
            problems.append(f"project {project}: {u['ledger'].storage_mib} MiB of storage > quota "
                            f"{u['quota'].storage_mib} MiB")
    return problems


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
    watch: "TwiceWatch | None" = None       # the running-twice watch (its samples)
    order: "FenceOrder | None" = None       # the event-order check (fences and HA restarts seen)

    @property
    def kills(self) -> list[Round]:
        return [r for r in self.rounds if r.killed]

    def points_hit(self) -> set[str]:
        return {r.kill for r in self.kills if r.kill != "timed"}

    def problems(self) -> list[str]:
        return [f"round {r.number} (kill {r.kill}): {p}" for r in self.rounds for p in r.problems]


# A target's libvirtd notices a power-cut source by its keepalive (libvirt's default ~30 s: the sim's
# incoming_linger_s). Until then a copy whose source came back empty is "asked again" (review N1); the
# harnesses give their sim hosts a 3 s keepalive so that it settles within their 30 s quiet period.
INCOMING_LINGER_S = 3.0


def run(home: Path, rounds: int, seed: int, steps: int = 60, timed_share: float = 0.4, unchecked_share: float = 0.25,
        log=lambda line: None, stop_at_problem: bool = True, ha: bool = True) -> Report:
    """`rounds` crash-and-restart rounds on one cluster; failpoints are cycled so each is armed. After
    a share of the kills the next control plane starts without a check in between, so that its own
    start-up (the recovery) runs with a crash point armed too. `ha`: HA VMs, and hosts failing during
    the workload (power, daemon, network; repaired later), so that recoveries are killed too; a watch
    reads the fabric all along for a domain running on two hosts at once, and each check also asks:
    every HA restart came after its host was fenced, no VM left charged on a fenced host."""
    with stores.sim_hosts_env(home), stores.env("VMPLANE_SIM_INCOMING_LINGER_S", INCOMING_LINGER_S):
        return _run(home, rounds, seed, steps, timed_share, unchecked_share, log, stop_at_problem, ha)


def _run(home, rounds, seed, steps, timed_share, unchecked_share, log, stop_at_problem, ha) -> Report:
    url = stores.store_url(home)
    seed_cluster(url, ha_grace=0 if ha else None)
    simfabric.forget_shared()
    logging.getLogger("vmplane").setLevel(logging.CRITICAL)     # recoveries log what they undo; rounds say it
    rng = random.Random(seed)
    ctx = multiprocessing.get_context("fork")
    report = Report()
    points, next_point, misses = list(crash_points(ha)), 0, 0
    order = FenceOrder()
    watch = TwiceWatch(simfabric.SimFabric.for_store(url).path).__enter__()
    report.watch, report.order = watch, order
    try:
        _rounds(url, home, rounds, rng, ctx, report, points, next_point, misses, steps, timed_share, unchecked_share,
                log, stop_at_problem, ha, watch, order)
    finally:
        watch.__exit__()
        simfabric.forget_shared()
    return report


def _rounds(url, home, rounds, rng, ctx, report, points, next_point, misses, steps, timed_share, unchecked_share, log,
            stop_at_problem, ha, watch, order) -> None:
    for number in range(rounds):
        timed = rng.random() < timed_share
        armed = {} if timed else {points[next_point % len(points)]: rng.randint(1, 2)}
        child = ctx.Process(target=_control_plane, args=(url, rng.randrange(2**32), armed, steps, ha))
        with watch.paused():
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
        for f in home.glob("hung-*.txt"):
            if f.stat().st_size == 0:       # only a hung control plane's stacks are kept
                f.unlink()
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
            if ha:          # what its monitor and HA loops do first: a host failed meanwhile is declared
                o.check_hosts()
                o.ha.check()
            problems = ["the control plane hung for 60 s"] * hung + check(o)
            if ha:
                problems += ha_problems(o) + order.check(db)
            problems += watch.take()
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
