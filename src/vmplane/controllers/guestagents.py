"""The guest agent controller (issue 30): asks each running VM's QEMU guest agent, on the hosts this
process owns, whether it answers and which addresses the guest holds, and keeps the answer in the store
(store/guestagents.py) for `vm show`, `vm list --wide`, the console and the audit. How often: core/guestagent.py
(every second while a guest boots, every 10 s once it answered with its addresses, rarer for a guest with
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
PASS_S = 0.5  # between passes: a VM is asked only when it is due (rules.next_check_s)
ASK_S = 2.0  # an agent's answer is waited for this long (a hung one costs its host a pass this long)
FORGET_EVERY = 120  # passes between two clean-ups of stopped VMs' rows


class GuestAgents:
    def __init__(self, plane: Plane):
        self.db, self.drivers = plane.db, plane.drivers
        self.capacity, self.membership = plane.capacity, plane.membership
        self._stop = threading.Event()
        self._due: dict[int, float] = {}  # vm id -> when it is asked next (monotonic)
        self._misses: dict[int, int] = {}  # vm id -> answers in a row that were not complete
        self._passes = 0

    def start(self) -> None:
        every(lambda: PASS_S, self.reconcile, self._stop, "guest-agents", log)

    def stop(self) -> None:
        self._stop.set()

    def reconcile(self) -> None:
        """One pass: every running VM that is due on every host this process owns and that answers."""
        seen: set[int] = set()
        for host in sorted(self.drivers):
            if host not in self.capacity.index or not self.membership.owns_host(host):
                continue
            if self.capacity.index.host(host).state in UNREACHABLE_HOST_STATES:
                continue
            try:
                seen |= self.check_host(host)
            except Exception:
                log.exception("guest agents on %s", host)
        for gone in set(self._due) - seen:  # stopped, deleted, or moved to a host of another process
            self._due.pop(gone, None)
            self._misses.pop(gone, None)
        self._passes += 1
        if self._passes % FORGET_EVERY == 0:
            with self.db.write() as s:
                store.forget_stopped(s.connection())

    def check_host(self, host: str, force: bool = False) -> set[int]:
        """Ask the due VMs of `host` (all of them with `force`); the ids of the VMs running there."""
        with self.db.read() as s:
            vms = store.running_on(s.connection(), host)
            known = store.views(s.connection(), [vm.vm_id for vm in vms])
        now = time.monotonic()
        for vm in vms:
            view = known.get(vm.vm_id)
            moved = view is None or view.host != host
            if force or moved or self._due.get(vm.vm_id, 0.0) <= now:
                self.check(host, vm, view)
        return {vm.vm_id for vm in vms}

    def check(self, host: str, vm: store.RunningVm, known: store.AgentView | None = None) -> str:
        """Ask one VM's agent and keep its answer; the agent's state."""
        driver = self.drivers.get(host)
        if driver is None:
            return "none"
        try:
            interfaces = driver.agent_interfaces(domain_name(vm.name), timeout_s=ASK_S)
            state = "connected"
        except DriverError:
            interfaces, state = [], "none"
        whole = state == "connected" and rules.complete(vm.nics, interfaces)
        misses = 0 if whole else self._misses.get(vm.vm_id, 0) + 1
        self._misses[vm.vm_id] = misses
        self._due[vm.vm_id] = time.monotonic() + rules.next_check_s(state, misses, whole)
        if known is None or (known.state, known.interfaces, known.host) != (state, interfaces, host):
            with self.db.write() as s:
                store.record(s.connection(), vm.vm_id, host, state, interfaces)
        return state
