"""Live-scaling rules (DESIGN section 5): when a VM is prepared, its ceiling, and the CPU cap (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from .drivers.base import CpuCap
from .model import Size

CAP_PERIOD_US = 10_000
CAP_MIN_QUOTA_US = 1_000
CAP_MAX_PERIOD_US = 1_000_000


@dataclass(frozen=True)
class ScalingFlags:
    """The four switches that must all be on for a VM to be prepared for live scaling."""

    zone_setting: bool          # enable.dynamic.scale.vm (zone scope)
    offering: bool              # offering.dynamic_scaling
    template: bool              # template.dynamically_scalable
    vm: bool                    # vm.dynamically_scalable

    def first_off(self) -> str | None:
        """The name of the first switch that is off, as an operator would look it up; None if all are on."""
        for name, value in (("setting enable.dynamic.scale.vm", self.zone_setting),
                            ("offering dynamic_scaling", self.offering),
                            ("template dynamically_scalable", self.template),
                            ("vm dynamically_scalable", self.vm)):
            if not value:
                return name
        return None

    @property
    def prepared(self) -> bool:
        return self.first_off() is None


def ceiling(flags: ScalingFlags, size: Size, cpu_capacity: int, memory_capacity_mib: int, host_cores: int,
            host_memory_mib: int) -> Size:
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
