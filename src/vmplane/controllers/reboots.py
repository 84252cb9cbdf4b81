"""`vm reboot` (issue 33, from the newcomer audit): a running VM's guest asked to reboot, through its guest agent
or ACPI, or reset at once (`force`). The domain keeps running either way (every domain has `on_reboot`
restart: a reboot from inside the guest keeps it running too), so the record does not change: the request,
and how the host took it, is an event of the VM. A host that refuses answers 409 with its words."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vmplane.core.driver import DriverError
from vmplane.core.errors import Conflict
from vmplane.core.model import VmState
from vmplane.core.names import domain_name
from vmplane.store import events
from vmplane.store import ledger as L

if TYPE_CHECKING:
    from vmplane.plane.context import Plane

log = logging.getLogger("vmplane.reboots")


class Reboots:
    def __init__(self, plane: Plane):
        self.plane = plane

    def reboot(self, name: str, force: bool = False) -> dict[str, Any]:
        with self.plane.db.read() as s:
            vm = L.vm_row(s.connection(), name=name)
        if vm.state != VmState.running.value:
            raise Conflict(f"vm {name} is {vm.state}; only a running VM is rebooted", field="state")
        driver = self.plane.drivers.get(vm.host_name or "")
        if driver is None:
            raise Conflict(f"vm {name}'s host {vm.host_name} has no driver in this process", field="vm")
        try:
            how = driver.reboot(domain_name(name), force=force)
        except DriverError as exc:
            raise Conflict(f"vm {name} was not rebooted: {exc}", field="vm") from None
        with self.plane.db.transaction() as conn:
            events.record(
                conn, "vm", name, old_state="running", new_state="running", message=f"reboot: {how}", vm=name,
                host=vm.host_name, project_id=vm.project_id,
            )  # fmt: skip
        return {"vm": name, "host": vm.host_name, "how": how}
