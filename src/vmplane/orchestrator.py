"""Applies decisions: the only module that uses both the store and the drivers.

Every admission (create, start) runs in one write transaction that locks the project row, then
the host row, checks the pure rules (quota.check_admission, placement filters) against the rows
it holds, and writes the ledger, the claim and the operation together. Driver work happens after
commit, in an operation, and its result is written back in another transaction; a failure gives
back exactly what was charged and claimed.
"""

from __future__ import annotations

import logging
import threading
import uuid
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from .catalog import Catalog, ensure_new, get_by_name, ledger_of, offering_data, quota_of
from .drivers.base import DomainSpec, Driver, DriverError, HostInfo
from .drivers.sim import SimDriver
from .errors import Conflict, InsufficientCapacity, Invalid, NotFound, VmplaneError
from .model import (CHARGED_STATES, IN_FLIGHT_OPERATION_STATES, ClaimKind, HostCapacity, HostState,
                    OperationState, PlacementRequest, Size, Usage, VmState)
from .names import check_name
from .offerings import size_for
from .placement import CapacityIndex, choose
from .quota import check_admission, running_charge
from .store import Database
from .store.schema import Claim, Cluster, Host, Offering, Operation, Project, Template, Vm

log = logging.getLogger("vmplane.orchestrator")

DOMAIN_PREFIX = "vmplane-"
PLACEMENT_RETRIES = 5


def domain_name(vm_name: str) -> str:
    return DOMAIN_PREFIX + vm_name


class InlineExecutor(Executor):
    """Runs operations in the caller's thread (benchmarks and deterministic tests)."""

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[override]
        fn(*args, **kwargs)


@dataclass(frozen=True)
class Admitted:
    vm: Vm
    operation_id: str | None


