"""Settings at global, zone and cluster scope."""

from typing import Literal

from fastapi import APIRouter

from vmplane.api.deps import Admin, Orch
from vmplane.api.paging import StrictQueryRoute
from vmplane.api.schemas import SettingOut, SettingSet
from vmplane.orchestrator import Orchestrator

router = APIRouter(tags=["settings"], route_class=StrictQueryRoute)
Scope = Literal["global", "zone", "cluster"]
# keys whose change can leave hosts holding more than their capacity
CAPACITY_KEYS = ("cpu.overprovisioning.factor", "mem.overprovisioning.factor")


def over_capacity(orch: Orchestrator, key: str, scope: str, scope_name: str | None) -> list[str]:
    """Hosts within the scope now allocated beyond their capacity (the change is kept: placement only
    stops adding to them), e.g. "sim1: 92267 MiB allocated, capacity now 65536 MiB"."""
    if key not in CAPACITY_KEYS:
        return []
    zone_of = {c.name: c.zone.name for c in orch.catalog.clusters()}
    warnings = []
    for h in orch.index.hosts():
        if (scope == "zone" and zone_of.get(h.cluster) != scope_name) or (
            scope == "cluster" and h.cluster != scope_name
        ):
            continue
        if key.startswith("cpu") and h.used_vcpus > h.vcpus_capacity:
            warnings.append(f"{h.name}: {h.used_vcpus} vCPUs allocated, capacity now {h.vcpus_capacity} vCPUs")
        if key.startswith("mem") and h.used_memory_mib > h.memory_capacity_mib:
            warnings.append(f"{h.name}: {h.used_memory_mib} MiB allocated, capacity now {h.memory_capacity_mib} MiB")
    return sorted(warnings)


@router.get("/settings")
def list_settings(orch: Orch, _: Admin) -> list[dict]:
    return orch.catalog.list_settings()


@router.get("/settings/{key}", response_model=SettingOut)
def get_setting(key: str, orch: Orch, _: Admin, scope: Scope = "global", scope_name: str | None = None):
    return orch.catalog.get_setting(key, scope, scope_name)


@router.put("/settings/{key}", response_model=SettingOut)
def set_setting(key: str, body: SettingSet, orch: Orch, _: Admin):
    """Set a value (checked against the key's type and range before anything is saved: 422 naming the
    key, the value and the range). `warnings` names the hosts a lower factor leaves over capacity."""
    out = orch.catalog.set_setting(key, body.value, body.scope, body.scope_name)
    return {**out, "warnings": over_capacity(orch, key, body.scope, body.scope_name)}


@router.delete("/settings/{key}", response_model=SettingOut)
def unset_setting(key: str, orch: Orch, _: Admin, scope: Scope = "global", scope_name: str | None = None):
    """Remove the value set at this scope: the key takes the inherited value again (shown). 409 when no
    value is set there."""
    out = orch.catalog.unset_setting(key, scope, scope_name)
    return {**out, "warnings": over_capacity(orch, key, scope, scope_name)}
