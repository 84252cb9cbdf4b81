"""A crash harness: kill the control plane (SIGKILL) in the middle of random operations, restart it,
and check that nothing was lost, duplicated or leaked.

Each round forks a control plane (an Orchestrator with its thread pool, over the SQLite store and
the sim hosts' fabric file) that runs a random workload: create and start, stop, delete, live
migrate and cancel, live scale (growing past a full host, so that it migrates first), drain a host
and bring it back, change quotas and whether overhead counts; with storage (the default), VMs with
root disks on small local and shared pools, and volumes created, attached (hot-plugged into running VMs),
detached, grown and deleted against small storage quotas; with HA (the default), VMs with `--ha restart`
and hosts failing (power, daemon, network; `vmplane.ha.grace` 0, so each is declared, fenced and its HA
VMs restarted at once: the ha.* crash points) and repaired later; with networks (the harness's cluster), an
isolated network per project (all on one CIDR), a share of the VMs created with a NIC on it, and NICs
hot-plugged into and unplugged from running VMs (the nic.* and network.* crash points). The round ends with
a kill:
- at a named crash point (vmplane.failpoints), armed for its N-th pass; the workload steps toward it
  (`toward`: the step that passes it, or the one that makes the cluster allow it) most of the time, or
- at a random moment, by the harness, after 0-150 ms.
A run follows a schedule (`schedule`): each cycle arms every crash point once and kills at a random moment
TIMED_KILLS times, in an order drawn from the seed, so that one cycle meets every point by construction (a
point not reached is armed again in the next round).
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
- no NIC is left between two steps once the NIC settle pass ran (a NIC of a VM on a host out of service waits
  for it), the NIC audit (each running VM's NICs == its domain's) has no finding, after a full pass of the
  networking controller every sim host's filter ports == the store's view of that host, and no two NICs share
  a MAC or an address on one network;
- with HA: the checking control plane first looks at its hosts (as its monitor and HA loops would), so a
  recovery the kill interrupted is resumed and one not yet declared is; then no VM is left charged on a
  fenced host (each HA VM runs exactly once elsewhere, or is in error), every HA restart in the event log
  came after its host was fenced, and a watch that read the fabric file every 5 ms during the whole run
  (killed control planes included) never saw a domain running on two hosts.

Determinism: the seed fixes every choice of the harness: the schedule, each round's crash point and the pass
it kills at, the moment of a timed kill, whether the restart is checked, each control plane's workload seed;
every workload step draws from a stream of its own (one draw a step), so a step's choices do not depend on
what the steps before it drew. What a step does still depends on the cluster it finds, which threads shape
(the control plane's pool and loops, the copies under way): which VM a step picks, where a timed kill lands
and the findings' VM names can differ between two runs of one seed; the schedule and the points armed do
not. A failing run keeps its evidence (`assert_clean`, `keep_evidence`) in a folder its message names.
"""

from __future__ import annotations

import collections
import faulthandler
import logging
import multiprocessing
import os
import random
import re
import shutil
import signal
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import select

from vmplane.controllers import nics
from vmplane.controllers.networking import underlay
from vmplane.core import failpoints
from vmplane.core.driver import DriverError
from vmplane.core.errors import VmplaneError
from vmplane.core.model import Offering, OfferingKind
from vmplane.hosts.drivers import simfabric
from vmplane.hosts.drivers.sim import SimDriver
from vmplane.hosts.drivers.simstorage import SHARED
from vmplane.orchestrator import InlineExecutor, Orchestrator
from vmplane.store import Database, netview
from vmplane.store import ledger as L
from vmplane.store import networks as SN
from vmplane.store.events import EVENTS
from vmplane.store.schema import Vm

from . import crashsnapshots, evidence, stores

GIB = 1024
PROJECTS = {"alpha": (12, 20 * GIB, 8), "beta": (8, 12 * GIB, 6), "gamma": (6, 10 * GIB, 5)}
OFFERINGS = (("s1", 1, 512), ("s2", 2, 1024), ("m4", 4, 2048), ("l6", 4, 6144))
HOSTS = 4
STORAGE_MIB = {"alpha": 3 * GIB, "beta": 2 * GIB, "gamma": 1536}  # storage quota per project
LOCAL_POOL_MIB, SHARED_POOL_MIB = 2 * GIB, 3 * GIB  # small pools: they fill up
POOLS = (None, "shared", *(f"local-h{i}" for i in range(1, HOSTS + 1)))
# the crash points of the volume steps (failpoints.POINTS may not list them yet)
VOLUME_POINTS = (
    "volume.before-create",
    "volume.after-create",
    "volume.before-attach",
    "volume.before-detach",
    "volume.before-delete",
)
NET_CIDR = "10.10.0.0/24"  # every project's network: two projects may use one CIDR
COPY_RATE_MIB_S = 12 * GIB  # a 1 GiB VM copies in ~80 ms: long enough to be killed mid-copy
SETTLE_S = 30.0


def crash_points(ha: bool = True) -> tuple[str, ...]:
    points = failpoints.POINTS + tuple(p for p in VOLUME_POINTS if p not in failpoints.POINTS)
    return points if ha else tuple(p for p in points if not p.startswith("ha."))


def seed_cluster(url: str, storage: bool = True, ha_grace: float | None = None, networks: bool = False) -> None:
    """Zone, cluster, four small sim hosts, offerings that scale live, three tight projects; with
    `storage`: a small local pool per host, a small shared pool, a template with a disk image and
    storage quotas; with `networks`: an isolated network per project (`net_of`), all on NET_CIDR."""
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
    if ha_grace is not None:  # the crash harness: 0, a failed host is declared at once
        c.set_setting("vmplane.ha.grace", str(ha_grace))
    for i in range(1, HOSTS + 1):
        o.add_host(f"h{i}", "c1", "sim", 8, 2400, 8 * GIB)
    for name, vcpus, memory in OFFERINGS:
        c.create_offering(Offering(name, OfferingKind.fixed, vcpus=vcpus, memory_mib=memory, dynamic_scaling=True))
    c.create_template("t", "tiny-linux", dynamic_scaling=True)
    for name, (vcpus, memory, vms) in PROJECTS.items():
        c.create_project(
            name, vcpus, memory, vms, count_overhead=True, **({"storage_mib": STORAGE_MIB[name]} if storage else {})
        )
    if storage:
        c.create_template("disk", "tiny-linux", disk="tiny-linux", dynamic_scaling=True)
        for i in range(1, HOSTS + 1):
            o.pools.create(f"local-h{i}", "local", host=f"h{i}")
        o.pools.create("shared", "shared", cluster="c1")
        o.backups.create_store("bk", "c1")  # (issue 32: backups of the VMs with disks)
    if networks:
        zone_id = next(z.id for z in c.zones() if z.name == "z1")
        for name in PROJECTS:
            with o.db.transaction() as conn:
                project_id = L.lock_project(conn, name=name).id
                SN.create_network(conn, net_of(name), "isolated", zone_id, NET_CIDR, project_id=project_id)
    o.close()
    db.dispose()


