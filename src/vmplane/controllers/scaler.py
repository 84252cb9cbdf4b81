"""Live scaling of running VMs (docs/design/scaling.md): admission, auto-migration, the driver steps, rollback.

Given the Plane (store, drivers, capacity) and its peers by the orchestrator. An increase is admitted in
one transaction (quota for the increase, then the host's capacity by compare-and-add); when the host has
no room and `auto.migrate.vm.on.live.scale.insufficient.capacity` is on, the VM is first live-migrated
to a host that fits the new size. A decrease is given back only after the guest released it. A failed step
rolls back what it charged and claimed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import select

from vmplane.controllers.resize import resize_stopped
from vmplane.core import failpoints
from vmplane.core import settings as settings_rules
from vmplane.core.driver import CpuCap, Resized
from vmplane.core.errors import Conflict, InsufficientCapacity, Interrupted, VmplaneError
from vmplane.core.failover import Load
from vmplane.core.migration import ACTIVE
from vmplane.core.model import OperationState, PlacementRequest, Size, Usage, VmState
from vmplane.core.names import domain_name
from vmplane.core.offerings import size_for
from vmplane.core.placement import choose
from vmplane.core.quota import check_admission, overhead_mib, running_charge
from vmplane.core.scaling import (
    ScaleFacts,
    ScalePlan,
    ScalingFlags,
    cap_for_share,
    cap_share,
    plan_scale,
)
from vmplane.core.scope import Scope
from vmplane.plane import metrics
from vmplane.plane.operations import Failed, FailureContext, Operations
from vmplane.plane.reserves import growth_refusal, placement_rules
from vmplane.store import ledger as L
from vmplane.store.catalog import offering_data

if TYPE_CHECKING:
    from vmplane.controllers.diskmoves import DiskMoves
    from vmplane.controllers.migrator import Migrator
    from vmplane.plane.context import Plane

log = logging.getLogger("vmplane.scaler")

ENDED = ("succeeded", "failed", "cancelled", "moved-unhealthy")
ACTIVE_MIGRATION = [st.value for st in ACTIVE]
# A scale that migrates first gives its migration twice the migration timeout plus this slack, then
# cancels it and fails; after the cancel it waits at most CANCEL_GRACE_S for the migration to end.
MIGRATION_TIMEOUT_KEY = "vmplane.migration.timeout"
MIGRATION_TIMEOUT_DEFAULT_S = 600
MIGRATE_FIRST_SLACK_S = 60
CANCEL_GRACE_S = 30.0


def _growth(vcpus: int, memory_mib: int) -> str:
    """`1 vCPU / 256 MiB`, leaving out a part that does not grow."""
    parts = [f"{vcpus} vCPU{'s' if vcpus != 1 else ''}"] if vcpus else []
    return " / ".join(parts + ([f"{memory_mib} MiB"] if memory_mib else [])) or "nothing"


@dataclass(frozen=True)
class Admitted:
    plan: ScalePlan
    charge_delta: Usage  # on the project's ledger (may be negative: given back at the end)
    footprint_delta: int  # MiB on the host (guest memory + overhead)
    overhead_mib: int  # the VM's overhead at its new size
    offering_id: int
    path: str  # "in-place" or "migrate-then-scale"
    migrate_to: str | None

    def to_record(self) -> dict:
        """Plain JSON, persisted with the operation so a restarted control plane can finish it."""
        p = self.plan
        return {
            "current": [p.current.vcpus, p.current.memory_mib],
            "target": [p.target.vcpus, p.target.memory_mib],
            "cap_share": p.cap_share,
            "cap_changes": p.cap_changes,
            "charge_delta": [self.charge_delta.vcpus, self.charge_delta.memory_mib],
            "footprint_delta": self.footprint_delta,
            "overhead_mib": self.overhead_mib,
            "offering_id": self.offering_id,
            "path": self.path,
            "migrate_to": self.migrate_to,
        }

    @classmethod
    def from_record(cls, r: dict) -> Admitted:
        plan = ScalePlan(Size(*r["current"]), Size(*r["target"]), r["cap_share"], r["cap_changes"])
        charged_vcpus, charged_memory_mib = r["charge_delta"]
        return cls(
            plan,
            Usage(charged_vcpus, charged_memory_mib, 0),
            r["footprint_delta"],
            r["overhead_mib"],
            r["offering_id"],
            r["path"],
            r["migrate_to"],
        )


@dataclass(frozen=True)
class _Step:
    """One driver step of a scale: the call (absolute: safe to repeat), what to read in the host's answer
    (a Resized, read back), the value wanted, and how a value reads in a refusal."""

    what: str  # "memory", "vcpus", "cpu cap"
    call: Callable[[], Resized]
    read: Callable[[Resized], object]
    want: object
    words: Callable[[object], str]
    label: str | None = None  # how it was done, once confirmed; None: the driver's method


def _steps(
    driver, domain: str, p: ScalePlan, size: Size, cap: CpuCap | None, cap_label: str | None = None
) -> list[_Step]:
    """The steps the plan changes, in the order a scale applies them, towards `size` and `cap` (the
    target for the scale, the old size and cap for its undo, which runs them in reverse); `cap_label`
    names the cap step once it is confirmed."""
    steps = []
    if p.memory_delta_mib:
        steps.append(
            _Step(
                "memory",
                lambda: driver.set_memory(domain, size.memory_mib),
                lambda got: got.memory_mib,
                size.memory_mib,
                lambda v: f"{v} MiB",
            )
        )
    if p.vcpus_delta:
        steps.append(
            _Step(
                "vcpus",
                lambda: driver.set_vcpus(domain, size.vcpus),
                lambda got: got.vcpus,
                size.vcpus,
                lambda v: f"{v} usable vCPU(s)",
            )
        )
    if p.cap_changes or (p.cap_share is not None and p.vcpus_delta):
        steps.append(
            _Step(
                "cpu cap",
                lambda: driver.set_cpu_cap(domain, cap),
                lambda got: got.cpu_cap,
                cap,
                lambda v: f"the CPU cap {v}",
                cap_label,
            )
        )
    return steps


def _attempt(applied: list[tuple[str, str]], host: str, step: _Step) -> Resized:
    """Attempt, read back, compare: the intent goes into `applied` before the call (a step that raises
    midway may have had an effect), then how it was done (the driver's method, or the step's label once
    the read-back matches); a read-back that is not the wanted value raises naming what the host reports."""
    applied.append((step.what, "attempted"))
    got = step.call()
    if step.label is None:
        applied[-1] = (step.what, got.method)
    if step.read(got) != step.want:
        raise Conflict(f"{host} reports {step.words(step.read(got))} after the change, not {step.want}")
    if step.label is not None:
        applied[-1] = (step.what, step.label)
    return got


def settle_at_size(
    conn, vm, a: Admitted, size: Size, ratio: float, claimed: bool
) -> tuple[int, Usage, tuple[int, int]]:
    """A scale that did not commit ends at `size` (its old size, its new one, or what the domain has in
    between; the larger when unknown): the project's ledger, which holds the old charge plus the
    increase admitted, is made to hold the charge at `size`, and a host claim that holds max(old, new)
    (`claimed`) is trimmed to `size`, never grown. Returns (overhead, charge, (vCPUs, MiB) given back
    on the host, for the capacity index)."""
    p = a.plan
    old, new = p.current, p.target
    project = L.lock_project(conn, vm.project_id)
    if size == old:
        overhead, charge = vm.overhead_mib, Usage(vm.charged_vcpus, vm.charged_memory_mib, 0)
    elif size == new:
        overhead = a.overhead_mib
        charge = Usage(vm.charged_vcpus + a.charge_delta.vcpus, vm.charged_memory_mib + a.charge_delta.memory_mib, 0)
    else:
        overhead = overhead_mib(size, ratio)
        charge = running_charge(size, overhead, project.count_overhead)
    increase = Usage(max(a.charge_delta.vcpus, 0), max(a.charge_delta.memory_mib, 0), 0)
    ledger = Usage(
        charge.vcpus - vm.charged_vcpus - increase.vcpus,
        charge.memory_mib - vm.charged_memory_mib - increase.memory_mib,
        0,
    )
    if ledger.vcpus or ledger.memory_mib:
        L.add_to_ledger(conn, vm.project_id, ledger)
    give_vcpus = give_memory = 0
    if claimed:
        old_footprint = old.memory_mib + overhead_mib(old, ratio)
        held_vcpus = old.vcpus + max(p.vcpus_delta, 0)
        held_memory = old_footprint + max(a.footprint_delta, 0)
        footprint = (
            old_footprint
            if size == old
            else old_footprint + a.footprint_delta
            if size == new
            else size.memory_mib + overhead
        )
        give_vcpus, give_memory = max(held_vcpus - size.vcpus, 0), max(held_memory - footprint, 0)
        if give_vcpus or give_memory:
            L.shrink_running_claim(conn, vm.id, vm.host_id, give_vcpus, give_memory)
    return overhead, charge, (give_vcpus, give_memory)


class Scaler:
    def __init__(self, plane: Plane, migrator: Migrator, disk_moves: DiskMoves):
        self.plane = plane
        self.migrator, self.disk_moves = migrator, disk_moves

    def _where(self, key: str, vm) -> str:
        """The scope a setting's value was read for, for refusals: `in zone z2 (host s1)`, and where the
        value comes from when it is not set there (`...; inherited from global`, `...; the default`)."""
        meta = self.plane.capacity.hosts[vm.host_name]
        scope = settings_rules.setting_key(key).narrowest_scope
        name = meta.zone if scope == "zone" else meta.cluster
        where = f"in {scope} {name} (host {vm.host_name}" if scope != "global" else f"(host {vm.host_name}"
        try:
            source = self.plane.catalog.get_setting(key, scope, name if scope != "global" else None).get("source")
        except VmplaneError:
            source = None
        if source == "default":
            return where + "; the default)"
        if source and source != f"{scope} {name}":
            return where + f"; inherited from {source})"
        return where + ")"

    def _facts(self, vm, offering, current_offering) -> ScaleFacts:
        meta = self.plane.capacity.hosts[vm.host_name] if vm.host_name else None
        zone_on = bool(
            self.plane.catalog.effective(
                "enable.dynamic.scale.vm", meta.zone if meta else None, meta.cluster if meta else None
            )
        )
        where = self._where("enable.dynamic.scale.vm", vm) if meta and not zone_on else ""
        return ScaleFacts(
            vm.name,
            vm.state,
            Size(vm.vcpus, vm.memory_mib),
            Size(vm.max_vcpus or vm.vcpus, vm.max_memory_mib or vm.memory_mib),
            bool(vm.prepared),
            # the offering it started with decided preparation; the new one must allow scaling too
            ScalingFlags(
                zone_on,
                offering.dynamic_scaling and current_offering.dynamic_scaling,
                vm.template_dynamic,
                vm.dynamically_scalable,
            ),
            (vm.cpu_cap_percent / 100) if vm.cpu_cap_percent else None,
            boot_memory_mib=vm.boot_memory_mib,
            setting_scope=where,
        )

    def _target(self, vm, offering, vcpus, memory_mib) -> Size:
        if offering.kind == "fixed":
            return size_for(offering_data(offering), vcpus, memory_mib)
        return size_for(offering_data(offering), vcpus or vm.vcpus, memory_mib or vm.memory_mib)

    def scale(
        self,
        name: str,
        offering: str | None = None,
        vcpus: int | None = None,
        memory_mib: int | None = None,
        cpu_cap: bool | None = None,
        dry_run: bool = False,
    ) -> dict:
        """Admit a live scale; returns the plan (dry run) or the VM name and its operation."""
        with self.plane.capacity.lock:
            with self.plane.db.transaction() as conn:
                self.plane.admissions.serialise(conn)  # before any row: batches lock projects and hosts too
                vm = L.vm_row(conn, name=name, lock=True)
                if vm.state == VmState.stopped.value:  # offline resize: charged when it next starts
                    return resize_stopped(self.plane, conn, vm, offering, vcpus, memory_mib, cpu_cap, dry_run)
                current_offering = self.plane.catalog.offering_by_id(vm.offering_id)
                new_offering = self.plane.catalog.offering(offering) if offering else current_offering
                target = self._target(vm, new_offering, vcpus, memory_mib)
                facts = self._facts(vm, new_offering, current_offering)
                cap_on = (
                    cpu_cap
                    if cpu_cap is not None
                    else (new_offering.cpu_cap if offering else facts.cap_share is not None)
                )
                host = self.plane.capacity.hosts[vm.host_name] if vm.host_name else None
                share = cap_share(new_offering.cpu_speed_mhz, host.cpu_mhz) if cap_on and host else None
                plan = plan_scale(facts, target, share, share != facts.cap_share)
                admitted = self._admit(conn, vm, plan, new_offering.id, dry_run)
                if dry_run:
                    return self._describe(vm, admitted)
                described = self._describe(vm, admitted)
                op_id = L.new_operation(
                    conn,
                    "scale",
                    name,
                    vm.id,
                    vm.project_id,
                    step="admitted",
                    message=described["summary"],
                    result={**described, "admitted": admitted.to_record()},
                )
                L.set_vm(conn, vm.id, state=VmState.scaling)
            grow_vcpus, grow_memory = max(plan.vcpus_delta, 0), max(admitted.footprint_delta, 0)
            if (grow_vcpus or grow_memory) and admitted.path == "in-place":  # as _admit took it on the host
                self.plane.capacity.add(vm.host_name, grow_vcpus, grow_memory)
        failpoints.hit("scale.admitted")
        self.plane.executor.submit(self.plane.ops.run, op_id, lambda op: self._run(op, vm.id, admitted))
        return {"vm": name, "operation_id": op_id}

    def fail_scale(self, ctx: FailureContext) -> Failed:
        """The failure hook of a scale (Operations.fail). Neither _commit nor _roll_back ended it (one of them
        raised): the ledger still holds the increase charged at admission. Unknown is not "as before": once
        the driver may have been called, the VM stays recorded, charged and claimed at the larger of its
        two sizes."""
        conn, op, vm, reason = ctx.conn, ctx.op, ctx.vm, ctx.reason
        given: tuple[str, int, int] | None = None
        if vm is None:
            return Failed(given=given)  # no VM: nothing held, nothing to settle
        resized: dict = {}
        if (
            vm.state in (VmState.scaling.value, VmState.migrating.value)
            and (op.result or {}).get("admitted") is not None
        ):
            a = Admitted.from_record(op.result["admitted"])
            old, new = a.plan.current, a.plan.target
            claimed = a.path == "in-place" or op.step == "resizing"
            size = Size(max(old.vcpus, new.vcpus), max(old.memory_mib, new.memory_mib)) if claimed else old
            ratio = self.plane.capacity.index.host(vm.host_name).overhead_ratio
            overhead, charge, (give_vcpus, give_memory) = settle_at_size(conn, vm, a, size, ratio, claimed)
            if give_vcpus or give_memory:
                given = (vm.host_name, give_vcpus, give_memory)
            resized = {
                "vcpus": size.vcpus,
                "memory_mib": size.memory_mib,
                "overhead_mib": overhead,
                "charged_vcpus": charge.vcpus,
                "charged_memory_mib": charge.memory_mib,
                **({"offering_id": a.offering_id} if size == new and size != old else {}),
            }
            if vm.state == VmState.migrating.value:  # its migration's end settles the state
                L.set_vm(conn, vm.id, **resized)
        if ctx.host_down:
            Operations.held_unknown(conn, op, vm, reason, **resized)
        elif vm.state == VmState.scaling.value:
            # at the size settled above (the larger one once the driver may have been called)
            L.set_vm(
                conn,
                vm.id,
                note=f"scale failed: {reason}"
                + (
                    f"; kept at {resized['vcpus']} vCPU(s) / {resized['memory_mib']} MiB, charged and claimed"
                    if resized
                    else ""
                ),
                state=VmState.running,
                **resized,
            )
        return Failed(given=given)

    def resume(self, op_id: str) -> None:
        """Finish a scale interrupted by a restart from its persisted step: the driver steps set
        absolute sizes, so doing them again is safe; a failure rolls back as it would have."""
        with self.plane.db.read() as s:
            op = L.operation_row(s.connection(), op_id)
        record = (op.result or {}).get("admitted")
        if record is None:
            raise Conflict("an interrupted scale without its admission record can not be resumed")
        self._run(op_id, op.vm_id, Admitted.from_record(record))

    def _admit(self, conn, vm, plan: ScalePlan, offering_id: int, dry_run: bool) -> Admitted:
        p = L.lock_project(conn, vm.project_id)
        meta = self.plane.capacity.hosts[vm.host_name]
        ratio = self.plane.capacity.index.host(vm.host_name).overhead_ratio
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
            # growing in place must keep the cluster's failover reserve; if it does not, the VM moves (as
            # when its host has no room) to a host that keeps it, or the scale is refused naming the reserve
            refused = growth_refusal(self.plane, conn, vm, grow_vcpus, grow_memory)
            if refused:
                fits = False
            elif dry_run:
                host = self.plane.capacity.index.host(vm.host_name)
                fits = (
                    host.used_vcpus + grow_vcpus <= host.vcpus_capacity
                    and host.used_memory_mib + grow_memory <= host.memory_capacity_mib
                )
            else:
                fits = self._take_growth(conn, vm.host_name, vm.id, grow_vcpus, grow_memory)
            if not fits:
                key = "auto.migrate.vm.on.live.scale.insufficient.capacity"
                if not self.plane.catalog.effective(key, meta.zone, meta.cluster):
                    if refused:
                        raise InsufficientCapacity(
                            f"{refused}; and {key} is false {self._where(key, vm)}", field="host"
                        )
                    raise InsufficientCapacity(
                        f"host {vm.host_name} has no room to grow vm {vm.name} by {_growth(grow_vcpus, grow_memory)} "
                        f"and {key} is false {self._where(key, vm)}",
                        field="host",
                    )
                # the move stays within the host's cluster (as a migration without --to does)
                request = PlacementRequest(
                    plan.target,
                    exclude_hosts=frozenset({vm.host_name}),
                    exclude_reason=refused or "the VM's own host has no room for the new size",
                    zone=vm.zone_name or meta.zone,
                    cluster=meta.cluster,
                    storage_hosts=self.disk_moves.reach(conn, vm.id),
                    storage_reason="its disks can not follow it here",
                    **placement_rules(
                        self.plane,
                        conn,
                        Scope(vm.zone_name or meta.zone, meta.cluster),
                        action=f"moving {vm.name} to {{host}} to grow it",
                        vm_id=vm.id,
                        ha=vm.ha_policy == "restart",
                        release=(vm.host_name, Load(vm.vcpus, old_footprint)),
                    ),
                )
                migrate_to = choose(self.plane.capacity.index, request).host
                path = "migrate-then-scale"
        if not dry_run and (increase.vcpus or increase.memory_mib):
            L.add_to_ledger(conn, p.id, increase)
        return Admitted(plan, delta, footprint_delta, new_overhead, offering_id, path, migrate_to)

    def _take_growth(self, conn, host: str, vm_id: int, vcpus: int, memory_mib: int) -> bool:
        """Take a VM's growth on its host (compare-and-add) and add it to its running claim; False if no room."""
        cap_vcpus, cap_memory = self.plane.capacity.index.capacity_of(host)
        if not L.take_on_host(conn, self.plane.capacity.hosts[host].id, vcpus, memory_mib, cap_vcpus, cap_memory):
            return False
        L.grow_running_claim(conn, vm_id, vcpus, memory_mib)
        return True

    @staticmethod
    def _describe(vm, a: Admitted) -> dict:
        p = a.plan
        summary = (
            f"{p.current.vcpus} -> {p.target.vcpus} vCPU(s), {p.current.memory_mib} -> {p.target.memory_mib} MiB"
            + (
                f", CPU cap {'off' if p.cap_share is None else f'{p.cap_share:.2f} CPU per vCPU'}"
                if p.cap_changes
                else ""
            )
            + (
                f"; {vm.host_name} has no room: live-migrate to {a.migrate_to} first"
                if a.migrate_to
                else f"; in place on {vm.host_name}"
            )
        )
        return {
            "vm": vm.name,
            "path": a.path,
            "migrate_to": a.migrate_to,
            "summary": summary,
            "vcpus": [p.current.vcpus, p.target.vcpus],
            "memory_mib": [p.current.memory_mib, p.target.memory_mib],
            "cpu_cap_share": p.cap_share,
            "quota_delta": {"vcpus": a.charge_delta.vcpus, "memory_mib": a.charge_delta.memory_mib},
        }

    # -- the work ------------------------------------------------------------------------------
    def _run(self, op_id: str, vm_id: int, a: Admitted) -> None:
        """The work, from the operation's persisted step: `admitted` (a move may be needed first),
        `migrating to X` (its migration may exist), `resizing` (the growth is claimed where the VM
        runs). Each step is persisted before it is acted on."""
        with self.plane.db.transaction() as conn:
            op = L.operation_row(conn, op_id, lock=True)
            claimed = a.path == "in-place" or op.step == "resizing"
            resizing: dict[str, Any] = {"step": "resizing"} if claimed else {}
            L.set_operation(conn, op_id, state=OperationState.running, progress=20, **resizing)
        applied: list[tuple[str, str]] = []  # (what, method) done by the driver in this run
        try:
            if not claimed:
                self._migrate_first(op_id, vm_id, a, resuming=op.step.startswith("migrating"), since=op.created_at)
                claimed = True
            with self.plane.db.read() as s:
                vm = L.vm_row(s.connection(), vm_id)
            driver = self.plane.drivers[vm.host_name]
            domain = domain_name(vm.name)
            p = a.plan
            # each step: intent recorded, driver call, the host's read-back compared with the target
            cap, cap_label = (
                (None, "off") if p.cap_share is None else (cap_for_share(p.cap_share), f"{p.cap_share:.2f}")
            )
            for step in _steps(driver, domain, p, p.target, cap, cap_label):
                _attempt(applied, vm.host_name, step)
                if step.what == "memory":
                    failpoints.hit("scale.after-memory")
        except Interrupted:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever failed, what was applied is rolled back
            self._roll_back(op_id, vm_id, a, applied, exc, claimed)
            return
        failpoints.hit("scale.before-commit")
        self._commit(op_id, vm_id, a, [f"{what} {how}" for what, how in applied])

    def _migration_since(self, vm_name: str, since) -> dict | None:
        """The migration this scale admitted before a restart, if it got that far."""
        for mig in self.migrator.list(vm=vm_name, limit=5):
            if mig["created_at"] >= since:
                return mig
        return None

    def _migrate_first(self, op_id: str, vm_id: int, a: Admitted, resuming: bool, since) -> None:
        with self.plane.db.read() as s:
            vm = L.vm_row(s.connection(), vm_id)
        mig = self._migration_since(vm.name, since) if resuming else None
        if mig is None:
            with self.plane.db.transaction() as conn:
                L.set_operation(conn, op_id, step=f"migrating to {a.migrate_to}", progress=30)
            failpoints.hit("scale.migrating")
            mig = self.migrator.migrate(
                vm.name, to=a.migrate_to, reason=f"live scale of {vm.name} needs room", for_scale=True
            )
        timeout = self._migration_timeout(vm.host_name)
        limit = timeout * 2 + MIGRATE_FIRST_SLACK_S
        deadline, cancelled_at, still = time.monotonic() + limit, None, ""
        while True:
            ended = mig["state"] in ENDED
            if cancelled_at is not None and (ended or time.monotonic() - cancelled_at > CANCEL_GRACE_S):
                raise Conflict(
                    f"the migration to {a.migrate_to} before scaling was still {still} after {limit} s "
                    f"(twice vmplane.migration.timeout {timeout} s, plus {MIGRATE_FIRST_SLACK_S} s); it "
                    f"was cancelled ({mig['state']} now) and the VM was not scaled"
                )
            if ended:
                break
            if mig["state"] == "postcopy-failed":  # the migration owns the VM until an operator decides
                raise Conflict(
                    f"the migration to {a.migrate_to} before scaling failed in post-copy "
                    f"({mig['reason'] or 'paused on both hosts'}); the VM was not scaled: see "
                    f"`vmplane migration show {mig['id'][:8]}`"
                )
            if self.plane.closing.wait(0.1):
                raise Interrupted(f"shutting down while {vm.name} migrates for its scale")
            mig = self.migrator.get(mig["id"])
            if cancelled_at is None and mig["state"] not in ENDED and time.monotonic() > deadline:
                cancelled_at, still = time.monotonic(), mig["state"]
                log.warning(
                    "scale of vm %s: its migration %s is still %s after %d s; cancelling it",
                    vm.name,
                    mig["id"],
                    still,
                    limit,
                )
                try:
                    mig = self.migrator.cancel(vm.name)
                except Conflict as exc:  # switched over meanwhile, or ended: it ends on its own
                    log.info("scale of vm %s: cancel of its migration refused: %s", vm.name, exc.message)
        failpoints.hit("scale.after-migration")
        with self.plane.capacity.lock:
            with self.plane.db.transaction() as conn:
                if mig["state"] != "succeeded":
                    raise Conflict(f"the migration to {a.migrate_to} before scaling {mig['state']}: {mig['reason']}")
                vm = L.vm_row(conn, vm_id)
                grow_vcpus, grow_memory = max(a.plan.vcpus_delta, 0), max(a.footprint_delta, 0)
                if not self._take_growth(conn, vm.host_name, vm_id, grow_vcpus, grow_memory):
                    raise InsufficientCapacity(
                        f"{vm.host_name} filled up during the migration; the VM runs there at its old size",
                        field="host",
                    )
                L.set_operation(conn, op_id, step="resizing", progress=60)
            self.plane.capacity.add(vm.host_name, grow_vcpus, grow_memory)

    def _migration_timeout(self, host: str) -> int:
        """`vmplane.migration.timeout` (seconds) where the VM runs, when the setting exists; else 600."""
        if MIGRATION_TIMEOUT_KEY not in settings_rules.KEYS:
            return MIGRATION_TIMEOUT_DEFAULT_S
        meta = self.plane.capacity.hosts[host]
        return int(cast(int, self.plane.catalog.effective(MIGRATION_TIMEOUT_KEY, meta.zone, meta.cluster)))

    def _commit(self, op_id: str, vm_id: int, a: Admitted, steps: list[str]) -> None:
        p = a.plan
        shrink_vcpus, shrink_memory = max(-p.vcpus_delta, 0), max(-a.footprint_delta, 0)
        with self.plane.capacity.lock:
            with self.plane.db.transaction() as conn:
                vm = L.vm_row(conn, vm_id, lock=True)
                L.lock_project(conn, vm.project_id)
                decrease = Usage(min(a.charge_delta.vcpus, 0), min(a.charge_delta.memory_mib, 0), 0)
                if decrease.vcpus or decrease.memory_mib:
                    L.add_to_ledger(conn, vm.project_id, decrease)
                if shrink_vcpus or shrink_memory:
                    L.shrink_running_claim(conn, vm_id, vm.host_id, shrink_vcpus, shrink_memory)
                L.set_vm(
                    conn,
                    vm_id,
                    state=VmState.running,
                    vcpus=p.target.vcpus,
                    memory_mib=p.target.memory_mib,
                    overhead_mib=a.overhead_mib,
                    offering_id=a.offering_id,
                    charged_vcpus=vm.charged_vcpus + a.charge_delta.vcpus,
                    charged_memory_mib=vm.charged_memory_mib + a.charge_delta.memory_mib,
                    cpu_cap_percent=p.cap_share * 100 if p.cap_share is not None else None,
                )
                L.set_operation(
                    conn,
                    op_id,
                    state=OperationState.succeeded,
                    step="done",
                    progress=100,
                    message="; ".join(([f"moved to {a.migrate_to}"] if a.migrate_to else []) + steps)
                    or "nothing to do",
                    result={"path": a.path, "migrated_to": a.migrate_to, "methods": steps},
                )
            if shrink_vcpus or shrink_memory:
                self.plane.capacity.add(vm.host_name, -shrink_vcpus, -shrink_memory)
        metrics.OPERATIONS.labels("scale", "succeeded").inc()
        metrics.SCALES.labels("succeeded", a.path).inc()

    def _roll_back(
        self, op_id: str, vm_id: int, a: Admitted, applied: list[tuple[str, str]], exc: Exception, claimed_here: bool
    ) -> None:
        """Undo the whole plan (to the absolute old size: this covers a step that raised midway and steps
        of a run before a crash), then read the domain back and record the size it really has: the VM's
        size, its charge and its host claim follow what is confirmed, never what was only asked. When the
        domain can not be read back, the larger of the two sizes stays recorded, charged and claimed."""
        reason = exc.message if isinstance(exc, VmplaneError) else str(exc)
        p = a.plan
        old, new = p.current, p.target
        undone, now = "", None
        if claimed_here:  # the driver may have been called (in this run or before a crash)
            undone = self._undo(vm_id, a)
            now = self._read_back(vm_id)
            if now is None:
                size = Size(max(old.vcpus, new.vcpus), max(old.memory_mib, new.memory_mib))
                found = (
                    f"the domain could not be read back: kept at the larger size {size.vcpus} vCPU(s) / "
                    f"{size.memory_mib} MiB, charged and claimed"
                )
            else:
                size = Size(
                    min(max(now.usable_vcpus, min(old.vcpus, new.vcpus)), max(old.vcpus, new.vcpus)),
                    min(max(now.memory_mib, min(old.memory_mib, new.memory_mib)), max(old.memory_mib, new.memory_mib)),
                )
                found = (
                    ""
                    if size == old
                    else f"the domain has {size.vcpus} vCPU(s) / {size.memory_mib} MiB: recorded and charged at "
                    f"that size"
                )
        else:  # failed before any driver step (the migration first)
            size, found = old, ""
        want_cap = cap_for_share(p.cap_share) if p.cap_share is not None else None
        new_cap = p.cap_changes and now is not None and now.cpu_cap == want_cap
        offering: dict[str, Any] = {"offering_id": a.offering_id} if size == new and size != old else {}
        cap: dict[str, Any] = (
            {"cpu_cap_percent": p.cap_share * 100 if p.cap_share is not None else None} if new_cap else {}
        )
        with self.plane.capacity.lock:
            with self.plane.db.transaction() as conn:
                vm = L.vm_row(conn, vm_id, lock=True)
                ratio = self.plane.capacity.index.host(vm.host_name).overhead_ratio
                overhead, charge, (give_vcpus, give_memory) = settle_at_size(conn, vm, a, size, ratio, claimed_here)
                moving = (
                    not claimed_here
                    and conn.execute(
                        select(L.MIGRATIONS.c.id)
                        .where(L.MIGRATIONS.c.vm_id == vm_id, L.MIGRATIONS.c.state.in_(ACTIVE_MIGRATION))
                        .limit(1)
                    ).first()
                )
                L.set_vm(
                    conn,
                    vm_id,
                    state=VmState.migrating if moving else VmState.running,  # its end settles it
                    vcpus=size.vcpus,
                    memory_mib=size.memory_mib,
                    overhead_mib=overhead,
                    charged_vcpus=charge.vcpus,
                    charged_memory_mib=charge.memory_mib,
                    **offering,
                    **cap,
                )
                done = "; ".join(f"{what} {how}" for what, how in applied) or "no step"
                L.set_operation(
                    conn,
                    op_id,
                    state=OperationState.failed,
                    progress=100,
                    message=f"scale failed after [{done}]: {reason}"
                    + (f"; {undone}" if undone else "")
                    + (f"; {found}" if found else ""),
                    result={"path": a.path, "recorded": [size.vcpus, size.memory_mib]},
                )
            if give_vcpus or give_memory:
                self.plane.capacity.add(vm.host_name, -give_vcpus, -give_memory)
        metrics.OPERATIONS.labels("scale", "failed").inc()
        metrics.SCALES.labels("failed", a.path).inc()
        log.warning("scale of vm %s failed: %s%s", vm_id, reason, f" ({found})" if found else "")

    def _undo(self, vm_id: int, a: Admitted) -> str:
        """Put the domain back at its old size, every part the plan changes (the steps are absolute, so
        this is safe for steps never attempted or done by a run before a crash); says what failed."""
        with self.plane.db.read() as s:
            vm = L.vm_row(s.connection(), vm_id)
        driver, domain, p = self.plane.drivers[vm.host_name], domain_name(vm.name), a.plan
        cap = cap_for_share(vm.cpu_cap_percent / 100) if vm.cpu_cap_percent else None
        failed = []
        for step in reversed(_steps(driver, domain, p, p.current, cap)):
            try:
                step.call()
            except Exception as exc:  # noqa: BLE001 - the read-back that follows says what the domain is
                failed.append(f"{step.what} not undone ({exc})")
        return "; ".join(failed)

    def _read_back(self, vm_id: int):
        """The VM's domain as its host reports it now; None if it can not be read (or is not there)."""
        with self.plane.db.read() as s:
            vm = L.vm_row(s.connection(), vm_id)
        try:
            info = self.plane.drivers[vm.host_name].domain(domain_name(vm.name))
        except Exception as exc:  # noqa: BLE001 - unknown is not "as before"
            log.warning("scale of vm %s: the domain can not be read back: %s", vm.name, exc)
            return None
        return info if info is not None and info.active else None
