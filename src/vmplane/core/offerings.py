"""Offering rules: what makes an offering valid and which size a VM gets from it (pure)."""

from __future__ import annotations

from vmplane.core.errors import Invalid
from vmplane.core.model import Offering, OfferingKind, Size


def _positive(value: int | None, field: str) -> None:
    if value is not None and value <= 0:
        raise Invalid(f"{field} must be greater than 0, got {value}", field=field)


def validate_offering(o: Offering) -> None:
    for field in (
        "vcpus",
        "memory_mib",
        "min_vcpus",
        "max_vcpus",
        "min_memory_mib",
        "max_memory_mib",
        "cpu_speed_mhz",
        "root_disk_mib",
        "max_root_disk_mib",
    ):
        _positive(getattr(o, field), field)
    if o.root_disk_mib and o.max_root_disk_mib and o.root_disk_mib > o.max_root_disk_mib:
        raise Invalid(
            f"root_disk_mib {o.root_disk_mib} is above max_root_disk_mib {o.max_root_disk_mib}", field="root_disk_mib"
        )
    ranges = ("min_vcpus", "max_vcpus", "min_memory_mib", "max_memory_mib")
    if o.kind == OfferingKind.fixed:
        for field in ("vcpus", "memory_mib"):
            if getattr(o, field) is None:
                raise Invalid(f"a fixed offering needs {field}", field=field)
        for field in ranges:
            if getattr(o, field) is not None:
                raise Invalid(f"a fixed offering has no {field}; use a custom-constrained offering", field=field)
    elif o.kind == OfferingKind.custom_constrained:
        for field in ranges:
            if getattr(o, field) is None:
                raise Invalid(f"a custom-constrained offering needs {field}", field=field)
        if o.min_vcpus > o.max_vcpus:  # type: ignore[operator]
            raise Invalid(f"min_vcpus {o.min_vcpus} is above max_vcpus {o.max_vcpus}", field="min_vcpus")
        if o.min_memory_mib > o.max_memory_mib:  # type: ignore[operator]
            raise Invalid(
                f"min_memory_mib {o.min_memory_mib} is above max_memory_mib {o.max_memory_mib}", field="min_memory_mib"
            )
    else:
        for field in ranges + ("vcpus", "memory_mib"):
            if getattr(o, field) is not None:
                raise Invalid(f"a custom-unconstrained offering takes no {field}; sizes are given per VM", field=field)


def size_for(o: Offering, vcpus: int | None, memory_mib: int | None) -> Size:
    """The size a VM gets from an offering and the custom values asked for."""
    _positive(vcpus, "vcpus")
    _positive(memory_mib, "memory_mib")
    if o.kind == OfferingKind.fixed:
        for field, asked, fixed, unit in (
            ("vcpus", vcpus, o.vcpus, "vCPU(s)"),
            ("memory_mib", memory_mib, o.memory_mib, "MiB of memory"),
        ):
            if asked is not None and asked != fixed:
                raise Invalid(f"offering {o.name} is fixed at {fixed} {unit}; {asked} cannot be asked for", field=field)
        return Size(o.vcpus, o.memory_mib)  # type: ignore[arg-type]
    for field, asked in (("vcpus", vcpus), ("memory_mib", memory_mib)):
        if asked is None:
            raise Invalid(f"offering {o.name} is {o.kind.value}: {field} is required", field=field)
    if o.kind == OfferingKind.custom_constrained:
        for field, asked, low, high in (
            ("vcpus", vcpus, o.min_vcpus, o.max_vcpus),
            ("memory_mib", memory_mib, o.min_memory_mib, o.max_memory_mib),
        ):
            if not low <= asked <= high:  # type: ignore[operator]
                raise Invalid(f"{field}={asked} is outside offering {o.name}'s range {low}..{high}", field=field)
    return Size(vcpus, memory_mib)  # type: ignore[arg-type]
