"""The store's read side the API and the console page through: VMs, hosts and operations filtered,
sorted and paged in SQL, a project's usage (its ledger against a recount), and every VM as the audit
compares it with the hosts (`drift_view`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Connection

from vmplane.core.drift import StoredVm
from vmplane.core.errors import NotFound
from vmplane.core.migration import ACTIVE, COPYING
from vmplane.core.model import IN_FLIGHT_OPERATION_STATES, VmState
from vmplane.store import Database
from vmplane.store import ledger as L
from vmplane.store.catalog import Catalog, get_by_name, ledger_of, quota_of
from vmplane.store.listing import Page, by_prefix, order_by, run_page
from vmplane.store.schema import Cluster, Host, Operation, Project, Vm, Zone

_IN_FLIGHT = [st.value for st in IN_FLIGHT_OPERATION_STATES]
_ACTIVE_MIGRATION = [st.value for st in ACTIVE]


class Reads:
    def __init__(self, db: Database, catalog: Catalog):
        self.db = db
        self.catalog = catalog

    def operation(self, op_id: str) -> Operation:
        with self.db.read() as s:
            op = s.get(Operation, op_id)
            if op is None:
                raise NotFound(f"operation {op_id} does not exist", field="operation")
            return op

    def operations(self, state: str | None = None, limit: int = 100) -> list[Operation]:
        with self.db.read() as s:
            stmt = select(Operation).order_by(Operation.created_at.desc()).limit(limit)
            if state:
                stmt = stmt.where(Operation.state == state)
            return list(s.scalars(stmt))

    def find_operation(self, prefix: str, project_id: int | None = None) -> Operation:
        """By its id or a unique prefix of it (4+ characters); `project_id` limits the search to one
        project's operations (a member's)."""
        with self.db.read() as s:
            scope = [] if project_id is None else [Operation.project_id == project_id]
            found = s.get(Operation, by_prefix(s, Operation.id, prefix, "operation", scope))
            return found  # type: ignore[return-value]  # by_prefix found its id in this session just before

    def operation_page(
        self,
        page: Page,
        state: str | None = None,
        kind: str | None = None,
        vm: str | None = None,
        host: str | None = None,
        project_id: int | None = None,
    ) -> tuple[list[Operation], int]:
        """Operations filtered, sorted and paged in SQL (newest first by default), and their total."""
        conds = [Operation.state == state] if state else []
        if kind:
            conds.append(Operation.kind == kind)
        if vm:
            conds += [Operation.target == vm, Operation.kind != "drain"]
        if host:
            conds += [Operation.target == host, Operation.kind == "drain"]
        if project_id is not None:
            conds.append(Operation.project_id == project_id)
        fields = {
            "created_at": Operation.created_at,
            "updated_at": Operation.updated_at,
            "kind": Operation.kind,
            "state": Operation.state,
            "progress": Operation.progress,
        }
        with self.db.read() as s:
            return run_page(
                s,
                select(Operation),
                Operation.id,
                conds,
                order_by(page.sort, fields, "-created_at", Operation.id),
                page,
            )

    def host_page(
        self, page: Page, cluster: str | None = None, zone: str | None = None, state: str | None = None
    ) -> tuple[list[Host], int]:
        conds = [Host.state == state] if state else []
        if cluster:
            conds.append(Host.cluster_id.in_(select(Cluster.id).where(Cluster.name == cluster)))
        if zone:
            conds.append(
                Host.cluster_id.in_(select(Cluster.id).join(Zone, Zone.id == Cluster.zone_id).where(Zone.name == zone))
            )
        cluster_name = select(Cluster.name).where(Cluster.id == Host.cluster_id).scalar_subquery()
        zone_name = (
            select(Zone.name)
            .join(Cluster, Cluster.zone_id == Zone.id)
            .where(Cluster.id == Host.cluster_id)
            .scalar_subquery()
        )
        fields = {
            "name": Host.name,
            "cluster": cluster_name,
            "zone": zone_name,
            "state": Host.state,
            "cores": Host.cores,
            "memory_mib": Host.memory_mib,
            "used_vcpus": Host.used_vcpus,
            "used_memory_mib": Host.used_memory_mib,
        }
        with self.db.read() as s:
            return run_page(s, select(Host), Host.id, conds, order_by(page.sort, fields, "name", Host.id), page)

    def vm_page(
        self,
        page: Page,
        project: str | None = None,
        state: str | None = None,
        host: str | None = None,
        zone: str | None = None,
        name: str | None = None,
        project_id: int | None = None,
    ) -> tuple[list[Vm], int]:
        """VMs filtered, sorted and paged in SQL, and their total. A filter naming an object that does not
        exist matches nothing (an empty page, not a 404); `project_id` scopes a member to its project."""
        conds = [Vm.state == state] if state else []
        if project:
            conds.append(Vm.project_id.in_(select(Project.id).where(Project.name == project)))
        if project_id is not None:
            conds.append(Vm.project_id == project_id)
        if host:
            conds.append(Vm.host_id.in_(select(Host.id).where(Host.name == host)))
        if zone:
            zone_id = select(Zone.id).where(Zone.name == zone)
            hosts_in_zone = (
                select(Host.id).join(Cluster, Cluster.id == Host.cluster_id).where(Cluster.zone_id.in_(zone_id))
            )
            conds.append(Vm.zone_id.in_(zone_id) | (Vm.zone_id.is_(None) & Vm.host_id.in_(hosts_in_zone)))
        if name:
            conds.append(Vm.name.startswith(name, autoescape=True))
        fields = {
            "name": Vm.name,
            "state": Vm.state,
            "vcpus": Vm.vcpus,
            "memory_mib": Vm.memory_mib,
            "created_at": Vm.created_at,
            "project": select(Project.name).where(Project.id == Vm.project_id).scalar_subquery(),
            "host": select(Host.name).where(Host.id == Vm.host_id).scalar_subquery(),
        }
        with self.db.read() as s:
            return run_page(s, select(Vm), Vm.id, conds, order_by(page.sort, fields, "name", Vm.id), page)

    def vm(self, name: str) -> Vm:
        with self.db.read() as s:
            return get_by_name(s, Vm, name, field="vm")

    def vms(self, project: str | None = None) -> list[Vm]:
        with self.db.read() as s:
            stmt = select(Vm).order_by(Vm.name)
            if project:
                stmt = stmt.where(Vm.project_id == get_by_name(s, Project, project, field="project").id)
            return list(s.scalars(stmt).unique())

    def project_usage(self, name: str) -> dict[str, Any]:
        with self.db.read() as s:
            p = get_by_name(s, Project, name, field="project")
            return {
                "project": p.name,
                "count_overhead": p.count_overhead,
                "ledger": ledger_of(p),
                "recomputed": self.catalog.recomputed_usage(s, p),
                "quota": quota_of(p),
            }


def drift_view(conn: Connection, domain_name: Callable[[str], str]) -> list[StoredVm]:
    """Every VM as the audit compares it with the hosts: size, CPU cap, state and host, whether an
    operation or a migration of it is in flight, and where its migration copies between."""
    v, h, o, m = L.VMS.c, L.HOSTS.c, L.OPERATIONS.c, L.MIGRATIONS.c
    rows = conn.execute(
        select(v.id, v.name, v.state, h.name, v.vcpus, v.memory_mib, v.cpu_cap_percent).outerjoin(
            L.HOSTS, h.id == v.host_id
        )
    ).all()
    busy = set(conn.execute(select(o.vm_id).where(o.state.in_(_IN_FLIGHT), o.vm_id.is_not(None))).scalars())
    copying: dict[int, tuple[str, str]] = {}
    for vm_id, state, source, target in conn.execute(
        select(m.vm_id, m.state, m.source, m.target).where(m.state.in_(_ACTIVE_MIGRATION))
    ):
        busy.add(vm_id)
        if state in {s.value for s in COPYING}:
            copying[vm_id] = (source, target)
    return [
        StoredVm(name, domain_name(name), VmState(state), host, vcpus, memory, cap, vm_id in busy, copying.get(vm_id))
        for vm_id, name, state, host, vcpus, memory, cap in rows
    ]