def net_of(project: str) -> str:
    return f"net-{project}"


# -- the workload ------------------------------------------------------------------------------
def _vms(o: Orchestrator, *states: str) -> list[str]:
    return [v.name for v in o.vms() if v.state in states]


def _create(o, rng, n):
    """A VM; half of them (when the cluster has storage) with a root disk on a random pool."""
    disk = _has_storage(o) and rng.random() < 0.5
    o.create_vm(
        f"vm-{n}-{rng.randrange(10**6)}",
        rng.choice(list(PROJECTS)),
        rng.choice(OFFERINGS)[0],
        "disk" if disk else "t",
        start=rng.random() < 0.85,
        pool=rng.choice(POOLS) if disk else None,
    )


def _has_storage(o) -> bool:
    return bool(o.pools.rows())


def _volumes(o, *states: str, role: str | None = None) -> list:
    return [v for v in o.volumes.rows() if v.state in states and (role is None or v.role == role)]


def _create_volume(o, rng, n):
    if _has_storage(o):
        o.volumes.create(
            f"vol-{n}-{rng.randrange(10**6)}",
            rng.choice(list(PROJECTS)),
            rng.choice((64, 128, 512)),
            pool=rng.choice(POOLS),
        )


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
    vcpus, memory, _vms = PROJECTS[name]
    if rng.random() < 0.3:
        o.catalog.set_quota(name, count_overhead=rng.random() < 0.7)
    else:
        storage = {"storage_mib": STORAGE_MIB[name] - rng.randint(0, 2) * 256} if _has_storage(o) else {}
        o.catalog.set_quota(
            name, vcpus=vcpus + rng.randint(-3, 0), memory_mib=memory + rng.randint(-4, 0) * GIB, **storage
        )


ACTIONS = (
    (_create, 5),
    (_start, 2),
    (_stop, 2),
    (_delete, 1),
    (_migrate, 3),
    (_scale, 4),
    (_scale_where_full, 2),
    (_drain, 1),
    (_cancel, 1),
    (_quota, 1),
    (_create_volume, 2),
    (_attach, 2),
    (_detach, 1),
    (_delete_volume, 1),
    (_resize_volume, 1),
)


# -- guest networks (issue 29) ------------------------------------------------------------------
MAX_NICS = 4  # a VM's NICs: the workload adds no more (adds and removes balance only on average)


def _nics(o, *vm_states: str) -> list[tuple[str, str]]:
    """(VM, MAC) of every attached NIC of a VM in `vm_states`, in the NICs' order."""
    n, v = SN.NICS.c, Vm.__table__.c
    with o.db.read() as s:
        rows = s.execute(
            select(v.name, n.mac)
            .join(Vm.__table__, v.id == n.vm_id)
            .where(v.state.in_(vm_states), n.state == "attached", n.mac.is_not(None))
            .order_by(n.id)
        ).all()
    return [(vm, mac) for vm, mac in rows]


def _create_with_nic(o, rng, n, start: bool | None = None, project: str | None = None):
    """A small VM with a NIC on its project's network (started mostly)."""
    project = project or rng.choice(list(PROJECTS))
    o.create_vm(
        f"vm-{n}-{rng.randrange(10**6)}",
        project,
        rng.choice(OFFERINGS[:3])[0],
        "t",
        start=rng.random() < 0.85 if start is None else start,
        networks=[(net_of(project), None)],
    )


def _nic_targets(o, *states: str) -> list:
    """The VMs in `states` that may get one NIC more."""
    count = collections.Counter(vm for vm, _ in _nics(o, *states))
    return [v for v in o.vms() if v.state in states and count[v.name] < MAX_NICS]


def _nic_add(o, rng, n):
    """A NIC on its project's network added to a VM (a running one mostly: hot-plugged)."""
    vms = _nic_targets(o, "running", "stopped")
    running = [v for v in vms if v.state == "running"]
    if pick := (running if running and rng.random() < 0.8 else vms):
        vm = rng.choice(pick)
        o.nics.add(vm.name, net_of(vm.project.name))


def _nic_remove(o, rng, n):
    """A NIC removed from its VM (a running one mostly: unplugged live)."""
    live = _nics(o, "running")
    if pick := (live if live and rng.random() < 0.8 else _nics(o, "running", "stopped")):
        o.nics.remove(*rng.choice(pick))


# a share of the VMs made with a NIC, NICs added and removed (crashkit's own: the truth harness's cluster
# has no network)
NET_ACTIONS = ((_create_with_nic, 2), (_nic_add, 1), (_nic_remove, 1))


# -- high availability (issue 12) -------------------------------------------------------------
HA_POINTS = ("ha.before-fenced", "ha.fenced", "ha.claimed", "ha.before-domain")
HA_MODES = ("power", "daemon", "network")
# a post-copy failure's two paused halves, and a migration's incoming domain on its target (paused, reason
# `migration`: a QEMU that has not run the guest yet, drivers/simfabric.py begin_incoming) are not a VM running twice
_ACTIVE_SQL = (
    "state NOT IN ('shutoff', 'crashed', 'nostate') AND NOT (state = 'paused' AND reason IN "
    "('postcopy-failed', 'migration'))"
)


def fabric_of(o: Orchestrator):
    return next(d.fabric for d in o.drivers.values() if isinstance(d, SimDriver))


