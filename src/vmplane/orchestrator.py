"""The composition root: builds one control-plane process's Plane and controllers, wires them, and is
the facade the API, the console and the CLI's local cluster call.

As KubeVirt's `VirtControllerApp`: each controller gets, in its constructor, the Plane (plane/context.py)
and the named peers it uses; no controller holds this object or reaches a peer through it. Operation
kinds register their body and failure hook with the runner (plane/operations.py) here. Nothing below this
module imports it. The public names below are one-line delegates, kept for the API and the tests.
"""

from __future__ import annotations

import logging
from concurrent.futures import Executor, ThreadPoolExecutor
from functools import partial
from typing import Any

from vmplane.controllers.audit import Audit
from vmplane.controllers.backuprestores import BackupRestores
from vmplane.controllers.backups import Backups
from vmplane.controllers.backupschedules import BackupSchedules
from vmplane.controllers.clones import Clones
from vmplane.controllers.consoles import Consoles
from vmplane.controllers.diskmoves import DiskMoves
from vmplane.controllers.guestagents import GuestAgents
from vmplane.controllers.ha import HaController
from vmplane.controllers.hostadmin import HostAdmin
from vmplane.controllers.hostevents import HostEvents
from vmplane.controllers.hostmonitor import HostMonitor
from vmplane.controllers.hostsync import HostSync
from vmplane.controllers.maintenance import Maintenance
from vmplane.controllers.migrationsettle import MigrationSettle
from vmplane.controllers.migrator import Migrator
from vmplane.controllers.networking import Networking
from vmplane.controllers.nics import Nics
from vmplane.controllers.pools import Pools
from vmplane.controllers.reboots import Reboots
from vmplane.controllers.reconcile import reconcile as reconcile_running
from vmplane.controllers.recovery import Recovery
from vmplane.controllers.scaler import Scaler
from vmplane.controllers.seeds import Seeds
from vmplane.controllers.snapshots import Snapshots
from vmplane.controllers.starts import Starts
from vmplane.controllers.stats import Stats
from vmplane.controllers.storagesettle import StorageSettle
from vmplane.controllers.vms import Admitted, Vms
from vmplane.controllers.volumemoves import VolumeMoves
from vmplane.controllers.volumes import Volumes
from vmplane.core.model import HostState
from vmplane.core.names import domain_name, local_pool_name
from vmplane.core.placement import CapacityIndex
from vmplane.hosts import images
from vmplane.plane.capacity import Capacity
from vmplane.plane.context import Plane
from vmplane.plane.membership import DEFAULT_LEASE_S, Membership
from vmplane.plane.operations import Operations
from vmplane.plane.overdue import OverdueOperations
from vmplane.plane.settle import after_failed_operation
from vmplane.store import Database, admission
from vmplane.store.catalog import Catalog
from vmplane.store.lifecycle import check_host_unused
from vmplane.store.reads import Reads
from vmplane.store.schema import Host, Operation, Vm

__all__ = ["Admitted", "InlineExecutor", "Orchestrator"]

log = logging.getLogger("vmplane.orchestrator")


class InlineExecutor(Executor):
    """Runs operations in the caller's thread (benchmarks and deterministic tests)."""

    runs_inline = True  # the start controller too asks every host in the caller's thread

    def submit(self, fn, /, *args, **kwargs):
        fn(*args, **kwargs)


