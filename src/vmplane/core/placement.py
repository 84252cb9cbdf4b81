"""Placement: filters drop hosts, weighers order the rest, over an in-memory capacity index (pure).

Like the Kubernetes scheduler and Nova's filter scheduler, a decision is a pipeline of small
filters (yes/no with a reason) and weighers (a score in [0, 1] times a multiplier). Here each
filter is evaluated for all hosts at once on numpy arrays, so a decision at 2,000 hosts takes
tens of microseconds; the same masks explain, host by host, why a host was refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from vmplane.core import failover
from vmplane.core import groups as group_rules
from vmplane.core.errors import InsufficientCapacity, NotFound
from vmplane.core.model import UNREACHABLE_HOST_STATES, HostCapacity, HostState, PlacementRequest, Refusal
from vmplane.core.quota import overhead_base_mib


class CapacityIndex:
    """Hosts' capacity and allocation as parallel arrays; names map to rows."""

    _GROW = 64

    def __init__(self, hosts: Iterable[HostCapacity] = ()):
        self._rows: dict[str, int] = {}
        self._hosts: list[HostCapacity | None] = []
        n = self._GROW
        self.enabled = np.zeros(n, dtype=bool)
        self.present = np.zeros(n, dtype=bool)
        self.vcpus_capacity = np.zeros(n)
        self.memory_capacity = np.zeros(n)
        self.used_vcpus = np.zeros(n)
        self.used_memory = np.zeros(n)
        self.overhead_ratio = np.ones(n)
        self.pack = np.zeros(n, dtype=bool)
        self.reachable = np.zeros(n, dtype=bool)  # not down, fencing or fenced: it can fail (failover)
        self.cluster_code = np.zeros(n, dtype=np.int64)
        self._cluster_codes: dict[str, int] = {}
        self.zone_code = np.zeros(n, dtype=np.int64)
        self._zone_codes: dict[str, int] = {}
        for host in hosts:
            self.upsert(host)

    # -- maintenance -------------------------------------------------------------------------
    def _grow(self) -> None:
        for attr in (
            "enabled",
            "present",
            "vcpus_capacity",
            "memory_capacity",
            "used_vcpus",
            "used_memory",
            "overhead_ratio",
            "pack",
            "reachable",
            "cluster_code",
            "zone_code",
        ):
            old = getattr(self, attr)
            new = np.zeros(len(old) * 2, dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, attr, new)

    def upsert(self, host: HostCapacity) -> None:
        row = self._rows.get(host.name)
        if row is None:
            row = len(self._hosts)
            if row >= len(self.present):
                self._grow()
            self._rows[host.name] = row
            self._hosts.append(host)
        self._hosts[row] = host
        self.present[row] = True
        self.enabled[row] = host.state == HostState.enabled
        self.reachable[row] = host.state not in UNREACHABLE_HOST_STATES
        self.vcpus_capacity[row] = host.vcpus_capacity
        self.memory_capacity[row] = host.memory_capacity_mib
        self.used_vcpus[row] = host.used_vcpus
        self.used_memory[row] = host.used_memory_mib
        self.overhead_ratio[row] = host.overhead_ratio
        self.pack[row] = host.strategy == "pack"
        self.cluster_code[row] = self._cluster_codes.setdefault(host.cluster, len(self._cluster_codes) + 1)
        self.zone_code[row] = self._zone_codes.setdefault(host.zone, len(self._zone_codes) + 1)

    def remove(self, name: str) -> None:
        row = self._rows.pop(name)
        self._hosts[row] = None
        self.present[row] = False
        self.enabled[row] = False
        self.reachable[row] = False

    def add_usage(self, name: str, vcpus: int, memory_mib: int) -> None:
        """Record a claim (positive) or its release (negative) on a host."""
        row = self._row(name)
        self.used_vcpus[row] += vcpus
        self.used_memory[row] += memory_mib

    def at(self, row: int) -> HostCapacity:
        """The host of a row that is present (a removed host's row holds None and is never asked for)."""
        host = self._hosts[row]
        assert host is not None, f"row {row} holds no host"
        return host

    def host(self, name: str) -> HostCapacity:
        row = self._row(name)
        return replace(self.at(row), used_vcpus=int(self.used_vcpus[row]), used_memory_mib=int(self.used_memory[row]))

    def capacity_of(self, name: str) -> tuple[int, int]:
        """(vCPUs, memory MiB) a host may hold under its overcommit factors."""
        row = self._row(name)
        return int(self.vcpus_capacity[row]), int(self.memory_capacity[row])

    def hosts(self) -> list[HostCapacity]:
        return [self.host(name) for name in self._rows]

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, name: str) -> bool:
        return name in self._rows

    def _row(self, name: str) -> int:
        try:
            return self._rows[name]
        except KeyError:
            raise NotFound(f"host {name!r} is not in the capacity index", field="host") from None

    def cluster_code_of(self, cluster: str) -> int:
        return self._cluster_codes.get(cluster, -1)

    def zone_code_of(self, zone: str) -> int:
        return self._zone_codes.get(zone, -1)

    @property
    def size(self) -> int:
        return len(self._hosts)

    def names_at(self, rows: np.ndarray) -> list[str]:
        return [self.at(i).name for i in rows]


