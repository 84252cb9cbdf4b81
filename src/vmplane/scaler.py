"""Live scaling of running VMs (DESIGN section 5): admission, auto-migration, the driver steps, rollback.

Composed into the Orchestrator. An increase is admitted in one transaction (quota for the increase,
then the host's capacity by compare-and-add); when the host has no room and
`auto.migrate.vm.on.live.scale.insufficient.capacity` is on, the VM is first live-migrated to a host
that fits the new size. A decrease is given back only after the guest released it. A failed step
rolls back what it charged and claimed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .catalog import offering_data
from .errors import Conflict, InsufficientCapacity, VmplaneError
from .model import OperationState, PlacementRequest, Size, Usage, VmState
from .offerings import size_for
from .placement import choose
from .quota import check_admission, overhead_mib, running_charge
from .scaling import (
    ScaleFacts,
    ScalePlan,
    ScalingFlags,
    cap_for_share,
    cap_share,
    plan_scale,
)
from .store import ledger as L

if TYPE_CHECKING:
    from .orchestrator import Orchestrator

log = logging.getLogger("vmplane.scaler")


@dataclass(frozen=True)
class Admitted:
    plan: ScalePlan
    charge_delta: Usage          # on the project's ledger (may be negative: given back at the end)
    footprint_delta: int         # MiB on the host (guest memory + overhead)
    overhead_mib: int            # the VM's overhead at its new size
    offering_id: int
    path: str                    # "in-place" or "migrate-then-scale"
    migrate_to: str | None


class Scaler:
    def __init__(self, orch: "Orchestrator"):
        self.o = orch

    def _facts(self, vm, offering, current_offering) -> ScaleFacts:
        meta = self.o._hosts[vm.host_name] if vm.host_name else None
        zone_on = bool(self.o.catalog.effective("enable.dynamic.scale.vm", meta.zone if meta else None,
                                                meta.cluster if meta else None))
        return ScaleFacts(vm.name, vm.state, Size(vm.vcpus, vm.memory_mib),
                          Size(vm.max_vcpus or vm.vcpus, vm.max_memory_mib or vm.memory_mib), bool(vm.prepared),
                          # the offering it started with decided preparation; the new one must allow scaling too
                          ScalingFlags(zone_on, offering.dynamic_scaling and current_offering.dynamic_scaling,
                                       vm.template_dynamic, vm.dynamically_scalable),
                          (vm.cpu_cap_percent / 100) if vm.cpu_cap_percent else None)

    def _target(self, vm, offering, vcpus, memory_mib) -> Size:
        if offering.kind == "fixed":
            return size_for(offering_data(offering), vcpus, memory_mib)
        return size_for(offering_data(offering), vcpus or vm.vcpus, memory_mib or vm.memory_mib)

    def scale(self, name: str, offering: str | None = None, vcpus: int | None = None, memory_mib: int | None = None,
              cpu_cap: bool | None = None, dry_run: bool = False) -> dict:
        """Admit a live scale; returns the plan (dry run) or the VM name and its operation."""
        with self.o._lock:
            with self.o.db.transaction() as conn:
                vm = L.vm_row(conn, name=name, lock=True)
                current_offering = self.o.catalog.offering_by_id(vm.offering_id)
                new_offering = self.o.catalog.offering(offering) if offering else current_offering
                target = self._target(vm, new_offering, vcpus, memory_mib)
                facts = self._facts(vm, new_offering, current_offering)
                cap_on = cpu_cap if cpu_cap is not None else (
                    new_offering.cpu_cap if offering else facts.cap_share is not None)
                host = self.o._hosts[vm.host_name] if vm.host_name else None
                share = cap_share(new_offering.cpu_speed_mhz, host.cpu_mhz) if cap_on and host else None
                plan = plan_scale(facts, target, share, share != facts.cap_share)
                admitted = self._admit(conn, vm, plan, new_offering.id, dry_run)
                if dry_run:
                    return self._describe(vm, admitted)
                op_id = L.new_operation(conn, "scale", name, vm.id, vm.project_id, step="admitted",
                                        message=self._describe(vm, admitted)["summary"],
                                        result=self._describe(vm, admitted))
                L.set_vm(conn, vm.id, state=VmState.scaling)
            if admitted.footprint_delta > 0 and admitted.path == "in-place":
                self.o.index.add_usage(vm.host_name, max(plan.vcpus_delta, 0), admitted.footprint_delta)
        self.o.executor.submit(self.o._run, op_id, lambda op: self._run(op, vm.id, admitted))
        return {"vm": name, "operation_id": op_id}

    def _admit(self, conn, vm, plan: ScalePlan, offering_id: int, dry_run: bool) -> Admitted:
        p = L.lock_project(conn, vm.project_id)
        meta = self.o._hosts[vm.host_name]
        ratio = self.o.index.host(vm.host_name).overhead_ratio
        new_overhead = overhead_mib(plan.target, ratio)
        charge = running_charge(plan.target, new_overhead, p.count_overhead)
        delta = Usage(charge.vcpus - vm.charged_vcpus, charge.memory_mib - vm.charged_memory_mib, 0)
        increase = Usage(max(delta.vcpus, 0), max(delta.memory_mib, 0), 0)
        check_admission(p.name, L.quota_row(p), L.ledger_row(p), increase)
        old_footprint = vm.memory_mib + overhead_mib(Size(vm.vcpus, vm.memory_mib), ratio)
        footprint_delta = plan.target.memory_mib + new_overhead - old_footprint
        path, migrate_to = "in-place", None
        grow_vcpus, grow_memory = max(plan.vcpus_delta, 0), max(footprint_delta, 0)
        if grow_vcpus or grow_memory:
            if dry_run:
                host = self.o.index.host(vm.host_name)
                fits = (host.used_vcpus + grow_vcpus <= host.vcpus_capacity
                        and host.used_memory_mib + grow_memory <= host.memory_capacity_mib)
            else:
                fits = self._take_growth(conn, vm.host_name, vm.id, grow_vcpus, grow_memory)
            if not fits:
                if not self.o.catalog.effective("auto.migrate.vm.on.live.scale.insufficient.capacity",
                                                meta.zone, meta.cluster):
                    raise InsufficientCapacity(
                        f"host {vm.host_name} has no room to grow vm {vm.name} by {grow_vcpus} vCPU(s) / {grow_memory} "
                        f"MiB and auto.migrate.vm.on.live.scale.insufficient.capacity is false", field="host")
                request = PlacementRequest(plan.target, exclude_hosts=frozenset({vm.host_name}),
                                           exclude_reason="the VM's own host has no room for the new size")
                migrate_to = choose(self.o.index, request).host
                path = "migrate-then-scale"
        if not dry_run and (increase.vcpus or increase.memory_mib):
            L.add_to_ledger(conn, p.id, increase)
        return Admitted(plan, delta, footprint_delta, new_overhead, offering_id, path, migrate_to)

    def _take_growth(self, conn, host: str, vm_id: int, vcpus: int, memory_mib: int) -> bool:
        """Take a VM's growth on its host (compare-and-add) and add it to its running claim; False if no room."""
        cap_vcpus, cap_memory = self.o.index.capacity_of(host)
        if not L.take_on_host(conn, self.o._hosts[host].id, vcpus, memory_mib, cap_vcpus, cap_memory):
            return False
        L.grow_running_claim(conn, vm_id, vcpus, memory_mib)
        return True

    @staticmethod
    def _describe(vm, a: Admitted) -> dict:
        p = a.plan
        summary = (f"{p.current.vcpus} -> {p.target.vcpus} vCPU(s), {p.current.memory_mib} -> {p.target.memory_mib} MiB"
                   + (f", CPU cap {'off' if p.cap_share is None else f'{p.cap_share:.2f} CPU per vCPU'}"
                      if p.cap_changes else "")
                   + (f"; {vm.host_name} has no room: live-migrate to {a.migrate_to} first"
                      if a.migrate_to else f"; in place on {vm.host_name}"))
        return {"vm": vm.name, "path": a.path, "migrate_to": a.migrate_to, "summary": summary,
                "vcpus": [p.current.vcpus, p.target.vcpus], "memory_mib": [p.current.memory_mib, p.target.memory_mib],
                "cpu_cap_share": p.cap_share, "quota_delta": {"vcpus": a.charge_delta.vcpus,
                                                             "memory_mib": a.charge_delta.memory_mib}}

    # -- the work ------------------------------------------------------------------------------
    def _run(self, op_id: str, vm_id: int, a: Admitted) -> None:
        with self.o.db.transaction() as conn:
            L.set_operation(conn, op_id, state=OperationState.running, step="scaling", progress=20)
        steps: list[str] = []
        claimed = [a.path == "in-place"]      # whether the growth is claimed on the VM's current host
        try:
            if a.path == "migrate-then-scale":
                self._migrate_first(op_id, vm_id, a)
                claimed[0] = True
            with self.o.db.read() as s:
                vm = L.vm_row(s.connection(), vm_id)
            driver = self.o.drivers[vm.host_name]
            domain = self.o.domain_name(vm.name)
            p = a.plan
            if p.memory_delta_mib:
                steps.append(f"memory {driver.set_memory(domain, p.target.memory_mib)}")
            if p.vcpus_delta:
                steps.append(f"vcpus {driver.set_vcpus(domain, p.target.vcpus)}")
            if p.cap_changes or (p.cap_share is not None and p.vcpus_delta):
                driver.set_cpu_cap(domain, cap_for_share(p.cap_share) if p.cap_share is not None else None)
                steps.append("cpu cap " + ("off" if p.cap_share is None else f"{p.cap_share:.2f}"))
        except Exception as exc:
            self._roll_back(op_id, vm_id, a, steps, exc, claimed[0])
            return
        self._commit(op_id, vm_id, a, steps)

    def _migrate_first(self, op_id: str, vm_id: int, a: Admitted) -> None:
        with self.o.db.transaction() as conn:
            vm = L.vm_row(conn, vm_id)
            L.set_vm(conn, vm_id, state=VmState.running)      # the migration admits running VMs
            L.set_operation(conn, op_id, step=f"migrating to {a.migrate_to}", progress=30)
        mig = self.o.migrator.migrate(vm.name, to=a.migrate_to, reason=f"live scale of {vm.name} needs room")
        while mig["state"] not in ("succeeded", "failed", "cancelled"):
            time.sleep(0.1)
            mig = self.o.migrator.get(mig["id"])
        with self.o._lock:
            with self.o.db.transaction() as conn:
                L.set_vm(conn, vm_id, state=VmState.scaling)
                if mig["state"] != "succeeded":
                    raise Conflict(f"the migration to {a.migrate_to} before scaling {mig['state']}: {mig['reason']}")
                vm = L.vm_row(conn, vm_id)
                grow_vcpus, grow_memory = max(a.plan.vcpus_delta, 0), max(a.footprint_delta, 0)
                if not self._take_growth(conn, vm.host_name, vm_id, grow_vcpus, grow_memory):
                    raise InsufficientCapacity(f"{vm.host_name} filled up during the migration; the VM runs there "
                                               f"at its old size", field="host")
            self.o.index.add_usage(vm.host_name, grow_vcpus, grow_memory)

    def _commit(self, op_id: str, vm_id: int, a: Admitted, steps: list[str]) -> None:
        p = a.plan
        shrink_vcpus, shrink_memory = max(-p.vcpus_delta, 0), max(-a.footprint_delta, 0)
        with self.o._lock:
            with self.o.db.transaction() as conn:
                vm = L.vm_row(conn, vm_id, lock=True)
                L.lock_project(conn, vm.project_id)
                decrease = Usage(min(a.charge_delta.vcpus, 0), min(a.charge_delta.memory_mib, 0), 0)
                if decrease.vcpus or decrease.memory_mib:
                    L.add_to_ledger(conn, vm.project_id, decrease)
                if shrink_vcpus or shrink_memory:
                    L.shrink_running_claim(conn, vm_id, vm.host_id, shrink_vcpus, shrink_memory)
                L.set_vm(conn, vm_id, state=VmState.running, vcpus=p.target.vcpus, memory_mib=p.target.memory_mib,
                         overhead_mib=a.overhead_mib, offering_id=a.offering_id,
                         charged_vcpus=vm.charged_vcpus + a.charge_delta.vcpus,
                         charged_memory_mib=vm.charged_memory_mib + a.charge_delta.memory_mib,
                         cpu_cap_percent=p.cap_share * 100 if p.cap_share is not None else None)
                L.set_operation(conn, op_id, state=OperationState.succeeded, step="done", progress=100,
                                message="; ".join(steps) or "nothing to do",
                                result={"path": a.path, "migrated_to": a.migrate_to, "methods": steps})
            if shrink_vcpus or shrink_memory:
                self.o.index.add_usage(vm.host_name, -shrink_vcpus, -shrink_memory)

    def _roll_back(self, op_id: str, vm_id: int, a: Admitted, steps: list[str], exc: Exception,
                   claimed_here: bool) -> None:
        """Give back what the increase took; the VM keeps running at the size the guest has."""
        reason = exc.message if isinstance(exc, VmplaneError) else str(exc)
        grow_vcpus, grow_memory = max(a.plan.vcpus_delta, 0), max(a.footprint_delta, 0)
        with self.o._lock:
            with self.o.db.transaction() as conn:
                vm = L.vm_row(conn, vm_id, lock=True)
                increase = Usage(max(a.charge_delta.vcpus, 0), max(a.charge_delta.memory_mib, 0), 0)
                if increase.vcpus or increase.memory_mib:
                    L.add_to_ledger(conn, vm.project_id, Usage(-increase.vcpus, -increase.memory_mib, 0))
                if (grow_vcpus or grow_memory) and claimed_here:
                    L.shrink_running_claim(conn, vm_id, vm.host_id, grow_vcpus, grow_memory)
                L.set_vm(conn, vm_id, state=VmState.running)
                L.set_operation(conn, op_id, state=OperationState.failed, progress=100,
                                message=f"scale failed after [{'; '.join(steps) or 'no step'}]: {reason}")
            if (grow_vcpus or grow_memory) and claimed_here:
                self.o.index.add_usage(vm.host_name, -grow_vcpus, -grow_memory)
        log.warning("scale of vm %s failed: %s", vm_id, reason)
