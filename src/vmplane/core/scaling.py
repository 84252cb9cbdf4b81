"""Live-scaling rules (docs/design/scaling.md): when a VM is prepared, its ceiling, and the CPU cap (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from vmplane.core.driver import CpuCap
from vmplane.core.model import Size

CAP_PERIOD_US = 10_000
CAP_MIN_QUOTA_US = 1_000
CAP_MAX_PERIOD_US = 1_000_000


@dataclass(frozen=True)
class ScalingFlags:
    """The four switches that must all be on for a VM to be prepared for live scaling."""

    zone_setting: bool  # enable.dynamic.scale.vm (zone scope)
    offering: bool  # offering.dynamic_scaling
    template: bool  # template.dynamic_scaling
    vm: bool  # vm.dynamically_scalable

    def first_off(self) -> str | None:
        """The name of the first switch that is off, as an operator would look it up; None if all are on."""
        for name, value in (
            ("setting enable.dynamic.scale.vm", self.zone_setting),
            ("offering dynamic_scaling", self.offering),
            ("template dynamic_scaling", self.template),
            ("vm dynamic_scaling", self.vm),
        ):
            if not value:
                return name
        return None

    @property
    def prepared(self) -> bool:
        return self.first_off() is None


def ceiling(
    flags: ScalingFlags, size: Size, cpu_capacity: int, memory_capacity_mib: int, host_cores: int, host_memory_mib: int
) -> Size:
    """The maximum a VM can be live-scaled to, fixed when it starts.

    Not prepared: the current size. Prepared: kvm.cpu.dynamic.scaling.capacity /
    kvm.memory.dynamic.scaling.capacity when > 0, else the host's cores / memory; never below the
    current size.
    """
    if not flags.prepared:
        return size
    vcpus = cpu_capacity if cpu_capacity > 0 else host_cores
    memory = memory_capacity_mib if memory_capacity_mib > 0 else host_memory_mib
    return Size(max(vcpus, size.vcpus), max(memory, size.memory_mib))


def cap_share(vm_mhz: int, host_mhz: int) -> float:
    """The fraction of one host CPU a capped vCPU may use: vm MHz / host MHz, 2 decimals, in [0.01, 1]."""
    return max(min(round(vm_mhz / host_mhz, 2), 1.0), 0.01)


def cpu_cap(vm_mhz: int, host_mhz: int) -> CpuCap:
    """CloudStack's cap: share = vm MHz / host MHz (2 decimals, at most 1.0); period 10,000 us and
    quota = period x share; below 1,000 us the quota is 1,000 and the period 1,000 / share (at most
    1,000,000). Applied to each vCPU."""
    return cap_for_share(cap_share(vm_mhz, host_mhz))


def cap_for_share(share: float) -> CpuCap:
    period = CAP_PERIOD_US
    quota = int(period * share)
    if quota < CAP_MIN_QUOTA_US:
        quota = CAP_MIN_QUOTA_US
        period = min(int(CAP_MIN_QUOTA_US / share), CAP_MAX_PERIOD_US)
    return CpuCap(period_us=period, quota_us=quota)


MEMORY_STEP_MIB = 128  # Linux onlines hot-plugged memory in 128 MiB blocks (x86_64)


@dataclass(frozen=True)
class ScaleFacts:
    """What a scale decision needs to know of a VM, as plain data."""

    name: str
    state: str
    current: Size
    ceiling: Size
    prepared: bool  # it was started with a ceiling (all four switches on then)
    flags: ScalingFlags  # the switches now
    cap_share: float | None  # the CPU cap now (fraction of a host CPU per vCPU), None = uncapped
    boot_memory_mib: int | None = None  # what it booted with: memory below it can not be released live
    setting_scope: str = ""  # where its zone setting was read, e.g. "in zone z2 (host s1)"


@dataclass(frozen=True)
class ScalePlan:
    current: Size
    target: Size
    cap_share: float | None  # after the scale
    cap_changes: bool

    @property
    def vcpus_delta(self) -> int:
        return self.target.vcpus - self.current.vcpus

    @property
    def memory_delta_mib(self) -> int:
        return self.target.memory_mib - self.current.memory_mib

    @property
    def grows(self) -> bool:
        return self.vcpus_delta > 0 or self.memory_delta_mib > 0

    @property
    def size_changes(self) -> bool:
        return self.target != self.current


def plan_scale(vm: ScaleFacts, target: Size, cap_share: float | None, cap_changes: bool) -> ScalePlan:
    """Check a live scale (docs/design/scaling.md) and say what it does; every refusal names its cause.
    Quota and host capacity are checked by the caller with the plan's deltas."""
    from vmplane.core.errors import Conflict, Invalid

    if vm.state != "running":
        raise Conflict(f"vm {vm.name} is {vm.state}; live scaling needs a running VM", field="state")
    plan = ScalePlan(vm.current, target, cap_share, cap_changes)
    if not plan.size_changes and not cap_changes:
        raise Conflict(
            f"vm {vm.name} already has {target.vcpus} vCPU(s) / {target.memory_mib} MiB and that CPU cap; "
            f"nothing to change",
            field=None,
        )
    if plan.size_changes:
        off = vm.flags.first_off()
        if off:
            where = f" {vm.setting_scope}" if off.startswith("setting") and vm.setting_scope else ""
            raise Conflict(f"vm {vm.name} can not be live-scaled: {off} is false{where}", field="dynamic_scaling")
        if not vm.prepared:
            raise Conflict(
                f"vm {vm.name} was not prepared for live scaling when it started (a switch was off "
                f"then); restart it to prepare it",
                field="dynamic_scaling",
            )
        for field, asked, top in (
            ("vcpus", target.vcpus, vm.ceiling.vcpus),
            ("memory_mib", target.memory_mib, vm.ceiling.memory_mib),
        ):
            if asked > top:
                raise Conflict(
                    f"{field}={asked} is above vm {vm.name}'s ceiling of {top} prepared at start; "
                    f"a restart is needed to go beyond it",
                    field=field,
                )
        if vm.boot_memory_mib is not None and target.memory_mib < vm.boot_memory_mib:
            raise Conflict(
                f"memory {target.memory_mib} MiB is below the {vm.boot_memory_mib} MiB vm {vm.name} booted "
                f"with; it can not be released live (stop the VM to resize it)",
                field="memory_mib",
            )
        if plan.memory_delta_mib % MEMORY_STEP_MIB:
            raise Invalid(
                f"live memory changes go in steps of {MEMORY_STEP_MIB} MiB (the guest's memory block); "
                f"{vm.current.memory_mib} -> {target.memory_mib} MiB is not one",
                field="memory_mib",
            )
    return plan
