"""The host monitor: is each host's hypervisor answering? (review finding 4)

Every `vmplane.host.check.interval` seconds every host is asked for its domains, all hosts at once
(a hung libvirtd delays no other host's verdict). A host that does not answer is marked `down`: the
state it had (enabled, maintenance, disabled) is kept in `hosts.state_before_down`, placement skips
it, and each of its `running` VMs becomes `unknown` (charge and claim kept: it may well still run;
never started elsewhere). VMs an operation owns are left to it; if that operation's failure path puts
one back to `running` while the host is down, the next pass makes it `unknown` too. When the host
answers again it gets its previous state back, and EVERY VM recorded on it is settled from what it
runs (settle.settle_vm): running again, or stopped with charge and claim given back. A VM an operation
owns at that moment is skipped; its operation settles it when it ends: a migration that finds the domain
on neither host records it stopped (migrator), and an operation that fails leaving it `running` has it
settled from its host at once (settle.after_failed_operation), not only by the next full sync.

A VM can also become `unknown` while its host keeps answering (a start or stop whose host could not say
whether the domain exists, an HA restart whose read-back failed, start-up reconcile): no transition of the
host's state settles it. So every `vmplane.unknown.settle.interval` seconds a pass settles every `unknown`
VM of a host that answered this check (settle_vm, as when a host is back). One an operation or migration
in flight owns is left to it; one start-up recovery is busy with is settled by the first pass after
recovery ended (review N3). Until then `vmplane audit` names it.

High availability (ha.py) takes over a host that stays down longer than `vmplane.ha.grace`: it is
`fencing`, then `fenced`. This monitor leaves a `fencing` host to it (whether it answers again decides
there), and brings a `fenced` host back like a down one once it answers (an operator repaired it),
but not while HA's recovery of it is still in flight: its VMs are that operation's until it ends.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, cast

from sqlalchemy import select

from vmplane.core.driver import Driver, DriverError
from vmplane.core.migration import ACTIVE as ACTIVE_MIGRATION
from vmplane.core.model import IN_FLIGHT_OPERATION_VALUES as IN_FLIGHT
from vmplane.core.model import UNREACHABLE_HOST_STATES, HostState, VmState
from vmplane.plane.loops import every
from vmplane.plane.settle import settle_vm
from vmplane.store import ledger as L
from vmplane.store.events import acting_as
from vmplane.store.schema import utcnow

if TYPE_CHECKING:
    from vmplane.plane.context import Plane

log = logging.getLogger("vmplane.hostmonitor")
CAUSE = "monitor"
PROBE_THREADS = 8
PROBE_DEADLINE_S = 30.0  # libvirt's keepalive (5 s x 3) ends a call to a silent daemon well before


def probe(driver) -> DriverError | None:
    """Whether a host's hypervisor answers: None, or the error it gave (also the HA recovery's check)."""
    try:
        driver.domains()
        return None
    except DriverError as exc:
        return exc


class HostMonitor:
    def __init__(self, plane: Plane):
        self.plane = plane
        self._stop = threading.Event()
        self._probing: dict[str, Future] = {}  # each host's last probe (one still running is not asked again)
        self._unknown_due = 0.0  # when unknown VMs are settled next (time.monotonic())

    def start(self) -> None:
        """Check the hosts every `vmplane.host.check.interval` seconds until stop()."""

        every(
            lambda: float(cast(float, self.plane.catalog.effective("vmplane.host.check.interval"))),
            self.check,
            self._stop,
            "host-monitor",
            log,
            owner=lambda: self.plane.membership.epoch,
        )

    def stop(self) -> None:
        self._stop.set()

    # -- one pass ------------------------------------------------------------------------------
    def check(self) -> list[str]:
        """One pass over every host; returns what changed, in words."""
        hosts = [
            (name, d)
            for name, d in list(self.plane.drivers.items())
            if name in self.plane.capacity.index and self.plane.membership.owns_host(name)
        ]  # the hosts this process listens to
        if not hosts:
            return []
        answers = self._probe(hosts)
        changes = []
        with acting_as(CAUSE):
            for (name, _), error in zip(hosts, answers):
                if name not in self.plane.capacity.index:
                    continue  # removed meanwhile
                state = self.plane.capacity.index.host(name).state
                down = state in UNREACHABLE_HOST_STATES
                if error is not None:
                    changes += self._mark_down(name, error) if not down else self._keep_unknown(name)
                elif state == HostState.down or (state == HostState.fenced and not self._recovering(name)):
                    changes += self._bring_back(name)
        changes += self._settle_unknown_when_due([name for (name, _), error in zip(hosts, answers) if error is None])
        return changes

    def _probe(self, hosts: list[tuple[str, Driver]]) -> list[DriverError | None]:
        """Each host's answer, in parallel. A probe not answered within PROBE_DEADLINE_S is "does not answer",
        whatever libvirt's keepalive does (a call it never ends would hold every later verdict); it is
        left running, and its host counts as not answering until it ends."""
        asked = {name for name, _ in hosts}
        for name in [n for n, f in list(self._probing.items()) if n not in asked and f.done()]:
            self._probing.pop(name, None)  # a host removed or handed to another process
        pool = ThreadPoolExecutor(min(PROBE_THREADS, len(hosts)), thread_name_prefix="vmplane-probe")
        try:
            for name, driver in hosts:
                if name not in self._probing or self._probing[name].done():
                    self._probing[name] = pool.submit(probe, driver)
            futures = [self._probing[name] for name, _ in hosts]
            wait(futures, timeout=PROBE_DEADLINE_S)
        finally:
            pool.shutdown(wait=False)
        return [
            f.result() if f.done() else DriverError(name, f"no answer within {PROBE_DEADLINE_S:g} s")
            for (name, _), f in zip(hosts, futures)
        ]

    def _recovering(self, host: str) -> bool:
        """Whether HA's recovery of this fenced host is still in flight: its VMs are that operation's until
        it ends (a restart of the control plane may have started the host's daemon again meanwhile)."""
        op = L.OPERATIONS.c
        with self.plane.db.read() as s:
            return (
                s.connection()
                .execute(select(op.id).where(op.kind == "recover", op.target == host, op.state.in_(IN_FLIGHT)).limit(1))
                .first()
                is not None
            )

    # -- down --------------------------------------------------------------------------------
    def _mark_down(self, name: str, error: DriverError) -> list[str]:
        h = L.HOSTS.c
        with self.plane.capacity.lock:
            with self.plane.db.transaction() as conn:
                row = conn.execute(select(h.id, h.state).where(h.name == name).with_for_update()).first()
                if row is None or row.state == HostState.down.value:
                    return []
                reason = f"its hypervisor does not answer: {error}"
                L.set_host_state(
                    conn,
                    name,
                    HostState.down,
                    reason,
                    state_before_down=row.state,
                    state_reason=reason,
                    down_since=utcnow(),
                )
                moved = self._running_to_unknown(conn, row.id, name)
            self.plane.capacity.set_state(name, HostState.down)
        log.error("host %s is down (%s); %d VM(s) unknown; it was %s", name, error, moved, row.state)
        return [f"{name} is down ({error}); {moved} VM(s) unknown"]

    def _keep_unknown(self, name: str) -> list[str]:
        """While a host is down, a VM put back to `running` (an operation's failure path) is unknown."""
        with self.plane.db.transaction() as conn:
            host_id = conn.execute(select(L.HOSTS.c.id).where(L.HOSTS.c.name == name)).scalar()
            moved = self._running_to_unknown(conn, host_id, name) if host_id is not None else 0
        return [f"{name} is still down; {moved} more VM(s) unknown"] if moved else []

    @staticmethod
    def _running_to_unknown(conn, host_id: int, host: str) -> int:
        v = L.VMS.c
        ids = (
            conn.execute(select(v.id).where(v.host_id == host_id, v.state == VmState.running.value).with_for_update())
            .scalars()
            .all()
        )
        for vm_id in ids:  # each change is an event (the ledger records it)
            L.set_vm(
                conn,
                vm_id,
                f"its host {host} does not answer; still charged, never started elsewhere",
                state=VmState.unknown,
            )
        return len(ids)

    # -- back ----------------------------------------------------------------------------------
    def _bring_back(self, name: str) -> list[str]:
        h, v = L.HOSTS.c, L.VMS.c
        with self.plane.capacity.lock:
            with self.plane.db.transaction() as conn:
                row = conn.execute(
                    select(h.id, h.state, h.state_before_down).where(h.name == name).with_for_update()
                ).first()
                if row is None or row.state not in (HostState.down.value, HostState.fenced.value):
                    return []
                restored = row.state_before_down or HostState.enabled.value
                L.set_host_state(
                    conn,
                    name,
                    restored,
                    f"its hypervisor answers again; its state before it went {row.state} is restored",
                    state_before_down=None,
                    state_reason=None,
                    down_since=None,
                )
            self.plane.capacity.set_state(name, HostState(restored))
        with self.plane.db.read() as s:
            names = (
                s.connection()
                .execute(
                    select(v.name).where(
                        v.host_id == row.id, v.state.in_([VmState.running.value, VmState.unknown.value])
                    )
                )
                .scalars()
                .all()
            )
        outcome: dict[str | None, int] = {}
        for vm_name in names:  # every VM recorded on it, not only the unknown ones
            new = settle_vm(self.plane, vm_name, name, CAUSE, f"host {name} is back")
            outcome[new] = outcome.get(new, 0) + 1
        found, gone = outcome.get(VmState.running.value, 0), outcome.get(VmState.stopped.value, 0)
        log.warning("host %s is back (%s): %d VM(s) found running again, %d gone", name, restored, found, gone)
        return [f"{name} is back ({restored}); {found} VM(s) found running, {gone} gone"]

    # -- unknown VMs of hosts that answer (review N3) --------------------------------------------------
    def _settle_unknown_when_due(self, answered: list[str]) -> list[str]:
        now = time.monotonic()
        if now < self._unknown_due:
            return []
        self._unknown_due = now + float(cast(float, self.plane.catalog.effective("vmplane.unknown.settle.interval")))
        return self.settle_unknown(answered)

    def settle_unknown(self, answered: list[str]) -> list[str]:
        """Every `unknown` VM recorded on a host of `answered` (hosts that answered just now) that is neither
        down nor fenced, settled from what the hosts run (settle_vm): running, stopped, or left unknown when
        another host of its zone runs it or can not be asked. VMs an operation or a migration in flight owns
        are left to it. Returns what changed, in words."""
        hosts = [
            h
            for h in answered
            if h in self.plane.capacity.index and self.plane.capacity.index.host(h).state not in UNREACHABLE_HOST_STATES
        ]
        if not hosts:
            return []
        v, h, op, m = L.VMS.c, L.HOSTS.c, L.OPERATIONS.c, L.MIGRATIONS.c
        owned = select(op.vm_id).where(op.state.in_(IN_FLIGHT), op.vm_id.is_not(None))
        migrating = select(m.vm_id).where(m.state.in_([st.value for st in ACTIVE_MIGRATION]))
        with self.plane.db.read() as s:
            rows = (
                s.connection()
                .execute(
                    select(v.name, h.name)
                    .join(L.HOSTS, h.id == v.host_id)
                    .where(
                        v.state == VmState.unknown.value, h.name.in_(hosts), v.id.not_in(owned), v.id.not_in(migrating)
                    )
                    .order_by(v.name)
                )
                .all()
            )
        changes = []
        for vm_name, host in rows:
            new = settle_vm(self.plane, vm_name, host, CAUSE, f"unknown while its host {host} answers")
            if new is not None and new != VmState.unknown.value:
                changes.append(f"{vm_name}: unknown on {host}, which answers; settled {new}")
        return changes
