"""Storage on a libvirt host: pools, volumes and a domain's disks, through libvirt's own storage API.

A pool is a libvirt `dir` pool (defined persistent, built, started, autostarted); a volume is made,
grown, uploaded into and deleted by libvirt (`storageVolCreateXML` with a <backingStore> for a qcow2
overlay, `vol.resize`, `vol.upload` over a stream, `vol.delete`): this code never writes the files.

As for domains, "absent" and "can't ask" are kept apart: only VIR_ERR_NO_STORAGE_POOL /
VIR_ERR_NO_STORAGE_VOL say a pool or volume is not there; any other error raises DriverError naming
the host. Every change is read back before it is returned.

`StorageMixin` is mixed into LibvirtDriver: it uses the driver's `conn`, `host`, `_call`, `_dom`.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any
from xml.etree import ElementTree
from xml.sax.saxutils import escape, quoteattr

import libvirt

from vmplane.core.driver import DiskSpec, DriverError, PoolInfo, PoolSpec, VolumeInfo
from vmplane.hosts.drivers.domainxml import disk_xml
from vmplane.hosts.drivers.volumefiles import same_volume

MIB = 1 << 20
LIVE = libvirt.VIR_DOMAIN_AFFECT_LIVE
CONFIG = libvirt.VIR_DOMAIN_AFFECT_CONFIG
_POOL_STATES = {
    libvirt.VIR_STORAGE_POOL_INACTIVE: "inactive",
    libvirt.VIR_STORAGE_POOL_BUILDING: "building",
    libvirt.VIR_STORAGE_POOL_RUNNING: "running",
    libvirt.VIR_STORAGE_POOL_DEGRADED: "degraded",
    libvirt.VIR_STORAGE_POOL_INACCESSIBLE: "inaccessible",
}
VOLUME_FORMATS = ("qcow2", "raw")


def pool_absent(exc: libvirt.libvirtError) -> bool:
    return exc.get_error_code() == libvirt.VIR_ERR_NO_STORAGE_POOL


def volume_absent(exc: libvirt.libvirtError) -> bool:
    return exc.get_error_code() == libvirt.VIR_ERR_NO_STORAGE_VOL


def pool_xml(spec: PoolSpec) -> str:
    if not os.path.isabs(spec.path):
        raise ValueError(f"a pool's path is absolute, not {spec.path!r}")
    return (
        f"<pool type='dir'>\n  <name>{escape(spec.name)}</name>\n"
        f"  <target>\n    <path>{escape(spec.path)}</path>\n  </target>\n</pool>\n"
    )


def volume_xml(
    name: str, capacity_bytes: int, format: str, backing: str | None = None, backing_format: str | None = None
) -> str:
    """A volume of `capacity_bytes` (thin: allocation 0); an overlay on `backing` when given."""
    if format not in VOLUME_FORMATS:
        raise ValueError(f"volume format must be one of {', '.join(VOLUME_FORMATS)}, not {format!r}")
    if backing is not None and format != "qcow2":
        raise ValueError("only a qcow2 volume can have a backing image")
    if backing_format is not None and backing_format not in VOLUME_FORMATS:
        raise ValueError(f"backing format must be one of {', '.join(VOLUME_FORMATS)}, not {backing_format!r}")
    if "/" in name or name in ("", ".", ".."):
        raise ValueError(f"a volume name is a file name, not {name!r}")
    lines = [
        "<volume>",
        f"  <name>{escape(name)}</name>",
        f"  <capacity unit='bytes'>{int(capacity_bytes)}</capacity>",
        "  <allocation unit='bytes'>0</allocation>",
        # qcow2 v3 (compat 1.1): libvirt's default is v2, which can not keep the persistent dirty bitmaps
        # that incremental backups read (issue 32: "Cannot store dirty bitmaps in qcow2 v2 files")
        f"  <target><format type={quoteattr(format)}/>{'<compat>1.1</compat>' if format == 'qcow2' else ''}</target>",
    ]
    if backing is not None:
        lines.append(
            f"  <backingStore><path>{escape(backing)}</path>"
            + (f"<format type={quoteattr(backing_format)}/>" if backing_format else "")
            + "</backingStore>"
        )
    lines.append("</volume>")
    return "\n".join(lines) + "\n"


def _mib_up(n: int) -> int:
    return -(-int(n) // MIB)


def disks_of(xml: str) -> dict[str, tuple[str, str, ElementTree.Element]]:
    """{target: (source file, alias, element)} of a domain XML's file disks."""
    out = {}
    for disk in ElementTree.fromstring(xml).findall("devices/disk"):
        target = disk.find("target")
        if target is None:
            continue
        source = disk.find("source")
        alias = disk.find("alias")
        path = "" if source is None else source.get("file") or source.get("dev") or ""
        out[target.get("dev", "")] = (path, "" if alias is None else alias.get("name", ""), disk)
    return out


