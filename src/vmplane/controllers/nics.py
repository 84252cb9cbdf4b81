"""A VM's NICs added and removed while it runs (issue 29): `vm nic add|remove`.

As a volume's hot-plug (controllers/volumes.py): the store says the step a NIC is in (`attaching`,
`attached`, `detaching`), the host is asked, and what the domain has afterwards (read back) decides the
record, whatever the request answered. An added NIC is allocated first (its MAC and address, once), its
host is brought to hold its network and filter, then it is plugged; a NIC the domain does not list after a
failed plug is removed again (nothing half-made). A removal waits for the guest to let the NIC go (libvirt's
DEVICE_REMOVED, or the domain no longer listing it); a guest that never does keeps the NIC `detaching`, and
the removal is refused naming why (asking again tries again). A stopped VM's NICs change in the record
only: its next start defines them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from sqlalchemy import update

from vmplane.core import failpoints
from vmplane.core.driver import DriverError, NicSpec
from vmplane.core.errors import Conflict, NotFound
from vmplane.core.model import VmState
from vmplane.core.names import domain_name
from vmplane.plane.loops import every
from vmplane.store import ledger as L
from vmplane.store import netview
from vmplane.store import networks as SN
from vmplane.store.schema import Nic, utcnow

if TYPE_CHECKING:
    from vmplane.controllers.networking import Networking
    from vmplane.plane.context import Plane

log = logging.getLogger("vmplane.nics")
NICS = Nic.__table__
SETTLE_S = 5.0  # between two settle passes
BUSY_S = 120.0  # a NIC's step younger than this may still be another process's call: left to it
_LIVE = (VmState.running.value, VmState.stopped.value)


class Nics:
    def __init__(self, plane: Plane, networking: Networking):
        self.plane = plane
        self.networking = networking
        self._stop = threading.Event()
        self._busy: set[int] = set()  # NICs a call of this process is adding or removing now

    def add(self, vm: str, network: str, ip: str | None = None, secgroups: Sequence[str] = ()) -> SN.NicRecord:
        with self.plane.db.transaction() as conn:
            row = L.vm_row(conn, name=vm, lock=True)
            if row.state not in _LIVE:
                raise Conflict(f"vm {vm} is {row.state}; add a NIC once it is running or stopped", field="vm")
            (nic,) = SN.add_vm_nics(conn, row.id, row.project_id, row.zone_id, [(network, ip)], secgroups)
            live = row.state == VmState.running.value
            if live:
                conn.execute(update(NICS).where(NICS.c.id == nic.id).values(state="attaching"))
        self.networking.changed()
        if not live:
            return nic
        self._busy.add(nic.id)
        try:
            return self._plug(vm, row.host_name, network, nic)
        finally:
            self._busy.discard(nic.id)

    def _plug(self, vm: str, host: str, network: str, nic: SN.NicRecord) -> SN.NicRecord:
        error = None
        spec = self._spec(nic)
        try:
            self.networking.ensure(host)
            failpoints.hit("nic.before-attach")
            self.plane.drivers[host].attach_nic(domain_name(vm), spec)
        except DriverError as exc:
            error = exc
        present = self._present(host, vm, nic)
        with self.plane.db.transaction() as conn:
            if present:
                conn.execute(update(NICS).where(NICS.c.id == nic.id).values(state="attached"))
            else:
                SN.delete_nic(conn, nic.id)
        self.networking.changed()
        if not present:
            raise Conflict(f"a NIC on {network} could not be added to vm {vm}: {error}", field="network")
        return nic

    def remove(self, vm: str, mac: str) -> None:
        mac = mac.lower()
        with self.plane.db.transaction() as conn:
            row = L.vm_row(conn, name=vm, lock=True)
            nic = next((n for n in SN.nics_of(conn, row.id) if n.mac == mac), None)
            if nic is None:
                raise NotFound(f"vm {vm} has no NIC {mac}", field="mac")
            if row.state not in _LIVE:
                raise Conflict(f"vm {vm} is {row.state}; remove a NIC once it is running or stopped", field="vm")
            live = row.state == VmState.running.value
            if live:
                conn.execute(update(NICS).where(NICS.c.id == nic.id).values(state="detaching"))
            else:
                SN.delete_nic(conn, nic.id)
        if not live:
            self.networking.changed()
            return
        self._busy.add(nic.id)
        try:
            self._unplug(vm, row.host_name, nic)
        finally:
            self._busy.discard(nic.id)

    def _unplug(self, vm: str, host: str, nic: SN.NicRecord) -> None:
        error, mac = None, nic.mac
        failpoints.hit("nic.before-detach")
        try:
            self.plane.drivers[host].detach_nic(domain_name(vm), mac)
        except DriverError as exc:
            error = exc
        present = self._present(host, vm, nic)
        if not present:
            with self.plane.db.transaction() as conn:
                SN.delete_nic(conn, nic.id)
            self.networking.changed()
            return
        raise Conflict(f"NIC {mac} is still in vm {vm} ({error}); it stays detaching: ask again", field="mac")

    def _spec(self, nic: SN.NicRecord) -> NicSpec:
        with self.plane.db.read() as s:
            return next(n for n in netview.nic_specs(s.connection(), nic.vm_id) if n.mac == nic.mac)

    def _present(self, host: str, vm: str, nic: SN.NicRecord) -> bool:
        """Whether the domain lists the NIC now; a host that can not say is a 409 (the NIC keeps its step)."""
        try:
            return nic.mac in self.plane.drivers[host].domain_nics(domain_name(vm))
        except DriverError as exc:
            raise Conflict(
                f"{host} did not say whether vm {vm} has NIC {nic.mac} ({exc}); it keeps its step until the "
                f"host answers",
                field="mac",
            ) from None

    # -- NICs left between two steps ---------------------------------------------------------------------
    def start(self) -> None:
        every(lambda: SETTLE_S, self.settle, self._stop, "nic-settle", log, owner=lambda: self.plane.membership.epoch)

    def stop(self) -> None:
        self._stop.set()

    def settle(self) -> list[str]:
        """NICs left `attaching` or `detaching` (a host that did not answer, a process killed between two
        steps): the domain read back decides, as for a volume. In the domain: attached (a removal not
        confirmed is asked again by the user); not in it: gone from the record. A stopped VM's: its next start
        defines what the record has, so an attaching NIC is attached and a detaching one gone. A NIC a call of
        this process is working on, or one added less than BUSY_S ago (another process's call), is left to
        it. Only hosts this process owns. Returns what changed, in words."""
        with self.plane.db.read() as s:
            rows = SN.nics_between_steps(s.connection())
        done = []
        now = utcnow()
        for nic_id, mac, state, vm, host, vm_state, created in rows:
            if nic_id in self._busy or (now - created).total_seconds() < BUSY_S:
                continue
            if host is None and vm_state == VmState.stopped.value:
                present = state == "attaching"
            elif host is None or host not in self.plane.drivers or not self.plane.membership.owns_host(host):
                continue
            else:
                try:
                    present = mac in self.plane.drivers[host].domain_nics(domain_name(vm))
                except DriverError:
                    continue  # don't know: asked again next pass
            with self.plane.db.transaction() as conn:
                if present:
                    conn.execute(
                        update(NICS).where(NICS.c.id == nic_id, NICS.c.state == state).values(state="attached")
                    )
                    done.append(f"vm {vm}: NIC {mac} is in the domain: attached")
                else:
                    SN.delete_nic(conn, nic_id)
                    done.append(f"vm {vm}: NIC {mac} is not in the domain: removed from the record")
        if done:
            self.networking.changed()
        return done
