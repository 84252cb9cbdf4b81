"""Start-up reconcile: every VM the record has `running` against what the hosts of its zone run.

Run once by start-up recovery (recovery.Recovery, before migrations are settled), with the cause
`recovery`. The record changes only by what hosts answered (docs/design/crash-safety.md and
docs/design/truth.md):
- its domain runs on its own host (running or paused: its QEMU holds memory): nothing changes;
- its own host, or any other host of its zone, can not be asked: nothing changes (unknown is not absent;
  the loops that listen to the hosts settle it later);
- an active migration covers it: left to the migration's own recovery (Migrator.recover);
- no host of its zone runs it: recorded `stopped`, charge and claims given back;
- exactly one other host runs it (a migration whose client connection was lost completed behind the
  control plane's back): that host is adopted, the running claim moving there, when the host has room
  for it; when it has none, the VM is set `unknown` with a note naming both hosts and its claim stays
  (`vmplane vm sync NAME` adopts it there whatever the room, once an operator decides);
- several other hosts run it: `unknown`, naming them (an operator decides which copy is the VM).
Each change is one transaction, made only if the VM's row did not change meanwhile, with its event and
a `reconcile` operation saying what was found.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sqlalchemy import select, update

from vmplane.core.driver import DriverError
from vmplane.core.migration import ACTIVE
from vmplane.core.model import ClaimKind, OperationState, VmState
from vmplane.core.names import domain_name
from vmplane.store import ledger as L

if TYPE_CHECKING:
    from vmplane.plane.context import Plane

log = logging.getLogger("vmplane.reconcile")

_ACTIVE_MIGRATION = [st.value for st in ACTIVE]


class _Hosts:
    """What each host runs, asked once per reconcile; None for a host that can not be asked."""

    def __init__(self, plane: Plane):
        self.plane = plane
        self._seen: dict[str, set[str] | None] = {}

    def running(self, host: str) -> set[str] | None:
        if host not in self._seen:
            driver = self.plane.drivers.get(host)
            try:
                if driver is None:
                    raise DriverError(host, "no driver")
                self._seen[host] = {d.name for d in driver.domains() if d.active}  # paused holds memory too
            except DriverError as exc:
                log.warning(
                    "reconcile: host %s can not be asked (%s); VMs that depend on it are left as they are", host, exc
                )
                self._seen[host] = None
        return self._seen[host]


def reconcile(plane: Plane) -> list[str]:
    """Compare every `running` VM with the hosts of its zone (see the module); returns findings in words."""
    v, h, m = L.VMS.c, L.HOSTS.c, L.MIGRATIONS.c
    with plane.db.read() as s:
        conn = s.connection()
        rows = conn.execute(
            select(v.id, v.name, h.name, v.updated_at)
            .join(L.HOSTS, h.id == v.host_id)
            .where(v.state == VmState.running.value)
            .order_by(v.name)
        ).all()
        migrating = set(conn.execute(select(m.vm_id).where(m.state.in_(_ACTIVE_MIGRATION))).scalars())
    hosts = _Hosts(plane)
    findings = []
    for vm_id, name, host, updated in rows:
        own = hosts.running(host)
        domain = domain_name(name)
        if own is None or domain in own:
            continue
        zone = plane.capacity.hosts[host].zone if host in plane.capacity.hosts else None
        others = sorted(n for n, meta in plane.capacity.hosts.items() if n != host and meta.zone == zone)
        silent = [n for n in others if hosts.running(n) is None]
        if silent:
            findings.append(f"{name}: not running on {host}; {', '.join(silent)} can not be asked: left as it is")
            log.warning(
                "reconcile: vm %s is not running on %s, and %s can not be asked; left as it is",
                name,
                host,
                ", ".join(silent),
            )
            continue
        if vm_id in migrating:
            findings.append(f"{name}: not running on {host}; its active migration settles it")
            continue
        elsewhere = [n for n in others if domain in (hosts.running(n) or ())]
        if not elsewhere:
            words = _record_stopped(plane, vm_id, name, host, updated)
        elif len(elsewhere) == 1:
            words = _adopt(plane, vm_id, name, host, elsewhere[0], updated)
        else:
            words = _unknown(
                plane,
                vm_id,
                name,
                updated,
                f"recorded on {host}, but its domain runs on {' and '.join(elsewhere)}; vmplane can "
                f"not tell which copy is the VM: stop the other one(s), then `vmplane vm sync {name}`",
            )
        if words:
            findings.append(f"{name}: {words}")
    return findings


def _locked_if_unchanged(conn, vm_id: int, updated):
    vm = L.vm_row(conn, vm_id, lock=True)
    if vm.state != VmState.running.value or vm.updated_at != updated:
        return None  # an operation or a loop changed it meanwhile: it owns the outcome
    return vm


def _operation(conn, vm, state: OperationState, message: str) -> None:
    op_id = L.new_operation(conn, "reconcile", vm.name, vm.id, vm.project_id, step="done", progress=100)
    L.set_operation(conn, op_id, state=state, message=message)


def _record_stopped(plane: Plane, vm_id: int, name: str, host: str, updated) -> str | None:
    with plane.db.transaction() as conn:
        vm = _locked_if_unchanged(conn, vm_id, updated)
        if vm is None:
            return None
        L.lock_project(conn, vm.project_id)
        freed = L.release_vm(conn, vm_id, note=f"not running on {host} at start-up, nor on any other host of its zone")
        _operation(
            conn,
            vm,
            OperationState.failed,
            f"vm {name} was not running on {host} at start-up (nor on any other host of its zone); recorded as stopped",
        )
    plane.capacity.give_back(freed)
    log.warning("reconcile: vm %s was not running on %s nor elsewhere; recorded as stopped", name, host)
    return f"not running on {host}; recorded stopped"


def _adopt(plane: Plane, vm_id: int, name: str, host: str, there: str, updated) -> str | None:
    """Move the VM's running claim from `host` to `there`, where its domain runs, if `there` has room."""
    c, hc = L.CLAIMS.c, L.HOSTS.c
    with plane.capacity.lock:
        with plane.db.transaction() as conn:
            vm = _locked_if_unchanged(conn, vm_id, updated)
            if vm is None:
                return None
            vcpus, memory = conn.execute(
                select(c.vcpus, c.memory_mib).where(c.vm_id == vm_id, c.kind == ClaimKind.running.value)
            ).first() or (vm.vcpus, vm.memory_mib)
            cap_vcpus, cap_memory = plane.capacity.index.capacity_of(there)
            target = plane.capacity.hosts[there].id
            # room as placement counts it (whatever the host's state: the VM already runs there)
            taken = conn.execute(
                update(L.HOSTS)
                .where(hc.id == target, hc.used_vcpus + vcpus <= cap_vcpus, hc.used_memory_mib + memory <= cap_memory)
                .values(used_vcpus=hc.used_vcpus + vcpus, used_memory_mib=hc.used_memory_mib + memory)
            ).rowcount
            if not taken:
                freed: list = []
                note = (
                    f"recorded on {host}, but its domain runs on {there} (a migration completed behind "
                    f"vmplane's back), which has no room for its claim ({vcpus} vCPU(s) / {memory} MiB); the "
                    f"claim stays on {host}: `vmplane vm sync {name}` adopts it on {there}"
                )
                L.set_vm(conn, vm_id, note=f"reconcile: {note}", state=VmState.unknown)
                _operation(conn, vm, OperationState.failed, f"vm {name} {note}")
            else:
                freed = L.release_claim(conn, vm_id, None, ClaimKind.running)
                L.record_claim(conn, target, vm_id, None, ClaimKind.running, vcpus, memory)
                note = (
                    f"reconcile: not running on {host} at start-up but on {there} (a migration completed behind "
                    f"vmplane's back): adopted there, its claim moved"
                )
                L.set_vm(conn, vm_id, note=note, host_id=target)
                if vm.cluster_id is not None:  # a VM pinned to a cluster follows, as after a migration
                    conn.execute(
                        update(L.VMS)
                        .where(L.VMS.c.id == vm_id)
                        .values(cluster_id=plane.capacity.hosts[there].cluster_id)
                    )
                _operation(conn, vm, OperationState.succeeded, f"vm {name} {note.removeprefix('reconcile: ')}")
        if taken:
            for freed_host, fv, fm in freed:
                if freed_host in plane.capacity.index:
                    plane.capacity.add(freed_host, -fv, -fm)
            if there in plane.capacity.index:
                plane.capacity.add(there, vcpus, memory)
    log.warning(
        "reconcile: vm %s runs on %s, recorded on %s: %s",
        name,
        there,
        host,
        "adopted" if taken else "unknown (no room there)",
    )
    return (
        f"runs on {there}, not {host}; adopted there"
        if taken
        else f"runs on {there}, not {host}, which has no room; set unknown"
    )


def _unknown(plane: Plane, vm_id: int, name: str, updated, note: str) -> str | None:
    with plane.db.transaction() as conn:
        vm = _locked_if_unchanged(conn, vm_id, updated)
        if vm is None:
            return None
        L.set_vm(conn, vm_id, note=f"reconcile: {note}", state=VmState.unknown)
        _operation(conn, vm, OperationState.failed, f"vm {name} {note}")
    log.error("reconcile: vm %s %s", name, note)
    return note
