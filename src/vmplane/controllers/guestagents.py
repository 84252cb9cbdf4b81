"""The guest agent controller (issue 30): asks each running VM's QEMU guest agent, on the hosts this
process owns, whether it answers and which addresses the guest holds, and keeps the answer in the store
(store/guestagents.py) for `vm show`, `vm list --wide`, the console and the audit. How often: core/guestagent.py
(every second while a guest boots, every 30 s once it answered with its addresses, rarer for a guest with
no agent). Only a change is written. What the agent said is what the guest holds: never what was asked."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from vmplane.core import guestagent as rules
from vmplane.core.driver import DriverError
from vmplane.core.model import UNREACHABLE_HOST_STATES
from vmplane.core.names import domain_name
from vmplane.plane.loops import every
from vmplane.store import guestagents as store

if TYPE_CHECKING:
    from vmplane.plane.context import Plane

log = logging.getLogger("vmplane.guestagents")
PASS_S = 1.0  # between passes: a VM is asked only when it is due (rules.next_check_s)
ASK_S = 2.0  # an agent's answer is waited for this long (a hung one costs its host a pass this long)
FORGET_EVERY = 120  # passes between two clean-ups of stopped VMs' rows
HOST_QUIET_S = 10.0  # a host whose connection failed is not asked for this long (its monitor deals with it)
ASKS_PER_PASS = 100  # agents asked in one pass at most (the most overdue first)


class GuestAgents:
    def __init__(self, plane: Plane):
        self.db, self.drivers = plane.db, plane.drivers
        self.capacity, self.membership = plane.capacity, plane.membership
        self._stop = threading.Event()
        self._due: dict[int, float] = {}  # vm id -> when it is asked next (monotonic)
        self._misses: dict[int, int] = {}  # vm id -> answers in a row that were not complete
        self._asked: dict[int, float] = {}  # vm id -> when it was last asked
        self._quiet: dict[str, float] = {}  # host -> until when it is not asked (its connection failed)
        self._passes = 0

    def start(self) -> None:
        every(lambda: PASS_S, self.reconcile, self._stop, "guest-agents", log)

    def stop(self) -> None:
        self._stop.set()

    def reconcile(self) -> None:
        """One pass: the running VMs that are due on the hosts this process owns and that answer, at most
        ASKS_PER_PASS of them (the most overdue first): a large cluster is asked less often, never with
        more work per pass. Two reads of the store per pass, whatever the cluster's size."""
        hosts = {
            h
            for h in self.drivers
            if h in self.capacity.index
            and self.membership.owns_host(h)
            and self.capacity.index.host(h).state not in UNREACHABLE_HOST_STATES
        }
        with self.db.read() as s:
            by_host = {h: vms for h, vms in store.running(s.connection()).items() if h in hosts}
            known = store.views(s.connection())
        self._ask_due(by_host, known, force=False)
        seen = {vm.vm_id for vms in by_host.values() for vm in vms}
        for gone in set(self._due) - seen:  # stopped, deleted, or moved to a host of another process
            self._due.pop(gone, None)
            self._misses.pop(gone, None)
            self._asked.pop(gone, None)
        self._passes += 1
        if self._passes % FORGET_EVERY == 0:
            with self.db.write() as s:
                store.forget_stopped(s.connection())

    def check_host(self, host: str, force: bool = False) -> None:
        """Ask the due VMs of `host` now (all of them with `force`)."""
        with self.db.read() as s:
            vms = store.running_on(s.connection(), host)
            known = store.views(s.connection(), [vm.vm_id for vm in vms])
        self._ask_due({host: vms}, known, force)

    def _ask_due(
        self, by_host: dict[str, list[store.RunningVm]], known: dict[int, store.AgentView], force: bool
    ) -> None:
        now = time.monotonic()
        due = []
        for host, vms in by_host.items():
            for vm in vms:
                view = known.get(vm.vm_id)
                moved = view is None or view.host != host
                # a NIC recorded since the last answer (plugged through vmplane): asked now, not in 30 s
                lacking = (
                    view is not None and view.state == "connected" and not rules.complete(vm.nics, view.interfaces)
                )
                at = 0.0 if force or moved else self._due.get(vm.vm_id, 0.0)
                if lacking:
                    at = min(at, self._asked.get(vm.vm_id, 0.0) + 1.0)
                if at <= now:
                    due.append((at, vm.vm_id, host, vm, view))
        for _at, _id, host, vm, view in sorted(due, key=lambda d: d[:2])[: None if force else ASKS_PER_PASS]:
            if not force and self._quiet.get(host, 0.0) > now:
                continue
            try:
                self.check(host, vm, view)
            except Exception:  # one VM's trouble (its row gone meanwhile) never stops the others
                log.exception("guest agent of %s on %s", vm.name, host)

    def check(self, host: str, vm: store.RunningVm, known: store.AgentView | None = None) -> str:
        """Ask one VM's agent and keep its answer; the agent's state."""
        driver = self.drivers.get(host)
        if driver is None:
            return "none"
        try:
            interfaces = driver.agent_interfaces(domain_name(vm.name), timeout_s=ASK_S)
            state = "connected"
        except DriverError as exc:
            if "guest agent of" not in str(exc):  # the host, not the agent: left alone a while, nothing recorded
                self._quiet[host] = time.monotonic() + HOST_QUIET_S
                return "unknown"
            interfaces, state = [], "none"
        whole = state == "connected" and rules.complete(vm.nics, interfaces)
        misses = 0 if whole else self._misses.get(vm.vm_id, 0) + 1
        self._misses[vm.vm_id] = misses
        self._asked[vm.vm_id] = time.monotonic()
        self._due[vm.vm_id] = time.monotonic() + rules.next_check_s(state, misses, whole)
        if known is None or (known.state, known.interfaces, known.host) != (state, interfaces, host):
            with self.db.write() as s:
                store.record(s.connection(), vm.vm_id, host, state, interfaces)
        return state