def _create_ha(o, rng, n, nic: bool = False):
    """A VM restarted elsewhere when its host fails (no disk mostly: nothing but fencing keeps it from
    running twice; else its root disk on the shared pool), with a priority; with `nic`, a NIC on its
    project's network (its restart brings the new host to hold it first)."""
    disk = _has_storage(o) and rng.random() < 0.3
    name, project = f"ha-{n}-{rng.randrange(10**6)}", rng.choice(list(PROJECTS))  # (the draws in their old order)
    o.create_vm(
        name,
        project,
        rng.choice(OFFERINGS[:3])[0],
        "disk" if disk else "t",
        start=True,
        pool="shared" if disk else None,
        ha_policy="restart",
        ha_priority=rng.randint(0, 5),
        networks=[(net_of(project), None)] if nic else (),
    )


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


def _create_ha_with_nic(o, rng, n):
    _create_ha(o, rng, n, nic=True)


HA_NET_ACTIONS = ((_create_ha_with_nic, 1),)  # (crashkit's own: the truth harness's cluster has no network)


def running_twice(path) -> list[str]:
    """Every domain active on more than one host of the fabric file, read directly (a host the control
    plane can not reach included; a post-copy failure's two paused halves excluded)."""
    conn = sqlite3.connect(str(path), timeout=30)
    try:
        rows = conn.execute(
            f"SELECT name, GROUP_CONCAT(host, ', ') FROM domains WHERE {_ACTIVE_SQL} GROUP BY name HAVING COUNT(*) > 1"
        ).fetchall()
    finally:
        conn.close()
    return [f"domain {name} runs on {hosts} at once" for name, hosts in rows]


class TwiceWatch:
    """Samples the fabric file every `every_s` from a thread of its own, for the whole run: any domain
    active on two hosts at once is a finding (the audit can not see it: it asks hosts through their
    daemons, and a failed host's guests run on unseen)."""

    def __init__(self, path, every_s: float = 0.005):
        self.path, self.every_s = path, every_s
        self.found: dict[str, int] = {}  # finding -> times seen
        self.samples = 0
        self._stop = threading.Event()
        self._busy = threading.Lock()  # held while sampling: a fork waits for it (paused())
        self._thread = threading.Thread(target=self._loop, name="twice-watch", daemon=True)

    def __enter__(self) -> TwiceWatch:
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
            return []  # the file is being created or locked: the next sample
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
        self.fenced: dict[str, bool] = {}  # fenced since it last went down
        self.fences = 0
        self.restarts = 0
        self.lost: list[str] = []  # HA VMs (named ha-*) settled stopped from unknown: not restarted

    def check(self, db) -> list[str]:
        e = EVENTS.c
        with db.read() as s:
            rows = (
                s.connection()
                .execute(
                    select(e.id, e.kind, e.subject, e.vm, e.old_state, e.new_state, e.message)
                    .where(e.id > self.last_id)
                    .order_by(e.id)
                )
                .all()
            )
        problems = []
        for row in rows:
            self.last_id = row.id
            if row.kind == "host" and row.new_state:
                self.hosts[row.subject] = row.new_state
                self.fences += row.new_state == "fenced"
                if row.new_state in ("down", "fenced"):
                    self.fenced[row.subject] = row.new_state == "fenced"
            elif (
                row.kind == "vm"
                and row.new_state == "stopped"
                and (row.vm or "").startswith("ha-")
                and row.old_state == "unknown"
                and "not restarted after" not in (row.message or "")
            ):
                self.lost.append(f"{row.vm} (event {row.id}: {row.message})")
            elif row.kind == "vm" and (m := _RESTART.search(row.message or "")):
                self.restarts += 1
                host = m.group(1)
                state = self.hosts.get(host, "enabled")
                if not self.fenced.get(host) or state not in ("fenced", "enabled"):
                    problems.append(
                        f"vm {row.vm}: restarted by HA (event {row.id}) while its host {host} was "
                        f"{state}, not fenced since it went down"
                    )
        return problems


def ha_problems(o: Orchestrator) -> list[str]:
    """After the recoveries ended: no VM charged on a fenced host (its HA VMs run elsewhere or are in
    error, the others stopped), no HA VM left starting/unknown on one."""
    fenced = {h.name for h in o.hosts() if h.state == "fenced"}
    return [
        f"vm {v.name} (ha {v.ha_policy}) is {v.state} on the fenced host {v.host.name}"
        for v in o.vms()
        if v.host and v.host.name in fenced and v.state not in ("stopped", "error")
    ]


# -- steps forced towards an armed crash point ------------------------------------------------------------
# Each `_toward_*` takes, from the cluster as it is, the next step on the way to its crash point: the step
# that passes the point when the cluster allows it (trying a few candidates in turn), else the one that makes
# it allow it (a VM to start, a volume to make, room made by stopping a VM). A round armed at a point takes
# such a step most of the time (STEER), so that it reaches the point within a few steps instead of by luck
# (135 random rounds once missed volume.before-detach in all 8 rounds armed for it).
STEER = 0.75
TRIES = 5  # candidates a forced step tries before it makes room instead


def _first_accepted(attempts) -> bool:
    """Each attempt (a callable) in turn, until one is not refused."""
    for attempt in attempts:
        try:
            attempt()
            return True
        except VmplaneError:
            continue
    return False


def _tidy(o) -> None:
    """A host left in maintenance brought back and a host out of service repaired: room to admit again (before
    each forced step of the crash harness; not in the truth harness, whose nemesis keeps hosts failed)."""
    for h in o.hosts():
        if h.state == "maintenance":
            o.maintenance.exit(h.name)
    for host in out_of_service(o):
        repair(o, host)


def _make_room(o, rng, project: str | None = None, off: str | None = None) -> None:
    """A running VM (of `project`; not on host `off`) stopped, and a stopped one deleted: quota, hosts' room
    and the count of VMs freed for the next step."""
    running = [
        v.name
        for v in o.vms()
        if v.state == "running"
        and (project is None or v.project.name == project)
        and not (off and v.host and v.host.name == off)
    ]
    if running:
        _first_accepted([lambda: o.stop_vm(rng.choice(running), force=True)])
    if stopped := _vms(o, "stopped"):
        _first_accepted([lambda: o.delete_vm(rng.choice(stopped))])


