"""The console's reads that the API has no list for: counts and overhead sums, each one SQL aggregate
(never a Python loop over every VM: the console stays fast at 10,000 VMs)."""

from __future__ import annotations

from sqlalchemy import func, select

from vmplane.core.migration import ACTIVE as MIGRATION_ACTIVE
from vmplane.core.model import VmState
from vmplane.store.schema import Backup, Claim, Host, Migration, Operation, Project, Vm

ACTIVE_MIGRATIONS = [s.value for s in MIGRATION_ACTIVE]
IN_FLIGHT_OPERATIONS = ("pending", "running")


def vm_counts(db, project_id: int | None) -> dict[str, int]:
    """VMs by state (a member: its project's)."""
    stmt = select(Vm.state, func.count()).group_by(Vm.state)
    if project_id is not None:
        stmt = stmt.where(Vm.project_id == project_id)
    with db.read() as s:
        return {state: n for state, n in s.execute(stmt)}  # noqa: C416 - rows of two columns, not pairs to mypy


def host_counts(db) -> dict[str, int]:
    """Hosts by state: one GROUP BY (not a copy of every host in the placement index)."""
    with db.read() as s:
        return {state: n for state, n in s.execute(select(Host.state, func.count()).group_by(Host.state))}  # noqa: C416


def project_page(db, project_id: int | None, limit: int, offset: int) -> tuple[list[Project], int]:
    """One page of projects by name and their total (a member: its own project only)."""
    stmt, count = select(Project), select(func.count()).select_from(Project)
    if project_id is not None:
        stmt, count = stmt.where(Project.id == project_id), count.where(Project.id == project_id)
    with db.read() as s:
        total = s.execute(count).scalar_one()
        return list(s.scalars(stmt.order_by(Project.name, Project.id).limit(limit).offset(offset))), total


def overhead_by_host(db, host_names: list[str]) -> dict[str, int]:
    """The memory overhead part of what is claimed on each of `host_names` (the VMs placed there)."""
    if not host_names:
        return {}
    stmt = (
        select(Host.name, func.coalesce(func.sum(Vm.overhead_mib), 0))
        .join(Vm, Vm.host_id == Host.id)
        .where(Host.name.in_(host_names), Vm.state != VmState.stopped.value)
        .group_by(Host.name)
    )
    with db.read() as s:
        return {name: int(total) for name, total in s.execute(stmt)}


def overhead_by_project(db, project_ids: list[int]) -> dict[int, int]:
    """The overhead part of each project's charged memory (counted only where the project counts it)."""
    if not project_ids:
        return {}
    stmt = (
        select(Vm.project_id, func.coalesce(func.sum(Vm.overhead_mib), 0))
        .join(Project, Project.id == Vm.project_id)
        .where(Vm.project_id.in_(project_ids), Vm.charged_memory_mib > 0, Project.count_overhead.is_(True))
        .group_by(Vm.project_id)
    )
    with db.read() as s:
        return {pid: int(total) for pid, total in s.execute(stmt)}


def in_flight(db, project_id: int | None, limit: int = 20) -> tuple[list[dict], list[dict], list[dict]]:
    """What runs now: active migrations (with progress), pending or running operations, and backups being
    written (with progress), newest first."""
    m = (
        select(
            Migration.id,
            Migration.vm_name,
            Migration.source,
            Migration.target,
            Migration.state,
            Migration.progress,
            Migration.waiting_for,
            Migration.reason,
            Migration.created_at,
        )
        .where(Migration.state.in_(ACTIVE_MIGRATIONS))
        .order_by(Migration.created_at.desc())
        .limit(limit)
    )
    o = (
        select(
            Operation.id,
            Operation.kind,
            Operation.target,
            Operation.state,
            Operation.step,
            Operation.progress,
            Operation.message,
            Operation.created_at,
        )
        .where(Operation.state.in_(IN_FLIGHT_OPERATIONS))
        .order_by(Operation.created_at.desc())
        .limit(limit)
    )
    b = (
        select(Backup.id, Backup.vm_name, Backup.kind, Backup.progress, Backup.created_at)
        .where(Backup.state == "running")
        .order_by(Backup.created_at.desc())
        .limit(limit)
    )
    if project_id is not None:
        m, o = m.where(Migration.project_id == project_id), o.where(Operation.project_id == project_id)
        b = b.where(Backup.project_id == project_id)
    with db.read() as s:
        conn = s.connection()
        return tuple([dict(r._mapping) for r in conn.execute(q)] for q in (m, o, b))  # type: ignore[return-value]


def vm_operations(db, vm_id: int, limit: int = 10) -> list[dict]:
    stmt = (
        select(
            Operation.id,
            Operation.kind,
            Operation.state,
            Operation.step,
            Operation.progress,
            Operation.message,
            Operation.created_at,
            Operation.updated_at,
        )
        .where(Operation.vm_id == vm_id)
        .order_by(Operation.created_at.desc())
        .limit(limit)
    )
    with db.read() as s:
        return [dict(r._mapping) for r in s.connection().execute(stmt)]


def vm_names_on_host(db, host_id: int, limit: int) -> tuple[list[dict], int]:
    stmt = select(Vm.name, Vm.state, Vm.vcpus, Vm.memory_mib, Vm.overhead_mib).where(Vm.host_id == host_id)
    with db.read() as s:
        total = s.execute(select(func.count()).select_from(Vm).where(Vm.host_id == host_id)).scalar_one()
        rows = [dict(r._mapping) for r in s.connection().execute(stmt.order_by(Vm.name).limit(limit))]
    return rows, total


def claims_on_host(db, host_id: int, limit: int) -> tuple[list[dict], int]:
    """What is claimed on a host (a running VM's claim, a migration's target, a scale's growth), by VM."""
    stmt = (
        select(Claim.kind, Claim.vcpus, Claim.memory_mib, Vm.name.label("vm"))
        .join(Vm, Vm.id == Claim.vm_id)
        .where(Claim.host_id == host_id)
    )
    with db.read() as s:
        total = s.execute(select(func.count()).select_from(Claim).where(Claim.host_id == host_id)).scalar_one()
        rows = [dict(r._mapping) for r in s.connection().execute(stmt.order_by(Vm.name, Claim.kind).limit(limit))]
    return rows, total
