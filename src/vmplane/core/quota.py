"""The quota ledger's rules: per-VM overhead, what a VM charges, admission, quota changes (pure)."""

from __future__ import annotations

import math
from collections.abc import Iterable

from vmplane.core.errors import Conflict, QuotaExceeded
from vmplane.core.model import CHARGED_STATES, Quota, Size, Usage, VmState
from vmplane.core.units import format_mib

# KubeVirt GetMemoryOverhead-like model (docs/design/quotas.md); all MiB.
OVERHEAD_FIXED_MIB = 220
OVERHEAD_PER_VCPU_MIB = 8
OVERHEAD_IOTHREAD_MIB = 8
OVERHEAD_VIDEO_MIB = 32
OVERHEAD_PAGETABLE_DIVISOR = 512

RESOURCES = ("vcpus", "memory_mib", "vms", "storage_mib")


def overhead_base_mib(size: Size) -> float:
    """The overhead model before the cluster's ratio is applied (placement vectorises over ratios)."""
    return (
        OVERHEAD_FIXED_MIB
        + OVERHEAD_PER_VCPU_MIB * size.vcpus
        + OVERHEAD_IOTHREAD_MIB
        + OVERHEAD_VIDEO_MIB
        + size.memory_mib / OVERHEAD_PAGETABLE_DIVISOR
    )


def overhead_mib(size: Size, ratio: float = 1.0) -> int:
    """Memory the QEMU process uses beyond guest RAM, rounded up to a whole MiB."""
    return math.ceil(overhead_base_mib(size) * ratio)


def host_footprint_mib(size: Size, ratio: float = 1.0) -> int:
    """Memory a VM of this size takes on a host: guest RAM plus overhead, always."""
    return size.memory_mib + overhead_mib(size, ratio)


def running_charge(size: Size, overhead: int, count_overhead: bool) -> Usage:
    """What a charged (starting/running/migrating/scaling) VM adds to its project's usage, besides `vms`."""
    return Usage(vcpus=size.vcpus, memory_mib=size.memory_mib + (overhead if count_overhead else 0), vms=0)


def vm_charge(state: VmState, size: Size, overhead: int, count_overhead: bool) -> Usage:
    """A VM's whole contribution to usage: always one `vms`, plus vCPUs/memory when charged."""
    if state in CHARGED_STATES:
        return running_charge(size, overhead, count_overhead) + Usage(vms=1)
    return Usage(vms=1)


def recompute_usage(vms: Iterable[tuple[VmState, Size, int]], count_overhead: bool) -> Usage:
    """Usage from first principles, from (state, size, overhead) of every VM of a project."""
    total = Usage()
    for state, size, overhead in vms:
        total = total + vm_charge(state, size, overhead, count_overhead)
    return total


def storage_usage(volume_sizes_mib: Iterable[int]) -> Usage:
    """A project's storage from first principles: every volume it has (root disks included), whatever
    its state: a disk is charged while it exists, running or not, and while vmplane does not know
    whether it still exists (creating, deleting). A migration's copy is never charged here."""
    return Usage(storage_mib=sum(volume_sizes_mib))


def _describe(resource: str, value: int) -> str:
    if resource == "memory_mib":
        return f"{value} MiB"
    if resource == "storage_mib":
        return f"{format_mib(value)} of storage"
    if resource == "vcpus":
        return f"{value} vCPU{'s' if value != 1 else ''}"
    return f"{value} VM{'s' if value != 1 else ''}"


def first_exceeded(quota: Quota, usage: Usage, delta: Usage) -> str | None:
    """The first resource that `usage + delta` would push above `quota`, or None."""
    after = usage + delta
    for resource in RESOURCES:
        if getattr(delta, resource) > 0 and getattr(after, resource) > getattr(quota, resource):
            return resource
    return None


def check_admission(project: str, quota: Quota, usage: Usage, delta: Usage) -> None:
    """Refuse `delta` if it would take the project above its quota, naming the resource."""
    resource = first_exceeded(quota, usage, delta)
    if resource is None:
        return
    used, asked, limit = getattr(usage, resource), getattr(delta, resource), getattr(quota, resource)
    raise QuotaExceeded(
        f"project {project}: {resource} quota exceeded: {_describe(resource, used)} used + "
        f"{_describe(resource, asked)} asked > quota {_describe(resource, limit)}",
        field=resource,
    )


def check_quota_change(project: str, new: Quota, usage: Usage) -> None:
    """A quota may not be lowered below what is in use (nothing is evicted to make room)."""
    for resource in RESOURCES:
        used, asked = getattr(usage, resource), getattr(new, resource)
        if asked < used:
            raise Conflict(
                f"project {project}: cannot set {resource} quota to {_describe(resource, asked)}: "
                f"{_describe(resource, used)} in use (used {used}, asked {asked})",
                field=resource,
            )


def describe_usage(usage: Usage, quota: Quota) -> dict[str, dict[str, float]]:
    """Usage as a table row: used, quota and percent per resource."""
    out = {}
    for resource in RESOURCES:
        used, limit = getattr(usage, resource), getattr(quota, resource)
        out[resource] = {"used": used, "quota": limit, "percent": round(100.0 * used / limit, 1) if limit else 0.0}
    return out


__all__ = [
    "check_admission",
    "check_quota_change",
    "describe_usage",
    "first_exceeded",
    "format_mib",
    "host_footprint_mib",
    "overhead_base_mib",
    "overhead_mib",
    "recompute_usage",
    "running_charge",
    "storage_usage",
    "vm_charge",
]