# -- filters ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Demand:
    """A request turned into per-host needs (memory depends on each host's overhead ratio)."""

    vcpus: int
    memory_mib: np.ndarray  # guest memory + overhead, per host row


def demand_for(index: CapacityIndex, request: PlacementRequest) -> Demand:
    n = index.size
    base = overhead_base_mib(request.size)
    memory = request.size.memory_mib + np.ceil(base * index.overhead_ratio[:n])
    return Demand(request.size.vcpus, memory)


@dataclass(frozen=True)
class Filter:
    """`mask` says, for every host row, whether the host passes; None means the filter does not apply
    to this request (every host passes) and costs nothing."""

    name: str
    mask: Callable[[CapacityIndex, PlacementRequest, Demand], np.ndarray | None]
    reason: Callable[[CapacityIndex, int, PlacementRequest, Demand], str]


def _state_mask(ix: CapacityIndex, req: PlacementRequest, d: Demand) -> np.ndarray:
    return ix.enabled[: ix.size]


def _state_reason(ix: CapacityIndex, row: int, req: PlacementRequest, d: Demand) -> str:
    return f"state is {ix.at(row).state.value}, not enabled"


def _zone_mask(ix: CapacityIndex, req: PlacementRequest, d: Demand) -> np.ndarray | None:
    if req.zone is None:
        return None
    mask: np.ndarray = ix.zone_code[: ix.size] == ix.zone_code_of(req.zone)
    return mask


def _zone_reason(ix: CapacityIndex, row: int, req: PlacementRequest, d: Demand) -> str:
    return f"in zone {ix.at(row).zone}, not {req.zone}"


def _cluster_mask(ix: CapacityIndex, req: PlacementRequest, d: Demand) -> np.ndarray | None:
    if req.cluster is None:
        return None
    mask: np.ndarray = ix.cluster_code[: ix.size] == ix.cluster_code_of(req.cluster)
    return mask


def _cluster_reason(ix: CapacityIndex, row: int, req: PlacementRequest, d: Demand) -> str:
    return f"in cluster {ix.at(row).cluster}, not {req.cluster}"


def _named(ix: CapacityIndex, names: frozenset[str]) -> np.ndarray:
    """True on the rows of these hosts (those the index has)."""
    mask = np.zeros(ix.size, dtype=bool)
    for name in names:
        if name in ix:
            mask[ix._row(name)] = True
    return mask


def _exclude_mask(ix: CapacityIndex, req: PlacementRequest, d: Demand) -> np.ndarray | None:
    return ~_named(ix, req.exclude_hosts) if req.exclude_hosts else None


