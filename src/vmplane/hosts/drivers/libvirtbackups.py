"""Backups on a libvirt host (issue 32): libvirt's backup API in push mode (QEMU writes the disk, or only what
changed since a checkpoint's persistent dirty bitmap, into a qcow2 file vmplane made beforehand in the backup
store: REUSE_EXTERNAL; an incremental's file has the previous backup as its backing file), a checkpoint taken
with each backup, checkpoints defined again where the domain runs (libvirt forgets them when the domain is
undefined or moves; their bitmaps stay in the qcow2 file), and a file's sha256 read through the storage API."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from xml.etree import ElementTree
from xml.sax.saxutils import escape, quoteattr

import libvirt

from vmplane.core.driver import DriverError
from vmplane.hosts.drivers.libvirtstorage import disks_of

POLL_S = 0.2


def backup_xml(targets: list[str], disks: dict[str, tuple[str, bool]], since: str | None) -> str:
    """Push mode, each disk into its file; an incremental disk names the checkpoint its changes are since (a
    disk's own `backupmode`: a disk new since that checkpoint is copied whole in the same job)."""

    def one(t: str) -> str:
        if t not in disks:
            return f"<disk name={quoteattr(t)} backup='no'/>"
        path, incremental = disks[t]
        mode = (
            f"backupmode='incremental' incremental={quoteattr(since)}" if incremental and since else "backupmode='full'"
        )
        return (
            f"<disk name={quoteattr(t)} type='file' {mode}><target file={quoteattr(path)}/>"
            "<driver type='qcow2'/></disk>"
        )

    return f"<domainbackup><disks>{''.join(one(t) for t in targets)}</disks></domainbackup>"


def checkpoint_xml(targets: list[str], disks: dict[str, tuple[str, bool]], name: str) -> str:
    marks = "".join(f"<disk name={quoteattr(t)} checkpoint='{'bitmap' if t in disks else 'no'}'/>" for t in targets)
    return f"<domaincheckpoint><name>{escape(name)}</name><disks>{marks}</disks></domaincheckpoint>"


class BackupMixin:
    if TYPE_CHECKING:
        host: str
        conn: Any

        def _dom(self, name: str) -> Any: ...
        def _xml(self, dom: Any, inactive: bool = False) -> str: ...
        def _pool_or_raise(self, name: str) -> Any: ...
        def _vol(self, pool: Any, name: str) -> Any: ...
        def _refresh(self, pool: Any) -> None: ...

    def backup_disks(
        self, name: str, disks: dict[str, tuple[str, bool]], since: str | None, checkpoint: str,
        timeout_s: float = 3600.0, on_progress: Callable[[int, int], None] | None = None,
    ) -> int:  # fmt: skip
        dom = self._dom(name)
        targets = list(disks_of(self._xml(dom)))
        missing = sorted(set(disks) - set(targets))
        if missing:
            raise DriverError(self.host, f"backup of {name}: the domain has no disk {', '.join(missing)}")
        try:
            dom.backupBegin(
                backup_xml(targets, disks, since),
                checkpoint_xml(targets, disks, checkpoint),
                libvirt.VIR_DOMAIN_BACKUP_BEGIN_REUSE_EXTERNAL,
            )
        except libvirt.libvirtError as exc:
            raise DriverError(self.host, f"backup of {name}: {exc.get_error_message()}") from None
        deadline = time.monotonic() + timeout_s
        try:
            while dom.jobInfo()[0] != libvirt.VIR_DOMAIN_JOB_NONE:
                if time.monotonic() > deadline:
                    dom.abortJob()
                    raise DriverError(self.host, f"backup of {name} did not end within {timeout_s:g} s")
                if on_progress is not None:
                    now = dom.jobStats(0)
                    if now.get("disk_total"):
                        on_progress(int(now.get("disk_processed", 0)), int(now["disk_total"]))
                time.sleep(POLL_S)
            stats = dom.jobStats(libvirt.VIR_DOMAIN_JOB_STATS_COMPLETED)
        except libvirt.libvirtError as exc:
            raise DriverError(self.host, f"backup of {name}: {exc.get_error_message()}") from None
        if not stats.get("success"):
            raise DriverError(self.host, f"backup of {name} failed: {stats.get('errmsg', 'libvirt says so')}")
        return int(stats.get("disk_processed", 0))

    def checkpoint_xml(self, name: str, checkpoint: str) -> str:
        try:
            return str(self._dom(name).checkpointLookupByName(checkpoint).getXMLDesc(0))
        except libvirt.libvirtError as exc:
            raise DriverError(self.host, f"checkpoint {checkpoint} of {name}: {exc.get_error_message()}") from None

    def define_checkpoints(self, name: str, xmls: list[str]) -> None:
        dom = self._dom(name)
        try:
            have = {c.getName() for c in dom.listAllCheckpoints()}
            uuid = dom.UUIDString()
            for xml in xmls:  # oldest first: a checkpoint's parent is defined before it
                root = ElementTree.fromstring(xml)
                if root.findtext("name") in have:
                    continue
                for node in root.iterfind("./domain/uuid"):  # the domain is defined anew at each start
                    node.text = uuid
                dom.checkpointCreateXML(
                    ElementTree.tostring(root, encoding="unicode"), libvirt.VIR_DOMAIN_CHECKPOINT_CREATE_REDEFINE
                )
        except libvirt.libvirtError as exc:
            raise DriverError(self.host, f"define the checkpoints of {name}: {exc.get_error_message()}") from None

    def abort_backup(self, name: str, checkpoint: str) -> None:
        try:
            dom = self.conn.lookupByName(name)
        except libvirt.libvirtError as exc:
            if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                return
            raise DriverError(self.host, f"abort the backup of {name}: {exc.get_error_message()}") from None
        try:
            if dom.isActive() and dom.jobInfo()[0] != libvirt.VIR_DOMAIN_JOB_NONE:
                dom.abortJob()
            if checkpoint in {c.getName() for c in dom.listAllCheckpoints()}:
                dom.checkpointLookupByName(checkpoint).delete(0)  # its bitmap too
        except libvirt.libvirtError as exc:
            raise DriverError(self.host, f"abort the backup of {name}: {exc.get_error_message()}") from None

    def volume_sha256(self, pool: str, name: str) -> tuple[str, int]:
        p = self._pool_or_raise(pool)
        self._refresh(p)  # (a file made through another host of a shared directory)
        vol = self._vol(p, name)
        if vol is None:
            raise DriverError(self.host, f"volume {name} is not in pool {pool}")
        digest, size = hashlib.sha256(), 0
        try:
            stream = self.conn.newStream(0)
            vol.download(stream, 0, 0, 0)
            while chunk := stream.recv(1 << 20):
                if isinstance(chunk, int):
                    continue
                digest.update(chunk)
                size += len(chunk)
            stream.finish()
        except libvirt.libvirtError as exc:
            raise DriverError(self.host, f"read volume {name} of pool {pool}: {exc.get_error_message()}") from None
        return digest.hexdigest(), size