def _room(vm) -> tuple[int, int]:
    """What the quota of `vm`'s project leaves: vCPUs, MiB."""
    p = vm.project
    return p.quota_vcpus - p.used_vcpus, p.quota_memory_mib - p.used_memory_mib


def _shuffled(rng, items) -> list:
    items = list(items)
    rng.shuffle(items)
    return items


def _toward_start(o, rng, n):
    """A stopped VM started, else a small VM created and started; else room made."""
    starts = [lambda x=x: o.start_vm(x) for x in _shuffled(rng, _vms(o, "stopped"))[:TRIES]]
    creates = [
        lambda p=p: o.create_vm(f"vm-{n}-{rng.randrange(10**6)}", p, OFFERINGS[0][0], "t", start=True)
        for p in _shuffled(rng, PROJECTS)
    ]
    if not _first_accepted(starts + creates):
        _make_room(o, rng)


def _toward_stop(o, rng, n):
    _stop(o, rng, n) if _vms(o, "running") else _toward_start(o, rng, n)


def _toward_migrate(o, rng, n):
    """A running VM migrated (where the planner says); else a VM started, or room made."""
    running = _vms(o, "running")
    if not running:
        return _toward_start(o, rng, n)
    if not _first_accepted([lambda x=x: o.migrator.migrate(x) for x in _shuffled(rng, running)[:TRIES]]):
        _make_room(o, rng)


def _toward_scale(o, rng, n):
    """A running VM grown to a larger offering its quota allows (its memory grows: scale.after-memory)."""
    running = [v for v in o.vms() if v.state == "running" and v.host]
    if not running:
        return _toward_start(o, rng, n)
    pairs = [
        (v.name, name)
        for v in running
        for name, vcpus, memory in OFFERINGS
        if memory > v.memory_mib and vcpus - v.vcpus <= _room(v)[0] and memory - v.memory_mib + 400 <= _room(v)[1]
    ]
    if not _first_accepted([lambda p=p: o.scaler.scale(p[0], offering=p[1]) for p in _shuffled(rng, pairs)[:TRIES]]):
        _make_room(o, rng, project=rng.choice(running).project.name)


def _toward_scale_where_full(o, rng, n):
    """A scale that must migrate first: a VM whose quota allows the largest offering, its host packed (other
    VMs migrated to it) until that offering no longer fits there, then the VM grown to it."""
    name, vcpus, memory = OFFERINGS[-1]
    running = [v for v in o.vms() if v.state == "running" and v.host and v.offering.name != name]
    growable = [v for v in running if _room(v)[0] >= vcpus - v.vcpus and _room(v)[1] >= memory - v.memory_mib + 400]
    if not growable:
        return _make_room(o, rng) if running else _toward_start(o, rng, n)
    hosts = {h.name: h for h in o.hosts()}
    vm = min(growable, key=lambda v: (hosts[v.host.name].memory_mib - hosts[v.host.name].used_memory_mib, v.name))
    home = hosts[vm.host.name]
    if (
        home.memory_mib - home.used_memory_mib < memory - vm.memory_mib
        or home.cores - home.used_vcpus < vcpus - vm.vcpus
    ):
        try:
            o.scaler.scale(vm.name, offering=name)  # no room beside it: it migrates first
        except VmplaneError:
            _make_room(o, rng, off=home.name)  # (no other host has room for it)
            raise
        return
    others = [v.name for v in running if v.host.name != home.name]
    packed = _first_accepted([lambda x=x: o.migrator.migrate(x, to=home.name) for x in _shuffled(rng, others)[:TRIES]])
    creates = [
        lambda p=p: o.create_vm(f"vm-{n}-{rng.randrange(10**6)}", p, OFFERINGS[2][0], "t", start=True)
        for p in _shuffled(rng, PROJECTS)
    ]
    if not packed and not _first_accepted(creates):
        _make_room(o, rng, off=home.name)


def _toward_drain(o, rng, n):
    """The host that runs the most VMs into maintenance (a host left in maintenance brought back first);
    none of its VMs admitted to migrate: room made elsewhere."""
    if back := [h.name for h in o.hosts() if h.state == "maintenance"]:
        o.maintenance.exit(back[0])
        return
    for host in out_of_service(o):
        repair(o, host)
    running = [v.host.name for v in o.vms() if v.state == "running" and v.host]
    if not running:
        return _toward_start(o, rng, n)
    host = max(sorted(set(running)), key=running.count)
    if not o.maintenance.enter(host)["migrations"]:
        _make_room(o, rng, off=host)


def _toward_create_volume(o, rng, n):
    """A volume created (one deleted first when several wait: the storage quotas are small)."""
    if len(_volumes(o, "available")) > 3:
        _delete_volume(o, rng, n)
    else:
        _create_volume(o, rng, n)


def _opens(volume, vm) -> bool:
    """Whether `vm`'s host can open `volume` (a local pool's volume: only on its own host)."""
    pool = volume.pool_name or ""
    return not pool.startswith("local-") or (vm.host is not None and pool == f"local-{vm.host.name}")


def _toward_attach(o, rng, n, running_only: bool = False):
    """A volume attached to a VM of its project (a running one with `running_only`) whose host opens it; else
    a volume made on the shared pool for a project that has such a VM."""
    vms = [v for v in o.vms() if v.state in (("running",) if running_only else ("running", "stopped"))]
    if not vms:
        return _toward_start(o, rng, n)
    pairs = [
        (vol.name, vm.name)
        for vol in _volumes(o, "available")
        for vm in vms
        if vm.project.name == vol.project and _opens(vol, vm)
    ]
    if not _first_accepted([lambda p=p: o.volumes.attach(*p) for p in _shuffled(rng, pairs)[:TRIES]]):
        o.volumes.create(f"vol-{n}-{rng.randrange(10**6)}", rng.choice(vms).project.name, 64, pool="shared")


