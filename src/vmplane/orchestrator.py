"""Applies decisions: the only module that uses both the store and the drivers.

An admission (create, start) is one write transaction: lock the project row, pick a host from the
in-memory capacity index, lock that host's row and re-check it, apply the pure rules
(quota.check_admission, the placement filters), then write ledger, claim, VM and operation together.
Driver work happens after commit, inside an operation whose every step is persisted before it is
acted on; a failure gives back exactly what was charged and claimed.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable

from sqlalchemy import bindparam, select
from sqlalchemy.engine import Connection, Row
from sqlalchemy.exc import IntegrityError

from vmplane.controllers import audit as audit_rules
from vmplane.store import admission, events
from vmplane.core import failpoints
from vmplane.plane import metrics
from vmplane.store.catalog import (
    Catalog,
    Outdated,
    ensure_new,
    get_by_name,
    ledger_of,
    quota_of,
)
from vmplane.controllers.adopt import drift_view
from vmplane.core.driver import DomainSpec, Driver, DriverError, HostInfo
from vmplane.hosts.drivers.sim import SimDriver
from vmplane.hosts.drivers.simfabric import SimFabric
from vmplane.core.errors import (
    AlreadyExists,
    Conflict,
    InsufficientCapacity,
    Interrupted,
    Invalid,
    NotFound,
    VmplaneError,
)
from vmplane.store.lifecycle import delete_host_row
from vmplane.controllers.hostevents import HostEvents
from vmplane.controllers.hostmonitor import HostMonitor
from vmplane.controllers.hostsync import HostSync
from vmplane.controllers.migrationsettle import MigrationSettle
from vmplane.controllers.maintenance import Maintenance
from vmplane.controllers.migrator import Migrator
from vmplane.core.model import (
    IN_FLIGHT_OPERATION_STATES,
    UNREACHABLE_HOST_STATES,
    ClaimKind,
    HostCapacity,
    HostState,
    OperationState,
    PlacementRequest,
    Size,
    Usage,
    VmState,
)
from vmplane.core.names import DOMAIN_PREFIX, check_name
from vmplane.core.offerings import size_for
from vmplane.store.listing import Page, by_prefix, order_by, run_page
from vmplane.core.placement import CapacityIndex, Placement, choose
from vmplane.core.quota import check_admission, running_charge
from vmplane.controllers.reconcile import reconcile as reconcile_running
from vmplane.plane.settle import after_failed_operation as settle_after_failure
from vmplane.store.groupstore import resolve_group
from vmplane.plane.reserves import placement_rules
from vmplane.controllers.ha import HaController, check_ha, default_agents
from vmplane.controllers.recovery import Recovery
from vmplane.plane.overdue import OverdueOperations, carrying
from vmplane.controllers.scaler import Scaler
from vmplane.core.scaling import ScalingFlags, cap_for_share, cap_share, ceiling
from vmplane.core.scope import Scope
from vmplane.controllers.diskmoves import DiskMoves
from vmplane.controllers.pools import Pools
from vmplane.controllers.storageaudit import storage_problems
from vmplane.controllers.starts import Starts
from vmplane.controllers.storagesettle import StorageSettle
from vmplane.controllers.volumes import Volumes
from vmplane.store import Database
from vmplane.plane.membership import DEFAULT_LEASE_S, Controllers
from vmplane.store import ownership
from vmplane.store import ledger as L
from vmplane.store import storageledger as SL
from vmplane.store.prepared import prepared
from vmplane.store.schema import Cluster, Host, Operation, Project, Vm, Zone

log = logging.getLogger("vmplane.orchestrator")

PLACEMENT_RETRIES = 5
OUTDATED_TRIES = 3              # admissions of one create that may find its offering or template changed
IN_FLIGHT = {st.value for st in IN_FLIGHT_OPERATION_STATES}
UNREACHABLE = {st.value for st in UNREACHABLE_HOST_STATES}


def domain_name(vm_name: str) -> str:
    return DOMAIN_PREFIX + vm_name


def libvirt_driver(host: str, uri: str | None) -> Driver:
    try:
        from vmplane.hosts.drivers.libvirt import LibvirtDriver
    except ImportError:
        raise Invalid("libvirt hosts need the libvirt-python package (scripts/setup.sh installs it)",
                      field="driver") from None
    return LibvirtDriver(host, uri or "")


_OP = L.OPERATIONS.c
_OPERATION_TO_RUN = select(_OP.kind, _OP.target, _OP.vm_id, _OP.owner).where(_OP.id == bindparam("id"))


class InlineExecutor(Executor):
    """Runs operations in the caller's thread (benchmarks and deterministic tests)."""

    runs_inline = True          # the start controller too asks every host in the caller's thread

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[override]
        fn(*args, **kwargs)


@dataclass(frozen=True)
class Admitted:
    vm: str
    operation_id: str | None


@dataclass(frozen=True)
class HostMeta:
    """What admission needs to know of a host besides its capacity."""

    id: int
    zone: str
    cluster: str
    cores: int
    cpu_mhz: int
    memory_mib: int
    migration_address: str | None = None
    zone_id: int | None = None
    cluster_id: int | None = None


@dataclass(frozen=True)
class StartFacts:
    """The offering, template and VM flags that decide how a VM is started."""

    offering_dynamic: bool
    template_dynamic: bool
    vm_dynamic: bool
    cpu_cap: bool
    cpu_speed_mhz: int


@dataclass(frozen=True)
class Claimed:
    """A start admitted in a transaction, to mirror in the index once it commits."""

    operation_id: str
    host: str
    vcpus: int
    memory_mib: int