def _exclude_reason(ix: CapacityIndex, row: int, req: PlacementRequest, d: Demand) -> str:
    return req.exclude_reason


def _storage_mask(ix: CapacityIndex, req: PlacementRequest, d: Demand) -> np.ndarray | None:
    return None if req.storage_hosts is None else _named(ix, req.storage_hosts)


def _storage_reason(ix: CapacityIndex, row: int, req: PlacementRequest, d: Demand) -> str:
    return req.storage_reason


def _group_mask(ix: CapacityIndex, req: PlacementRequest, d: Demand) -> np.ndarray | None:
    rule = req.group
    if rule is None or not rule.hard or not rule.placed:
        return None
    members = _named(ix, rule.hosts)  # the hosts its other members hold (groups.breaks, for all hosts)
    return ~members if rule.policy == group_rules.ANTI_AFFINITY else members


def _group_reason(ix: CapacityIndex, row: int, req: PlacementRequest, d: Demand) -> str:
    return group_rules.refusal(req.group, ix.at(row).name) or ""


def _cluster_rows(ix: CapacityIndex, cluster: str) -> np.ndarray:
    return np.flatnonzero(ix.present[: ix.size] & (ix.cluster_code[: ix.size] == ix.cluster_code_of(cluster)))


def _reserve_mask(ix: CapacityIndex, req: PlacementRequest, d: Demand) -> np.ndarray | None:
    """Hosts whose choice would leave their cluster unable to restart the HA VMs of k failed hosts."""
    r = req.reserve
    if r is None or not any(k > 0 for k in r.k_by_cluster.values()):
        return None
    mask = np.ones(ix.size, dtype=bool)
    all_ha_v, all_ha_m = np.zeros(ix.size), np.zeros(ix.size)
    for name, load in r.ha_load.items():  # only hosts with HA VMs are listed
        if name in ix:
            all_ha_v[ix._row(name)], all_ha_m[ix._row(name)] = load[0], load[1]
    for cluster, k in r.k_by_cluster.items():
        rows = _cluster_rows(ix, cluster)
        if k <= 0 or len(rows) == 0:
            continue
        used_v, used_m = ix.used_vcpus[rows], ix.used_memory[rows]  # copies (fancy indexing)
        ha_v, ha_m = all_ha_v[rows], all_ha_m[rows]
        if r.release is not None and r.release[0] in ix and ix._row(r.release[0]) in rows:
            at = int(np.flatnonzero(rows == ix._row(r.release[0]))[0])
            used_v[at] -= r.release[1].vcpus
            used_m[at] -= r.release[1].memory_mib
            if r.is_ha:
                ha_v[at] -= r.release[1].vcpus
                ha_m[at] -= r.release[1].memory_mib
        breaks = failover.breaking_mask(
            ix.vcpus_capacity[rows],
            ix.memory_capacity[rows],
            used_v,
            used_m,
            ix.enabled[rows],
            ix.reachable[rows],
            ha_v,
            ha_m,
            d.vcpus,
            d.memory_mib[rows],
            r.is_ha,
            k,
        )
        mask[rows] = ~breaks
    return mask


def reserve_breach(
    ix: CapacityIndex, req: PlacementRequest, host: str, vcpus: int, memory_mib: int
) -> failover.Assessment | None:
    """would_break for placing (vcpus, memory_mib) on `host` under `req.reserve` (None: it keeps the reserve)."""
    r = req.reserve
    cluster = ix.host(host).cluster
    k = r.k_by_cluster.get(cluster, 0) if r is not None else 0
    if r is None or k <= 0:
        return None
    hosts = [ix.host(ix.at(i).name) for i in _cluster_rows(ix, cluster)]
    return failover.would_break(hosts, r.ha_load, k, host, failover.Load(vcpus, memory_mib), r.is_ha, r.release)