def _toward_detach(o, rng, n):
    """A data volume of a running VM detached (unplugged live: a detach of a stopped VM's volume never asks
    the guest; a few tried in turn); else one attached to a running VM (else to any VM)."""
    running = set(_vms(o, "running"))
    live = sorted(v.name for v in _volumes(o, "attached", role="data") if v.vm_name in running)
    if _first_accepted([lambda v=v: o.volumes.detach(v) for v in live[:TRIES]]):
        return
    _toward_attach(o, rng, n, running_only=bool(running))


def _toward_delete_volume(o, rng, n):
    if _volumes(o, "available"):
        _delete_volume(o, rng, n)
    elif _volumes(o, "attached", role="data"):
        _detach(o, rng, n)
    else:
        _create_volume(o, rng, n)


def _toward_ha(o, rng, n):
    """A host out of service repaired; else the host of a running HA VM fails (power: declared, fenced and
    its HA VMs restarted at once, grace 0) and its recovery is given time to run; else an HA VM made (room
    made when it is refused)."""
    if out := out_of_service(o):
        repair(o, rng.choice(out))
        return
    ha_hosts = sorted({v.host.name for v in o.vms() if v.ha_policy == "restart" and v.state == "running" and v.host})
    if not ha_hosts:
        try:
            return _create_ha(o, rng, n)
        except VmplaneError:
            _make_room(o, rng)
            raise
    fabric_of(o).fail_host(rng.choice(ha_hosts), "power")
    o.check_hosts()
    o.ha.check()
    settle(o, 10.0)  # the recovery runs in the pool: its crash points are passed meanwhile


def _toward_nic_add(o, rng, n):
    """A NIC hot-plugged into a running VM (a few tried in turn); else a VM started."""
    if not (running := _nic_targets(o, "running")):
        return _toward_start(o, rng, n)
    tries = [lambda v=v: o.nics.add(v.name, net_of(v.project.name)) for v in _shuffled(rng, running)[:TRIES]]
    if not _first_accepted(tries):
        _make_room(o, rng)


def _toward_nic_remove(o, rng, n):
    """A NIC of a running VM unplugged (a few tried in turn); else one hot-plugged into a running VM."""
    if not _first_accepted([lambda x=x: o.nics.remove(*x) for x in _shuffled(rng, _nics(o, "running"))[:TRIES]]):
        _toward_nic_add(o, rng, n)


def _toward_network_apply(o, rng, n):
    """A host brought to a view of the store it does not hold yet: a stopped VM with a NIC started (its host
    is made to hold its network and filter first), else a VM with a NIC created and started; else a NIC
    hot-plugged into a running VM."""
    stopped = sorted({vm for vm, _ in _nics(o, "stopped")})
    starts = [lambda x=x: o.start_vm(x) for x in _shuffled(rng, stopped)[:TRIES]]
    creates = [lambda p=p: _create_with_nic(o, rng, n, start=True, project=p) for p in _shuffled(rng, PROJECTS)]
    if not _first_accepted(starts + creates):
        _toward_nic_add(o, rng, n)


TOWARD = {
    "start": _toward_start,
    "stop": _toward_stop,
    "migrate": _toward_migrate,
    "scale": _toward_scale,
    "scale.migrating": _toward_scale_where_full,
    "scale.after-migration": _toward_scale_where_full,
    "drain": _toward_drain,
    "volume.before-create": _toward_create_volume,
    "volume.after-create": _toward_create_volume,
    "volume.before-attach": _toward_attach,
    "volume.before-detach": _toward_detach,
    "volume.before-delete": _toward_delete_volume,
    "ha": _toward_ha,
    "nic.before-attach": _toward_nic_add,
    "nic.before-detach": _toward_nic_remove,
    "network.before-apply": _toward_network_apply,
    **crashsnapshots.TOWARD,
}


def toward(point: str):
    """The forced step of `point` (by its full name, else by its prefix: start, stop, migrate...)."""
    return TOWARD.get(point) or TOWARD[point.split(".")[0]]


def workload(o: Orchestrator, rng: random.Random, steps: int, focus: str = "", ha: bool = False) -> None:
    """Random actions; with a crash point armed (`focus`), the step toward it (`toward`) is taken STEER of the
    time; `ha`: HA VMs are created and hosts fail (HA_ACTIONS). Each step draws from a stream of its own
    (derived from `rng`, one draw a step): which action a step takes, and its arguments' choices, do not
    depend on what the steps before it drew, only on the cluster they find."""
    actions, weights = zip(
        *(ACTIONS + NET_ACTIONS + crashsnapshots.ACTIONS + (HA_ACTIONS + HA_NET_ACTIONS if ha else ()))
    )
    forced = toward(focus) if focus else None
    for n in range(steps):
        step = random.Random(rng.getrandbits(64))
        steer = step.random() < STEER
        action = forced if forced and steer else step.choices(actions, weights)[0]
        try:
            if action is forced:
                _tidy(o)
            action(o, step, n)
        except VmplaneError:
            pass  # refused (quota, capacity, state): as a user would be
        time.sleep(step.uniform(0, 0.01))


def _control_plane(url: str, seed: int, armed: dict[str, int], steps: int, ha: bool = False) -> None:
    """A forked control plane: start up (recovering), run the workload, wait for its operations. With `ha`,
    it first looks at its hosts as its monitor and HA loops would (a host that failed before the last
    one was killed is declared now)."""
    simfabric.forget_shared()
    logging.disable(logging.CRITICAL)
    failpoints.arm(armed)
    # a control plane still alive after 55 s (the harness kills it at 60: "hung") says where each thread is
    folder = Path(
        os.environ.get("VMPLANE_SIM_HOSTS") or url.removeprefix("sqlite:///")
    ).parent  # (PostgreSQL: the sim hosts file's)
    stacks = open(folder / f"hung-{os.getpid()}.txt", "w")  # noqa: SIM115
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
    ops = [
        f"operation {op.kind} {op.target} ({op.step})" for st in ("pending", "running") for op in o.operations(state=st)
    ]
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
    if down:  # what waited for them, settled now that they answer (the loops do it every few s)
        o.migration_settle.run_once()
        o.storage_settle.run_once(min_age_s=0)
    problems = [f"still in flight after {SETTLE_S:.0f} s: {x}" for x in settle(o, SETTLE_S)]
    # the storage-settle loop's pass (every 10 s), run as it would: it settles a volume the start-up
    # recovery could not (its VM's host did not answer then, was fenced since and its VM restarted
    # elsewhere) and deletes a migration's second disk copy whose deletion a kill interrupted (recovery
    # skips the VMs still migrating then). What it can not settle or delete stays a finding.
    o.storage_settle.run_once(min_age_s=0)
    problems += [
        f"vm {v.name} left {v.state}" for v in o.vms() if v.state in ("starting", "stopping", "migrating", "scaling")
    ]
    problems += unknown_left(o)
    waiting = out_of_service(o)
    problems += storage_problems(o, waiting_for=waiting) + network_problems(o, waiting_for=waiting)
    problems += crashsnapshots.problems(o, {f"local-{h}" for h in waiting})
    return problems + o.audit()  # (its NIC audit after the NIC settle pass: a NIC between steps is not its)


