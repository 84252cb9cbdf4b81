"""Disk snapshots on a libvirt host (issue 32): external, disk-only, and without metadata (vmplane's store
keeps it: libvirt refuses to migrate a domain with snapshot metadata). libvirt makes the overlays (qemu-img)
and switches QEMU to them in one step (`ATOMIC`: no disk switched unless all are)."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any
from xml.etree import ElementTree
from xml.sax.saxutils import quoteattr

import libvirt

from vmplane.core.driver import DriverError
from vmplane.hosts.drivers.libvirtstorage import MIB, disks_of, volume_xml

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


def chain_of(xml: str, target: str) -> list[str]:
    """The files of disk `target` in a live domain XML: its source, then each `<backingStore>` down."""
    for disk in ElementTree.fromstring(xml).findall("devices/disk"):
        t = disk.find("target")
        if t is None or t.get("dev") != target:
            continue
        out: list[str] = []
        node: ElementTree.Element | None = disk
        while node is not None:
            source = node.find("source")
            if source is None or not (source.get("file") or source.get("dev")):
                break
            out.append(source.get("file") or source.get("dev") or "")
            node = node.find("backingStore")
        return out
    return []


def mirror_ready(xml: str, target: str) -> bool:
    """Whether disk `target`'s active commit is ready to pivot (libvirt's `<mirror ready='yes'>`)."""
    for disk in ElementTree.fromstring(xml).findall("devices/disk"):
        t, mirror = disk.find("target"), disk.find("mirror")
        if t is not None and t.get("dev") == target and mirror is not None:
            return mirror.get("ready") == "yes"
    return False


class CommitMixin:
    if TYPE_CHECKING:
        host: str

        def _dom(self, name: str) -> Any: ...
        def _xml(self, dom: Any, inactive: bool = False) -> str: ...

    POLL_S = 0.1

    def domain_chain(self, name: str, target: str) -> list[str]:
        return chain_of(self._xml(self._dom(name)), target)

    def commit_disk(self, name: str, target: str, top: str, base: str, timeout_s: float = 600.0) -> None:
        dom = self._dom(name)
        chain = chain_of(self._xml(dom), target)
        if top not in chain or base not in chain or chain.index(base) != chain.index(top) + 1:
            raise DriverError(self.host, f"commit {top} into {base}: disk {target} of {name} reads {chain}")
        active = chain[0] == top
        if not self._job(dom, target):  # a job already there (a commit a crash cut short) is carried on
            flags = libvirt.VIR_DOMAIN_BLOCK_COMMIT_ACTIVE if active else 0
            try:
                dom.blockCommit(target, base, None if active else top, 0, flags)
            except libvirt.libvirtError as exc:
                raise DriverError(self.host, f"commit {top} into {base}: {exc.get_error_message()}") from None
        self._await_job(dom, name, target, base if active else None, timeout_s, f"commit {top} into {base}")

    def _await_job(self, dom: Any, name: str, target: str, pivot_to: str | None, timeout_s: float, what: str) -> None:
        """Wait until the block job on `target` ended: a mirroring one (an active commit, a copy) is pivoted to
        `pivot_to` once it is ready; one still running past `timeout_s` is aborted (DriverError naming `what`)."""
        deadline = time.monotonic() + timeout_s
        while self._job(dom, target):
            if pivot_to is not None and mirror_ready(self._xml(dom), target):
                try:
                    dom.blockJobAbort(target, libvirt.VIR_DOMAIN_BLOCK_JOB_ABORT_PIVOT)
                except libvirt.libvirtError as exc:
                    raise DriverError(
                        self.host, f"pivot {name}'s {target} to {pivot_to}: {exc.get_error_message()}"
                    ) from None
            if time.monotonic() > deadline:
                self._abort_block_job(dom, target)
                raise DriverError(self.host, f"{what} did not end within {timeout_s:g} s")
            time.sleep(self.POLL_S)

    def _abort_block_job(self, dom: Any, target: str) -> None:
        try:
            dom.blockJobAbort(target, 0)
        except libvirt.libvirtError:
            pass

    def _job(self, dom: Any, target: str) -> bool:
        try:
            return bool(dom.blockJobInfo(target, 0))
        except libvirt.libvirtError as exc:
            raise DriverError(self.host, f"block job of {target}: {exc.get_error_message()}") from None


class CloneMixin:
    if TYPE_CHECKING:
        host: str
        conn: Any

        def _pool_or_raise(self, name: str) -> Any: ...
        def volume(self, pool: str, name: str) -> Any: ...

    def _vol_by_path(self, path: str) -> Any:
        """The volume at `path`; a file another host of a shared directory made is found once this host's pool
        of that directory is refreshed (libvirt lists what it saw at its last refresh)."""
        try:
            return self.conn.storageVolLookupByPath(path)
        except libvirt.libvirtError as exc:
            if exc.get_error_code() != libvirt.VIR_ERR_NO_STORAGE_VOL:
                raise
        folder = os.path.dirname(path)
        for p in self.conn.listAllStoragePools(libvirt.VIR_CONNECT_LIST_STORAGE_POOLS_ACTIVE):
            if ElementTree.fromstring(p.XMLDesc(0)).findtext("./target/path") == folder:
                p.refresh(0)
        return self.conn.storageVolLookupByPath(path)

    def clone_volume(self, pool: str, name: str, source: str) -> Any:
        try:
            src = self._vol_by_path(source)
            capacity = src.info()[1]
        except libvirt.libvirtError as exc:
            raise DriverError(self.host, f"clone {source}: {exc.get_error_message()}") from None
        if self.volume(pool, name) is not None:
            raise DriverError(self.host, f"clone {source}: pool {pool} holds {name} already")
        p = self._pool_or_raise(pool)
        try:  # libvirt runs `qemu-img convert`: the new file reads the source's whole chain, standing alone
            p.createXMLFrom(volume_xml(name, -(-capacity // MIB) * MIB, "qcow2"), src, 0)
        except libvirt.libvirtError as exc:
            raise DriverError(self.host, f"clone {source} into {name}: {exc.get_error_message()}") from None
        info = self.volume(pool, name)
        if info is None:
            raise DriverError(self.host, f"clone {source}: {name} is not in pool {pool} after the copy")
        return info