def _reserve_reason(ix: CapacityIndex, row: int, req: PlacementRequest, d: Demand) -> str:
    host = ix.at(row)
    after = reserve_breach(ix, req, host.name, d.vcpus, int(d.memory_mib[row]))
    if after is None or req.reserve is None:  # (a breach needs a reserve: reserve_breach is None without one)
        return "would break the failover reserve"
    return failover.reserve_message(after, req.reserve.action.format(host=host.name), host.cluster)


def _cpu_mask(ix: CapacityIndex, req: PlacementRequest, d: Demand) -> np.ndarray:
    n = ix.size
    return ix.used_vcpus[:n] + d.vcpus <= ix.vcpus_capacity[:n]


def _cpu_reason(ix: CapacityIndex, row: int, req: PlacementRequest, d: Demand) -> str:
    return f"vcpus {int(ix.used_vcpus[row])} of {int(ix.vcpus_capacity[row])} allocated, {d.vcpus} needed"


def _memory_mask(ix: CapacityIndex, req: PlacementRequest, d: Demand) -> np.ndarray:
    n = ix.size
    mask: np.ndarray = ix.used_memory[:n] + d.memory_mib <= ix.memory_capacity[:n]
    return mask


def _memory_reason(ix: CapacityIndex, row: int, req: PlacementRequest, d: Demand) -> str:
    need = int(d.memory_mib[row])
    return (
        f"memory {int(ix.used_memory[row])} of {int(ix.memory_capacity[row])} MiB allocated, "
        f"{need} MiB needed ({req.size.memory_mib} + {need - req.size.memory_mib} overhead)"
    )


FILTERS: tuple[Filter, ...] = (
    Filter("state", _state_mask, _state_reason),
    Filter("zone", _zone_mask, _zone_reason),
    Filter("cluster", _cluster_mask, _cluster_reason),
    Filter("exclude", _exclude_mask, _exclude_reason),
    Filter("storage", _storage_mask, _storage_reason),
    Filter("group", _group_mask, _group_reason),
    Filter("cpu", _cpu_mask, _cpu_reason),
    Filter("memory", _memory_mask, _memory_reason),
    Filter("reserve", _reserve_mask, _reserve_reason),
)


# -- weighers ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Weigher:
    """`score` gives every host row a score in [0, 1] (the rows a filter refused are then left out); None
    means the weigher does not apply to this request (every host scores the same) and costs nothing."""

    name: str
    score: Callable[[CapacityIndex, PlacementRequest, Demand], np.ndarray | None]
    multiplier: float = 1.0


def _allocation_score(ix: CapacityIndex, req: PlacementRequest, d: Demand) -> np.ndarray:
    """Fraction allocated after placing, averaged over CPU and memory; inverted where the cluster spreads."""
    n = ix.size
    cpu = (ix.used_vcpus[:n] + d.vcpus) / np.maximum(ix.vcpus_capacity[:n], 1)
    mem = (ix.used_memory[:n] + d.memory_mib) / np.maximum(ix.memory_capacity[:n], 1)
    allocated = np.clip((cpu + mem) / 2.0, 0.0, 1.0)
    score: np.ndarray = np.where(ix.pack[:n], allocated, 1.0 - allocated)
    return score


def _group_score(ix: CapacityIndex, req: PlacementRequest, d: Demand) -> np.ndarray | None:
    """A soft group's preference (groups.preference); None (the same everywhere) otherwise."""
    rule = req.group
    if rule is None or rule.hard:
        return None
    counts = np.zeros(ix.size)
    for host in rule.hosts:
        if host in ix:
            counts[ix._row(host)] = len(rule.on(host))
    if rule.policy == group_rules.ANTI_AFFINITY:
        return 1.0 / (1.0 + counts)
    return counts / len(rule.placed) if rule.placed else None


# the soft group's weight outweighs allocation: a host that keeps the group wins over a less loaded one
WEIGHERS: tuple[Weigher, ...] = (Weigher("allocation", _allocation_score), Weigher("group", _group_score, 10.0))