def answering_hosts(o: Orchestrator) -> list[str]:
    """The hosts recorded in service (not down, fencing or fenced) whose hypervisor answers now."""
    from vmplane.controllers.hostmonitor import probe

    return [
        h.name
        for h in o.hosts()
        if h.state not in ("down", "fencing", "fenced") and h.name in o.drivers and probe(o.drivers[h.name]) is None
    ]


def unknown_on_answering_hosts(o: Orchestrator) -> list[tuple[str, str]]:
    """(vm, host) of every `unknown` VM whose host answers (review N3: nothing settles it but the monitor's
    pass; the audit names it)."""
    answering = set(answering_hosts(o))
    return [(v.name, v.host.name) for v in o.vms() if v.state == "unknown" and v.host and v.host.name in answering]


def unknown_left(o: Orchestrator) -> list[str]:
    """After the settling: the monitor's pass over unknown VMs (hostmonitor.settle_unknown), run once as its
    loop would; an `unknown` VM whose host answers left after it is a finding."""
    if o.monitor.settle_unknown(answering_hosts(o)):  # what they leave to the other loops, as those would
        o.sync.sync()
        o.storage_settle.run_once(min_age_s=0)
    return [f"vm {vm} left unknown on {host}, which answers" for vm, host in unknown_on_answering_hosts(o)]


def _volume_story(o: Orchestrator, v) -> str:
    """What a finding about a volume needs to be understood: its VM now, and its last events."""
    vm = next((x for x in o.vms() if x.name == v.vm_name), None) if v.vm_name else None
    with o.db.read() as s:
        last = s.execute(
            select(EVENTS.c.old_state, EVENTS.c.new_state, EVENTS.c.cause, EVENTS.c.message)
            .where(EVENTS.c.kind == "volume", EVENTS.c.subject == v.name)
            .order_by(EVENTS.c.id.desc())
            .limit(4)
        ).all()
    where = f"vm {vm.name} {vm.state} on {vm.host.name if vm.host else None}" if vm else f"vm {v.vm_name}"
    return (
        where
        + "; last events: "
        + " | ".join(f"{r.old_state}->{r.new_state} by {r.cause}: {r.message}" for r in reversed(last))
    )


def storage_problems(o: Orchestrator, waiting_for: list[str] = ()) -> list[str]:
    """No volume between two steps (recovery settled them), no copy left claimed, each project's storage
    ledger == its volumes and within quota (the pools' used space == volumes: in the audit). A volume on
    the local pool of a host that does not answer (`waiting_for`: failed, fenced) waits for it: not a
    finding."""
    waiting = {f"local-{h}" for h in waiting_for}
    problems = [
        f"volume {v.name} left {v.state} ({_volume_story(o, v)})"
        for v in o.volumes.rows()
        if v.state in ("creating", "attaching", "detaching", "deleting") and v.pool_name not in waiting
    ]
    problems += [
        f"volume {v.name} still has a copy on {v.copy_pool_name}"
        for v in o.volumes.rows()
        if v.copy_pool_name and v.copy_pool_name not in waiting
    ]
    for project in PROJECTS:
        u = o.project_usage(project)
        if u["ledger"].storage_mib != u["recomputed"].storage_mib:
            problems.append(
                f"project {project}: storage ledger {u['ledger'].storage_mib} MiB, recomputed "
                f"{u['recomputed'].storage_mib} MiB"
            )
        if u["quota"].storage_mib is not None and u["ledger"].storage_mib > u["quota"].storage_mib:
            problems.append(
                f"project {project}: {u['ledger'].storage_mib} MiB of storage > quota {u['quota'].storage_mib} MiB"
            )
    return problems


def _nic_story(o: Orchestrator, vm: str, mac: str) -> str:
    """What a finding about a NIC needs to be understood: its VM now, and whether its domain lists it."""
    v = next((x for x in o.vms() if x.name == vm), None)
    if v is None or v.host is None:
        return f"vm {vm} {v.state if v else 'gone'}, on no host"
    try:
        held = "lists it" if mac in o.drivers[v.host.name].domain_nics(o.domain_name(vm)) else "does not list it"
    except (DriverError, KeyError) as exc:  # (a story, not a check: what the host said is enough)
        held = f"could not be read ({exc})"
    return f"vm {vm} {v.state} on {v.host.name}, whose domain {held}"