class Orchestrator:
    def __init__(self, db: Database, executor: Executor | None = None, name: str | None = None,
                 lease_s: float = DEFAULT_LEASE_S, api_url: str | None = None):
        self.db = db
        self.catalog = Catalog(db, on_settings_changed=self.rebuild_index)
        self.drivers: dict[str, Driver] = {}
        self.index = CapacityIndex()
        self._hosts: dict[str, HostMeta] = {}
        self._cluster_zones: dict[str, str] | None = None
        self._lock = threading.RLock()      # admissions in this process, and the index
        self.admissions = admission.Batcher(db, self._lock, on_abort=self.rebuild_index)   # group commit
        self.executor = executor or ThreadPoolExecutor(16, thread_name_prefix="vmplane-op")
        self.closing = threading.Event()    # set by close(): long waits inside operations end early
        self.migrator = Migrator(self)
        self.maintenance = Maintenance(self)        # host drains, by live migration
        self.scaler = Scaler(self)
        self.starts = Starts(self)          # start operations, run in batches
        self.recovery = Recovery(self)      # start-up recovery (in the background for the API)
        # the loops that listen to the hosts, started by start_monitor()
        self.monitor, self.sync, self.host_events = HostMonitor(self), HostSync(self), HostEvents(self)
        self.migration_settle = MigrationSettle(self)     # settles migrations no copy thread carries
        self.pools, self.volumes = Pools(self), Volumes(self)     # storage: pools, root disks and volumes
        self.disk_moves = DiskMoves(self)                         # what a migration does with the disks
        self.storage_settle = StorageSettle(self)                 # volumes between two steps, stale copies
        self.ha = HaController(self)                              # failed hosts: fencing, HA restarts
        self.overdue = OverdueOperations(self)    # its own operations left in flight past their deadline
        # this process among the control planes of the store: its lease, what it owns (registered by load())
        self.controllers = Controllers(self, name, lease_s, api_url)

    # -- start-up ------------------------------------------------------------------------------
    def load(self, background: bool = False, recover: bool = True) -> None:
        """Build drivers and the capacity index from the store, then finish interrupted operations
        (recovery.Recovery): VMs whose domain is gone are recorded stopped, migrations are finished or
        rolled back by asking their hosts, and other operations are resumed (or rolled back) from their
        last step. `background`: recovery runs in a thread (the API answers meanwhile, refusing
        operations on the VMs it has not finished with); wait_recovered() waits for it. `recover=False`:
        the caller starts it later (`vmplane up` once its local hosts run: recovery.run)."""
        with self.db.read() as s:
            for host in s.scalars(select(Host)).unique():
                self.drivers[host.name] = self._make_driver(host)
        self.rebuild_index()
        self.controllers.register()
        if recover:
            self.recovery.run(background)

    def wait_recovered(self, timeout: float | None = None) -> bool:
        """Wait until start-up recovery is done; False if `timeout` passed first."""
        return self.recovery.wait(timeout)

    def _make_driver(self, host: Host) -> Driver:
        if host.driver == "sim":
            return SimDriver(host.name, HostInfo(host.cores, host.cpu_mhz, host.memory_mib),
                             SimFabric.for_store(self.db.url))
        return libvirt_driver(host.name, host.uri)

    @staticmethod
    def _meta(h: Host) -> HostMeta:
        return HostMeta(h.id, h.cluster.zone.name, h.cluster.name, h.cores, h.cpu_mhz, h.memory_mib,
                        h.migration_address, h.cluster.zone_id, h.cluster_id)

    def _migration_address(self, host: str) -> str | None:
        return self._hosts[host].migration_address

    domain_name = staticmethod(domain_name)

    def set_host_state(self, name: str, state: HostState) -> None:
        """Enable a host or take it out of placement (maintenance, disabled). Refused (409) for a host
        that does not answer (down, fencing, fenced): its state is the monitor's and HA's until it answers."""
        state = HostState(state)
        with self._lock:
            with self.db.transaction() as conn:
                now = conn.execute(select(L.HOSTS.c.state).where(L.HOSTS.c.name == name).with_for_update()).scalar()
                if now is None:
                    raise NotFound(f"host {name!r} does not exist", field="host")
                if now in UNREACHABLE and now != state.value:
                    raise Conflict(f"host {name} is {now}: it does not answer; its state comes back when it does "
                                   f"(vmplane host show {name} says why)", field="host")
                L.set_host_state(conn, name, state)         # records the change in the event log
            self.index.upsert(replace(self.index.host(name), state=state))

    def _capacity(self, host: Host) -> HostCapacity:
        cluster, zone = host.cluster.name, host.cluster.zone.name
        eff = self.catalog.effective
        return HostCapacity(
            name=host.name, cluster=cluster, state=HostState(host.state), cores=host.cores,
            memory_mib=host.memory_mib,
            cpu_factor=float(eff("cpu.overprovisioning.factor", zone, cluster)),
            mem_factor=float(eff("mem.overprovisioning.factor", zone, cluster)),
            overhead_ratio=float(eff("vmplane.overhead.ratio", zone, cluster)),
            strategy=str(eff("vmplane.placement.strategy", zone, cluster)),
            used_vcpus=host.used_vcpus, used_memory_mib=host.used_memory_mib, zone=zone)

    def refresh_hosts(self) -> None:
        """Learn hosts other control-plane processes added or removed, and the index from the store."""
        with self.db.read() as s:
            hosts = {h.name: h for h in s.scalars(select(Host)).unique()}
        with self._lock:
            gone = [self.drivers.pop(name) for name in set(self.drivers) - set(hosts)]
            for name in set(hosts) - set(self.drivers):
                self.drivers[name] = self._make_driver(hosts[name])
        for driver in gone:         # outside the lock: closing asks the daemon, which may not answer
            driver.close()
        self.rebuild_index()

    def cluster_zones(self) -> dict[str, str]:
        """Each cluster with hosts and its zone, from the host list (kept until that changes: admissions
        ask for it, and going over thousands of hosts each time cost a fifth of an admission)."""
        zones = self._cluster_zones
        if zones is None:
            zones = self._cluster_zones = {m.cluster: m.zone for m in list(self._hosts.values())}
        return zones

    def rebuild_index(self) -> None:
        with self._lock:
            with self.db.read() as s:
                hosts = list(s.scalars(select(Host).order_by(Host.id)).unique())
            self._hosts = {h.name: self._meta(h) for h in hosts}
            self._cluster_zones = None
            self.index = CapacityIndex([self._capacity(h) for h in hosts])

    # -- hosts ---------------------------------------------------------------------------------
    def add_host(self, name: str, cluster: str, driver: str, cores: int | None = None,
                 cpu_mhz: int | None = None, memory_mib: int | None = None, uri: str | None = None,
                 migration_address: str | None = None) -> Host:
        check_name(name)
        if driver == "sim":
            for field, value in (("cores", cores), ("cpu_mhz", cpu_mhz), ("memory_mib", memory_mib)):
                if value is None:
                    raise Invalid(f"a sim host needs {field}", field=field)
                if value <= 0:
                    raise Invalid(f"{field} must be greater than 0, got {value}", field=field)
        elif driver == "libvirt":
            if not uri:
                raise Invalid("a libvirt host needs its uri (qemu+tls://HOST/system, or qemu+unix:///system?socket=...)",
                              field="uri")
            probe = libvirt_driver(name, uri)
            try:
                info = probe.host_info()
            except DriverError as exc:
                raise Invalid(f"cannot reach libvirt at {uri}: {exc}", field="uri") from None
            finally:
                probe.close()
            cores, cpu_mhz, memory_mib = info.cores, info.cpu_mhz, info.memory_mib
        else:
            raise Invalid(f"unknown driver {driver!r}; use sim or libvirt", field="driver")
        with self._lock:
            with self.db.write() as s:
                ensure_new(s, Host, name)
                c = get_by_name(s, Cluster, cluster, field="cluster")
                s.add(Host(name=name, cluster_id=c.id, driver=driver, uri=uri, cores=cores, cpu_mhz=cpu_mhz,
                           memory_mib=memory_mib, state=HostState.enabled.value, used_vcpus=0, used_memory_mib=0,
                           migration_address=migration_address, fence_agents=default_agents(driver, uri)))
            host = self.host(name)
            self.drivers[name] = self._make_driver(host)
            self._hosts[name] = self._meta(host)
            self._cluster_zones = None
            self.index.upsert(self._capacity(host))
        if self.controllers.epoch is not None:
            self.controllers.balance()      # its listener: this process or another, from now on
        return host

    def remove_host(self, name: str) -> None:
        """Delete a host that holds nothing (lifecycle.delete_host_row says what still uses it), with
        its driver and its row in the capacity index."""
        with self._lock:
            delete_host_row(self.catalog, name)
            driver = self.drivers.pop(name, None)
            self._hosts.pop(name, None)
            self._cluster_zones = None
            if name in self.index:
                self.index.remove(name)
        if driver is not None:
            driver.close()

    def hosts(self) -> list[Host]:
        with self.db.read() as s:
            return list(s.scalars(select(Host).order_by(Host.name)).unique())

    def host(self, name: str) -> Host:
        with self.db.read() as s:
            return get_by_name(s, Host, name, field="host")

    def host_capacity(self, name: str) -> HostCapacity:
        with self._lock:
            return self.index.host(name)

    # -- VMs: admission ------------------------------------------------------------------------
    def create_vm(self, name: str, project: str, offering: str, template: str, vcpus: int | None = None,
                  memory_mib: int | None = None, dynamically_scalable: bool = True,
                  start: bool = False, zone: str | None = None, cluster: str | None = None,
                  root_disk_mib: int | None = None, pool: str | None = None, ha_policy: str | None = None,
                  ha_priority: int = 0, group: str | None = None, *, _tries: int = OUTDATED_TRIES) -> Admitted:
        """Create a VM (charging one `vms`, and its root disk's storage when its template has a disk
        image) in a zone (and a cluster when given), and with `start` admit its start in the same
        transaction: either all of it is committed or nothing is. The root disk is then made on its
        pool (read back) before the start runs; a pool that refuses it undoes the whole create.
        `ha_policy` (restart or off; None: the offering's) says what happens when its host fails; `group`
        is its placement group (of its project)."""
        check_name(name)
        o, t = self.catalog.for_new_vm(offering, template)
        ha_chosen = check_ha(ha_policy or o.ha_policy, ha_priority)
        size = size_for(self.catalog.data_of(o), vcpus, memory_mib)
        disk_mib = self.volumes.root_size(t, o, root_disk_mib) if t.disk_image else None
        if disk_mib is None and (root_disk_mib is not None or pool is not None):
            raise Invalid(f"template {template} has no disk image: its VMs have no root disk", field="root_disk_mib")
        def admit(conn: Connection) -> tuple[int, str | None, Claimed | None]:
            self.catalog.check_new_vm(conn, o, t)
            scope, zone_id, cluster_id = admission.scope_of(conn, zone, cluster)
            p = L.lock_project(conn, name=project)
            base = Usage(vms=1, storage_mib=disk_mib or 0)
            reach = self.volumes.reach_for_new(conn, disk_mib, pool, scope.cluster) if disk_mib else None
            group_id = resolve_group(conn, group, p.id) if group else None
            rules = placement_rules(self, conn, scope, action=f"starting {name} on {{host}}", group_id=group_id,
                                    ha=ha_chosen == "restart") if start else None
            placement, delta = self._admit(conn, p, size, base, start, scope, reach, rules)
            L.add_to_ledger(conn, p.id, delta)
            facts = StartFacts(o.dynamic_scaling, t.dynamically_scalable, dynamically_scalable, o.cpu_cap,
                               o.cpu_speed_mhz)
            fields = dict(name=name, project_id=p.id, offering_id=o.id, template_id=t.id, vcpus=size.vcpus,
                          memory_mib=size.memory_mib, dynamically_scalable=dynamically_scalable,
                          zone_id=zone_id, cluster_id=cluster_id, ha_policy=ha_chosen, ha_priority=ha_priority,
                          group_id=group_id,
                          **self._started_fields(size, placement, delta, facts))
            host = placement[0].host if placement else None
            try:
                vm_id = L.insert_vm(conn, host_name=host, **fields)
            except IntegrityError:
                raise AlreadyExists(f"vm {name!r} already exists", field="name") from None
            if disk_mib:
                meta = self._hosts.get(host) if host else None
                chosen = self.volumes.root_pool(conn, disk_mib, pool, host,
                                                meta.cluster if meta else scope.cluster)
                if ha_chosen == "restart" and chosen.kind != "shared":
                    raise Invalid(f"--ha restart needs its root disk on a shared pool: {chosen.name} is a "
                                  f"{chosen.kind} pool, and the disk would be lost with its host; use "
                                  f"--pool with a shared pool", field="ha_policy")
                self.volumes.add_root(conn, vm_id, name, p.id, t.id, disk_mib, chosen)
            claimed = self._claim(conn, vm_id, name, p.id, size, placement) if placement else None
            return vm_id, host, self._mirror(claimed)

        try:
            vm_id, host, claimed = self.admissions.run(admit)
        except Outdated:        # the offering or template was deleted (or made again) meanwhile: read again
            if _tries <= 1:
                raise Conflict(f"offering {offering} or template {template} changed {OUTDATED_TRIES} times while "
                               f"vm {name} was admitted; nothing was created: try again", field="offering") from None
            return self.create_vm(name, project, offering, template, vcpus, memory_mib, dynamically_scalable,
                                  start, zone, cluster, root_disk_mib, pool, ha_policy, ha_priority, group,
                                  _tries=_tries - 1)
        if disk_mib:
            try:
                self._make_root_or_undo(name, vm_id, host, claimed)
            except VmplaneError:        # undone: the index gives back what admit() mirrored
                if claimed:
                    self._unindex([(claimed.host, claimed.vcpus, claimed.memory_mib)])
                raise
        return self._launch(name, claimed)

    def _make_root_or_undo(self, name: str, vm_id: int, host: str | None, claimed: Claimed | None) -> None:
        """Make the new VM's root disk; if its pool refuses, undo the create: the start's claim and charge
        go, and the VM goes too unless its disk is left `creating` (a host that could not say whether
        it made it: the VM then stays, stopped, and the disk is resolved later)."""
        try:
            self.volumes.make_root(name, host)
        except VmplaneError:
            with self.db.transaction() as conn:
                vm = L.vm_row(conn, vm_id=vm_id, lock=True)
                L.lock_project(conn, vm.project_id)
                if claimed:
                    L.set_operation(conn, claimed.operation_id, state=OperationState.failed, step="done",
                                    message="its root disk could not be created")
                L.release_vm(conn, vm_id)       # the index never had the claim (_launch did not run)
                if not SL.vm_volumes(conn, vm_id):
                    L.add_to_ledger(conn, vm.project_id, Usage(vms=-1))
                    L.delete_vm(conn, vm_id, note="its root disk could not be created")
            raise

    def start_vm(self, name: str) -> Admitted:
        def admit(conn: Connection) -> Claimed:
            vm = L.vm_row(conn, name=name, lock=True)
            if vm.state not in (VmState.stopped.value, VmState.error.value):      # neither holds anything
                raise Conflict(f"vm {name} is {vm.state}; only a stopped VM can be started", field="state")
            p = L.lock_project(conn, vm.project_id)
            size = Size(vm.vcpus, vm.memory_mib)
            self.volumes.check_ready(conn, vm.id, name)
            reach = self.volumes.storage_hosts(conn, vm.id)
            scope = Scope(vm.zone_name, vm.cluster_name)
            rules = placement_rules(self, conn, scope, action=f"starting {name} on {{host}}", vm_id=vm.id,
                                    ha=vm.ha_policy == "restart")
            placement, delta = self._admit(conn, p, size, Usage(), True, scope, reach, rules)
            L.add_to_ledger(conn, p.id, delta)
            facts = StartFacts(vm.offering_dynamic, vm.template_dynamic, vm.dynamically_scalable,
                               vm.offering_cpu_cap, vm.offering_cpu_mhz)
            fields = self._started_fields(size, placement, delta, facts)
            if vm.zone_id is None:          # placed before zones mattered: it joins its host's zone
                fields["zone_id"] = self._hosts[placement[0].host].zone_id
            L.set_vm(conn, vm.id, **fields)
            return self._mirror(self._claim(conn, vm.id, name, p.id, size, placement))

        return self._launch(name, self.admissions.run(admit))

    def _admit(self, conn: Connection, p: Row, size: Size, base: Usage, start: bool,
               scope: Scope = Scope(None, None),
               reach: frozenset[str] | None = None,
               rules: dict | None = None) -> tuple[tuple[Placement, int] | None, Usage]:
        """Quota and placement for `base` (+ a start): returns the locked host and the ledger delta.
        `rules`: the group and failover-reserve fields of the placement (reserves.placement_rules).
        Quota is checked before placement (without overhead) so that a quota refusal is reported as
        one even when no host has room; the exact check follows once the host (and its cluster's
        overhead ratio) is known, before its capacity is taken: a refusal writes nothing."""
        quota, ledger = L.quota_row(p), L.ledger_row(p)
        if not start:
            check_admission(p.name, quota, ledger, base)
            return None, base
        t0 = time.perf_counter()
        try:
            check_admission(p.name, quota, ledger, base + running_charge(size, 0, False))
            placement = self._place(conn, size, scope, reach, rules, check=lambda chosen: check_admission(
                p.name, quota, ledger, base + running_charge(size, chosen.overhead_mib, p.count_overhead)))
            delta = base + running_charge(size, placement[0].overhead_mib, p.count_overhead)
        except VmplaneError as exc:
            metrics.ADMISSIONS.labels(exc.code).inc()
            raise
        metrics.ADMISSIONS.labels("admitted").inc()
        metrics.ADMISSION_SECONDS.observe(time.perf_counter() - t0)
        return placement, delta

    def _started_fields(self, size: Size, placement: tuple[Placement, int] | None, delta: Usage,
                        facts: StartFacts) -> dict:
        """The VM's row once admitted: host, charge, the live-scaling ceiling and the CPU cap share."""
        if placement is None:
            return dict(state=VmState.stopped.value, overhead_mib=0, charged_vcpus=0, charged_memory_mib=0)
        chosen, host_id = placement
        meta = self._hosts[chosen.host]
        eff = self.catalog.effective
        flags = ScalingFlags(bool(eff("enable.dynamic.scale.vm", meta.zone, meta.cluster)), facts.offering_dynamic,
                             facts.template_dynamic, facts.vm_dynamic)
        top = ceiling(flags, size, int(eff("kvm.cpu.dynamic.scaling.capacity", meta.zone, meta.cluster)),
                      int(eff("kvm.memory.dynamic.scaling.capacity", meta.zone, meta.cluster)), meta.cores,
                      meta.memory_mib)
        share = cap_share(facts.cpu_speed_mhz, meta.cpu_mhz) if facts.cpu_cap else None
        return dict(state=VmState.starting.value, host_id=host_id, overhead_mib=chosen.overhead_mib,
                    boot_memory_mib=size.memory_mib,
                    charged_vcpus=delta.vcpus, charged_memory_mib=delta.memory_mib, max_vcpus=top.vcpus,
                    max_memory_mib=top.memory_mib, cpu_cap_percent=share * 100 if share else None,
                    prepared=flags.prepared)

    def _place(self, conn: Connection, size: Size, scope: Scope,
               reach: frozenset[str] | None = None, rules: dict | None = None,
               check: Callable[[Placement], None] | None = None) -> tuple[Placement, int]:
        """Pick a host within the VM's zone (and cluster) and take its capacity (take_placement)."""
        request = PlacementRequest(size, zone=scope.zone, cluster=scope.cluster, storage_hosts=reach,
                                   storage_reason="can not open the VM's disks (their pools are not on it)",
                                   **(rules or {}))
        return self.take_placement(conn, request, check)

    def take_placement(self, conn: Connection, request: PlacementRequest,
                       check: Callable[[Placement], None] | None = None) -> tuple[Placement, int]:
        """Pick a host for `request` from the index and take the capacity on its row (compare-and-add);
        if the store shows the index was behind (another process claimed), learn the store's numbers and
        pick again (so a final refusal carries the host's real numbers). `check(placement)` may refuse
        the chosen host before anything is written (the quota with its overhead). Returns the placement
        and the host's id."""
        for _ in range(PLACEMENT_RETRIES):
            placement = choose(self.index, request)
            if check is not None:
                check(placement)
            host_id = self._hosts[placement.host].id
            cap_vcpus, cap_memory = self.index.capacity_of(placement.host)
            if L.take_on_host(conn, host_id, request.size.vcpus, placement.memory_mib, cap_vcpus, cap_memory):
                return placement, host_id
            host = L.lock_host(conn, placement.host)
            self.index.upsert(replace(self.index.host(host.name), state=HostState(host.state),
                                      used_vcpus=host.used_vcpus, used_memory_mib=host.used_memory_mib))
        raise InsufficientCapacity(f"no host could be claimed after {PLACEMENT_RETRIES} tries; hosts are "
                                   f"changing fast, retry", field="host")

    @staticmethod
    def _claim(conn: Connection, vm_id: int, name: str, project_id: int, size: Size,
               placement: tuple[Placement, int]) -> Claimed:
        chosen, host_id = placement
        op_id = L.new_operation(conn, "start", name, vm_id, project_id, step="claimed",
                                message=f"claimed {size.vcpus} vCPU(s) / {chosen.memory_mib} MiB on {chosen.host}",
                                result={"host": chosen.host})
        L.record_claim(conn, host_id, vm_id, op_id, ClaimKind.running, size.vcpus, chosen.memory_mib)
        return Claimed(op_id, chosen.host, size.vcpus, chosen.memory_mib)

    def _mirror(self, claimed: Claimed | None) -> Claimed | None:
        """In the admission transaction, its last step: mirror the claim in the index, so that the next
        admission of the batch places against it (the batcher rebuilds the index if the commit fails)."""
        if claimed is not None:
            self.index.add_usage(claimed.host, claimed.vcpus, claimed.memory_mib)
        return claimed

    def _launch(self, name: str, claimed: Claimed | None) -> Admitted:
        """After commit: hand the admitted start to an operation (the index already has its claim)."""
        if claimed is None:
            return Admitted(name, None)
        failpoints.hit("start.admitted")
        self.starts.submit(claimed.operation_id)
        return Admitted(name, claimed.operation_id)

    # -- VMs: stop and delete ------------------------------------------------------------------
    def stop_vm(self, name: str, force: bool = False) -> Admitted:
        """Stop a running VM: the guest is asked to power off for `vmplane.vm.shutdown.timeout`
        seconds, then forced off; `force` skips the wait."""
        with self.db.transaction() as conn:
            vm = L.vm_row(conn, name=name, lock=True)
            if vm.state != VmState.running.value:
                raise Conflict(f"vm {name} is {vm.state}; only a running VM can be stopped", field="state")
            op_id = L.new_operation(conn, "stop", name, vm.id, vm.project_id, step="stopping",
                                    result={"force": force})
            L.set_vm(conn, vm.id, state=VmState.stopping)
        failpoints.hit("stop.admitted")
        self.executor.submit(self._run, op_id, self._run_stop)
        return Admitted(name, op_id)

    def delete_vm(self, name: str, keep_disk: bool = False) -> None:
        """Delete a stopped (or error) VM once its hosts confirm no domain of it is left
        (`_no_domain_left`: a shut-off definition is removed; a running one, or a host that can not be
        asked, refuses the delete with nothing changed). Its root disk is deleted (kept as a volume
        with `keep_disk`) and its volumes detached: they outlive it."""
        with self.db.read() as s:
            vm = L.vm_row(s.connection(), name=name)
        if vm.state not in (VmState.stopped.value, VmState.error.value):
            raise Conflict(f"vm {name} is {vm.state}; stop it before deleting it", field="state")
        self._no_domain_left(vm)
        with self.db.transaction() as conn:
            now = L.vm_row(conn, name=name, lock=True)
            if now.state not in (VmState.stopped.value, VmState.error.value):
                raise Conflict(f"vm {name} is {now.state}; stop it before deleting it", field="state")
            if (now.state, now.host_id, now.updated_at) != (vm.state, vm.host_id, vm.updated_at):
                raise Conflict(f"vm {name} changed while its hosts were asked; delete it again", field="state")
            L.lock_project(conn, vm.project_id)
            self.volumes.check_settled(conn, vm.id, name)
            doomed = self.volumes.release_disks(conn, vm.id, keep_disk)
            freed = L.release_vm(conn, vm.id)
            L.add_to_ledger(conn, vm.project_id, Usage(vms=-1))
            L.delete_vm(conn, vm.id)
        self._unindex(freed)
        self.volumes.delete_files(doomed)       # charged until each pool confirms its file gone

    def _hosts_to_ask(self, vm: Row) -> list[str]:
        """Where a domain of `vm` can be: its host, the host it last ran on, and every host of its cluster
        (else of its zone; else every host, for a VM that never ran and has no scope)."""
        by_id = self._hosts_by_id()
        own = [by_id[i] for i in (vm.host_id, vm.last_host_id) if i is not None and i in by_id]
        cluster_id = vm.cluster_id or next((self._hosts[h].cluster_id for h in own), None)
        zone_id = vm.zone_id or next((self._hosts[h].zone_id for h in own), None)
        if cluster_id is not None:
            others = [h for h, meta in self._hosts.items() if meta.cluster_id == cluster_id]
        elif zone_id is not None:
            others = [h for h, meta in self._hosts.items() if meta.zone_id == zone_id]
        else:
            others = list(self._hosts)
        return list(dict.fromkeys(own + sorted(others)))

    def _no_domain_left(self, vm: Row) -> None:
        """Before a delete: make sure no `vmplane-NAME` domain is left on the hosts it may be on
        (`_hosts_to_ask`). A shut-off definition is removed (and must then be confirmed gone); a running
        one refuses the delete (409 naming the host). Its own or last host must answer; any other host of
        its cluster that is not recorded down must answer too: a host that can not be asked refuses the
        delete (409, "can not tell"), since unknown is not absent. Nothing in the record changes here."""
        domain = domain_name(vm.name)
        mine = {self._hosts_by_id().get(i) for i in (vm.host_id, vm.last_host_id)} - {None}
        for host in self._hosts_to_ask(vm):
            driver = self.drivers.get(host)
            if driver is None:
                continue
            if host not in mine and host in self.index and self.index.host(host).state in UNREACHABLE_HOST_STATES:
                continue            # not reachable and not where it ran: the monitor reports it when back
            try:
                info = driver.domain(domain)
                if info is not None and not info.active:     # a leftover definition: removed, then confirmed
                    driver.stop(domain, timeout_s=0)
                    info = driver.domain(domain)
            except DriverError as exc:
                raise Conflict(f"vm {vm.name} can not be deleted now: vmplane can not tell whether {host} still "
                               f"has its domain {domain} ({exc}); nothing changed, retry when {host} answers",
                               field="host") from None
            if info is not None and info.active:
                raise Conflict(f"vm {vm.name} can not be deleted: its domain {domain} is {info.state} on {host} "
                               f"although the VM is recorded {vm.state}; stop it there (or `vmplane vm sync "
                               f"{vm.name}`), then delete it", field="host")
            if info is not None:
                raise Conflict(f"vm {vm.name} can not be deleted now: {host} still has its shut-off domain "
                               f"{domain} after removing it; nothing changed, retry", field="host")

    def _hosts_by_id(self) -> dict[int, str]:
        return {meta.id: name for name, meta in self._hosts.items()}

    def _unindex(self, freed: list[tuple[str, int, int]]) -> None:
        with self._lock:
            for host, vcpus, memory in freed:
                if host in self.index:
                    self.index.add_usage(host, -vcpus, -memory)

    # -- operations ----------------------------------------------------------------------------
    def _run(self, op_id: str, body, cause: str | None = None) -> None:
        """Run an operation's body (in an executor thread, or later) under `cause`, by default the cause of
        the request that created it: its events name that user, not whoever's thread happens to run it."""
        op = prepared(self.db.engine, _OPERATION_TO_RUN).first(id=op_id)      # one read, no transaction
        if cause is None:
            cause = events.remembered(op_id)          # this process created it: no need to ask the store
        if cause is None and op is not None:
            with self.db.read() as s:
                cause = events.cause_of(s.connection(), "operation", op_id,
                                        vm=op["target"] if op["vm_id"] is not None else None,
                                        host=op["target"] if op["kind"] == "drain" else None)
        owner = op["owner"] if op is not None else None
        if owner is not None and owner != self.controllers.epoch:
            log.warning("operation %s is owned by controller %s now, not by this one (%s): not run here",
                        op_id, owner, self.controllers.epoch)
            return
        # its writes land only while its owner's lease holds (ownership.py): a lapsed owner changes nothing
        with ownership.owned(owner), events.acting_as(cause or events.current_cause()):
            self._run_body(op_id, body)

    def _run_body(self, op_id: str, body) -> None:
        """`body(op_id)`; one that returns OperationState.succeeded ended its operation so itself, and has
        no failure to settle (not read back). Carried by this thread meanwhile (overdue.py)."""
        with carrying(op_id):
            try:
                if body(op_id) is OperationState.succeeded:
                    return
            except Exception as exc:  # an operation must end, whatever happened
                self._settle_failed(op_id, exc)
                return
            self._settle_after(op_id)

    def _settle_failed(self, op_id: str, exc: Exception) -> None:
        """An operation's body raised `exc`: it ends failed (Interrupted: left at its step for the next
        start, or for the process that takes it over)."""
        if isinstance(exc, Interrupted):
            log.info("operation %s left at its step for the next start", op_id)
            return
        log.warning("operation %s failed: %s", op_id, exc)
        try:
            self._fail(op_id, exc)
        except Interrupted:
            log.info("operation %s left at its step for the next start", op_id)
            return
        self._settle_after(op_id)

    def _settle_after(self, op_id: str) -> None:
        try:            # a failure path that put the VM back to running is checked against its host
            settle_after_failure(self, op_id)
        except Exception:  # noqa: BLE001 - the sync settles it later
            log.exception("operation %s: settling its VM after the failure", op_id)

    @staticmethod
    def _spec(vm: Row) -> DomainSpec:
        return DomainSpec(name=domain_name(vm.name), vcpus=vm.vcpus, max_vcpus=vm.max_vcpus or vm.vcpus,
                          memory_mib=vm.memory_mib, max_memory_mib=vm.max_memory_mib or vm.memory_mib,
                          image=vm.image,
                          cpu_cap=cap_for_share(vm.cpu_cap_percent / 100) if vm.cpu_cap_percent else None)

    def _begin_step(self, op_id: str, step: str) -> Row | None:
        """Persist that an in-flight operation enters `step`; returns its VM, or None if it already ended."""
        with self.db.transaction() as conn:
            return self._enter_step(conn, op_id, step)

    @staticmethod
    def _enter_step(conn: Connection, op_id: str, step: str) -> Row | None:
        op = L.operation_row(conn, op_id, lock=True)
        if op.state not in IN_FLIGHT:
            return None
        L.set_operation(conn, op_id, before=op, state=OperationState.running, step=step, progress=30)
        return L.vm_row(conn, op.vm_id)

    def _run_stop(self, op_id: str) -> None:
        vm = self._begin_step(op_id, "stopping-domain")
        if vm is None:
            return
        with self.db.transaction() as conn:
            force = bool((L.operation_row(conn, op_id).result or {}).get("force"))
        meta = self._hosts[vm.host_name]
        timeout = 0 if force else int(self.catalog.effective("vmplane.vm.shutdown.timeout", meta.zone, meta.cluster))
        failpoints.hit("stop.before-domain")
        self.drivers[vm.host_name].stop(domain_name(vm.name), timeout_s=timeout)
        failpoints.hit("stop.after-domain")
        with self.db.transaction() as conn:
            L.lock_project(conn, vm.project_id)
            freed = L.release_vm(conn, vm.id)
            L.set_operation(conn, op_id, state=OperationState.succeeded, step="done", progress=100,
                            message=f"stopped on {vm.host_name}")
        metrics.OPERATIONS.labels("stop", "succeeded").inc()
        self._unindex(freed)

    def _fail(self, op_id: str, exc: BaseException) -> None:
        """End an operation as failed, giving back what a failed start holds. One that already ended (by
        its own run, or a run of it handed over meanwhile) is left as it ended: nothing is given back twice."""
        reason = exc.message if isinstance(exc, VmplaneError) else str(exc) or type(exc).__name__
        if self.ha.recovery.fail_restart(op_id, exc):    # an HA restart: its host asked, never left starting
            return
        freed: list = []
        presence = self._domain_presence(op_id)     # asked before a start/stop gives anything back
        given: tuple[str, int, int] | None = None
        with self.db.transaction() as conn:
            op = L.operation_row(conn, op_id, lock=True)
            if op.state not in IN_FLIGHT:
                log.info("operation %s already %s; not failed again (%s)", op_id, op.state, reason)
                return
            vm = L.vm_row(conn, op.vm_id, lock=True) if op.vm_id is not None else None
            resized: dict = {}
            if (vm is not None and op.kind == "scale" and op.state in IN_FLIGHT
                    and vm.state in (VmState.scaling.value, VmState.migrating.value)
                    and (op.result or {}).get("admitted") is not None):
                # neither _commit nor _roll_back ended it (one of them raised): the ledger still holds the
                # increase charged at admission. Unknown is not "as before": once the driver may have been
                # called, the VM stays recorded, charged and claimed at the larger of its two sizes
                from vmplane.controllers.scaler import Admitted, settle_at_size
                a = Admitted.from_record(op.result["admitted"])
                old, new = a.plan.current, a.plan.target
                claimed = a.path == "in-place" or op.step == "resizing"
                size = Size(max(old.vcpus, new.vcpus), max(old.memory_mib, new.memory_mib)) if claimed else old
                ratio = self.index.host(vm.host_name).overhead_ratio
                overhead, charge, (give_vcpus, give_memory) = settle_at_size(conn, vm, a, size, ratio, claimed)
                if give_vcpus or give_memory:
                    given = (vm.host_name, give_vcpus, give_memory)
                resized = {"vcpus": size.vcpus, "memory_mib": size.memory_mib, "overhead_mib": overhead,
                           "charged_vcpus": charge.vcpus, "charged_memory_mib": charge.memory_mib,
                           **({"offering_id": a.offering_id} if size == new and size != old else {})}
                if vm.state == VmState.migrating.value:     # its migration's end settles the state
                    L.set_vm(conn, vm.id, **resized)
            settling = vm is not None and ((op.kind == "start" and vm.state == VmState.starting.value)
                                           or (op.kind == "stop" and vm.state == VmState.stopping.value))
            if vm is not None and vm.state in (VmState.starting.value, VmState.stopping.value,
                                               VmState.scaling.value) and self._host_down(conn, vm.host_id):
                # nobody can tell what its host did: kept charged and claimed until the host answers
                # (hostmonitor settles it then), never put back to running/stopped unasked
                L.set_vm(conn, vm.id, note=f"{op.kind} failed and its host {vm.host_name} does not answer: "
                                           f"{reason}", state=VmState.unknown, **resized)
            elif settling and presence == "unknown":
                # its host can not say whether the domain is there: kept charged and claimed, unknown
                L.set_vm(conn, vm.id, note=f"{op.kind} failed and {vm.host_name} can not tell whether the domain "
                                           f"exists: {reason}", state=VmState.unknown)
            elif settling and presence == "running":
                L.set_vm(conn, vm.id, note=f"{op.kind} failed, but the domain runs on {vm.host_name}: {reason}",
                         state=VmState.running)
            elif vm is not None and op.kind == "start" and vm.state == VmState.starting.value:
                L.lock_project(conn, vm.project_id)      # the host confirmed: no domain runs
                freed = L.release_vm(conn, vm.id, note=f"start failed: {reason}")
            elif settling and presence in ("gone", "defined"):
                L.lock_project(conn, vm.project_id)      # a stop that failed after the domain went
                freed = L.release_vm(conn, vm.id, note=f"stop reported an error, but the domain is not running "
                                                       f"on {vm.host_name}: {reason}")
            elif vm is not None and op.kind == "stop" and vm.state == VmState.stopping.value:
                # the domain still runs; the stop can be retried
                L.set_vm(conn, vm.id, note=f"stop failed: {reason}", state=VmState.running)
            elif vm is not None and op.kind == "scale" and vm.state == VmState.scaling.value:
                # at the size settled above (the larger one once the driver may have been called)
                L.set_vm(conn, vm.id, note=f"scale failed: {reason}"
                         + (f"; kept at {resized['vcpus']} vCPU(s) / {resized['memory_mib']} MiB, charged and "
                            f"claimed" if resized else ""), state=VmState.running, **resized)
            L.set_operation(conn, op_id, state=OperationState.failed, progress=100,
                            message=f"{op.kind} failed at step {op.step}: {reason}")
        metrics.OPERATIONS.labels(op.kind, "failed").inc()
        if given is not None:
            with self._lock:
                self.index.add_usage(given[0], -given[1], -given[2])
        self._unindex(freed)

    def _domain_presence(self, op_id: str) -> str | None:
        """For a failed start or stop: whether the VM's domain is on its host, asked now. "gone" only when
        the host says it has no such domain; "running" (a QEMU exists), "defined" (not running), or
        "unknown" when the host can not be asked. None for other operations."""
        with self.db.read() as s:
            conn = s.connection()
            op = L.operation_row(conn, op_id)
            if op.kind not in ("start", "stop") or op.vm_id is None:
                return None
            vm = L.vm_row(conn, op.vm_id)
        driver = self.drivers.get(vm.host_name) if vm.host_name else None
        if driver is None:
            return None
        try:
            info = driver.domain(domain_name(vm.name))
        except Exception as exc:        # unknown is not absent
            log.warning("vm %s: can not tell whether its domain is on %s: %s", vm.name, vm.host_name, exc)
            return "unknown"
        if info is None:
            return "gone"
        return "running" if info.active else "defined"

    @staticmethod
    def _host_down(conn: Connection, host_id: int | None) -> bool:
        return host_id is not None and conn.execute(select(L.HOSTS.c.state).where(
            L.HOSTS.c.id == host_id)).scalar() in UNREACHABLE

    def reconcile(self) -> list[str]:
        """Start-up reconcile (reconcile.reconcile): every `running` VM against the hosts of its zone."""
        return reconcile_running(self)

    # -- host health (hostmonitor, hostsync, hostevents: this class only starts and stops them) -------
    def check_hosts(self) -> list[str]:
        """One pass of the host monitor (hostmonitor.HostMonitor.check)."""
        return self.monitor.check()

    def start_monitor(self) -> None:
        """Start the loops that listen to the hosts until close(): the host monitor (every
        `vmplane.host.check.interval` s), the full sync (every `vmplane.host.sync.interval` s) and the
        libvirt event loop."""
        self.monitor.start()
        self.sync.start()
        self.host_events.start()
        self.migration_settle.start()
        self.storage_settle.start()
        self.ha.start()
        self.overdue.start()

    def exec_in_guest(self, name: str, command: str, timeout_s: float = 30.0) -> tuple[str, int]:
        """Run one shell line in a running VM's guest (through its console); (output, exit code)."""
        if not command.strip():
            raise Invalid("command is empty", field="command")
        deadline = time.monotonic() + timeout_s
        while True:                       # a VM that is starting is waited for, within the timeout
            with self.db.read() as s:
                vm = L.vm_row(s.connection(), name=name)
            if vm.state != VmState.starting.value or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if vm.state == VmState.unknown.value:
            raise Conflict(f"vm {name} is unknown: its host {vm.host_name} does not answer; retry when it is back",
                           field="state")
        if vm.state not in (VmState.running.value, VmState.scaling.value):
            raise Conflict(f"vm {name} is {vm.state}; commands run in a running VM", field="state")
        driver = self.drivers[vm.host_name]
        run = getattr(driver, "guest_run", None)
        if run is None:
            raise Conflict(f"vm {name} runs on {vm.host_name}, a {driver.kind} host without a guest to run "
                           f"commands in; use a libvirt host", field="host")
        try:
            return run(domain_name(name), command, max(deadline - time.monotonic(), 1.0))
        except DriverError as exc:
            raise Conflict(str(exc), field="command") from None

    def _resume_operations(self) -> None:
        """Operations interrupted by a restart are driven to their end from their persisted step:
        start and stop are idempotent, a scale redoes its (absolute) driver steps or rolls back, a
        drain admits migrations for the VMs it had not reached."""
        pending = self.controllers.claim_operations()      # those whose owner is not live, now this one's
        bodies = {"stop": self._run_stop, "scale": self.scaler.resume,
                  "drain": self.maintenance.resume_drain, "recover": self.ha.recovery.resume,
                  "restart": self.ha.recovery.run_restart}
        for op_id, kind in pending:
            body = bodies.get(kind)
            if kind == "start":
                self.starts.submit(op_id, "recovery")
            elif body is None:
                self._fail(op_id, Conflict(f"interrupted {kind} cannot be resumed"))
            else:
                self.executor.submit(self._run, op_id, body, "recovery")

    def operation(self, op_id: str) -> Operation:
        with self.db.read() as s:
            op = s.get(Operation, op_id)
            if op is None:
                raise NotFound(f"operation {op_id} does not exist", field="operation")
            return op

    def operations(self, state: str | None = None, limit: int = 100) -> list[Operation]:
        with self.db.read() as s:
            stmt = select(Operation).order_by(Operation.created_at.desc()).limit(limit)
            if state:
                stmt = stmt.where(Operation.state == state)
            return list(s.scalars(stmt))

    def find_operation(self, prefix: str, project_id: int | None = None) -> Operation:
        """By its id or a unique prefix of it (4+ characters); `project_id` limits the search to one
        project's operations (a member's)."""
        with self.db.read() as s:
            scope = [] if project_id is None else [Operation.project_id == project_id]
            return s.get(Operation, by_prefix(s, Operation.id, prefix, "operation", scope))

    def operation_page(self, page: Page, state: str | None = None, kind: str | None = None, vm: str | None = None,
                       host: str | None = None, project_id: int | None = None) -> tuple[list[Operation], int]:
        """Operations filtered, sorted and paged in SQL (newest first by default), and their total."""
        conds = [Operation.state == state] if state else []
        if kind:
            conds.append(Operation.kind == kind)
        if vm:
            conds += [Operation.target == vm, Operation.kind != "drain"]
        if host:
            conds += [Operation.target == host, Operation.kind == "drain"]
        if project_id is not None:
            conds.append(Operation.project_id == project_id)
        fields = {"created_at": Operation.created_at, "updated_at": Operation.updated_at, "kind": Operation.kind,
                  "state": Operation.state, "progress": Operation.progress}
        with self.db.read() as s:
            return run_page(s, select(Operation), Operation.id, conds,
                            order_by(page.sort, fields, "-created_at", Operation.id), page)

    def host_page(self, page: Page, cluster: str | None = None, zone: str | None = None,
                  state: str | None = None) -> tuple[list[Host], int]:
        conds = [Host.state == state] if state else []
        if cluster:
            conds.append(Host.cluster_id.in_(select(Cluster.id).where(Cluster.name == cluster)))
        if zone:
            conds.append(Host.cluster_id.in_(select(Cluster.id).join(Zone, Zone.id == Cluster.zone_id)
                                             .where(Zone.name == zone)))
        cluster_name = select(Cluster.name).where(Cluster.id == Host.cluster_id).scalar_subquery()
        zone_name = (select(Zone.name).join(Cluster, Cluster.zone_id == Zone.id)
                     .where(Cluster.id == Host.cluster_id).scalar_subquery())
        fields = {"name": Host.name, "cluster": cluster_name, "zone": zone_name, "state": Host.state,
                  "cores": Host.cores, "memory_mib": Host.memory_mib, "used_vcpus": Host.used_vcpus,
                  "used_memory_mib": Host.used_memory_mib}
        with self.db.read() as s:
            return run_page(s, select(Host), Host.id, conds, order_by(page.sort, fields, "name", Host.id), page)

    def vm_page(self, page: Page, project: str | None = None, state: str | None = None, host: str | None = None,
                zone: str | None = None, name: str | None = None,
                project_id: int | None = None) -> tuple[list[Vm], int]:
        """VMs filtered, sorted and paged in SQL, and their total. A filter naming an object that does not
        exist matches nothing (an empty page, not a 404); `project_id` scopes a member to its project."""
        conds = [Vm.state == state] if state else []
        if project:
            conds.append(Vm.project_id.in_(select(Project.id).where(Project.name == project)))
        if project_id is not None:
            conds.append(Vm.project_id == project_id)
        if host:
            conds.append(Vm.host_id.in_(select(Host.id).where(Host.name == host)))
        if zone:
            zone_id = select(Zone.id).where(Zone.name == zone)
            hosts_in_zone = (select(Host.id).join(Cluster, Cluster.id == Host.cluster_id)
                             .where(Cluster.zone_id.in_(zone_id)))
            conds.append(Vm.zone_id.in_(zone_id) | (Vm.zone_id.is_(None) & Vm.host_id.in_(hosts_in_zone)))
        if name:
            conds.append(Vm.name.startswith(name, autoescape=True))
        fields = {"name": Vm.name, "state": Vm.state, "vcpus": Vm.vcpus, "memory_mib": Vm.memory_mib,
                  "created_at": Vm.created_at,
                  "project": select(Project.name).where(Project.id == Vm.project_id).scalar_subquery(),
                  "host": select(Host.name).where(Host.id == Vm.host_id).scalar_subquery()}
        with self.db.read() as s:
            return run_page(s, select(Vm), Vm.id, conds, order_by(page.sort, fields, "name", Vm.id), page)

    # -- reads ---------------------------------------------------------------------------------
    def vm(self, name: str) -> Vm:
        with self.db.read() as s:
            return get_by_name(s, Vm, name, field="vm")

    def vms(self, project: str | None = None) -> list[Vm]:
        with self.db.read() as s:
            stmt = select(Vm).order_by(Vm.name)
            if project:
                stmt = stmt.where(Vm.project_id == get_by_name(s, Project, project, field="project").id)
            return list(s.scalars(stmt).unique())

    def project_usage(self, name: str) -> dict:
        with self.db.read() as s:
            p = get_by_name(s, Project, name, field="project")
            return {"project": p.name, "count_overhead": p.count_overhead, "ledger": ledger_of(p),
                    "recomputed": self.catalog.recomputed_usage(s, p), "quota": quota_of(p)}

    def audit(self) -> list[str]:
        """Broken invariants in words: the ledger and claims (audit.audit), then the store against what
        every host runs (audit.placement_problems)."""
        with self._lock:
            problems = audit_rules.audit(self.db, self.catalog.recomputed_usage, self.index)
        return problems + self.audit_hosts() + self._audit_storage()

    def _audit_storage(self) -> list[str]:
        """Storage findings, reported when a second pass finds them again (as for the hosts)."""
        first = storage_problems(self)
        if not first:
            return first
        again = set(storage_problems(self))
        return [problem for problem in first if problem in again]

    def audit_hosts(self) -> list[str]:
        """The store against what every host runs. The hosts are scanned, then the store is read, with no
        lock between: an operation that ends in between shows as a finding that is already gone. So a
        finding is reported only if a second pass (a fresh scan and a fresh read) finds it again."""
        def scan() -> list[str]:
            seen: dict[str, list | None] = {}
            for name, driver in list(self.drivers.items()):
                try:
                    seen[name] = driver.domains()
                except DriverError:
                    seen[name] = None
            with self.db.read() as s:
                vms = drift_view(s.connection(), domain_name)
            return audit_rules.placement_problems(vms, seen, DOMAIN_PREFIX)

        first = scan()
        if not first:
            return first
        again = set(scan())
        return [problem for problem in first if problem in again]

    def close(self) -> None:
        self.closing.set()
        self.controllers.stop()
        for loop in (self.monitor, self.sync, self.host_events, self.migration_settle, self.storage_settle, self.ha,
                     self.overdue):
            loop.stop()
        if isinstance(self.executor, ThreadPoolExecutor):
            self.executor.shutdown(wait=True)
        self.starts.close()
        for driver in self.drivers.values():
            driver.close()
