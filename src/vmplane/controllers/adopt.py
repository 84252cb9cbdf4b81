"""`vm sync`: adopt what the hosts really run for one VM into the record, and the stored-VM view the
audit compares with the hosts.

The hosts are asked first (no lock held); then one transaction re-checks that nothing changed the VM
meanwhile and writes the VM's size, CPU cap, state and host, its charge on the ledger and its claim
on the host together, with an event. A VM that grew beyond its project's quota is adopted anyway
(it runs: stopping it is the owner's call) and the overrun is said in the result and the event.
Refused while an operation or a migration owns the VM: it will settle the VM itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy import select, update
from sqlalchemy.engine import Connection

from vmplane.core.drift import MOVING_STATES, cap_words, host_size, is_active
from vmplane.core.driver import DomainInfo, DriverError
from vmplane.core.errors import Conflict
from vmplane.core.migration import ACTIVE
from vmplane.core.model import IN_FLIGHT_OPERATION_STATES, ClaimKind, Size, Usage, VmState
from vmplane.core.names import domain_name
from vmplane.core.quota import overhead_mib, running_charge
from vmplane.store import events
from vmplane.store import ledger as L

if TYPE_CHECKING:
    from vmplane.plane.context import Plane

_IN_FLIGHT = [st.value for st in IN_FLIGHT_OPERATION_STATES]
_ACTIVE_MIGRATION = [st.value for st in ACTIVE]


def _owner(conn: Connection, vm) -> str | None:
    """What owns the VM now (an operation or a migration in flight), in words; None: nothing."""
    o, m = L.OPERATIONS.c, L.MIGRATIONS.c
    op = conn.execute(select(o.id, o.kind).where(o.vm_id == vm.id, o.state.in_(_IN_FLIGHT)).limit(1)).first()
    if op is not None:
        return f"operation {op.id} ({op.kind})"
    mig = conn.execute(select(m.id).where(m.vm_id == vm.id, m.state.in_(_ACTIVE_MIGRATION)).limit(1)).first()
    if mig is not None:
        return f"migration {mig.id}"
    if VmState(vm.state) in MOVING_STATES:
        return f"its {vm.state} state"
    return None


def _where_it_runs(plane: Plane, vm) -> tuple[str, DomainInfo] | None:
    """The one host whose domain of this VM is active, or None when every host says it has none."""
    domain = domain_name(vm.name)
    found, silent = [], []
    for host, driver in sorted(plane.drivers.items()):
        try:
            info = driver.domain(domain)
        except DriverError as exc:
            silent.append((host, str(exc)))
            continue
        if info is not None and is_active(info):
            found.append((host, info))
    if len(found) > 1:
        raise Conflict(
            f"vm {vm.name} runs on {' and '.join(h for h, _ in found)}; vmplane can not tell which copy "
            f"is the VM: stop the other one on its host, then sync again",
            field="vm",
        )
    own_silent = [why for host, why in silent if host == vm.host_name]
    if own_silent or (silent and not found):
        raise Conflict(
            f"vm {vm.name}: {'; '.join(own_silent or [why for _, why in silent])}; where it runs can "
            f"not be known now, nothing changed",
            field="host",
        )
    return found[0] if found else None


def _over_quota(p, ledger: Usage) -> str | None:
    parts = []
    if ledger.vcpus > p.quota_vcpus:
        n = ledger.vcpus - p.quota_vcpus
        parts.append(f"{n} vCPU{'s' if n != 1 else ''}")
    if ledger.memory_mib > p.quota_memory_mib:
        parts.append(f"{ledger.memory_mib - p.quota_memory_mib} MiB")
    return f"over quota by {' and '.join(parts)}" if parts else None


def sync_vm(plane: Plane, name: str) -> dict:
    """Read what the hosts run for vm `name` and adopt it: size (vCPUs the guest may use, memory), CPU
    cap, state (no domain anywhere: stopped; running elsewhere: that host), the charge and the host
    claim following in the same transaction. Returns the changes (field: record -> host)."""
    with plane.db.read() as s:
        conn = s.connection()
        vm = L.vm_row(conn, name=name)
        owner = _owner(conn, vm)
    if owner:
        raise Conflict(f"vm {name} is owned by {owner}; sync it once that ends", field="state")
    found = _where_it_runs(plane, vm)
    freed: list[tuple[str, int, int]] = []
    taken: tuple[str, int, int] | None = None
    over = None
    with plane.capacity.lock:
        with plane.db.transaction() as conn:
            now = L.vm_row(conn, vm.id, lock=True)
            if (now.state, now.host_id, now.updated_at) != (vm.state, vm.host_id, vm.updated_at) or _owner(conn, now):
                raise Conflict(f"vm {name} changed while its hosts were asked; sync it again", field="state")
            p = L.lock_project(conn, vm.project_id)
            changes = []
            if found is None:
                if vm.state != VmState.stopped.value:
                    changes.append({"field": "state", "record": vm.state, "host": "stopped (no host runs it)"})
                    freed = L.release_vm(conn, vm.id, note="sync: no host runs it")
            else:
                host, info = found
                size = host_size(info)
                if vm.host_name != host:
                    changes.append({"field": "host", "record": vm.host_name or "-", "host": host})
                if vm.state != VmState.running.value:
                    changes.append({"field": "state", "record": vm.state, "host": "running"})
                for field, before, after in (
                    ("vcpus", vm.vcpus, size.vcpus),
                    ("memory_mib", vm.memory_mib, size.memory_mib),
                ):
                    if before != after:
                        changes.append({"field": field, "record": str(before), "host": str(after)})
                before_cap = round(vm.cpu_cap_percent / 100, 2) if vm.cpu_cap_percent else None
                after_cap = round(size.cpu_cap_percent / 100, 2) if size.cpu_cap_percent else None
                if before_cap != after_cap:
                    changes.append({"field": "cpu_cap", "record": cap_words(before_cap), "host": cap_words(after_cap)})
                if changes:
                    freed, taken, over = _adopt(plane, conn, vm, p, host, size, changes)
            message = "; ".join(f"{c['field']}: {c['record']} -> {c['host']}" for c in changes) or "in sync"
            if over:
                message += f"; {over}"
            if changes and (found is not None and not any(c["field"] in ("state", "host") for c in changes)):
                # a state or host change is recorded by set_vm; a change of size alone is recorded here
                events.record(
                    conn,
                    "vm",
                    name,
                    old_state=vm.state,
                    new_state=vm.state,
                    message=f"sync: {message}",
                    vm=name,
                    host=vm.host_name,
                    project_id=vm.project_id,
                )
        for host, vcpus, memory in freed:
            if host in plane.capacity.index:
                plane.capacity.add(host, -vcpus, -memory)
        if taken is not None and taken[0] in plane.capacity.index:
            plane.capacity.add(*taken)
    return {
        "vm": name,
        "in_sync": not changes,
        "changes": changes,
        "over_quota": over,
        "message": message,
        "host": found[0] if found else None,
    }


def _adopt(plane: Plane, conn: Connection, vm, p, host: str, size, changes: list[dict]):
    """Write the VM as it runs on `host` at `size`: its claim there (whatever the host's free room: it runs),
    its charge on the ledger (whatever the quota), its row. Returns (freed, taken, over-quota words)."""
    new = Size(size.vcpus, size.memory_mib)
    ratio = plane.capacity.index.host(host).overhead_ratio if host in plane.capacity.index else 1.0
    overhead = overhead_mib(new, ratio)
    footprint = new.memory_mib + overhead
    host_id = plane.capacity.hosts[host].id
    freed = L.release_claim(conn, vm.id, None)
    conn.execute(
        update(L.HOSTS)
        .where(L.HOSTS.c.id == host_id)
        .values(used_vcpus=L.HOSTS.c.used_vcpus + new.vcpus, used_memory_mib=L.HOSTS.c.used_memory_mib + footprint)
    )
    L.record_claim(conn, host_id, vm.id, None, ClaimKind.running, new.vcpus, footprint)
    charge = running_charge(new, overhead, p.count_overhead)
    delta = Usage(charge.vcpus - vm.charged_vcpus, charge.memory_mib - vm.charged_memory_mib, 0)
    L.add_to_ledger(conn, p.id, delta)
    over = _over_quota(p, L.ledger_row(p) + delta)
    note = "sync: " + "; ".join(f"{c['field']}: {c['record']} -> {c['host']}" for c in changes)
    L.set_vm(
        conn,
        vm.id,
        note=note + (f"; {over}" if over else ""),
        state=VmState.running,
        host_id=host_id,
        vcpus=new.vcpus,
        memory_mib=new.memory_mib,
        overhead_mib=overhead,
        charged_vcpus=charge.vcpus,
        charged_memory_mib=charge.memory_mib,
        cpu_cap_percent=size.cpu_cap_percent,
        max_vcpus=max(vm.max_vcpus or vm.vcpus, new.vcpus),
        max_memory_mib=max(vm.max_memory_mib or vm.memory_mib, new.memory_mib),
    )
    return freed, (host, new.vcpus, footprint), over