# -- decisions --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Placement:
    host: str
    memory_mib: int  # what the VM claims on that host: guest memory + overhead
    overhead_mib: int
    score: float


def passing(
    index: CapacityIndex, request: PlacementRequest, filters: Sequence[Filter] = FILTERS
) -> tuple[np.ndarray, Demand]:
    """For every host row, whether every filter lets it take the request; and the request's demand."""
    demand = demand_for(index, request)
    mask = index.present[: index.size].copy()
    for f in filters:
        passes = f.mask(index, request, demand)
        if passes is not None:
            mask &= passes
    return mask, demand


def candidates(
    index: CapacityIndex, request: PlacementRequest, filters: Sequence[Filter] = FILTERS
) -> tuple[np.ndarray, Demand]:
    """The rows of the hosts that can take the request."""
    mask, demand = passing(index, request, filters)
    return np.flatnonzero(mask), demand


def choose(
    index: CapacityIndex,
    request: PlacementRequest,
    filters: Sequence[Filter] = FILTERS,
    weighers: Sequence[Weigher] = WEIGHERS,
) -> Placement:
    """The best host for the request, or InsufficientCapacity explaining every refusal. Every host row
    is scored (whole arrays: cheaper than gathering the candidates' rows first), and the best row among
    those that passed the filters wins (the first of equals, in row order)."""
    mask, demand = passing(index, request, filters)
    if not mask.any():
        raise InsufficientCapacity(refusal_message(request, explain(index, request, filters)), field="host")
    total = np.zeros(index.size)
    for w in weighers:
        score = w.score(index, request, demand)
        if score is not None:
            total += w.multiplier * score
    total[~mask] = -np.inf
    best = int(np.argmax(total))
    memory = int(demand.memory_mib[best])
    return Placement(
        index.at(best).name,
        memory,
        memory - request.size.memory_mib,
        float(total[best]),
    )


def fit_on(
    index: CapacityIndex, request: PlacementRequest, host: str, filters: Sequence[Filter] = FILTERS
) -> Placement:
    """The placement on one named host, or InsufficientCapacity naming the host and the resource."""
    row = index._row(host)
    demand = demand_for(index, request)
    for f in filters:
        mask = f.mask(index, request, demand)
        if mask is not None and not mask[row]:
            raise InsufficientCapacity(f"{host}: {f.reason(index, row, request, demand)}", field="to")
    memory = int(demand.memory_mib[row])
    return Placement(host, memory, memory - request.size.memory_mib, 0.0)


def explain(index: CapacityIndex, request: PlacementRequest, filters: Sequence[Filter] = FILTERS) -> list[Refusal]:
    """For every host that cannot take the request, the first filter that refused it and why."""
    demand = demand_for(index, request)
    masks = [(f, m) for f in filters if (m := f.mask(index, request, demand)) is not None]
    refusals = []
    for row in np.flatnonzero(index.present[: index.size]):
        for f, mask in masks:
            if not mask[row]:
                refusals.append(
                    Refusal(
                        index.at(int(row)).name,
                        f.name,
                        f.reason(index, int(row), request, demand),
                    )
                )
                break
    return refusals


def refusal_message(request: PlacementRequest, refusals: list[Refusal], shown: int = 5) -> str:
    size = request.size
    head = f"no host can take {size.vcpus} vCPU(s) / {size.memory_mib} MiB (plus overhead)"
    if not refusals:
        return head + ": there are no hosts"
    detail = "; ".join(str(r) for r in refusals[:shown])
    more = f"; and {len(refusals) - shown} more" if len(refusals) > shown else ""
    return f"{head}: {detail}{more}"


def lower_bound_hosts(total_vcpus: int, total_memory_mib: int, host_vcpus: int, host_memory_mib: int) -> int:
    """Fewest identical hosts that could hold a demand (ignoring fragmentation)."""
    return max(-(-total_vcpus // host_vcpus), -(-total_memory_mib // host_memory_mib), 0)