def network_problems(o: Orchestrator, waiting_for: list[str] = ()) -> list[str]:
    """The NIC settle pass run as its loop would, then: no NIC left attaching or detaching (one of a VM on a
    host that does not answer, `waiting_for`, waits for it); after a full pass of the networking controller
    (its loop's every 30th), each sim host's filter ports (tap, MAC, address) == the store's view of it; no
    two NICs share a MAC, nor an address on one network (the unique constraints' job: checked anyway)."""
    young, nics.BUSY_S = nics.BUSY_S, 0.0  # (the killed process's calls are over: no step is another's now)
    try:
        o.nics.settle()
    finally:
        nics.BUSY_S = young
    waiting = set(waiting_for)
    with o.db.read() as s:
        left = SN.nics_between_steps(s.connection())
    problems = [
        f"NIC {mac} left {state} after the NIC settle pass ({_nic_story(o, vm, mac)})"
        for _, mac, state, vm, host, _vm_state, _created in left
        if host not in waiting
    ]
    failed = o.networking.reconcile(full=True)
    problems += [f"host {h}: the networking controller's full pass failed: {why}" for h, why in failed.items()]
    for host, driver in sorted(o.drivers.items()):
        if not isinstance(driver, SimDriver) or host in waiting or host in failed:
            continue
        with o.db.read() as s:
            want = netview.host_networks(s.connection(), host, underlay)
        recorded = {(p.tap, p.mac, p.ip) for p in want.ports} if want else set()
        held = set(driver.fabric.ports(host))
        if recorded != held:
            problems.append(
                f"host {host}: its filter's ports differ from the store's after a full networking pass: "
                f"not on the host {sorted(recorded - held)}, only on the host {sorted(held - recorded)}"
            )
    n = SN.NICS.c
    with o.db.read() as s:
        rows = s.execute(select(n.network_id, n.mac, n.ip)).all()
    macs = collections.Counter(r.mac for r in rows if r.mac is not None)
    addresses = collections.Counter((r.network_id, r.ip) for r in rows)
    problems += [f"{count} NICs share MAC {mac}" for mac, count in macs.items() if count > 1]
    problems += [f"{c} NICs share {ip} on network #{net}" for (net, ip), c in addresses.items() if c > 1]
    return problems


@dataclass
class Round:
    number: int
    kill: str  # the failpoint, or "timed"
    killed: bool  # the control plane died by SIGKILL (not: finished its workload)
    problems: list[str]
    vms: int  # -1: the next control plane started without a check in between
    armed_at: int = 0  # the pass of its crash point that kills (1 or 2); 0: a timed kill
    after_ms: int = 0  # a timed kill: when, after the fork
    seed: int = 0  # the seed of the killed control plane's workload
    hung: bool = False  # it neither died nor finished in 60 s

    def line(self) -> str:
        """The round in the fault log."""
        how = (
            f"kill at {self.kill}, its pass {self.armed_at}"
            if self.armed_at
            else f"kill {self.after_ms} ms after the fork"
        )
        end = "killed" if self.killed else "not reached (the control plane finished its workload)"
        check = (
            "restarted without a check" if self.vms < 0 else f"checked: {self.vms} VMs, {len(self.problems)} problem(s)"
        )
        return f"round {self.number}: {how} (workload seed {self.seed}): {end}; {check}"


@dataclass
class Report:
    rounds: list[Round] = field(default_factory=list)
    watch: TwiceWatch | None = None  # the running-twice watch (its samples)
    order: FenceOrder | None = None  # the event-order check (fences and HA restarts seen)
    seed: int = 0
    url: str = ""
    home: Path | None = None
    schedule: list[str] = field(default_factory=list)  # the kills of the first cycle, in order

    @property
    def kills(self) -> list[Round]:
        return [r for r in self.rounds if r.killed]

    def points_hit(self) -> set[str]:
        return {r.kill for r in self.kills if r.kill != "timed"}

    def problems(self) -> list[str]:
        return [f"round {r.number} (kill {r.kill}): {p}" for r in self.rounds for p in r.problems]

    def fault_log(self) -> str:
        return f"seed {self.seed}; the first cycle's kills, in order: {', '.join(self.schedule)}\n" + "".join(
            r.line() + "\n" for r in self.rounds
        )


# A target's libvirtd notices a power-cut source by its keepalive (libvirt's default ~30 s: the sim's
# incoming_linger_s). Until then a copy whose source came back empty is "asked again" (review N1); the
# harnesses give their sim hosts a 3 s keepalive so that it settles within their 30 s quiet period.
INCOMING_LINGER_S = 3.0

DEFAULT_SEED = 20261129
TIMED_KILLS = 4  # kills at a random moment, per cycle (beside one at each crash point)
MISS_RETRIES = 3  # a crash point the workload did not reach is armed again in the next round, this often
EXTRA_ROUNDS = 8  # the most rounds a one-cycle run adds for points armed again


def schedule(seed: int, cycle: int = 0, ha: bool = True, timed: int = TIMED_KILLS) -> list[str]:
    """One cycle of kills: every crash point once, and `timed` kills at a random moment, in an order drawn
    from the seed (cycle N of a longer run: its own order)."""
    kills = [*crash_points(ha), *["timed"] * timed]
    random.Random(f"{seed}/schedule/{cycle}").shuffle(kills)
    return kills


def run(
    home: Path,
    seed: int | None = None,
    rounds: int | None = None,
    steps: int = 60,
    timed: int = TIMED_KILLS,
    unchecked_share: float = 0.25,
    log=lambda line: None,
    stop_at_problem: bool = True,
    ha: bool = True,
) -> Report:
    """Crash-and-restart rounds on one cluster, following `schedule`: each round arms the next crash point of
    the cycle (at its 1st or 2nd pass) and its workload steps toward it (`toward`), or kills at a random
    moment. `rounds=None`: one cycle (every point once; a point not reached is armed again, EXTRA_ROUNDS at
    most); else `rounds` rounds, cycle after cycle. After a share of the kills the next control plane starts
    without a check in between, so that its own start-up (the recovery) runs with a crash point armed too.
    `ha`: HA VMs, and hosts failing during the workload (power, daemon, network; repaired later), so that
    recoveries are killed too; a watch reads the fabric all along for a domain running on two hosts at once,
    and each check also asks: every HA restart came after its host was fenced, no VM left charged on a fenced
    host. The seed fixes every choice of the harness (module docstring: what it does not fix)."""
    seed = DEFAULT_SEED if seed is None else seed
    with stores.sim_hosts_env(home), stores.env("VMPLANE_SIM_INCOMING_LINGER_S", INCOMING_LINGER_S):
        return _run(home, seed, rounds, steps, timed, unchecked_share, log, stop_at_problem, ha)


