"""Disk moves on a libvirt host (issue 32, `volume move`): a live block copy of a running domain's disk into a
file of another pool, then the switch to it (pivot), as CommitMixin does for a commit; and the copy of a
volume's bytes from another host's pool (download there, upload here, through libvirt's streams).

A persistent domain's copy must be a transient job (VIR_DOMAIN_BLOCK_COPY_TRANSIENT_JOB: libvirt refuses a
block copy of a persistent domain otherwise); after the pivot its persistent definition is pointed at the new
file too, so a restart of the domain from its definition does not open the old one."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any
from xml.etree import ElementTree
from xml.sax.saxutils import quoteattr

import libvirt

from vmplane.core.driver import DriverError
from vmplane.hosts.drivers.libvirtsnapshots import chain_of
from vmplane.hosts.drivers.libvirtstorage import volume_xml


def copy_dest_xml(dest: str) -> str:
    return f"<disk type='file'><source file={quoteattr(dest)}/><driver type='qcow2'/></disk>"


def pointed_at(xml: str, target: str, dest: str) -> str | None:
    """The domain XML with disk `target` reading the standalone qcow2 file `dest`; None: it has no such disk."""
    root = ElementTree.fromstring(xml)
    for disk in root.findall("devices/disk"):
        t = disk.find("target")
        if t is None or t.get("dev") != target:
            continue
        source = disk.find("source")
        if source is None:
            source = ElementTree.SubElement(disk, "source")
        source.attrib.clear()
        source.set("file", dest)
        disk.set("type", "file")
        driver = disk.find("driver")
        if driver is not None:
            driver.set("type", "qcow2")
        for backing in disk.findall("backingStore"):
            disk.remove(backing)
        return ElementTree.tostring(root, encoding="unicode")
    return None


class BlockCopyMixin:
    if TYPE_CHECKING:
        host: str
        conn: Any

        def _dom(self, name: str) -> Any: ...
        def _xml(self, dom: Any, inactive: bool = False) -> str: ...
        def _job(self, dom: Any, target: str) -> bool: ...
        def _abort_block_job(self, dom: Any, target: str) -> None: ...
        def _await_job(
            self, dom: Any, name: str, target: str, pivot_to: str | None, timeout_s: float, what: str
        ) -> None: ...

        POLL_S: float

        def _lookup(self, name: str) -> Any: ...
        def _pool_or_raise(self, name: str) -> Any: ...
        def _vol(self, pool: Any, name: str) -> Any: ...
        def volume(self, pool: str, name: str) -> Any: ...
        def delete_volume(self, pool: str, name: str) -> None: ...

    def copy_disk(self, name: str, target: str, dest: str, timeout_s: float = 3600.0) -> None:
        dom = self._dom(name)
        chain = chain_of(self._xml(dom), target)
        if not chain:
            raise DriverError(self.host, f"copy {name}'s {target}: the domain has no such disk")
        persistent = self._persistent(dom)
        if chain[0] != dest:
            if not self._job(dom, target):  # a job already there (a copy a crash cut short) is carried on
                flags = libvirt.VIR_DOMAIN_BLOCK_COPY_TRANSIENT_JOB if persistent else 0
                try:
                    dom.blockCopy(target, copy_dest_xml(dest), None, flags)
                except libvirt.libvirtError as exc:
                    raise DriverError(
                        self.host, f"copy {name}'s {target} to {dest}: {exc.get_error_message()}"
                    ) from None
            self._await_job(dom, name, target, dest, timeout_s, f"copy of {name}'s {target}")
            now = chain_of(self._xml(dom), target)
            if not now or now[0] != dest:
                raise DriverError(
                    self.host, f"the copy of {name}'s {target} ended without the switch: it reads {now[:1]}, not {dest}"
                )
        if persistent:
            self._point_definition(dom, name, target, dest)

    def _persistent(self, dom: Any) -> bool:
        try:
            return bool(dom.isPersistent())
        except libvirt.libvirtError as exc:
            raise DriverError(self.host, f"persistence of {dom.name()}: {exc.get_error_message()}") from None

    def _point_definition(self, dom: Any, name: str, target: str, dest: str) -> None:
        inactive = self._xml(dom, inactive=True)
        if chain_of(inactive, target)[:1] == [dest]:
            return
        xml = pointed_at(inactive, target, dest)
        if xml is None:
            return  # (a disk the definition does not keep: nothing to point)
        try:
            self.conn.defineXML(xml)
        except libvirt.libvirtError as exc:
            raise DriverError(
                self.host, f"point the definition of {name}'s {target} at {dest}: {exc.get_error_message()}"
            ) from None
        if chain_of(self._xml(dom, inactive=True), target)[:1] != [dest]:
            raise DriverError(self.host, f"the definition of {name} does not read {dest} for {target} after the update")

    def abort_disk_copy(self, name: str, target: str) -> None:
        dom = self._lookup(name)
        if dom is None:
            return
        if self._job(dom, target):
            self._abort_block_job(dom, target)
            deadline = time.monotonic() + 30
            while self._job(dom, target) and time.monotonic() < deadline:
                time.sleep(self.POLL_S)
            if self._job(dom, target):
                raise DriverError(self.host, f"the block job of {name}'s {target} did not end after its abort")

    def copy_volume_from(self, pool: str, name: str, source: Any, source_pool: str, source_name: str) -> Any:
        src_conn = getattr(source, "conn", None)
        if src_conn is None:
            raise DriverError(self.host, f"copy {source_name} from {source.host}: not a libvirt host")
        try:
            src = source._vol(source._pool_or_raise(source_pool), source_name)
            if src is None:
                raise DriverError(source.host, f"volume {source_name} is not in pool {source_pool}")
            size = int(src.infoFlags(libvirt.VIR_STORAGE_VOL_GET_PHYSICAL)[2])  # the file's own bytes
        except libvirt.libvirtError as exc:
            raise DriverError(source.host, f"read volume {source_name}: {exc.get_error_message()}") from None
        if self.volume(pool, name) is not None:
            raise DriverError(self.host, f"copy {source_name}: pool {pool} holds {name} already")
        p = self._pool_or_raise(pool)
        try:
            vol = p.createXML(volume_xml(name, size, "raw"), 0)
        except libvirt.libvirtError as exc:
            raise DriverError(self.host, f"create {name} for the copy: {exc.get_error_message()}") from None
        streams: list[Any] = []
        try:
            down, up = src_conn.newStream(0), self.conn.newStream(0)
            streams += [down, up]
            src.download(down, 0, size, 0)
            vol.upload(up, 0, size, 0)
            while chunk := down.recv(1 << 20):
                if isinstance(chunk, int):  # (-2: no data yet)
                    time.sleep(0.01)
                    continue
                while chunk:
                    sent = up.send(chunk)
                    if isinstance(sent, int) and sent > 0:
                        chunk = chunk[sent:]
            down.finish()
            up.finish()
        except libvirt.libvirtError as exc:
            for stream in streams:
                try:
                    stream.abort()
                except libvirt.libvirtError:
                    pass
            raise DriverError(self.host, f"copy {source_name} from {source.host}: {exc.get_error_message()}") from None
        info = self.volume(pool, name)  # (refreshed: libvirt probes the copied file's format)
        if info is None:
            raise DriverError(self.host, f"{name} is not in pool {pool} after the copy")
        return info
