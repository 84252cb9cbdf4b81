"""Host maintenance: drain a host by live migration, and enable it again.

A drain is an operation (kind `drain`): the host leaves placement at once, then a migration is admitted
for every running VM (Migrator.migrate, within the limits); VMs that fit nowhere are listed and stay
where they are, never stopped. A restart in the middle admits migrations for the VMs it had not reached
(resume_drain).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from vmplane.core import failpoints
from vmplane.core.errors import Conflict, Invalid, NotFound
from vmplane.core.model import HostState, OperationState, VmState
from vmplane.core.placement import CapacityIndex
from vmplane.plane import metrics
from vmplane.plane.carried import carrying
from vmplane.store import ledger as L

if TYPE_CHECKING:
    from vmplane.controllers.hostadmin import HostAdmin
    from vmplane.controllers.migrator import Migrator
    from vmplane.plane.context import Plane


class Maintenance:
    def __init__(self, plane: Plane, migrator: Migrator, host_admin: HostAdmin):
        self.plane = plane
        self.migrator, self.host_admin = migrator, host_admin

    def enter(self, host: str, dry_run: bool = False) -> dict:
        """Drain a host by live migration: every running VM gets a target from placement (the host is
        out of placement from now on); VMs that fit nowhere are listed and stay where they are. The
        drain is an operation: a restart in the middle admits migrations for the VMs it had not reached."""
        if host not in self.plane.capacity.index:
            raise NotFound(f"host {host!r} does not exist", field="host")
        if self.plane.capacity.host(host).state == HostState.maintenance:
            raise Conflict(f"host {host} is already in maintenance{self._still_running(host)}", field="state")
        if dry_run:
            return self._drain(host, None)
        with self.plane.db.transaction() as conn:
            op_id = L.new_operation(conn, "drain", host, None, None, step="maintenance")
        try:
            with carrying(op_id):  # run in the request's thread, not by Operations.run
                return self._drain(host, op_id)
        except Exception as exc:  # the drain operation must end, whatever happened
            self.plane.ops.fail(op_id, exc)
            raise

    def resume_drain(self, op_id: str) -> None:
        with self.plane.db.read() as s:
            host = L.operation_row(s.connection(), op_id).target
        self._drain(host, op_id)

    def _drain(self, host: str, op_id: str | None) -> dict:
        dry_run = op_id is None
        if op_id is not None:
            self.host_admin.set_host_state(host, HostState.maintenance)
            with self.plane.db.transaction() as conn:
                L.set_operation(conn, op_id, state=OperationState.running, step="admitting migrations", progress=20)
        with self.plane.db.read() as s:
            vms = (
                s.connection()
                .execute(
                    select(L.VMS.c.name, L.VMS.c.state, L.VMS.c.memory_mib)
                    .join(L.HOSTS, L.HOSTS.c.id == L.VMS.c.host_id)
                    .where(L.HOSTS.c.name == host)
                    .order_by(L.VMS.c.memory_mib.desc(), L.VMS.c.name)
                )
                .all()
            )
        planned, unplaceable = [], []
        # a dry run plans on its own copy of the index: the shared one stays exact for real admissions
        # meanwhile (a plan added there, even for a moment, could refuse them for usage nobody claimed)
        index: CapacityIndex | None = None
        if dry_run:
            index = self.plane.capacity.snapshot()
        for name, state, _memory in vms:
            if state != VmState.running.value:
                if state == VmState.migrating.value:
                    planned.append({"vm": name, "note": "already migrating"})
                continue
            try:
                if index is not None:  # a dry run
                    with self.plane.db.read() as s:
                        vm = L.vm_row(s.connection(), name=name)
                    placement = self.migrator.plan(vm, None, index=index)
                    index.add_usage(placement.host, vm.vcpus, placement.memory_mib)  # the next VMs see it
                    planned.append({"vm": name, "target": placement.host, "claim_memory_mib": placement.memory_mib})
                else:
                    mig = self.migrator.migrate(name, reason=f"draining {host} for maintenance")
                    planned.append({"vm": name, "target": mig["target"], "migration": mig["id"], "state": mig["state"]})
                    failpoints.hit("drain.mid")
            except (Conflict, Invalid, NotFound) as exc:
                unplaceable.append({"vm": name, "reason": exc.message})
            except Exception as exc:  # noqa: BLE001 - InsufficientCapacity and the like: reported, not stopped
                unplaceable.append({"vm": name, "reason": getattr(exc, "message", str(exc))})
        result: dict[str, Any] = {
            "host": host,
            "state": "maintenance" if not dry_run else self.plane.capacity.host(host).state.value,
            "dry_run": dry_run,
            "migrations": planned,
            "unplaceable": unplaceable,
        }
        if op_id is not None:
            with self.plane.db.transaction() as conn:
                L.set_operation(
                    conn,
                    op_id,
                    state=OperationState.succeeded,
                    step="done",
                    progress=100,
                    result=result,
                    message=f"{len(planned)} migration(s) admitted, {len(unplaceable)} VM(s) fit nowhere",
                )
            metrics.OPERATIONS.labels("drain", "succeeded").inc()
            result["operation_id"] = op_id
        return result

    def _still_running(self, host: str) -> str:
        """What a second `maintenance enter` could still do: retry the VMs that fit nowhere the first time."""
        with self.plane.db.read() as s:
            left = (
                s.connection()
                .execute(
                    select(L.VMS.c.name)
                    .join(L.HOSTS, L.HOSTS.c.id == L.VMS.c.host_id)
                    .where(L.HOSTS.c.name == host, L.VMS.c.state == VmState.running.value)
                    .order_by(L.VMS.c.name)
                )
                .scalars()
                .all()
            )
        if not left:
            return ""
        return (
            f"; {len(left)} VM(s) still run on it ({', '.join(left[:5])}{', ...' if len(left) > 5 else ''}): "
            f"exit and enter maintenance again to retry draining them"
        )

    def exit(self, host: str) -> dict:
        if host not in self.plane.capacity.index:
            raise NotFound(f"host {host!r} does not exist", field="host")
        if self.plane.capacity.host(host).state == HostState.enabled:
            raise Conflict(f"host {host} is not in maintenance: it is already enabled", field="state")
        self.host_admin.set_host_state(host, HostState.enabled)
        return {"host": host, "state": "enabled"}
