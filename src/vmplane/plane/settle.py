"""Settle one VM's record from what its host says now.

Shared by the loops that listen to the hosts (hostevents: libvirt lifecycle events, hostsync: the
periodic full sync, hostmonitor: a host that answers again); none of them imports another. The rule
is one: the record is read first, then the host is asked afresh, then the record is changed only if
nobody changed it meanwhile (same state, host and `updated_at`, under the VM's row lock):
- a `running` or `unknown` VM whose domain is gone (absent: the driver says so only for "no such
  domain") or shut off on its host is recorded `stopped`; its charge and claims are given back and an
  event is written, all in one transaction. A shut-off definition is removed first, by the one driver
  call that never stops a domain (undefine_if_shut_off: what was read shut off may run again by now).
- a domain that LEFT its host (absent, shut off by a migration, or libvirt's STOPPED/migrated event) may
  run on another host: a lapsed owner's late migration moves it behind vmplane's back (review N7). The
  other hosts of its zone are asked first; if one runs it, or can not be asked (a fenced host is off: it
  runs nothing), the VM is `unknown`, still charged and claimed (it can not be started a second time),
  never stopped: `vmplane vm sync NAME` adopts it where it runs.
- an `unknown` VM whose domain runs is recorded `running` again; one whose domain is gone from its host
  but runs on another host of its zone (start-up reconcile found two candidates), or where another host
  of its zone can not be asked, stays `unknown`: `vm sync` or an operator decides. The host monitor
  settles every `unknown` VM of a host that answers this way every `vmplane.unknown.settle.interval` s.
- an operation that failed and left its VM `running` has it settled at once (after_failed_operation):
  its failure path may put the VM back as it was without asking the host.
- VMs an operation owns (starting, stopping, migrating, scaling: that operation settles them), VMs
  recorded on another host (a migration's incoming domain, a domain left behind) and VMs still being
  recovered after a restart are left alone. A host that does not answer changes nothing.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sqlalchemy import bindparam, select

from vmplane.core.driver import DriverError
from vmplane.core.errors import NotFound
from vmplane.core.model import HostState, OperationState, VmState
from vmplane.store import ledger as L
from vmplane.store.events import acting_as, current_cause

if TYPE_CHECKING:
    from vmplane.plane.context import Plane
from vmplane.core.names import domain_name

log = logging.getLogger("vmplane.settle")

# States an in-flight operation owns: it settles the VM itself, from its own read-back.
OWNED_STATES = frozenset(
    {VmState.starting.value, VmState.stopping.value, VmState.migrating.value, VmState.scaling.value}
)
SETTLED_STATES = frozenset({VmState.running.value, VmState.unknown.value})


def settle_vm(
    plane: Plane, vm_name: str, host: str, cause: str, why: str, op_ended: bool = False, migrated: bool = False
) -> str | None:
    """Settle `vm_name` on `host` (see the module's rule); returns the state written, or None.
    `op_ended`: called by an operation that just ended, which start-up recovery may have resumed (the
    VM counts as still being recovered until every resumed operation was submitted): not skipped then.
    `migrated`: libvirt said the domain migrated away from `host` (STOPPED/migrated)."""
    with plane.db.read() as s:
        try:
            vm = L.vm_row(s.connection(), name=vm_name)
        except NotFound:
            return None
    if vm.state not in SETTLED_STATES or vm.host_name != host or (not op_ended and plane.recovering.busy(vm_name)):
        return None
    driver = plane.drivers.get(host)
    if driver is None:
        return None
    domain = domain_name(vm_name)
    try:
        info = driver.domain(domain)
    except DriverError as exc:
        log.info("settle %s: %s does not answer (%s); left as it is", vm_name, host, exc)
        return None
    runs = info is not None and info.active  # paused still holds the host's memory: it stays running
    if runs and vm.state == VmState.running.value:
        return None
    left = not runs and (info is None or migrated or info.reason == "migrated")
    if not runs and (left or vm.state == VmState.unknown.value) and (elsewhere := _elsewhere(plane, domain, host)):
        if vm.state == VmState.running.value:
            return _unknown(
                plane,
                vm,
                cause,
                f"{why}; its domain left {host}, but {elsewhere}: kept charged and "
                f"claimed; `vmplane vm sync {vm_name}` adopts it where it runs",
            )
        log.info("settle %s: not on %s, but %s; left unknown for an operator (`vm sync`)", vm_name, host, elsewhere)
        return None
    if not runs and info is not None and not _drop_shut_off(driver, domain, vm_name, host):
        return None  # it runs again (started since it was read): nothing to settle
    freed: list = []
    with acting_as(cause), plane.db.transaction() as conn:  # the ledger records the change as an event
        cur = L.vm_row(conn, vm.id, lock=True)
        if (cur.state, cur.host_id, cur.updated_at) != (vm.state, vm.host_id, vm.updated_at):
            return None  # an operation or another loop got there first: it owns the outcome
        if runs:
            new = VmState.running.value
            message = f"{why}; its domain runs on {host}"
            L.set_vm(conn, vm.id, message, state=VmState.running)
        else:
            new = VmState.stopped.value
            message = (
                f"{why}; its domain is {'gone' if info is None else 'shut off'} on {host}: charge and claim given back"
            )
            L.lock_project(conn, cur.project_id)
            freed = L.release_vm(conn, vm.id, note=message)
    plane.capacity.give_back(freed)
    log.warning("vm %s: %s -> %s (%s)", vm_name, vm.state, new, message)
    return new


def _drop_shut_off(driver, domain: str, vm_name: str, host: str) -> bool:
    """Remove a shut-off definition as a stop would, but never stop a domain: it was read shut off before
    the other hosts were asked, and a start may have run it again since (review N8). False: it is active."""
    try:
        return driver.undefine_if_shut_off(domain)
    except DriverError as exc:  # a definition left behind runs nothing: a start replaces it
        log.warning("settle %s: removing its shut-off definition on %s: %s", vm_name, host, exc)
        return True


def _unknown(plane: Plane, vm, cause: str, message: str) -> str | None:
    """A `running` VM whose domain left its host for a host that runs it or can not be asked: `unknown`,
    its charge and claim kept, if nobody changed it meanwhile (the settle rule's optimistic check)."""
    with acting_as(cause), plane.db.transaction() as conn:
        cur = L.vm_row(conn, vm.id, lock=True)
        if (cur.state, cur.host_id, cur.updated_at) != (vm.state, vm.host_id, vm.updated_at):
            return None
        L.set_vm(conn, vm.id, message, state=VmState.unknown)
    log.error("vm %s: %s -> unknown (%s)", vm.name, vm.state, message)
    return VmState.unknown.value


_OP = L.OPERATIONS.c
_OPERATION_END = select(_OP.state, _OP.kind, _OP.vm_id).where(_OP.id == bindparam("id"))  # (built once)


def after_failed_operation(plane: Plane, op_id: str) -> str | None:
    """An operation that ended failed and left its VM `running` on a host (a failure path that puts the
    VM back as it was: a scale whose migration found the domain on neither host, or whose domain could
    not be read back) has it settled from that host at once (settle_vm), not at the next full sync: a
    host brought back while the operation owned the VM skipped it (hostmonitor), and the record must
    not say running where nothing runs. Returns the state written, or None."""
    with plane.db.read() as s:
        conn = s.connection()
        op = conn.execute(_OPERATION_END, {"id": op_id}).first()
        if op is None or op.state != OperationState.failed.value or op.vm_id is None:
            return None
        try:
            vm = L.vm_row(conn, op.vm_id)
        except NotFound:
            return None
    if vm.state != VmState.running.value or vm.host_name is None:
        return None
    return settle_vm(plane, vm.name, vm.host_name, current_cause(), f"after its failed {op.kind}", op_ended=True)


def _elsewhere(plane: Plane, domain: str, host: str) -> str:
    """For a VM whose domain left its host: why it must not be recorded stopped: another host of its zone
    runs it (a migration behind vmplane's back, or start-up reconcile found it there), or can not be asked
    (a fenced host is off: it runs nothing). Empty when no other host has it."""
    zone = plane.capacity.hosts[host].zone if host in plane.capacity.hosts else None
    for other, meta in sorted(plane.capacity.hosts.items()):
        driver = plane.drivers.get(other)
        if other == host or meta.zone != zone or driver is None:
            continue
        try:
            info = driver.domain(domain)
        except DriverError as exc:
            if _fenced(plane, other):
                continue
            return f"{other} can not be asked ({exc})"
        if info is not None and info.active:
            return f"it runs on {other}"
    return ""


def _fenced(plane: Plane, host: str) -> bool:
    """Whether `host` is recorded fenced: confirmed off (fence agent or operator), so it runs nothing."""
    return host in plane.capacity.index and plane.capacity.index.host(host).state == HostState.fenced
