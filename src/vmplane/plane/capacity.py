"""The capacity mirror: this process's in-memory copy of every host's capacity and use, for placement.

One object owns the index (core.placement.CapacityIndex), each host's metadata (zone, cluster, ids,
migration address) and the re-entrant lock that guards both; the admission batcher shares the lock.
The store is the truth: a change is mirrored here after (or, inside an admission, as the last step of)
the transaction that made it, through the few methods below, never by hand. A rebuild reads it all
back from the store (at start, when settings change, when an admission batch aborts).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import cast

from sqlalchemy import select
from sqlalchemy.engine import Connection, Row

from vmplane.core.errors import InsufficientCapacity
from vmplane.core.model import HostCapacity, HostState, PlacementRequest
from vmplane.core.placement import CapacityIndex, Placement, choose
from vmplane.store import Database
from vmplane.store import ledger as L
from vmplane.store.catalog import Catalog
from vmplane.store.schema import Host

PLACEMENT_RETRIES = 5

Freed = list[tuple[str, int, int]]  # (host, vcpus, memory MiB) given back, as ledger.release_vm returns


@dataclass(frozen=True)
class HostMeta:
    """What admission needs to know of a host besides its capacity."""

    id: int
    zone: str
    cluster: str
    cores: int
    cpu_mhz: int
    memory_mib: int
    migration_address: str | None = None
    zone_id: int | None = None
    cluster_id: int | None = None


def meta_of(h: Host) -> HostMeta:
    return HostMeta(
        h.id,
        h.cluster.zone.name,
        h.cluster.name,
        h.cores,
        h.cpu_mhz,
        h.memory_mib,
        h.migration_address,
        h.cluster.zone_id,
        h.cluster_id,
    )


class Capacity:
    def __init__(self, db: Database, catalog: Catalog):
        self.db = db
        self.catalog = catalog
        self.lock = threading.RLock()  # admissions in this process, and the index
        self.index = CapacityIndex()
        self.hosts: dict[str, HostMeta] = {}
        self._cluster_zones: dict[str, str] | None = None

    # -- reads ---------------------------------------------------------------------------------
    def host(self, name: str) -> HostCapacity:
        with self.lock:
            return self.index.host(name)

    def migration_address(self, host: str) -> str | None:
        return self.hosts[host].migration_address

    def hosts_by_id(self) -> dict[int, str]:
        return {meta.id: name for name, meta in self.hosts.items()}

    def cluster_zones(self) -> dict[str, str]:
        """Each cluster with hosts and its zone, from the host list (kept until that changes: admissions
        ask for it, and going over thousands of hosts each time cost a fifth of an admission)."""
        zones = self._cluster_zones
        if zones is None:
            zones = self._cluster_zones = {m.cluster: m.zone for m in list(self.hosts.values())}
        return zones

    def snapshot(self) -> CapacityIndex:
        """A copy of the index to plan against (a drain places its VMs one after the other on it)."""
        with self.lock:
            return CapacityIndex(self.index.hosts())

    # -- changes mirrored from the store -------------------------------------------------------
    def add(self, host: str, vcpus: int, memory_mib: int) -> None:
        """Capacity taken on `host` (negative: given back) by a transaction that committed, or commits now."""
        with self.lock:
            self.index.add_usage(host, vcpus, memory_mib)

    def give_back(self, freed: Freed) -> None:
        """What released claims held, back to their hosts (a host removed meanwhile is skipped)."""
        with self.lock:
            for host, vcpus, memory in freed:
                if host in self.index:
                    self.index.add_usage(host, -vcpus, -memory)

    def set_state(self, host: str, state: HostState) -> None:
        with self.lock:
            self.index.upsert(replace(self.index.host(host), state=state))

    def learn(self, row: Row) -> None:
        """A host row read (locked) in a transaction: its state and use, as the store has them. Called by
        an admission, which holds the lock already."""
        self.index.upsert(
            replace(
                self.index.host(row.name),
                state=HostState(row.state),
                used_vcpus=row.used_vcpus,
                used_memory_mib=row.used_memory_mib,
            )
        )

    def put_host(self, host: Host) -> None:
        """A host added to the store."""
        with self.lock:
            self.hosts[host.name] = meta_of(host)
            self._cluster_zones = None
            self.index.upsert(self._capacity(host))

    def drop_host(self, name: str) -> None:
        """A host deleted from the store."""
        with self.lock:
            self.hosts.pop(name, None)
            self._cluster_zones = None
            if name in self.index:
                self.index.remove(name)

    def rebuild(self) -> None:
        """Everything again from the store."""
        with self.lock:
            with self.db.read() as s:
                hosts = list(s.scalars(select(Host).order_by(Host.id)).unique())
            self.hosts = {h.name: meta_of(h) for h in hosts}
            self._cluster_zones = None
            self.index = CapacityIndex([self._capacity(h) for h in hosts])

    def _capacity(self, host: Host) -> HostCapacity:
        cluster, zone = host.cluster.name, host.cluster.zone.name
        eff = self.catalog.effective
        return HostCapacity(
            name=host.name,
            cluster=cluster,
            state=HostState(host.state),
            cores=host.cores,
            memory_mib=host.memory_mib,
            cpu_factor=float(cast(float, eff("cpu.overprovisioning.factor", zone, cluster))),
            mem_factor=float(cast(float, eff("mem.overprovisioning.factor", zone, cluster))),
            overhead_ratio=float(cast(float, eff("vmplane.overhead.ratio", zone, cluster))),
            strategy=str(eff("vmplane.placement.strategy", zone, cluster)),
            used_vcpus=host.used_vcpus,
            used_memory_mib=host.used_memory_mib,
            zone=zone,
        )

    # -- placement -----------------------------------------------------------------------------
    def take_placement(
        self, conn: Connection, request: PlacementRequest, check: Callable[[Placement], None] | None = None
    ) -> tuple[Placement, int]:
        """Pick a host for `request` from the index and take the capacity on its row (compare-and-add);
        if the store shows the index was behind (another process claimed), learn the store's numbers and
        pick again (so a final refusal carries the host's real numbers). `check(placement)` may refuse
        the chosen host before anything is written (the quota with its overhead). Returns the placement
        and the host's id."""
        for _ in range(PLACEMENT_RETRIES):
            placement = choose(self.index, request)
            if check is not None:
                check(placement)
            host_id = self.hosts[placement.host].id
            cap_vcpus, cap_memory = self.index.capacity_of(placement.host)
            if L.take_on_host(conn, host_id, request.size.vcpus, placement.memory_mib, cap_vcpus, cap_memory):
                return placement, host_id
            self.learn(L.lock_host(conn, placement.host))
        raise InsufficientCapacity(
            f"no host could be claimed after {PLACEMENT_RETRIES} tries; hosts are changing fast, retry", field="host"
        )
