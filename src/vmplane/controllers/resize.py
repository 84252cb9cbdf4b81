"""Offline resize: `vm scale` on a stopped VM changes its offering or size (as CloudStack does).

The new size is checked against the offering as at create (fixed sizes, custom ranges). Nothing is
charged now: a stopped VM holds only its `vms`; the new size is charged when the VM next starts, whose
admission checks the quota and a host then. The CPU cap of a stopped VM is not stored: it follows its
offering (cpu_cap) when it starts, so `--cpu-cap` is refused for a stopped VM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy.engine import Connection, Row

from vmplane.core.errors import Conflict, Invalid
from vmplane.core.model import OfferingKind, OperationState, Size
from vmplane.core.offerings import size_for
from vmplane.core.quota import first_exceeded, running_charge
from vmplane.store import ledger as L
from vmplane.store.catalog import offering_data

if TYPE_CHECKING:
    from vmplane.plane.context import Plane


def _target(offering, vm: Row, vcpus: int | None, memory_mib: int | None) -> Size:
    data = offering_data(offering)
    if data.kind == OfferingKind.fixed:
        return size_for(data, vcpus, memory_mib)
    return size_for(data, vcpus or vm.vcpus, memory_mib or vm.memory_mib)


def resize_stopped(
    plane: Plane,
    conn: Connection,
    vm: Row,
    offering: str | None,
    vcpus: int | None,
    memory_mib: int | None,
    cpu_cap: bool | None,
    dry_run: bool,
) -> dict:
    """Change a stopped VM's offering and/or size in the caller's transaction (the VM row locked).
    Returns the plan (dry run) or the VM and a finished operation saying what changed."""
    if cpu_cap is not None:
        raise Conflict(
            f"vm {vm.name} is stopped: its CPU cap follows its offering's cpu_cap when it starts; "
            f"resize it with --offering, or start it and then `vmplane vm scale {vm.name} --cpu-cap`",
            field="cpu_cap",
        )
    current = plane.catalog.offering_by_id(vm.offering_id)
    new_offering = plane.catalog.offering(offering) if offering else current
    if offering is None and vcpus is None and memory_mib is None:
        raise Invalid("give an offering, vcpus or memory_mib", field="offering")
    target = _target(new_offering, vm, vcpus, memory_mib)
    before = Size(vm.vcpus, vm.memory_mib)
    if target == before and new_offering.id == current.id:
        raise Conflict(
            f"vm {vm.name} already has {target.vcpus} vCPU(s) / {target.memory_mib} MiB on offering "
            f"{current.name}; nothing to change",
            field=None,
        )
    p = L.lock_project(conn, vm.project_id)
    # what its start will need (overhead is added there once a host is known): said now, checked then
    need = running_charge(target, 0, False)
    short = first_exceeded(L.quota_row(p), L.ledger_row(p), need)
    summary = (
        f"offline resize: {before.vcpus} -> {target.vcpus} vCPU(s), {before.memory_mib} -> "
        f"{target.memory_mib} MiB"
        + (f", offering {current.name} -> {new_offering.name}" if new_offering.id != current.id else "")
        + "; nothing charged now, charged when it next starts"
    )
    note = (
        f"project {p.name} has no room for it now ({short} quota); its start will be refused until there is"
        if short
        else None
    )
    plan = {
        "vm": vm.name,
        "path": "offline resize",
        "migrate_to": None,
        "summary": summary,
        "vcpus": [before.vcpus, target.vcpus],
        "memory_mib": [before.memory_mib, target.memory_mib],
        "offering": [current.name, new_offering.name],
        "cpu_cap_share": None,
        "quota_delta": {"vcpus": 0, "memory_mib": 0},
        "note": note,
    }
    if dry_run:
        return plan
    op_id = L.new_operation(
        conn,
        "scale",
        vm.name,
        vm.id,
        vm.project_id,
        step="done",
        progress=100,
        message=summary,
        result={**plan, "methods": ["offline resize"]},
    )
    L.set_vm(conn, vm.id, vcpus=target.vcpus, memory_mib=target.memory_mib, offering_id=new_offering.id)
    L.set_operation(conn, op_id, state=OperationState.succeeded, message=summary + (f"; {note}" if note else ""))
    return {"vm": vm.name, "operation_id": op_id, **plan}
