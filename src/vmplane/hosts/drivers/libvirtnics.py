"""The NIC methods of LibvirtDriver (issue 29): a NIC hot-plugged into a running domain and read back, and
unplugged only once the guest let it go (libvirt's DEVICE_REMOVED for its alias, or the live XML no longer
listing its MAC), as a disk is."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from xml.etree import ElementTree

from vmplane.core.driver import DriverError, NicSpec
from vmplane.hosts.drivers.domainxml import interface_xml
from vmplane.hosts.drivers.libvirtstorage import CONFIG, LIVE


def nics_of(xml: str) -> dict[str, tuple[str, str, ElementTree.Element]]:
    """{MAC: (bridge, alias, element)} of a domain XML's interfaces."""
    out = {}
    for iface in ElementTree.fromstring(xml).findall("devices/interface"):
        mac, source, alias = iface.find("mac"), iface.find("source"), iface.find("alias")
        if mac is None:
            continue
        out[mac.get("address", "").lower()] = (
            "" if source is None else source.get("bridge", ""),
            "" if alias is None else alias.get("name", ""),
            iface,
        )
    return out


class NicMixin:
    if TYPE_CHECKING:
        host: str

        def _call(self, what: str, fn: Any, *args: Any) -> Any: ...
        def _dom(self, name: str) -> Any: ...
        def _is_active(self, dom: Any) -> bool: ...
        def _xml(self, dom: Any, inactive: bool = False) -> str: ...
        def _unplug_device(
            self, dom: Any, xml: str, alias: str, what: str, still_there: Any, tries: int, wait_s: float
        ) -> None: ...

    NIC_UNPLUG_TRIES = 3
    NIC_UNPLUG_WAIT_S = 10.0  # per request: a PCIe unplug under TCG takes seconds

    def domain_nics(self, name: str) -> dict[str, str]:
        return {mac: bridge for mac, (bridge, _a, _e) in nics_of(self._xml(self._dom(name))).items()}

    def attach_nic(self, name: str, nic: NicSpec) -> None:
        dom = self._dom(name)
        try:
            xml = interface_xml(nic)
        except ValueError as exc:
            raise DriverError(self.host, f"attach a NIC to {name}: {exc}") from None
        have = self.domain_nics(name)
        if nic.mac in have:
            if have[nic.mac] == nic.bridge:
                return  # attached already (a retry)
            raise DriverError(self.host, f"{name} has NIC {nic.mac} on {have[nic.mac]}, not {nic.bridge}")
        flags = (LIVE if self._is_active(dom) else 0) | (CONFIG if self._call("persistence", dom.isPersistent) else 0)
        self._call(f"attach NIC {nic.mac} to {name}", dom.attachDeviceFlags, xml, flags)
        if self.domain_nics(name).get(nic.mac) != nic.bridge:
            raise DriverError(self.host, f"{name} does not list NIC {nic.mac} after the attach")

    def detach_nic(self, name: str, mac: str) -> None:
        dom = self._dom(name)
        if self._is_active(dom):
            found = nics_of(self._xml(dom)).get(mac)
            if found is not None:
                self._unplug_device(
                    dom,
                    ElementTree.tostring(found[2], encoding="unicode"),
                    found[1],
                    f"NIC {mac} ({found[1]}) of {name}",
                    lambda: mac in nics_of(self._xml(dom)),
                    self.NIC_UNPLUG_TRIES,
                    self.NIC_UNPLUG_WAIT_S,
                )
        if self._call("persistence", dom.isPersistent):
            found = nics_of(self._xml(dom, inactive=True)).get(mac)
            if found is not None:
                element = ElementTree.tostring(found[2], encoding="unicode")
                self._call(f"remove NIC {mac} from the definition of {name}", dom.detachDeviceFlags, element, CONFIG)
