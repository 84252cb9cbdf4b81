"""Gauges of the cluster's state, read at scrape time (served at /metrics after the counters of metrics.py).

Each scrape reads the store with a handful of aggregate queries (GROUP BY: a row per state, kind, project
or host, never a row per VM into Python) and the hosts' capacity from the orchestrator's in-memory index.
StateCollector is a prometheus_client collector (collect()), never registered on the process-wide
REGISTRY: an API app holds its own and /metrics appends its text() to the counters, so building many
apps in one process registers nothing twice. text() writes the exposition format directly: with 500
hosts prometheus_client's per-sample formatting cost ~10x the queries.

Series (the store's MiB are exposed as bytes):
- vmplane_vms{state}: VMs by state (every state, 0 included).
- vmplane_project_quota{project,resource}, vmplane_project_usage{project,resource}: resource is vcpus,
  memory_bytes, vms or storage_bytes; usage is the quota ledger (what admission compares with the quota:
  memory with QEMU overhead when the project counts it). Usage also has memory_with_overhead_bytes: the
  guest memory plus overhead of the project's charged VMs, whether the project counts overhead or not.
- vmplane_host_info{host,cluster,zone,driver} 1; vmplane_host_state{host,state} 1 (its current state only);
  vmplane_hosts{state}: hosts by state (every state, 0 included).
- vmplane_host_vcpus_capacity{host}, vmplane_host_memory_capacity_bytes{host}: what placement may put on the
  host (cores and memory times its cluster's overprovisioning factors).
- vmplane_host_vcpus_allocated{host}, vmplane_host_memory_allocated_bytes{host}: what is claimed on it
  (running VMs, migration targets, scales in progress; memory with overhead); of that memory,
  vmplane_host_memory_overhead_bytes{host} is QEMU's overhead; vmplane_host_vms{host}: VMs placed on it.
- vmplane_operations_in_flight{kind}, vmplane_operation_oldest_in_flight_seconds{kind}: pending or running
  operations, and the age of the oldest (0: none).
- vmplane_migrations_in_flight{state}, vmplane_migration_oldest_in_flight_seconds{state}: queued, copying,
  checking, postcopy-failed; the age counts from the migration's admission.
- vmplane_pool_capacity_bytes{pool}, vmplane_pool_used_bytes{pool}: storage pools (used: vmplane's volumes).
- vmplane_networks{kind}: guest networks; vmplane_nics{state}: NICs (attached, attaching, detaching);
  vmplane_network_addresses_used{network}, vmplane_network_addresses_total{network}.
- vmplane_state_scrape_ok: 0 when the store could not be read (the counters are still served);
  vmplane_state_scrape_duration_seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

from prometheus_client.core import GaugeMetricFamily, Metric
from sqlalchemy import func, select

from vmplane.api import statsmetrics
from vmplane.core import networks
from vmplane.core.migration import ACTIVE as ACTIVE_MIGRATION_STATES
from vmplane.core.model import CHARGED_STATES, IN_FLIGHT_OPERATION_STATES, ClaimKind, HostState, VmState
from vmplane.store import ledger as L
from vmplane.store.schema import Cluster, Network, Nic, Pool, Zone, utcnow

if TYPE_CHECKING:
    from vmplane.plane.context import Plane

log = logging.getLogger("vmplane.metrics")

MIB = 1024 * 1024
OPERATION_KINDS = ("start", "stop", "scale", "drain", "reconcile", "recover", "restart")  # shown at 0 too
_CHARGED = sorted(s.value for s in CHARGED_STATES)
_IN_FLIGHT = sorted(s.value for s in IN_FLIGHT_OPERATION_STATES)
_ACTIVE = sorted(s.value for s in ACTIVE_MIGRATION_STATES)

_V, _P, _H, _C, _O, _M = (t.c for t in (L.VMS, L.PROJECTS, L.HOSTS, L.CLAIMS, L.OPERATIONS, L.MIGRATIONS))
_CL, _Z, _PO = Cluster.__table__.c, Zone.__table__.c, Pool.__table__.c

VMS_BY_STATE = select(_V.state, func.count()).group_by(_V.state)
PROJECTS = select(
    _P.id,
    _P.name,
    _P.quota_vcpus,
    _P.quota_memory_mib,
    _P.quota_vms,
    _P.quota_storage_mib,
    _P.used_vcpus,
    _P.used_memory_mib,
    _P.used_vms,
    _P.used_storage_mib,
)
FOOTPRINT_BY_PROJECT = (
    select(_V.project_id, func.sum(_V.memory_mib + _V.overhead_mib))
    .where(_V.state.in_(_CHARGED))
    .group_by(_V.project_id)
)
HOSTS = (
    select(
        _H.id,
        _H.name,
        _H.state,
        _H.driver,
        _H.used_vcpus,
        _H.used_memory_mib,
        _CL.name.label("cluster"),
        _Z.name.label("zone"),
    )
    .join(Cluster.__table__, _CL.id == _H.cluster_id)
    .join(Zone.__table__, _Z.id == _CL.zone_id)
)
# the overhead on a host: of the VMs placed there, and of those migrating to it (few: their claims)
VMS_BY_HOST = (
    select(_V.host_id, func.count(), func.sum(_V.overhead_mib)).where(_V.host_id.is_not(None)).group_by(_V.host_id)
)
TARGETS_BY_HOST = (
    select(_C.host_id, func.sum(_V.overhead_mib))
    .join(L.VMS, _V.id == _C.vm_id)
    .where(_C.kind == ClaimKind.migration_target.value)
    .group_by(_C.host_id)
)
OPERATIONS_IN_FLIGHT = (
    select(_O.kind, func.count(), func.min(_O.created_at)).where(_O.state.in_(_IN_FLIGHT)).group_by(_O.kind)
)
MIGRATIONS_IN_FLIGHT = (
    select(_M.state, func.count(), func.min(_M.created_at)).where(_M.state.in_(_ACTIVE)).group_by(_M.state)
)
POOLS = select(_PO.name, _PO.capacity_mib, _PO.used_mib)
_N, _NIC = Network.__table__.c, Nic.__table__.c
NETWORKS = (
    select(_N.name, _N.kind, _N.cidr, func.count(_NIC.id).label("used"))
    .outerjoin(Nic.__table__, _NIC.network_id == _N.id)
    .group_by(_N.id, _N.name, _N.kind, _N.cidr)
    .order_by(_N.name)
)
NICS_BY_STATE = select(_NIC.state, func.count()).group_by(_NIC.state)


class Family(NamedTuple):
    """One gauge, by columns: a list of values per label, and the sample values (few allocations per
    sample: with 500 hosts a scrape writes ~5,000 samples)."""

    name: str
    doc: str
    labels: tuple[str, ...]
    columns: tuple[list, ...]
    values: list

    def samples(self) -> Iterator[tuple]:
        return zip(*self.columns, self.values)

    def metric(self) -> Metric:
        g = GaugeMetricFamily(self.name, self.doc, labels=list(self.labels))
        for *labels, value in self.samples():
            g.add_metric(labels, value)
        return g


def _family(name: str, doc: str, labels: tuple[str, ...], samples: list[tuple]) -> Family:
    """A family from (label values..., value) rows."""
    columns = tuple(map(list, zip(*samples))) if samples else tuple([] for _ in range(len(labels) + 1))
    return Family(name, doc, labels, columns[:-1], columns[-1])


def _addresses(cidr: str) -> int:
    first, last = networks.usable(networks.parse_cidr(cidr))
    return int(last) - int(first) + 1 - 2


def _age(now, since) -> float:
    return max((now - since).total_seconds(), 0.0) if since is not None else 0.0


def _escape(value: str) -> str:
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return value


def exposition(families: list[Family]) -> str:
    """The text format (version 0.0.4) of gauges, as generate_latest writes it (values are finite ints and
    floats: Python's str() of them is Prometheus' notation)."""
    out: list[str] = []
    for f in families:
        doc = f.doc.replace("\\", "\\\\").replace("\n", "\\n")
        out.append(f"# HELP {f.name} {doc}\n# TYPE {f.name} gauge\n")
        if not f.labels:
            out += [f"{f.name} {value}\n" for value in f.values]
        elif len(f.labels) == 1:
            head = f'{f.name}{{{f.labels[0]}="'
            out += [f'{head}{_escape(label)}"}} {value}\n' for label, value in zip(f.columns[0], f.values)]
        else:
            keys = [f'{label}="' for label in f.labels]
            for *labels, value in f.samples():
                text = '",'.join(k + _escape(v) for k, v in zip(keys, labels))
                out.append(f'{f.name}{{{text}"}} {value}\n')
    return "".join(out)


class StateCollector:
    """Reads the cluster's state at each scrape (no describe(): nothing is read at registration)."""

    def __init__(self, plane: Plane):
        self.plane = plane

    def collect(self) -> Iterator[Metric]:
        for family in self.families():
            yield family.metric()

    def text(self) -> str:
        return exposition(self.families())

    def families(self) -> list[Family]:
        """The state's gauges, then whether it could be read and how long that took."""
        t0 = time.perf_counter()
        try:
            families, ok = self._read(), 1
        except Exception:  # the store does not answer: the counters are still worth serving
            log.exception("reading the cluster's state for /metrics")
            families, ok = [], 0
        return families + [
            Family("vmplane_state_scrape_ok", "1 if the cluster's state could be read for this scrape", (), (), [ok]),
            Family(
                "vmplane_state_scrape_duration_seconds",
                "Time to read the cluster's state",
                (),
                (),
                [time.perf_counter() - t0],
            ),
        ]

    def _read(self) -> list[Family]:
        with self.plane.db.read() as s:
            conn = s.connection()
            vms = dict(conn.execute(VMS_BY_STATE).tuples().all())
            projects = conn.execute(PROJECTS).all()
            footprint = dict(conn.execute(FOOTPRINT_BY_PROJECT).tuples().all())
            hosts = conn.execute(HOSTS).all()
            placed = {host_id: (n, mib) for host_id, n, mib in conn.execute(VMS_BY_HOST)}
            targets = dict(conn.execute(TARGETS_BY_HOST).tuples().all())
            operations = conn.execute(OPERATIONS_IN_FLIGHT).all()
            migrations = conn.execute(MIGRATIONS_IN_FLIGHT).all()
            pools = conn.execute(POOLS).all()
            networks = conn.execute(NETWORKS).all()
            nics = dict(conn.execute(NICS_BY_STATE).tuples().all())
            usage = [_family(*g) for g in statsmetrics.gauges(conn)]  # the graphs' latest points (issue 33)
        now = utcnow()
        states = [st.value for st in VmState] + sorted(set(vms) - {st.value for st in VmState})  # unknown ones too
        out = [Family("vmplane_vms", "VMs by state", ("state",), (states,), [vms.get(st, 0) for st in states])]
        out += self._projects(projects, footprint)
        out += self._hosts(hosts, placed, targets)

        seen = {kind: (n, since) for kind, n, since in operations}
        kinds = sorted(set(OPERATION_KINDS) | set(seen))
        out.append(
            Family(
                "vmplane_operations_in_flight",
                "Operations pending or running, by kind",
                ("kind",),
                (kinds,),
                [seen.get(k, (0, None))[0] for k in kinds],
            )
        )
        out.append(
            Family(
                "vmplane_operation_oldest_in_flight_seconds",
                "Age of the oldest operation pending or running, by kind (0: none)",
                ("kind",),
                (kinds,),
                [_age(now, seen.get(k, (0, None))[1]) for k in kinds],
            )
        )
        seen = {state: (n, since) for state, n, since in migrations}
        out.append(
            Family(
                "vmplane_migrations_in_flight",
                "Migrations not ended, by state",
                ("state",),
                (_ACTIVE,),
                [seen.get(st, (0, None))[0] for st in _ACTIVE],
            )
        )
        out.append(
            Family(
                "vmplane_migration_oldest_in_flight_seconds",
                "Age (since admission) of the oldest migration in this state (0: none)",
                ("state",),
                (_ACTIVE,),
                [_age(now, seen.get(st, (0, None))[1]) for st in _ACTIVE],
            )
        )
        names = [name for name, _, _ in pools]
        out.append(
            Family(
                "vmplane_pool_capacity_bytes",
                "A storage pool's capacity as its host reports it",
                ("pool",),
                (names,),
                [cap * MIB for _, cap, _ in pools],
            )
        )
        out.append(
            Family(
                "vmplane_pool_used_bytes",
                "What vmplane's volumes take on a pool (provisioned size)",
                ("pool",),
                (names,),
                [used * MIB for _, _, used in pools],
            )
        )
        return out + self._networks(networks, nics) + usage

    @staticmethod
    def _networks(networks, nics: dict) -> list[Family]:
        kinds = ["isolated", "provider"]
        names = [n.name for n in networks]
        nic_states = sorted({"attached", "attaching", "detaching"} | set(nics))
        return [
            Family("vmplane_networks", "Guest networks, by kind", ("kind",), (kinds,),
                   [sum(1 for n in networks if n.kind == k) for k in kinds]),
            Family("vmplane_nics", "NICs, by state", ("state",), (nic_states,), [nics.get(st, 0) for st in nic_states]),
            Family("vmplane_network_addresses_used", "Addresses a network's NICs hold", ("network",), (names,),
                   [n.used for n in networks]),
            Family("vmplane_network_addresses_total", "Addresses a network can give its NICs (its host addresses "
                   "less the gateway's and the DHCP server's)", ("network",), (names,),
                   [_addresses(n.cidr) for n in networks]),
        ]  # fmt: skip

    @staticmethod
    def _projects(projects, footprint: dict) -> list[Family]:
        quota: list = []
        usage: list = []
        for p in projects:
            quota += [
                (p.name, "vcpus", p.quota_vcpus),
                (p.name, "memory_bytes", p.quota_memory_mib * MIB),
                (p.name, "vms", p.quota_vms),
                (p.name, "storage_bytes", p.quota_storage_mib * MIB),
            ]
            usage += [
                (p.name, "vcpus", p.used_vcpus),
                (p.name, "memory_bytes", p.used_memory_mib * MIB),
                (p.name, "vms", p.used_vms),
                (p.name, "storage_bytes", p.used_storage_mib * MIB),
                (p.name, "memory_with_overhead_bytes", (footprint.get(p.id) or 0) * MIB),
            ]
        return [
            _family(
                "vmplane_project_quota",
                "A project's quota by resource (memory and storage in bytes)",
                ("project", "resource"),
                quota,
            ),
            _family(
                "vmplane_project_usage",
                "A project's usage by resource: its quota ledger (memory with "
                "overhead when the project counts it); memory_with_overhead_bytes: its charged VMs' guest "
                "memory plus overhead",
                ("project", "resource"),
                usage,
            ),
        ]

    def _hosts(self, hosts, placed: dict, targets: dict) -> list[Family]:
        ids, names, states, drivers, vcpus, memory, clusters, zones = (
            tuple(map(list, zip(*hosts))) if hosts else ([],) * 8
        )
        index = self.plane.capacity.index
        known = [name for name in names if name in index]  # else added by another process, not indexed here yet
        capacity = [index.capacity_of(name) for name in known]
        counts = dict.fromkeys((st.value for st in HostState), 0)
        for st in states:
            counts[st] = counts.get(st, 0) + 1
        nothing = (0, 0)
        return [
            Family(
                "vmplane_host_info",
                "A host's place and driver (always 1)",
                ("host", "cluster", "zone", "driver"),
                (names, clusters, zones, drivers),
                [1] * len(names),
            ),
            Family(
                "vmplane_host_state",
                "A host's state (1; its other states are absent)",
                ("host", "state"),
                (names, states),
                [1] * len(names),
            ),
            Family("vmplane_hosts", "Hosts by state", ("state",), (list(counts),), list(counts.values())),
            Family(
                "vmplane_host_vcpus_capacity",
                "vCPUs placement may put on a host (cores times the cpu overprovisioning factor)",
                ("host",),
                (known,),
                [c[0] for c in capacity],
            ),
            Family(
                "vmplane_host_memory_capacity_bytes",
                "Memory placement may put on a host (memory times the mem overprovisioning factor)",
                ("host",),
                (known,),
                [c[1] * MIB for c in capacity],
            ),
            Family("vmplane_host_vcpus_allocated", "vCPUs claimed on a host", ("host",), (names,), vcpus),
            Family(
                "vmplane_host_memory_allocated_bytes",
                "Memory claimed on a host, QEMU overhead included",
                ("host",),
                (names,),
                [m * MIB for m in memory],
            ),
            Family(
                "vmplane_host_memory_overhead_bytes",
                "The QEMU-overhead part of the memory claimed on a host",
                ("host",),
                (names,),
                [((placed.get(i, nothing)[1] or 0) + (targets.get(i) or 0)) * MIB for i in ids],
            ),
            Family(
                "vmplane_host_vms",
                "VMs placed on a host",
                ("host",),
                (names,),
                [placed.get(i, nothing)[0] for i in ids],
            ),
        ]
