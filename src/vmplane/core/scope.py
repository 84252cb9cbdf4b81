"""Where a VM may run: its zone, and its cluster when pinned (pure).

A VM belongs to one zone for life: start, restart, migration, drain and the move of a live scale
place it within that zone, and within its source host's cluster unless the operator names a host of
another cluster of the same zone (`vm migrate --to`). A VM pinned to a cluster follows such a move.
"""

from __future__ import annotations

from dataclasses import dataclass

from vmplane.core.errors import Invalid


@dataclass(frozen=True)
class Scope:
    zone: str | None  # None only when there is no zone at all
    cluster: str | None  # None: any cluster of the zone


def vm_scope(zones: dict[str, list[str]], zone: str | None, cluster: str | None) -> Scope:
    """The scope of a new VM from what was asked; `zones` maps each zone to its clusters.

    No zone given: the cluster's zone, else the only zone; with several zones the request is refused
    naming the choices."""
    choices = ", ".join(sorted(zones)) or "none"
    if zone is not None and zone not in zones:
        raise Invalid(f"zone {zone!r} does not exist; zones: {choices}", field="zone")
    if cluster is not None:
        owner = next((z for z, clusters in zones.items() if cluster in clusters), None)
        if owner is None:
            raise Invalid(f"cluster {cluster!r} does not exist", field="cluster")
        if zone is not None and owner != zone:
            raise Invalid(f"cluster {cluster} is in zone {owner}, not in zone {zone}", field="cluster")
        return Scope(owner, cluster)
    if zone is not None:
        return Scope(zone, None)
    if len(zones) == 1:
        return Scope(next(iter(zones)), None)
    if not zones:
        raise Invalid("there is no zone yet; create one (vmplane zone create) before creating VMs", field="zone")
    raise Invalid(f"{len(zones)} zones exist; choose the VM's zone: {choices}", field="zone")


def migration_scope_problem(vm: str, vm_zone: str | None, target: str, target_zone: str) -> str | None:
    """Why an explicit migration target is refused (another zone), or None if it is in the VM's zone."""
    if vm_zone is not None and target_zone != vm_zone:
        return (
            f"host {target} is in zone {target_zone}; vm {vm} belongs to zone {vm_zone} and never leaves it "
            f"(choose a host of zone {vm_zone})"
        )
    return None
