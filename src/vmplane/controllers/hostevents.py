"""The libvirt event loop: what a domain's lifecycle event changes in the record.

libvirt's default event loop runs in a daemon thread (drivers/libvirt.py `_EventLoop`, registered
before any connection is opened). Each libvirt host's driver is asked to `watch` its domains: it
registers a lifecycle callback on every connection it opens (again after a reconnect). A callback
only queues the event (it runs in libvirt's event thread, which must never block); a worker thread:
- stopped / shut down / crashed / undefined: settles the VM from what its host says now
  (settle.settle_vm): gone or shut off means `stopped`, its charge and claim given back in the same
  transaction, with an event whose cause is `libvirt event`. There is no `crashed` state: the event's
  message says it crashed. Within a second or so of the guest powering off. A domain that migrated away
  (STOPPED/migrated) or is gone is first looked for on the other hosts of its zone: one that runs it, or
  can not be asked, makes the VM `unknown`, never stopped (review N7).
- paused / resumed: an event in the log; the VM stays `running` (a paused domain still holds its
  memory and its claim).
Events for VMs an operation owns (starting, stopping, migrating, scaling) and for a domain on a host
the VM is not recorded on (a migration's incoming domain, the source after a switch-over) are ignored:
the operation settles them. Missed events are caught by the periodic sync (hostsync).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING

from sqlalchemy import select

from vmplane.core.model import VmState
from vmplane.core.names import domain_name
from vmplane.plane.settle import settle_vm
from vmplane.store import ledger as L
from vmplane.store.events import acting_as, record
from vmplane.store.ownership import owned

if TYPE_CHECKING:
    from vmplane.plane.context import Plane

log = logging.getLogger("vmplane.hostevents")
CAUSE = "libvirt event"

# virDomainEventType (libvirt-python is optional: sim-only installs do not have it)
UNDEFINED, SUSPENDED, RESUMED, STOPPED, SHUTDOWN, CRASHED = 1, 3, 4, 5, 6, 8
SETTLES = {UNDEFINED: "was undefined", STOPPED: "stopped", SHUTDOWN: "shut down", CRASHED: "crashed"}
STOPPED_DETAIL = {0: "shut down", 1: "destroyed", 2: "crashed", 3: "migrated", 4: "saved", 5: "failed"}
STOPPED_MIGRATED = 3
# a destroy first stops QEMU with a signal: libvirt reports SHUTDOWN/host before STOPPED/destroyed
SHUTDOWN_DETAIL = {0: "shut down", 1: "was shut down by its guest", 2: "was shut down by the host (destroyed)"}
NOTES = {SUSPENDED: "paused", RESUMED: "resumed"}
ATTACH_EVERY_S = 1.0


class HostEvents:
    def __init__(self, plane: Plane):
        self.plane = plane
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._watched: set[int] = set()

    def start(self) -> None:
        threading.Thread(target=self._loop, name="vmplane-host-events", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _attach(self) -> None:
        """Watch every driver that can be watched (hosts added later included)."""
        for host, driver in list(self.plane.drivers.items()):
            if not self.plane.membership.owns_host(host):
                continue  # another control-plane process listens to it
            watch = getattr(driver, "watch", None)
            if watch is not None and id(driver) not in self._watched:
                watch(self.on_event)
                self._watched.add(id(driver))

    def on_event(self, host: str, domain: str, event: int, detail: int) -> None:
        """Called in libvirt's event thread: queue only."""
        self._queue.put((host, domain, event, detail))

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._attach()
            except Exception:
                log.exception("watching hosts")
            try:
                item = self._queue.get(timeout=ATTACH_EVERY_S)
            except queue.Empty:
                continue
            if not self.plane.membership.owns_host(item[0]):
                continue  # no longer this process's host: its new listener reads it at attach
            try:
                with acting_as(CAUSE), owned(self.plane.membership.epoch):
                    self.handle(*item)
            except Exception:  # one bad event must not end the loop
                log.exception("libvirt event %s", item)

    def handle(self, host: str, domain: str, event: int, detail: int) -> str | None:
        prefix = domain_name("")
        if not domain.startswith(prefix):
            return None
        vm = domain[len(prefix) :]
        if event in SETTLES:
            what = SETTLES[event]
            if event == STOPPED:
                what = STOPPED_DETAIL.get(detail, what)
            elif event == SHUTDOWN:
                what = SHUTDOWN_DETAIL.get(detail, what)
            # migrated away: it may run on another host (a migration vmplane did not order): settle_vm asks
            return settle_vm(
                self.plane,
                vm,
                host,
                CAUSE,
                f"libvirt on {host}: the domain {what}",
                migrated=event == STOPPED and detail == STOPPED_MIGRATED,
            )
        if event in NOTES:
            self._note(vm, host, NOTES[event], detail)
        return None

    def _note(self, vm: str, host: str, what: str, detail: int) -> None:
        v, h = L.VMS.c, L.HOSTS.c
        with self.plane.db.transaction() as conn:
            row = conn.execute(
                select(v.project_id, v.state).join(L.HOSTS, h.id == v.host_id).where(v.name == vm, h.name == host)
            ).first()
            if row is None or row.state != VmState.running.value:
                return  # an operation owns it, or it is not recorded here
            record(
                conn,
                "vm",
                vm,
                message=f"libvirt on {host}: the domain was {what} (detail {detail}); it stays running and charged",
                vm=vm,
                host=host,
                project_id=row.project_id,
                cause=CAUSE,
            )
