"""A libvirt host's CPU for guests (issue 33): its host-model and usable named models, and the baseline of
several hosts' CPUs, asked of libvirt for the domain type this driver runs (`accel`: "qemu" is TCG).

Both come from the domain capabilities of (emulator, x86_64, q35, accel): `<mode name='host-model'>` is the
CPU libvirt would give a host-model guest here (under TCG, QEMU's own emulated CPU, not the machine's), and
`<mode name='custom'>` lists each named model with `usable='yes'` when this host runs it as it is. The
baseline is `baselineHypervisorCPU` over the hosts' host-model CPUs, migratable features only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from xml.etree import ElementTree

import libvirt

from vmplane.core.driver import DriverError, HostCpu
from vmplane.hosts.drivers.domainxml import EMULATOR

ARCH, MACHINE = "x86_64", "q35"


def host_cpu_of(domcaps: str) -> HostCpu:
    """The HostCpu a domain capabilities document describes."""
    root = ElementTree.fromstring(domcaps)
    usable = tuple(
        (m.text or "").strip()
        for m in root.findall("cpu/mode[@name='custom']/model")
        if m.get("usable") == "yes" and m.text
    )
    mode = root.find("cpu/mode[@name='host-model']")
    if mode is None or mode.get("supported") != "yes" or mode.find("model") is None:
        return HostCpu("", usable)
    cpu = ElementTree.Element("cpu", {"mode": "custom", "match": "exact"})
    cpu.extend(list(mode))  # <model>, <vendor>, <feature>s as the host-model has them
    return HostCpu((mode.findtext("model") or "").strip(), usable, ElementTree.tostring(cpu, encoding="unicode"))


def baseline_model(xml: str) -> str:
    """The model name of a baseline CPU document."""
    return (ElementTree.fromstring(xml).findtext("model") or "").strip()


class CpuMixin:
    """host_cpu and baseline_cpu of LibvirtDriver (which gives `conn`, `accel`, `host` and `_call`)."""

    if TYPE_CHECKING:
        host: str

        @property
        def conn(self) -> Any: ...
        @property
        def accel(self) -> str: ...
        def _call(self, what: str, fn: Any, *args: Any) -> Any: ...

    def host_cpu(self) -> HostCpu:
        domcaps = self._call(
            "domain capabilities", self.conn.getDomainCapabilities, EMULATOR, ARCH, MACHINE, self.accel, 0
        )
        return host_cpu_of(domcaps)

    def baseline_cpu(self, cpus: list[HostCpu]) -> str:
        xmls = [c.xml for c in cpus if c.xml]
        if not xmls:
            raise DriverError(self.host, "no host of the cluster described its CPU: no baseline")
        xml = self._call(
            "CPU baseline",
            self.conn.baselineHypervisorCPU,
            EMULATOR,
            ARCH,
            MACHINE,
            self.accel,
            xmls,
            libvirt.VIR_CONNECT_BASELINE_CPU_MIGRATABLE,
        )
        return baseline_model(xml)
