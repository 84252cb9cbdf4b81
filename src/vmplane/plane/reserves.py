"""The shell around failover.py and groups.py: reads what a placement's group and failover rules need
(HA load per host from the store, k per cluster from the settings) into plain data for
PlacementRequest, and the failover report of `cluster show`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from sqlalchemy import func, select
from sqlalchemy.engine import Connection

from vmplane.core import failover
from vmplane.core.failover import Load, Reserve
from vmplane.core.model import CHARGED_STATES
from vmplane.store.catalog import get_by_name
from vmplane.store.groupstore import group_rule_for
from vmplane.store.schema import Claim, Cluster, Host, Vm

if TYPE_CHECKING:
    from vmplane.core.scope import Scope
    from vmplane.plane.context import Plane

_V, _C, _H = Vm.__table__.c, Claim.__table__.c, Host.__table__.c
_CHARGED = sorted(s.value for s in CHARGED_STATES)


def ha_load(conn: Connection, hosts: Iterable[str] | None = None) -> dict[str, Load]:
    """Per host name, what its HA VMs (ha_policy restart, in a charged state) claim there: vCPUs and
    memory with overhead, the units of the host's own counters. Hosts without HA VMs are left out."""
    q = (
        select(_H.name, func.sum(_C.vcpus), func.sum(_C.memory_mib))
        .join(Vm.__table__, _V.id == _C.vm_id)
        .join(Host.__table__, _H.id == _C.host_id)
        .where(_V.ha_policy == "restart", _V.state.in_(_CHARGED))
        .group_by(_H.name)
    )
    if hosts is not None:
        q = q.where(_H.name.in_(list(hosts)))
    return {name: Load(int(v or 0), int(m or 0)) for name, v, m in conn.execute(q)}


def tolerated(plane: Plane, cluster: str) -> int:
    """k of a cluster (vmplane.ha.host.failures.tolerated, at its scope)."""
    zone = plane.capacity.cluster_zones().get(cluster)
    if zone is None:  # a cluster without hosts
        with plane.db.read() as s:
            zone = get_by_name(s, Cluster, cluster, field="cluster").zone.name
    return int(plane.catalog.effective(failover.SETTING, zone, cluster))  # type: ignore[call-overload]


def _clusters_in(plane: Plane, zone: str | None, cluster: str | None) -> list[str]:
    if cluster is not None:
        return [cluster]
    return sorted(c for c, z in plane.capacity.cluster_zones().items() if zone is None or z == zone)


def reserve_for(
    plane: Plane,
    conn: Connection,
    zone: str | None,
    cluster: str | None,
    is_ha: bool,
    action: str,
    release: tuple[str, Load] | None = None,
) -> Reserve | None:
    """The failover reserve a placement within (zone, cluster) keeps; None when every cluster there has
    k = 0 (then nothing is read: k=0 costs nothing)."""
    ks = {c: k for c in _clusters_in(plane, zone, cluster) if (k := tolerated(plane, c)) > 0}
    if not ks:
        return None
    hosts = [name for name, m in plane.capacity.hosts.items() if m.cluster in ks]
    return Reserve(ks, ha_load(conn, hosts), is_ha, action, release)


def placement_rules(
    plane: Plane,
    conn: Connection,
    scope: Scope,
    *,
    action: str,
    vm_id: int | None = None,
    group_id: int | None = None,
    ha: bool = False,
    keep_reserve: bool = True,
    release: tuple[str, Load] | None = None,
) -> dict:
    """The group and reserve fields of a PlacementRequest (`PlacementRequest(size, ..., **rules)`):
    the group of VM `vm_id` (itself left out) or of `group_id` (a VM being created), and the failover
    reserve of the clusters in `scope` for an HA VM (`ha`) or not; `action` names the placement in a
    refusal, with {host} for the host ("starting web-3 on {host}"). `keep_reserve=False`: an HA restart,
    never refused by the reserve (reserve=None)."""
    rule = group_rule_for(conn, vm_id=vm_id, group_id=group_id) if (vm_id or group_id) else None
    reserve = reserve_for(plane, conn, scope.zone, scope.cluster, ha, action, release) if keep_reserve else None
    return {"group": rule, "reserve": reserve}


def cluster_report(plane: Plane, cluster: str) -> dict:
    """`cluster show`'s failover part: k, the reserve held back, the free room, and whether the HA VMs
    of the worst k hosts can be restarted now (aggregate bound), naming the worst case."""
    k = tolerated(plane, cluster)
    with plane.capacity.lock:
        hosts = [h for h in plane.capacity.index.hosts() if h.cluster == cluster]
    with plane.db.transaction() as conn:
        load = ha_load(conn, [h.name for h in hosts])
    a = failover.assess(hosts, load, k)
    return {
        "failures_tolerated": k,
        "setting": failover.SETTING,
        "reserve_vcpus": a.reserve.vcpus,
        "reserve_memory_mib": a.reserve.memory_mib,
        "free_vcpus": a.free.vcpus,
        "free_memory_mib": a.free.memory_mib,
        "ha_vcpus": sum(v.vcpus for v in load.values()),
        "ha_memory_mib": sum(v.memory_mib for v in load.values()),
        "survives": a.survives,
        "survivable_failures": a.tolerated if k else 0,
        "worst_case": list(a.worst),
        "shortfall_vcpus": a.shortfall.vcpus,
        "shortfall_memory_mib": a.shortfall.memory_mib,
    }


def growth_refusal(plane: Plane, conn: Connection, vm, vcpus: int, memory_mib: int) -> str | None:
    """Why growing `vm` (a vm_row) in place on its host by (vcpus, memory_mib with overhead) would
    break its cluster's failover reserve, or None."""
    from vmplane.core.model import PlacementRequest, Size
    from vmplane.core.placement import reserve_breach

    meta = plane.capacity.hosts[vm.host_name]
    reserve = reserve_for(plane, conn, None, meta.cluster, vm.ha_policy == "restart", f"growing {vm.name} on {{host}}")
    if reserve is None:
        return None
    with plane.capacity.lock:
        after = reserve_breach(
            plane.capacity.index,
            PlacementRequest(Size(vcpus, memory_mib), reserve=reserve),
            vm.host_name,
            vcpus,
            memory_mib,
        )
    return (
        None if after is None else failover.reserve_message(after, f"growing {vm.name} on {vm.host_name}", meta.cluster)
    )