class StorageMixin:
    """The storage methods of LibvirtDriver (see base.Driver for their contracts)."""

    if TYPE_CHECKING:  # what LibvirtDriver gives the methods here (libvirt's objects are untyped)
        host: str
        conn: Any

        def _call(self, what: str, fn: Any, *args: Any) -> Any: ...
        def _dom(self, name: str) -> Any: ...
        def _is_active(self, dom: Any) -> bool: ...
        def _unplug_device(
            self, dom: Any, xml: str, alias: str, what: str, still_there: Any, tries: int, wait_s: float
        ) -> None: ...

    DISK_UNPLUG_TRIES = 3
    DISK_UNPLUG_WAIT_S = 10.0  # per request: a PCIe unplug under TCG takes seconds
    REFRESH_TRIES = 25  # a refresh is refused while the pool builds a volume: retried

    # -- pools ---------------------------------------------------------------------------------
    def _pool(self, name: str) -> libvirt.virStoragePool | None:
        try:
            return self.conn.storagePoolLookupByName(name)
        except libvirt.libvirtError as exc:
            if pool_absent(exc):
                return None
            raise DriverError(self.host, f"looking up pool {name}: {exc.get_error_message()}") from None

    def _pool_or_raise(self, name: str) -> libvirt.virStoragePool:
        pool = self._pool(name)
        if pool is None:
            raise DriverError(self.host, f"pool {name} does not exist here")
        return pool

    def _pool_path(self, pool: libvirt.virStoragePool) -> str:
        xml = self._call(f"read pool {pool.name()}", pool.XMLDesc, 0)
        return ElementTree.fromstring(xml).findtext("target/path") or ""

    def _refresh(self, pool: libvirt.virStoragePool) -> None:
        """Rescan the pool's folder (a shared pool's files change on other hosts); libvirt refuses a
        refresh while it builds a volume there: asked again for a few seconds."""
        for attempt in range(self.REFRESH_TRIES):
            try:
                if not pool.isActive():
                    raise DriverError(self.host, f"pool {pool.name()} is not running")
                pool.refresh(0)
                return
            except libvirt.libvirtError as exc:
                if pool_absent(exc):
                    raise DriverError(self.host, f"pool {pool.name()} went away") from None
                if "asynchronous jobs" not in (exc.get_error_message() or "") or attempt == self.REFRESH_TRIES - 1:
                    raise DriverError(self.host, f"refresh pool {pool.name()}: {exc.get_error_message()}") from None
            time.sleep(0.2)

    def define_pool(self, spec: PoolSpec) -> PoolInfo:
        try:
            xml = pool_xml(spec)
        except ValueError as exc:
            raise DriverError(self.host, f"define pool {spec.name}: {exc}") from None
        pool = self._pool(spec.name)
        if pool is None:
            try:
                pool = self.conn.storagePoolDefineXML(xml, 0)
            except libvirt.libvirtError as exc:
                pool = self._pool(spec.name)  # defined meanwhile by another caller: checked below
                if pool is None:
                    raise DriverError(self.host, f"define pool {spec.name}: {exc.get_error_message()}") from None
        path = self._pool_path(pool)
        if os.path.normpath(path) != os.path.normpath(spec.path):
            raise DriverError(self.host, f"pool {spec.name} exists at {path}, not {spec.path}")
        if not self._call(f"state of pool {spec.name}", pool.isActive):
            # a dir pool's build makes its folder (mkdir -p); an existing folder and its files are kept
            self._call(f"build pool {spec.name}", pool.build, 0)
            try:
                pool.create(0)
            except libvirt.libvirtError as exc:
                if not pool.isActive():  # started meanwhile by another caller: fine
                    raise DriverError(self.host, f"start pool {spec.name}: {exc.get_error_message()}") from None
        if self._call(f"persistence of pool {spec.name}", pool.isPersistent):
            self._call(f"autostart pool {spec.name}", pool.setAutostart, 1)
        info = self.pool_info(spec.name)
        if info is None or info.state != "running":
            raise DriverError(self.host, f"pool {spec.name} is {info.state if info else 'gone'} after it was started")
        return info

    def pool_info(self, name: str) -> PoolInfo | None:
        pool = self._pool(name)
        if pool is None:
            return None
        try:
            if pool.isActive():
                try:
                    self._refresh(pool)
                except DriverError:
                    pass  # e.g. its folder vanished: libvirt stops the pool, and the state says so
            state, capacity, allocation, available = pool.info()
            path = self._pool_path(pool)
        except libvirt.libvirtError as exc:
            if pool_absent(exc):
                return None
            raise DriverError(self.host, f"reading pool {name}: {exc.get_error_message()}") from None
        return PoolInfo(
            name, path, _POOL_STATES.get(state, str(state)), capacity // MIB, allocation // MIB, available // MIB
        )

    def remove_pool(self, name: str) -> None:
        pool = self._pool(name)
        if pool is None:
            return
        try:
            if pool.isActive():
                pool.destroy()
            if pool.isPersistent():
                pool.undefine()
        except libvirt.libvirtError as exc:
            if not pool_absent(exc):
                raise DriverError(self.host, f"remove pool {name}: {exc.get_error_message()}") from None
        if self._pool(name) is not None:
            raise DriverError(self.host, f"pool {name} is still defined after it was removed")

    # -- volumes -------------------------------------------------------------------------------
    def _volume_info(self, pool_name: str, vol: libvirt.virStorageVol) -> VolumeInfo:
        _type, capacity, allocation = vol.info()
        root = ElementTree.fromstring(vol.XMLDesc(0))
        fmt = root.find("target/format")
        backing = root.findtext("backingStore/path")
        return VolumeInfo(
            pool_name,
            vol.name(),
            vol.path(),
            fmt.get("type", "") if fmt is not None else "",
            _mib_up(capacity),
            _mib_up(allocation),
            backing or None,
        )

    def _vol(self, pool: libvirt.virStoragePool, name: str) -> libvirt.virStorageVol | None:
        try:
            return pool.storageVolLookupByName(name)
        except libvirt.libvirtError as exc:
            if volume_absent(exc):
                return None
            raise DriverError(
                self.host, f"looking up volume {name} in pool {pool.name()}: {exc.get_error_message()}"
            ) from None

    def volumes(self, pool: str) -> list[VolumeInfo]:
        p = self._pool_or_raise(pool)
        self._refresh(p)
        out = []
        for vol in self._call(f"list volumes of pool {pool}", p.listAllVolumes, 0):
            try:
                out.append(self._volume_info(pool, vol))
            except libvirt.libvirtError as exc:
                if not volume_absent(exc):  # deleted between the listing and the read: not there
                    raise DriverError(self.host, f"reading volume {vol.name()}: {exc.get_error_message()}") from None
        return sorted(out, key=lambda v: v.name)

    def volume(self, pool: str, name: str) -> VolumeInfo | None:
        p = self._pool_or_raise(pool)
        self._refresh(p)
        vol = self._vol(p, name)
        if vol is None:
            return None
        try:
            return self._volume_info(pool, vol)
        except libvirt.libvirtError as exc:
            if volume_absent(exc):
                return None
            raise DriverError(self.host, f"reading volume {name}: {exc.get_error_message()}") from None

    def create_volume(
        self,
        pool: str,
        name: str,
        capacity_mib: int,
        format: str = "qcow2",
        backing: str | None = None,
        backing_format: str | None = None,
    ) -> VolumeInfo:
        """libvirt runs `qemu-img create` (with `-b backing -F backing_format` for an overlay); a
        volume whose creation failed is removed by libvirt itself. An overlay smaller than its backing
        image (when the backing is a volume this host knows) is refused: the guest would lose the end
        of its disk."""
        try:
            xml = volume_xml(name, capacity_mib * MIB, format, backing, backing_format)
        except ValueError as exc:
            raise DriverError(self.host, f"create volume {name}: {exc}") from None
        existing = self.volume(pool, name)
        if existing is not None:
            return self._asked_for(existing, format, backing)
        if backing is not None:
            self._check_backing(name, capacity_mib, backing)
        p = self._pool_or_raise(pool)
        try:
            vol = p.createXML(xml, 0)
        except libvirt.libvirtError as exc:
            if exc.get_error_code() == libvirt.VIR_ERR_STORAGE_VOL_EXIST:
                made = self.volume(pool, name)  # created meanwhile by another caller
                if made is not None:
                    return self._asked_for(made, format, backing)
            raise DriverError(self.host, f"create volume {name} in pool {pool}: {exc.get_error_message()}") from None
        info = self._call(f"read volume {name} back", self._volume_info, pool, vol)
        if info.capacity_mib < capacity_mib or info.format != format or (backing and info.backing != backing):
            raise DriverError(
                self.host,
                f"volume {name} reads back as {info}, not {capacity_mib} MiB {format}"
                + (f" on {backing}" if backing else ""),
            )
        return info

    def _asked_for(self, found: VolumeInfo, format: str, backing: str | None) -> VolumeInfo:
        """A volume already there is returned only if it is the one asked for (a retried create: its format
        and backing; the caller compares the size): another one is not adopted (review N2)."""
        if not same_volume(found, format, backing):
            raise DriverError(
                self.host,
                f"create volume {found.name}: the pool holds it already as {found.format} "
                f"on {found.backing}, not the volume asked for",
            )
        return found

    def _check_backing(self, name: str, capacity_mib: int, backing: str) -> None:
        try:
            base = self.conn.storageVolLookupByPath(backing)
        except libvirt.libvirtError:
            return  # not in a pool of this host: qemu-img checks that it exists
        try:
            size = base.info()[1]
        except libvirt.libvirtError:
            return
        if capacity_mib * MIB < size:
            raise DriverError(
                self.host,
                f"volume {name}: {capacity_mib} MiB is smaller than its backing image {backing} ({_mib_up(size)} MiB)",
            )

    def _users(self, path: str) -> list[str]:
        """Domains of this host (running or defined) with a disk on `path`."""
        users = []
        for dom in self._call("list domains", self.conn.listAllDomains):
            try:
                xmls = [dom.XMLDesc(0)]
                if dom.isActive() and dom.isPersistent():
                    xmls.append(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))
            except libvirt.libvirtError as exc:
                if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                    continue
                raise DriverError(self.host, f"reading domain {dom.name()}: {exc.get_error_message()}") from None
            if any(src == path for xml in xmls for src, _a, _e in disks_of(xml).values()):
                users.append(dom.name())
        return users

    def delete_volume(self, pool: str, name: str) -> None:
        p = self._pool_or_raise(pool)
        self._refresh(p)
        vol = self._vol(p, name)
        if vol is None:
            return
        path = self._call(f"path of volume {name}", vol.path)
        users = self._users(path)
        if users:
            raise DriverError(self.host, f"volume {name} is in use by domain {', '.join(users)}: not deleted")
        try:
            vol.delete(0)
        except libvirt.libvirtError as exc:
            if not volume_absent(exc):
                raise DriverError(self.host, f"delete volume {name}: {exc.get_error_message()}") from None
        if self.volume(pool, name) is not None:
            raise DriverError(self.host, f"volume {name} is still in pool {pool} after it was deleted")

    def resize_volume(self, pool: str, name: str, capacity_mib: int) -> VolumeInfo:
        """Grow only (libvirt refuses a shrink without VIR_STORAGE_VOL_RESIZE_SHRINK, which is never
        passed); refused while a running domain of this host has it open."""
        p = self._pool_or_raise(pool)
        self._refresh(p)
        vol = self._vol(p, name)
        if vol is None:
            raise DriverError(self.host, f"volume {name} does not exist in pool {pool}")
        info = self._call(f"read volume {name}", self._volume_info, pool, vol)
        if capacity_mib == info.capacity_mib:
            return info
        if capacity_mib < info.capacity_mib:
            raise DriverError(
                self.host, f"volume {name} is {info.capacity_mib} MiB: it can not shrink to {capacity_mib} MiB"
            )
        running = [d for d in self._users(info.path) if self._is_active(self._dom(d))]
        if running:
            raise DriverError(
                self.host,
                f"volume {name} is open in running domain {', '.join(running)}: grow it "
                f"live (grow_disk) or stop the domain first",
            )
        self._call(f"resize volume {name} to {capacity_mib} MiB", vol.resize, capacity_mib * MIB, 0)
        after = self.volume(pool, name)
        if after is None or after.capacity_mib != capacity_mib:
            raise DriverError(self.host, f"volume {name} reads back as {after} after a resize to {capacity_mib} MiB")
        return after

    def upload_volume(self, pool: str, name: str, source: str, format: str) -> VolumeInfo:
        """A raw volume of the file's size is created, the file's bytes are sent over libvirt's upload
        stream, and the pool is refreshed: libvirt then probes the volume's real format, which must be
        `format` (else the volume is deleted and DriverError says what it is)."""
        if format not in VOLUME_FORMATS:
            raise DriverError(self.host, f"upload {name}: format must be one of {', '.join(VOLUME_FORMATS)}")
        try:
            size = os.path.getsize(source)
        except OSError as exc:
            raise DriverError(self.host, f"upload {name}: {exc}") from None
        existing = self.volume(pool, name)
        if existing is not None:
            return existing
        p = self._pool_or_raise(pool)
        vol = self._call(f"create volume {name} for the upload", p.createXML, volume_xml(name, size, "raw"), 0)
        try:
            stream = self.conn.newStream(0)
            self._call(f"upload into volume {name}", vol.upload, stream, 0, size, 0)
            with open(source, "rb") as f:
                try:
                    stream.sendAll(lambda _s, nbytes, fh: fh.read(nbytes), f)
                    stream.finish()
                except libvirt.libvirtError as exc:
                    try:
                        stream.abort()
                    except libvirt.libvirtError:
                        pass
                    raise DriverError(self.host, f"upload into volume {name}: {exc.get_error_message()}") from None
            info = self.volume(pool, name)
            if info is None:
                raise DriverError(self.host, f"volume {name} is gone after the upload")
            if info.format != format and not (format == "raw" and info.format == "iso"):  # (an ISO is raw bytes)
                raise DriverError(self.host, f"{source} is a {info.format or 'unknown'} image, not {format}")
            return info
        except BaseException:
            try:
                vol.delete(0)
            except libvirt.libvirtError:
                pass  # the audit finds a volume the store does not know
            raise

    # -- a domain's disks ----------------------------------------------------------------------
    def _xml(self, dom, inactive: bool = False) -> str:
        return self._call(
            f"read the XML of {dom.name()}", dom.XMLDesc, libvirt.VIR_DOMAIN_XML_INACTIVE if inactive else 0
        )

    def domain_disks(self, name: str) -> dict[str, str]:
        dom = self._dom(name)
        # the volumes' disks (virtio, vdX); a CD-ROM (sdX: a cloud-init seed) is no volume
        return {t: src for t, (src, _a, _e) in disks_of(self._xml(dom)).items() if not t.startswith("sd")}

    def attach_disk(self, name: str, disk: DiskSpec) -> None:
        dom = self._dom(name)
        try:
            xml = disk_xml(disk)
        except ValueError as exc:
            raise DriverError(self.host, f"attach to {name}: {exc}") from None
        have = self.domain_disks(name)
        if disk.target in have:
            if have[disk.target] == disk.path:
                return  # attached already (a retry)
            raise DriverError(self.host, f"{name} has another disk at {disk.target}: {have[disk.target]}")
        if disk.path in have.values():
            raise DriverError(self.host, f"{name} has {disk.path} attached already")
        active = self._is_active(dom)
        flags = (LIVE if active else 0) | (CONFIG if self._call("persistence", dom.isPersistent) else 0)
        self._call(f"attach {disk.path} to {name} as {disk.target}", dom.attachDeviceFlags, xml, flags)
        if self.domain_disks(name).get(disk.target) != disk.path:
            raise DriverError(self.host, f"{name} does not list {disk.path} at {disk.target} after the attach")

    def detach_disk(self, name: str, target: str) -> None:
        """Unplug live (confirmed by DEVICE_REMOVED for the disk's alias, or the live XML no longer
        listing the target), then remove it from the persistent definition. Absent already: fine."""
        dom = self._dom(name)
        persistent = self._call("persistence", dom.isPersistent)
        if self._is_active(dom):
            found = disks_of(self._xml(dom)).get(target)
            if found is not None:
                self._unplug_disk(dom, target, found[1], ElementTree.tostring(found[2], encoding="unicode"))
        if persistent:
            found = disks_of(self._xml(dom, inactive=True)).get(target)
            if found is not None:
                self._call(
                    f"remove {target} from the definition of {name}",
                    dom.detachDeviceFlags,
                    ElementTree.tostring(found[2], encoding="unicode"),
                    CONFIG,
                )
                if target in disks_of(self._xml(dom, inactive=True)):
                    raise DriverError(self.host, f"the definition of {name} still lists {target} after a detach")

    def _unplug_disk(self, dom, target: str, alias: str, xml: str) -> None:
        self._unplug_device(
            dom,
            xml,
            alias,
            f"disk {target} ({alias}) of {dom.name()}",
            lambda: target in disks_of(self._xml(dom)),
            self.DISK_UNPLUG_TRIES,
            self.DISK_UNPLUG_WAIT_S,
        )

    def grow_disk(self, name: str, target: str, capacity_mib: int) -> None:
        """blockResize (bytes) on the running domain, then blockInfo says the size the guest sees."""
        dom = self._dom(name)
        current = self._call(f"size of {target}", dom.blockInfo, target, 0)[0]
        want = capacity_mib * MIB
        if want == current:
            return
        if want < current:
            raise DriverError(
                self.host, f"disk {target} of {name} is {_mib_up(current)} MiB: it can not shrink to {capacity_mib} MiB"
            )
        self._call(
            f"grow {target} of {name} to {capacity_mib} MiB",
            dom.blockResize,
            target,
            want,
            libvirt.VIR_DOMAIN_BLOCK_RESIZE_BYTES,
        )
        after = self._call(f"size of {target}", dom.blockInfo, target, 0)[0]
        if after != want:
            raise DriverError(self.host, f"disk {target} of {name} is {after} bytes after a resize to {want}")