def _run(home, seed, rounds, steps, timed, unchecked_share, log, stop_at_problem, ha) -> Report:
    url = stores.store_url(home)
    seed_cluster(url, ha_grace=0 if ha else None, networks=True)
    simfabric.forget_shared()
    logging.getLogger("vmplane").setLevel(logging.CRITICAL)  # recoveries log what they undo; rounds say it
    report = Report(seed=seed, url=url, home=home, schedule=schedule(seed, 0, ha, timed))
    report.order, report.watch = FenceOrder(), TwiceWatch(simfabric.SimFabric.for_store(url).path).__enter__()
    try:
        _rounds(report, rounds, steps, timed, unchecked_share, log, stop_at_problem, ha)
    finally:
        report.watch.__exit__()
        simfabric.forget_shared()
    return report


def _rounds(report, rounds, steps, timed, unchecked_share, log, stop_at_problem, ha) -> None:
    queue, cycle, misses = list(report.schedule), 0, collections.Counter()
    limit = len(queue) + EXTRA_ROUNDS if rounds is None else rounds
    for number in range(limit):
        if not queue:
            if rounds is None:
                break
            cycle += 1
            queue = schedule(report.seed, cycle, ha, timed)
        kill = queue.pop(0)
        r = _kill_round(report, number, kill, steps, ha)
        if kill != "timed" and not r.killed and misses[kill] < MISS_RETRIES:
            misses[kill] += 1
            queue.insert(0, kill)  # armed again: the next round steps toward it from where this one left
        # the round's own stream decides whether its restart is checked (drawn whatever the outcome)
        unchecked = random.Random(f"{report.seed}/unchecked/{number}").random() < unchecked_share
        last = number == limit - 1 or (rounds is None and not queue)  # the last round is always checked
        if r.killed and not last and unchecked:
            report.rounds.append(r)
            log(f"round {number}: kill {kill} (killed), restarted without a check")
            continue
        r.problems, r.vms = _check_round(report, r.hung, ha)
        report.rounds.append(r)
        log(
            f"round {number}: kill {kill} {'(killed)' if r.killed else '(not reached)'}, {r.vms} VMs, "
            f"{len(r.problems)} problem(s)" + (f": {r.problems[:3]}" if r.problems else "")
        )
        if r.problems and stop_at_problem:  # the store is left as the check found it, to be looked at
            break
        if r.problems and not any(x.problems for x in report.rounds[:-1]):
            keep = report.home / f"first-problem-round-{number}"  # the store as the first problem left it
            keep.mkdir()
            for f in report.home.glob("vmplane.db*"):
                shutil.copy(f, keep / f.name)


def _kill_round(report: Report, number: int, kill: str, steps: int, ha: bool) -> Round:
    """Fork a control plane armed at `kill` (or kill it at a random moment), wait for it to die or finish
    (60 s at most: then it hung, a finding)."""
    rr = random.Random(f"{report.seed}/round/{number}")  # every draw made, whichever is used
    at, child_seed, after = rr.randint(1, 2), rr.getrandbits(64), rr.uniform(0.0, 0.15)
    timed = kill == "timed"
    armed = {} if timed else {kill: at}
    child = multiprocessing.get_context("fork").Process(
        target=_control_plane, args=(report.url, child_seed, armed, steps, ha)
    )
    with report.watch.paused():
        child.start()
    if timed:
        child.join(after)
        if child.exitcode is None:
            os.kill(child.pid, signal.SIGKILL)
    child.join(60)
    hung = child.exitcode is None  # its workload and 20 s of settling are long over: a finding
    if hung:
        os.kill(child.pid, signal.SIGKILL)
        child.join()
    for f in report.home.glob("hung-*.txt"):
        if f.stat().st_size == 0:  # only a hung control plane's stacks are kept
            f.unlink()
    return Round(
        number,
        kill,
        child.exitcode == -signal.SIGKILL and not hung,
        [],
        -1,
        0 if timed else at,
        int(after * 1000) if timed else 0,
        child_seed,
        hung,
    )


def _check_round(report: Report, hung: bool, ha: bool) -> tuple[list[str], int]:
    """A fresh control plane on the store the kill left: every invariant (`check`), with HA what its monitor
    and HA loops do first (a host failed meanwhile is declared) and the HA checks."""
    db = Database(report.url)
    o = Orchestrator(db, ThreadPoolExecutor(4))
    try:
        o.load()
        if ha:
            o.check_hosts()
            o.ha.check()
        problems = ["the control plane hung for 60 s"] * hung + check(o)
        if ha:
            problems += ha_problems(o) + report.order.check(db)
        return problems + report.watch.take(), len(o.vms())
    finally:
        o.close()
        db.dispose()
        simfabric.forget_shared()


# -- a failure keeps its evidence ------------------------------------------------------------------------
def replay_command(nodeid: str, seed: int) -> str:
    """The pytest command that runs `nodeid` again with `seed` (on the store kind of this run)."""
    db = " --db postgresql" if stores.is_postgres() else ""
    return f".venv/bin/pytest '{nodeid}' --seed {seed}{db} -p no:cacheprovider"


def keep_evidence(name: str, url: str, home: Path, seed: int, fault_log: str, findings: list[str], replay: str) -> Path:
    """Into `evidence.folder(name)`: the store and its event log, the sim hosts' state, seed.txt (the seed and
    the command that replays it), faults.txt (what was injected where), findings.txt, a hung control plane's
    stacks. Returns the folder."""
    dest = evidence.folder(name)
    evidence.keep_store(url, dest, stores.sim_hosts_file(home))
    for f in home.glob("hung-*.txt"):
        shutil.copy2(f, dest / f.name)
    evidence.write(dest, "seed.txt", f"seed {seed}\nreplay: {replay}\n")
    evidence.write(dest, "faults.txt", fault_log)
    evidence.write(dest, "findings.txt", "".join(f"{p}\n" for p in findings))
    return dest


def assert_clean(report: Report, nodeid: str) -> None:
    """No problem found; else the evidence is kept and the assertion names its folder."""
    problems = report.problems()
    if problems:
        dest = keep_evidence(
            nodeid,
            report.url,
            report.home,
            report.seed,
            report.fault_log(),
            problems,
            replay_command(nodeid, report.seed),
        )
        shown = "\n  ".join(problems[:10])
        raise AssertionError(f"{len(problems)} problem(s) (seed {report.seed}; evidence kept in {dest}):\n  {shown}")
