"""Failover capacity (admission control, as VMware HA's "host failures cluster tolerates"): pure rules.

A cluster tolerating k host failures (setting `vmplane.ha.host.failures.tolerated`) must keep enough
free room on its other hosts to restart the HA VMs (ha_policy restart) of ANY k of its hosts. For a
set S of failed hosts the survivors' free room must hold S's HA load, per resource:

    sum(free_j, j not in S) >= sum(ha_i, i in S)   <=>   total_free >= sum(free_i + ha_i, i in S)

so the worst case is the k hosts with the largest free_i + ha_i, and the check is one top-k per
resource (vCPUs and memory MiB), O(n log k). Both resources are checked on their own worst set
(the condition holds for every S exactly when it holds for each resource's worst S).

This is an AGGREGATE bound: it counts the survivors' free room as one pool. Fragmentation is not
modelled (a VM of 8 vCPUs does not fit on two hosts with 4 free each), nor are placement groups or
the disks' reach; an HA restart may therefore still find no host for one VM. It is the bound VMware
calls the "cluster resource percentage" policy, computed for the worst k hosts instead of a percentage.

Which hosts count: hosts that are not already failed (down, fencing, fenced) can fail; only enabled
hosts give free room to restarted VMs (maintenance and disabled hosts take no placements). The free
room of a host is max(0, capacity - used) under its overcommit factors.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from vmplane.core.model import UNREACHABLE_HOST_STATES, HostCapacity, HostState
from vmplane.core.model import Load as Load  # (re-exported: plain data of model.py, the rules' own words)
from vmplane.core.model import Reserve as Reserve

SETTING = "vmplane.ha.host.failures.tolerated"


@dataclass(frozen=True)
class Assessment:
    """Whether a cluster's HA VMs can be restarted after any k of its hosts fail (aggregate bound)."""

    k: int
    survives: bool
    tolerated: int  # how many of the k failures it can take now (== k when it survives)
    reserve: Load  # held back: the most HA load any k hosts carry, per resource
    free: Load  # the counted hosts' free room, all together
    shortfall: Load  # what the worst case needs beyond the survivors' free room (0 if none)
    worst_vcpus: tuple[str, ...]  # worst-case host set for vCPUs
    worst_memory: tuple[str, ...]  # ... and for memory

    @property
    def worst(self) -> tuple[str, ...]:
        """The one worst case to name: the set of a resource short of room (vCPUs first), else the
        set of the resource with the least margin."""
        if self.shortfall.vcpus > 0:
            return self.worst_vcpus
        if self.shortfall.memory_mib > 0:
            return self.worst_memory
        margin_v = (self.free.vcpus - self.reserve.vcpus) / max(self.free.vcpus, 1)
        margin_m = (self.free.memory_mib - self.reserve.memory_mib) / max(self.free.memory_mib, 1)
        return self.worst_vcpus if margin_v <= margin_m else self.worst_memory


def _counted(host: HostCapacity) -> bool:
    return host.state not in UNREACHABLE_HOST_STATES


def _free(host: HostCapacity) -> Load:
    if host.state != HostState.enabled:
        return Load()
    return Load(max(0, host.vcpus_capacity - host.used_vcpus), max(0, host.memory_capacity_mib - host.used_memory_mib))


def _top_k(values: Sequence[tuple[str, int, int]], k: int) -> tuple[int, tuple[str, ...]]:
    """Sum and names of the k largest values (ties: the larger HA load, then by name), O(n log k)."""
    top = heapq.nsmallest(k, values, key=lambda nvh: (-nvh[1], -nvh[2], nvh[0]))
    return sum(v for _, v, _ in top), tuple(sorted(n for n, _, _ in top))


def _tolerated(values: list[int], total_free: int, k: int) -> int:
    """The most failures j <= k whose worst case fits: top-j sums grow with j (values are >= 0)."""
    top = heapq.nlargest(k, values)  # in decreasing order, O(n log k)
    acc, j = 0, 0
    for v in top:
        if acc + v > total_free:
            break
        acc, j = acc + v, j + 1
    return j


def assess(hosts: Sequence[HostCapacity], ha_load: Mapping[str, Load], k: int) -> Assessment:
    """The failover reserve of one cluster's hosts for k tolerated host failures. `ha_load`: per host
    name, what its HA VMs claim there (hosts without any may be left out)."""
    counted = [h for h in hosts if _counted(h)]
    free = {h.name: _free(h) for h in counted}
    ha = {h.name: Load(*ha_load.get(h.name, Load())) for h in counted}
    total = Load(sum(f.vcpus for f in free.values()), sum(f.memory_mib for f in free.values()))
    if k <= 0:
        return Assessment(0, True, 0, Load(), total, Load(), (), ())
    per: list[tuple[int, tuple[str, ...], int, int]] = []
    for r in (0, 1):
        values = [(n, free[n][r] + ha[n][r], ha[n][r]) for n in free]
        top_sum, names = _top_k(values, k)
        reserve = sum(heapq.nlargest(k, (ha[n][r] for n in free)))
        per.append((top_sum, names, reserve, _tolerated([v for _, v, _ in values], total[r], k)))
    shortfall = Load(max(0, per[0][0] - total.vcpus), max(0, per[1][0] - total.memory_mib))
    return Assessment(
        k=k,
        survives=shortfall == Load(),
        tolerated=min(per[0][3], per[1][3]),
        reserve=Load(per[0][2], per[1][2]),
        free=total,
        shortfall=shortfall,
        worst_vcpus=per[0][1],
        worst_memory=per[1][1],
    )