class Orchestrator:
    def __init__(self, db: Database, executor: Executor | None = None):
        self.db = db
        self.catalog = Catalog(db, on_settings_changed=self.rebuild_index)
        self.drivers: dict[str, Driver] = {}
        self.index = CapacityIndex()
        self._lock = threading.RLock()
        self.executor = executor or ThreadPoolExecutor(8, thread_name_prefix="vmplane-op")

    # -- start-up ------------------------------------------------------------------------------
    def load(self) -> None:
        """Build drivers and the capacity index from the store, then finish interrupted operations."""
        with self.db.read() as s:
            hosts = list(s.scalars(select(Host)).unique())
            for host in hosts:
                self.drivers[host.name] = self._make_driver(host)
            running = s.execute(select(Vm).where(Vm.state.in_([st.value for st in CHARGED_STATES
                                                              if st != VmState.starting]))).unique().scalars()
            for vm in running:
                driver = self.drivers.get(vm.host.name) if vm.host else None
                if isinstance(driver, SimDriver):
                    driver.adopt(self._spec(vm))
        self.rebuild_index()
        self._resume_operations()

    def _make_driver(self, host: Host) -> Driver:
        if host.driver == "sim":
            return SimDriver(host.name, HostInfo(host.cores, host.cpu_mhz, host.memory_mib))
        raise Invalid(f"host {host.name}: driver {host.driver!r} is not available in this build", field="driver")

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
            used_vcpus=host.used_vcpus, used_memory_mib=host.used_memory_mib)

    def rebuild_index(self) -> None:
        with self.db.read() as s:
            capacities = [self._capacity(h) for h in s.scalars(select(Host).order_by(Host.id)).unique()]
        with self._lock:
            self.index = CapacityIndex(capacities)

    def _refresh_host(self, s: Session, host: Host) -> None:
        with self._lock:
            self.index.upsert(self._capacity(host))

    # -- hosts ---------------------------------------------------------------------------------
    def add_host(self, name: str, cluster: str, driver: str, cores: int | None = None,
                 cpu_mhz: int | None = None, memory_mib: int | None = None, uri: str | None = None) -> Host:
        check_name(name)
        if driver == "sim":
            for field, value in (("cores", cores), ("cpu_mhz", cpu_mhz), ("memory_mib", memory_mib)):
                if value is None:
                    raise Invalid(f"a sim host needs {field}", field=field)
                if value <= 0:
                    raise Invalid(f"{field} must be greater than 0, got {value}", field=field)
            info = HostInfo(cores, cpu_mhz, memory_mib)  # type: ignore[arg-type]
        else:
            raise Invalid(f"driver {driver!r} is not available in this build; use sim", field="driver")
        with self.db.write() as s:
            ensure_new(s, Host, name)
            c = get_by_name(s, Cluster, cluster, field="cluster")
            host = Host(name=name, cluster_id=c.id, driver=driver, uri=uri, cores=info.cores,
                        cpu_mhz=info.cpu_mhz, memory_mib=info.memory_mib, state=HostState.enabled.value,
                        used_vcpus=0, used_memory_mib=0)
            s.add(host)
            s.flush()
            s.refresh(host)
        self.drivers[name] = self._make_driver(host)
        with self.db.read() as s:
            host = get_by_name(s, Host, name)
            self._refresh_host(s, host)
        return host

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
                  start: bool = False) -> Admitted:
        check_name(name)
        with self._lock:
            with self.db.write() as s:
                ensure_new(s, Vm, name)
                p = get_by_name(s, Project, project, field="project", for_update=True)
                o = get_by_name(s, Offering, offering, field="offering")
                t = get_by_name(s, Template, template, field="template")
                size = size_for(offering_data(o), vcpus, memory_mib)
                check_admission(p.name, quota_of(p), ledger_of(p), Usage(vms=1))
                p.used_vms += 1
                vm = Vm(name=name, project_id=p.id, offering_id=o.id, template_id=t.id, vcpus=size.vcpus,
                        memory_mib=size.memory_mib, dynamically_scalable=dynamically_scalable,
                        state=VmState.stopped.value, overhead_mib=0, charged_vcpus=0, charged_memory_mib=0)
                s.add(vm)
                s.flush()
                op_id = self._admit_start(s, vm, p) if start else None
                s.flush()
                s.refresh(vm)
            return self._launch(vm, op_id)

    def start_vm(self, name: str) -> Admitted:
        with self._lock:
            with self.db.write() as s:
                vm = get_by_name(s, Vm, name, field="vm", for_update=True)
                if vm.state != VmState.stopped.value:
                    raise Conflict(f"vm {name} is {vm.state}; only a stopped VM can be started", field="state")
                p = s.get(Project, vm.project_id, with_for_update=True, populate_existing=True)
                op_id = self._admit_start(s, vm, p)
                s.flush()
                s.refresh(vm)
            return self._launch(vm, op_id)

    def _admit_start(self, s: Session, vm: Vm, p: Project) -> str:
        """Place, charge and claim in the caller's transaction. Caller holds self._lock."""
        size = Size(vm.vcpus, vm.memory_mib)
        excluded: set[str] = set()
        for _ in range(PLACEMENT_RETRIES):
            placement = choose(self.index, PlacementRequest(size, exclude_hosts=frozenset(excluded)))
            host = get_by_name(s, Host, placement.host, for_update=True)
            cap = self._capacity(host)
            if (host.state == HostState.enabled.value
                    and host.used_vcpus + size.vcpus <= cap.vcpus_capacity
                    and host.used_memory_mib + placement.memory_mib <= cap.memory_capacity_mib):
                break
            # The index was behind the store (another process claimed); learn and try elsewhere.
            self.index.upsert(cap)
            excluded.add(host.name)
        else:
            raise InsufficientCapacity(f"no host could be claimed for vm {vm.name} after {PLACEMENT_RETRIES} "
                                       f"tries; hosts are changing fast, retry", field="host")
        charge = running_charge(size, placement.overhead_mib, p.count_overhead)
        check_admission(p.name, quota_of(p), ledger_of(p), charge)
        p.used_vcpus += charge.vcpus
        p.used_memory_mib += charge.memory_mib
        host.used_vcpus += size.vcpus
        host.used_memory_mib += placement.memory_mib
        op_id = str(uuid.uuid4())
        s.add(Claim(host_id=host.id, vm_id=vm.id, operation_id=op_id, kind=ClaimKind.running.value,
                    vcpus=size.vcpus, memory_mib=placement.memory_mib))
        s.add(Operation(id=op_id, kind="start", target=vm.name, vm_id=vm.id, project_id=p.id,
                        state=OperationState.pending.value, step="claimed", progress=10,
                        message=f"claimed {size.vcpus} vCPU(s) / {placement.memory_mib} MiB on {host.name}",
                        result={"host": host.name}))
        vm.state = VmState.starting.value
        vm.host_id = host.id
        vm.overhead_mib = placement.overhead_mib
        vm.charged_vcpus, vm.charged_memory_mib = charge.vcpus, charge.memory_mib
        vm.max_vcpus, vm.max_memory_mib = size.vcpus, size.memory_mib
        return op_id

    def _launch(self, vm: Vm, op_id: str | None) -> Admitted:
        """After commit, under self._lock: mirror the new claim in the index, then start the work."""
        if op_id is not None:
            self.index.add_usage(vm.host.name, vm.vcpus, vm.memory_mib + vm.overhead_mib)
            self.executor.submit(self._run, op_id, self._run_start)
        return Admitted(vm, op_id)

    # -- VMs: stop and delete ------------------------------------------------------------------
    def stop_vm(self, name: str) -> Admitted:
        with self.db.write() as s:
            vm = get_by_name(s, Vm, name, field="vm", for_update=True)
            if vm.state != VmState.running.value:
                raise Conflict(f"vm {name} is {vm.state}; only a running VM can be stopped", field="state")
            op_id = str(uuid.uuid4())
            s.add(Operation(id=op_id, kind="stop", target=vm.name, vm_id=vm.id, project_id=vm.project_id,
                            state=OperationState.pending.value, step="stopping", progress=10, message=""))
            vm.state = VmState.stopping.value
        self.executor.submit(self._run, op_id, self._run_stop)
        return Admitted(vm, op_id)

    def delete_vm(self, name: str) -> None:
        with self.db.write() as s:
            vm = get_by_name(s, Vm, name, field="vm", for_update=True)
            if vm.state not in (VmState.stopped.value, VmState.error.value):
                raise Conflict(f"vm {name} is {vm.state}; stop it before deleting it", field="state")
            p = s.get(Project, vm.project_id, with_for_update=True, populate_existing=True)
            self._release(s, vm, p)
            p.used_vms -= 1
            s.delete(vm)

    def _release(self, s: Session, vm: Vm, p: Project) -> list[tuple[str, int, int]]:
        """Give back everything `vm` holds: its claims on hosts and its charge on the ledger."""
        freed = []
        for claim in s.scalars(select(Claim).where(Claim.vm_id == vm.id)):
            host = s.get(Host, claim.host_id, with_for_update=True, populate_existing=True)
            host.used_vcpus -= claim.vcpus
            host.used_memory_mib -= claim.memory_mib
            freed.append((host.name, claim.vcpus, claim.memory_mib))
        s.execute(delete(Claim).where(Claim.vm_id == vm.id))
        p.used_vcpus -= vm.charged_vcpus
        p.used_memory_mib -= vm.charged_memory_mib
        vm.charged_vcpus = vm.charged_memory_mib = 0
        vm.host_id = None
        vm.state = VmState.stopped.value
        return freed

    def _unindex(self, freed: list[tuple[str, int, int]]) -> None:
        with self._lock:
            for host, vcpus, memory in freed:
                if host in self.index:
                    self.index.add_usage(host, -vcpus, -memory)

    # -- operations ----------------------------------------------------------------------------
    def _run(self, op_id: str, body) -> None:
        try:
            body(op_id)
        except Exception as exc:  # an operation must end, whatever happened
            log.exception("operation %s failed", op_id)
            self._fail(op_id, exc)

    def _spec(self, vm: Vm) -> DomainSpec:
        return DomainSpec(name=domain_name(vm.name), vcpus=vm.vcpus, max_vcpus=vm.max_vcpus or vm.vcpus,
                          memory_mib=vm.memory_mib, max_memory_mib=vm.max_memory_mib or vm.memory_mib,
                          image=vm.template.image)

    def _op_vm(self, s: Session, op_id: str) -> tuple[Operation, Vm | None]:
        op = s.get(Operation, op_id, with_for_update=True)
        if op is None:
            raise NotFound(f"operation {op_id} does not exist", field="operation")
        vm = s.get(Vm, op.vm_id, populate_existing=True) if op.vm_id is not None else None
        return op, vm

    def _run_start(self, op_id: str) -> None:
        with self.db.write() as s:
            op, vm = self._op_vm(s, op_id)
            if op.state not in {st.value for st in IN_FLIGHT_OPERATION_STATES}:
                return
            op.state, op.step, op.progress = OperationState.running.value, "starting-domain", 30
            spec, host = self._spec(vm), vm.host.name
        driver = self.drivers[host]
        current = driver.domain(spec.name)
        if current is None or not current.running:
            driver.start(spec)
        with self.db.write() as s:
            op, vm = self._op_vm(s, op_id)
            vm.state = VmState.running.value
            op.state, op.step, op.progress = OperationState.succeeded.value, "done", 100
            op.message = f"running on {host}"

    def _run_stop(self, op_id: str) -> None:
        with self.db.write() as s:
            op, vm = self._op_vm(s, op_id)
            if op.state not in {st.value for st in IN_FLIGHT_OPERATION_STATES}:
                return
            op.state, op.step, op.progress = OperationState.running.value, "stopping-domain", 30
            spec, host = self._spec(vm), vm.host.name
        self.drivers[host].stop(spec.name)
        with self.db.write() as s:
            op, vm = self._op_vm(s, op_id)
            p = s.get(Project, vm.project_id, with_for_update=True, populate_existing=True)
            freed = self._release(s, vm, p)
            op.state, op.step, op.progress = OperationState.succeeded.value, "done", 100
            op.message = f"stopped on {host}"
        self._unindex(freed)

    def _fail(self, op_id: str, exc: BaseException) -> None:
        """End an operation as failed, giving back what a failed start holds."""
        reason = exc.message if isinstance(exc, VmplaneError) else str(exc) or type(exc).__name__
        freed: list = []
        with self.db.write() as s:
            op, vm = self._op_vm(s, op_id)
            if vm is not None and op.kind == "start" and vm.state == VmState.starting.value:
                p = s.get(Project, vm.project_id, with_for_update=True, populate_existing=True)
                freed = self._release(s, vm, p)
            elif vm is not None and op.kind == "stop" and vm.state == VmState.stopping.value:
                vm.state = VmState.running.value   # the domain still runs; the stop can be retried
            op.state, op.progress = OperationState.failed.value, 100
            op.message = f"{op.kind} failed at step {op.step}: {reason}"
        self._unindex(freed)

    def _resume_operations(self) -> None:
        """Operations interrupted by a restart are driven to their end (start and stop are idempotent)."""
        with self.db.read() as s:
            pending = list(s.scalars(select(Operation).where(
                Operation.state.in_([st.value for st in IN_FLIGHT_OPERATION_STATES]))))
        for op in pending:
            body = {"start": self._run_start, "stop": self._run_stop}.get(op.kind)
            if body is None:
                self._fail(op.id, Conflict(f"interrupted {op.kind} cannot be resumed"))
            else:
                self.executor.submit(self._run, op.id, body)

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
        """Every broken invariant of the ledger and the claims, in words (empty when all hold)."""
        problems = []
        with self.db.read() as s:
            for p in s.scalars(select(Project)):
                ledger, again = ledger_of(p), self.catalog.recomputed_usage(s, p)
                if ledger != again:
                    problems.append(f"project {p.name}: ledger {ledger} != recomputed {again}")
                for r in ("vcpus", "memory_mib", "vms"):
                    if getattr(ledger, r) > getattr(quota_of(p), r):
                        problems.append(f"project {p.name}: {r} {getattr(ledger, r)} above quota")
            sums = dict((hid, (c, m)) for hid, c, m in s.execute(
                select(Claim.host_id, func.sum(Claim.vcpus), func.sum(Claim.memory_mib)).group_by(Claim.host_id)))
            for h in s.scalars(select(Host)).unique():
                c, m = sums.get(h.id, (0, 0))
                if (h.used_vcpus, h.used_memory_mib) != (c, m):
                    problems.append(f"host {h.name}: used {h.used_vcpus}/{h.used_memory_mib} != claims {c}/{m}")
                with self._lock:
                    ix = self.index.host(h.name) if h.name in self.index else None
                if ix is not None and (ix.used_vcpus, ix.used_memory_mib) != (h.used_vcpus, h.used_memory_mib):
                    problems.append(f"host {h.name}: index {ix.used_vcpus}/{ix.used_memory_mib} != store")
            for vm in s.scalars(select(Vm)).unique():
                charged = VmState(vm.state) in CHARGED_STATES
                claims = s.scalar(select(func.count()).select_from(Claim).where(Claim.vm_id == vm.id))
                if charged and (vm.host_id is None or claims != 1):
                    problems.append(f"vm {vm.name}: {vm.state} with {claims} claims on host {vm.host_id}")
                if not charged and (claims or vm.charged_vcpus or vm.charged_memory_mib):
                    problems.append(f"vm {vm.name}: {vm.state} still holds {claims} claims / a charge")
        return problems

    def close(self) -> None:
        if isinstance(self.executor, ThreadPoolExecutor):
            self.executor.shutdown(wait=True)
        for driver in self.drivers.values():
            driver.close()
