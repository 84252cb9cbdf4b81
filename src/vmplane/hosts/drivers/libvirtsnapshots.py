"""Disk snapshots on a libvirt host (issue 32): external, disk-only, and without metadata (vmplane's store
keeps it: libvirt refuses to migrate a domain with snapshot metadata). libvirt makes the overlays (qemu-img)
and switches QEMU to them in one step (`ATOMIC`: no disk switched unless all are)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from xml.sax.saxutils import quoteattr

import libvirt

from vmplane.core.driver import DriverError
from vmplane.hosts.drivers.libvirtstorage import disks_of

FLAGS = (
    libvirt.VIR_DOMAIN_SNAPSHOT_CREATE_DISK_ONLY
    | libvirt.VIR_DOMAIN_SNAPSHOT_CREATE_NO_METADATA
    | libvirt.VIR_DOMAIN_SNAPSHOT_CREATE_ATOMIC
)


def snapshot_xml(all_targets: list[str], overlays: dict[str, str]) -> str:
    """A `<domainsnapshot>` naming every disk of the domain: an external qcow2 overlay for those in
    `overlays`, none for the others (a CD-ROM, a disk the snapshot does not cover)."""
    disks = []
    for target in all_targets:
        if target in overlays:
            disks.append(
                f"<disk name={quoteattr(target)} snapshot='external' type='file'>"
                f"<driver type='qcow2'/><source file={quoteattr(overlays[target])}/></disk>"
            )
        else:
            disks.append(f"<disk name={quoteattr(target)} snapshot='no'/>")
    return f"<domainsnapshot><disks>{''.join(disks)}</disks></domainsnapshot>"


class SnapshotMixin:
    if TYPE_CHECKING:
        host: str

        def _dom(self, name: str) -> Any: ...
        def _xml(self, dom: Any, inactive: bool = False) -> str: ...

    def snapshot_disks(self, name: str, overlays: dict[str, str]) -> None:
        dom = self._dom(name)
        targets = list(disks_of(self._xml(dom)))
        missing = sorted(set(overlays) - set(targets))
        if missing:
            raise DriverError(self.host, f"snapshot {name}: the domain has no disk {', '.join(missing)}")
        try:
            dom.snapshotCreateXML(snapshot_xml(targets, overlays), FLAGS)
        except libvirt.libvirtError as exc:
            raise DriverError(self.host, f"snapshot the disks of {name}: {exc.get_error_message()}") from None