def _moved(
    hosts: Sequence[HostCapacity], ha_load: Mapping[str, Load], host: str, delta: Load, delta_is_ha: bool, sign: int
) -> tuple[list[HostCapacity], dict[str, Load]]:
    out, load = [], {n: Load(*v) for n, v in ha_load.items()}
    for h in hosts:
        if h.name == host:
            h = replace(
                h,
                used_vcpus=h.used_vcpus + sign * delta.vcpus,
                used_memory_mib=h.used_memory_mib + sign * delta.memory_mib,
            )
            if delta_is_ha:
                old = load.get(host, Load())
                load[host] = Load(old.vcpus + sign * delta.vcpus, old.memory_mib + sign * delta.memory_mib)
        out.append(h)
    return out, load


def would_break(
    hosts: Sequence[HostCapacity],
    ha_load: Mapping[str, Load],
    k: int,
    host: str,
    delta: Load,
    delta_is_ha: bool,
    release: tuple[str, Load] | None = None,
) -> Assessment | None:
    """Placing `delta` (vCPUs, memory with overhead) on `host` (an HA VM's when `delta_is_ha`): None when
    the cluster still survives k failures afterwards, else the assessment after it (naming the worst
    case and the shortfall). `release`: (host, load) freed at the same time (a migration's source, an
    HA VM's own claim when `delta_is_ha`). k <= 0 never breaks."""
    if k <= 0:
        return None
    if release is not None:
        hosts, ha_load = _moved(hosts, ha_load, release[0], release[1], delta_is_ha, -1)
    hosts, ha_load = _moved(hosts, ha_load, host, delta, delta_is_ha, +1)
    after = assess(hosts, ha_load, k)
    return None if after.survives else after


def breaking_mask(
    vcpus_capacity: np.ndarray,
    memory_capacity: np.ndarray,
    used_vcpus: np.ndarray,
    used_memory: np.ndarray,
    enabled: np.ndarray,
    counted: np.ndarray,
    ha_vcpus: np.ndarray,
    ha_memory: np.ndarray,
    delta_vcpus: int,
    delta_memory: np.ndarray,
    delta_is_ha: bool,
    k: int,
) -> np.ndarray:
    """would_break for every host of ONE cluster at once (arrays over its hosts; `delta_memory` per host,
    its overhead differs): True where placing the delta there leaves the cluster unable to take k
    failures. O(n log n) for all candidates together: placing on host i changes only total free and
    i's own value free_i + ha_i, so the new top-k sum follows from the old top-k, the k-th and the
    (k+1)-th largest values."""
    n = len(vcpus_capacity)
    if k <= 0 or n == 0:
        return np.zeros(n, dtype=bool)
    breaks = np.zeros(n, dtype=bool)
    for cap, used, ha, d in (
        (vcpus_capacity, used_vcpus, ha_vcpus, np.full(n, delta_vcpus, dtype=float)),
        (memory_capacity, used_memory, ha_memory, np.asarray(delta_memory, dtype=float)),
    ):
        live = enabled & counted
        free = np.where(live, np.maximum(cap - used, 0), 0.0)
        value = free + ha
        total = free.sum()
        new_free = np.where(live, np.maximum(cap - used - d, 0), 0.0)
        new_value = new_free + ha + (d if delta_is_ha else 0)
        new_total = total - free + new_free
        rows = np.flatnonzero(counted)  # not counted: never among the failed
        order = rows[np.argsort(-value[rows], kind="stable")]
        m = len(rows)
        kk = min(k, m)
        top = order[:kk]
        top_sum = value[top].sum() if kk else 0.0
        kth = value[order[kk - 1]] if kk else 0.0
        next_ = value[order[kk]] if kk < m else 0.0  # the (k+1)-th; 0 when every host fails
        in_top = np.zeros(n, dtype=bool)
        in_top[top] = True
        new_sum = np.where(
            in_top, top_sum - value + np.maximum(new_value, next_), top_sum + np.maximum(0.0, new_value - kth)
        )
        # a host already failed is no candidate (the state filter refuses it); placing there changes nothing
        breaks |= np.where(counted, new_sum > new_total, top_sum > total)
    return breaks


def reserve_message(after: Assessment, action: str, cluster: str) -> str:
    """Why `action` (e.g. "starting web-3 on h1") is refused: what the reserve would become."""
    worst = ", ".join(after.worst) or "no host"
    need = []
    if after.shortfall.vcpus:
        need.append(f"{after.shortfall.vcpus} vCPU")
    if after.shortfall.memory_mib:
        need.append(f"{after.shortfall.memory_mib} MiB")
    return (
        f"{action} would leave room for the HA VMs of {after.tolerated} of the {after.k} host failure(s) "
        f"cluster {cluster} tolerates ({SETTING}={after.k}): the worst case, {worst} failing, needs "
        f"{' / '.join(need)} more than the other hosts have free"
    )