class Orchestrator:
    def __init__(
        self,
        db: Database,
        executor: Executor | None = None,
        name: str | None = None,
        lease_s: float = DEFAULT_LEASE_S,
        api_url: str | None = None,
    ):
        catalog = Catalog(db, on_settings_changed=self._settings_changed, disk_image=images.template_disk)
        capacity = Capacity(db, catalog)
        self.plane = plane = Plane(
            db=db,
            catalog=catalog,
            drivers={},
            capacity=capacity,
            # this process among the control planes of the store: its lease, what it owns (registered by load())
            membership=Membership(db, name, lease_s, api_url),
            admissions=admission.Batcher(db, capacity.lock, on_abort=capacity.rebuild),  # group commit
            executor=executor or ThreadPoolExecutor(16, thread_name_prefix="vmplane-op"),
        )
        plane.ops = ops = Operations(plane, settle_after=partial(after_failed_operation, plane))
        self.db, self.catalog, self.drivers, self.capacity = db, catalog, plane.drivers, capacity
        self.admissions, self.executor, self.closing = plane.admissions, plane.executor, plane.closing
        self.host_admin = HostAdmin(plane)
        # storage: pools, root disks and volumes, and what a migration does with the disks
        self.pools = Pools(plane)
        self.volumes = Volumes(plane, self.pools)
        self.disk_moves = DiskMoves(plane, self.pools)
        self.networking = Networking(plane)  # each host holds its guests' networks and filters
        self.nics = Nics(plane, self.networking)  # NICs hot-plugged into running VMs
        self.seeds = Seeds(plane)  # cloud-init seeds, made on a VM's host before it runs there
        self.starts = Starts(plane, self.volumes, self.networking, self.seeds)  # start operations, run in batches
        self.vms_ctl = Vms(plane, self.volumes, self.starts)
        self.migrator = Migrator(plane, self.disk_moves, self.networking, self.seeds)
        self.maintenance = Maintenance(plane, self.migrator, self.host_admin)  # host drains, by live migration
        self.scaler = Scaler(plane, self.migrator, self.disk_moves)
        self.migration_settle = MigrationSettle(plane, self.migrator)  # migrations no copy thread carries
        self.storage_settle = StorageSettle(plane, self.volumes, self.disk_moves)  # volumes between two steps
        self.volume_moves = VolumeMoves(plane, self.volumes, self.pools)  # `volume move`, cold migrations
        # failed hosts: fencing, HA restarts
        self.ha = HaController(plane, self.volumes, self.migration_settle, self.networking, self.seeds)
        # the loops that listen to the hosts, started by start_monitor()
        self.monitor, self.sync, self.host_events = HostMonitor(plane), HostSync(plane), HostEvents(plane)
        self.recovery = Recovery(
            plane,
            self.migrator,
            self.storage_settle,  # start-up recovery
            lambda: reconcile_running(plane),
        )
        self.guest_agents = GuestAgents(plane)  # what running guests' agents say: connected, addresses
        self.consoles = Consoles(plane)  # people's serial console sessions
        self.snapshots = Snapshots(plane, self.pools)  # disk snapshots, and the steps a crash left
        self.overdue = OverdueOperations(plane)  # its own operations left in flight past their deadline
        self.auditor = Audit(plane, self.volumes, self.pools)
        self.reads = Reads(db, catalog)
        self.clones = Clones(plane, self.vms_ctl, self.volumes, self.pools, self.reads)  # full clones of root disks
        self.backups = Backups(plane, self.pools)  # backup stores, backups of every disk of a VM
        self.reboots = Reboots(plane)  # `vm reboot`: the guest asked (or reset), the VM keeps running
        self.backup_restores = BackupRestores(plane, self.backups, self.vms_ctl, self.volumes, self.pools, self.clones)
        self.backup_schedules = BackupSchedules(plane, self.backups)  # cron runs, exactly once across processes
        self.stats = Stats(db, plane.drivers, capacity, plane.membership)  # usage graphs: sampled every minute
        ops.register(
            "start",
            on_fail=self.vms_ctl.fail_start_stop,
            before_fail=self.vms_ctl.domain_presence,
            resume=lambda op_id: self.starts.submit(op_id, "recovery"),
            carried=self.starts.carried,
        )
        ops.register(
            "stop",
            self.vms_ctl.run_stop,
            on_fail=self.vms_ctl.fail_start_stop,
            before_fail=self.vms_ctl.domain_presence,
        )
        ops.register("scale", self.scaler.resume, on_fail=self.scaler.fail_scale)
        ops.register("drain", self.maintenance.resume_drain)
        ops.register("recover", self.ha.recovery.resume)
        ops.register("restart", self.ha.recovery.run_restart, take_failure=self.ha.recovery.fail_restart)
        plane.membership.on_peers_changed += [catalog.forget_settings, self.host_admin.refresh]
        plane.membership.on_orphans.append(self.recovery.take_over)

    def _settings_changed(self) -> None:
        self.plane.capacity.rebuild()

    # -- start-up and shutdown -------------------------------------------------------------------
    def load(self, background: bool = False, recover: bool = True) -> None:
        """Build drivers and the capacity index from the store, then finish interrupted operations
        (recovery.Recovery): VMs whose domain is gone are recorded stopped, migrations are finished or
        rolled back by asking their hosts, and other operations are resumed (or rolled back) from their
        last step. `background`: recovery runs in a thread (the API answers meanwhile, refusing
        operations on the VMs it has not finished with); wait_recovered() waits for it. `recover=False`:
        the caller starts it later (`vmplane up` once its local hosts run: recovery.run)."""
        self.host_admin.load()
        self.capacity.rebuild()
        self.plane.membership.register()
        if recover:
            self.recovery.run(background)

    def wait_recovered(self, timeout: float | None = None) -> bool:
        """Wait until start-up recovery is done; False if `timeout` passed first."""
        return self.recovery.wait(timeout)

    def start_monitor(self) -> None:
        """Start the loops that listen to the hosts until close(): the host monitor (every
        `vmplane.host.check.interval` s), the full sync (every `vmplane.host.sync.interval` s) and the
        libvirt event loop; the migration and storage settle loops, HA and overdue operations."""
        for loop in self._loops():
            loop.start()

    def _loops(self) -> tuple:
        return (
            self.monitor,
            self.sync,
            self.host_events,
            self.migration_settle,
            self.storage_settle,
            self.volume_moves,
            self.ha,
            self.overdue,
            self.networking,
            self.nics,
            self.guest_agents,
            self.consoles,
            self.snapshots,
            self.backups,
            self.backup_schedules,
            self.stats,
        )

    def close(self) -> None:
        self.closing.set()
        self.plane.membership.stop()
        for loop in self._loops():
            loop.stop()
        if isinstance(self.executor, ThreadPoolExecutor):
            self.executor.shutdown(wait=True)
        self.starts.close()

    # -- the facade: what the API, the console and the tests call ----------------------------------
    domain_name = staticmethod(domain_name)

    @property
    def index(self) -> CapacityIndex:
        return self.capacity.index

    @property
    def controllers(self) -> Membership:
        return self.plane.membership

    @property
    def ops(self) -> Operations:
        return self.plane.ops

    def rebuild_index(self) -> None:
        self.capacity.rebuild()

    def reconcile(self) -> list[str]:
        """Start-up reconcile (reconcile.reconcile): every `running` VM against the hosts of its zone."""
        return reconcile_running(self.plane)

    def check_hosts(self) -> list[str]:
        """One pass of the host monitor (hostmonitor.HostMonitor.check)."""
        return self.monitor.check()

    def add_host(self, *args: Any, local_pool: bool = False, **kwargs: Any) -> Host:
        """Register a host; with `local_pool`, its local pool `local-NAME` too (as `vmplane up` makes), so
        that it can take VMs with disks at once. A pool its host refuses undoes the add: nothing is left."""
        host = self.host_admin.add_host(*args, **kwargs)
        if local_pool:
            try:
                self.pools.create(local_pool_name(host.name), "local", host=host.name)
            except Exception:
                self.host_admin.remove_host(host.name)
                raise
        return host

    def remove_host(self, name: str, local_pools: bool = False) -> None:
        """Delete a host that holds nothing; with `local_pools`, its empty local pools go with it (checked
        first: a host still in use is refused before any pool is deleted)."""
        if local_pools:
            check_host_unused(self.catalog, name)
            for pool in self.pools.rows():
                if pool.kind == "local" and pool.host_name == name:
                    self.pools.delete(pool.name)
        self.host_admin.remove_host(name)

    def set_host_state(self, name: str, state: HostState) -> None:
        self.host_admin.set_host_state(name, state)

    def host_capacity(self, name: str):
        return self.capacity.host(name)

    def hosts(self) -> list[Host]:
        return self.host_admin.hosts()

    def host(self, name: str) -> Host:
        return self.host_admin.host(name)

    def create_vm(self, *args: Any, **kwargs: Any) -> Admitted:
        admitted = self.vms_ctl.create_vm(*args, **kwargs, dry_run=False)
        assert isinstance(admitted, Admitted)
        return admitted

    def plan_vm(self, *args: Any, **kwargs: Any) -> dict:
        """A create's dry run: its plan (host, pool, charge) or its refusal; nothing is written."""
        plan = self.vms_ctl.create_vm(*args, **kwargs, dry_run=True)
        assert isinstance(plan, dict)
        return plan

    def start_vm(self, name: str) -> Admitted:
        return self.vms_ctl.start_vm(name)

    def stop_vm(self, name: str, force: bool = False) -> Admitted:
        return self.vms_ctl.stop_vm(name, force)

    def delete_vm(self, name: str, keep_disk: bool = False) -> None:
        self.vms_ctl.delete_vm(name, keep_disk)

    def exec_in_guest(self, name: str, command: str, timeout_s: float = 30.0) -> tuple[str, int]:
        return self.vms_ctl.exec_in_guest(name, command, timeout_s)

    def vm(self, name: str) -> Vm:
        return self.reads.vm(name)

    def vms(self, project: str | None = None) -> list[Vm]:
        return self.reads.vms(project)

    def vm_page(self, *args: Any, **kwargs: Any) -> tuple[list[Vm], int]:
        return self.reads.vm_page(*args, **kwargs)

    def host_page(self, *args: Any, **kwargs: Any) -> tuple[list[Host], int]:
        return self.reads.host_page(*args, **kwargs)

    def operation(self, op_id: str) -> Operation:
        return self.reads.operation(op_id)

    def operations(self, state: str | None = None, limit: int = 100) -> list[Operation]:
        return self.reads.operations(state, limit)

    def find_operation(self, prefix: str, project_id: int | None = None) -> Operation:
        return self.reads.find_operation(prefix, project_id)

    def operation_page(self, *args: Any, **kwargs: Any) -> tuple[list[Operation], int]:
        return self.reads.operation_page(*args, **kwargs)

    def project_usage(self, name: str) -> dict:
        return self.reads.project_usage(name)

    def audit(self) -> list[str]:
        return self.auditor.audit() + self.backups.check()

    def audit_hosts(self) -> list[str]:
        return self.auditor.audit_hosts()
