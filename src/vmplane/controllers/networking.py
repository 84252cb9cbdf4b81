"""The networking controller: every host holds what the store says its guests' networks are (issue 29).

What a host must hold (store/netview.py: its zone's bridges and VXLAN links, the filter of the NICs it runs
or is about to receive, the DHCP reservations) is handed to its driver (`apply_networks`), which applies
only the difference and reads the host back. What a host confirmed is remembered; a pass applies again only
where the store's view moved since, and every FULL_EVERY passes applies everywhere (drift and orphans left
by a crash are repaired then). A change through the API wakes the loop at once (`changed`): a security
group's new rule reaches running guests within a pass. Before a start or a migration the target is brought
up to date first (`ensure_for`): a domain never starts on a host without its bridge or its filter.

A host is served by the process that owns it (membership.owns_host), as its monitor and sync are.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from sqlalchemy import select

from vmplane.core import failpoints
from vmplane.core import hostnet as H
from vmplane.core.driver import DriverError
from vmplane.core.model import UNREACHABLE_HOST_STATES
from vmplane.store import netview
from vmplane.store.schema import Nic

if TYPE_CHECKING:
    from vmplane.plane.context import Plane

log = logging.getLogger("vmplane.networking")
PASS_S = 1.0  # between passes (a change through the API wakes the loop at once)
FULL_EVERY = 30  # passes between two applies of every host, changed or not (drift, orphans)


def underlay(host: netview.ZoneHost) -> str:
    """A host's address on the network between hosts: where its incoming migrations arrive."""
    if host.migration_address:
        return host.migration_address
    parsed = urlparse(host.uri or "")
    return parsed.hostname or (host.name if not host.uri else "127.0.0.1")


class Networking:
    def __init__(self, plane: Plane):
        self.plane = plane
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._locks: defaultdict[str, threading.Lock] = defaultdict(threading.Lock)
        self._confirmed: dict[str, H.HostNetworks] = {}  # what each host held after its last apply
        self.failures: dict[str, str] = {}  # host -> why its last apply failed (cleared by the next success)
        self._passes = 0

    # -- the loop --------------------------------------------------------------------------------
    def start(self) -> None:
        threading.Thread(target=self._loop, name="vmplane-networking", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def changed(self) -> None:
        """The store's view of some host's networks moved (a network, rule or member): a pass now."""
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(PASS_S)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.reconcile(full=self._passes % FULL_EVERY == FULL_EVERY - 1)
            except Exception:  # the next pass tries again
                log.exception("networking pass")
            self._passes += 1

    def reconcile(self, full: bool = False) -> dict[str, str]:
        """One pass over the hosts this process owns that answer; each host's failure, in words."""
        failed = {}
        with self.plane.db.read() as s:
            zones = set(netview.zones_with_networks(s.connection()))
        for host in sorted(self.plane.drivers):
            meta = self.plane.capacity.hosts.get(host)
            if (
                host not in self.plane.capacity.index
                or self.plane.capacity.index.host(host).state in UNREACHABLE_HOST_STATES
                or not self.plane.membership.owns_host(host)
                or (host not in self._confirmed and (meta is None or meta.zone not in zones))
            ):
                continue  # (a host of a zone without networks that vmplane never touched: nothing to read)
            try:
                self.ensure(host, force=full)
            except DriverError as exc:
                failed[host] = str(exc)
        return failed

    # -- one host --------------------------------------------------------------------------------
    def want(self, host: str) -> H.HostNetworks | None:
        with self.plane.db.read() as s:
            return netview.host_networks(s.connection(), host, underlay)

    def ensure(self, host: str, force: bool = False) -> bool:
        """Bring `host` to the store's view when it moved since the host last confirmed it (or `force`);
        whether it was applied. A host of a zone without networks that vmplane never touched is left
        alone. DriverError when the host does not hold the view afterwards (recorded in `failures`)."""
        with self._locks[host]:
            want = self.want(host)
            if want is None or (not want.plan.networks and host not in self._confirmed):
                return False
            if not force and self._confirmed.get(host) == want:
                return False
            driver = self.plane.drivers.get(host)
            if driver is None:
                return False
            failpoints.hit("network.before-apply")
            try:
                driver.apply_networks(want)
            except DriverError as exc:
                self._confirmed.pop(host, None)  # what it holds is unknown now: applied again next pass
                if self.failures.get(host) != str(exc):
                    log.warning("networks on %s: %s", host, exc)
                self.failures[host] = str(exc)
                raise
            self._confirmed[host] = want
            self.failures.pop(host, None)
            return True

    def ensure_for(self, host: str, vm_id: int) -> None:
        """Before VM `vm_id` starts on, or migrates to, `host`: the host holds its networks and its NICs'
        filter (nothing to do for a VM without NICs)."""
        with self.plane.db.read() as s:
            has_nics = s.connection().execute(select(Nic.id).where(Nic.vm_id == vm_id).limit(1)).first()
        if has_nics is not None:
            self.ensure(host)
