"""The libvirt driver's storage on two real local libvirtd hosts (no orchestrator): pools, qcow2
overlays on the test template's disk image, a guest booting with a disk, hot-plug, live grow, and live
migration with a copied (local pool) or a shared disk.

Layout (localhosts): inside each host's mount namespace `{host.dir}/local` is /var/lib/vmplane/local
(a different folder per host at the same path: the local pool), `{base}/shared` is
/var/lib/vmplane/shared (the shared pool is a subfolder) and `{base}/images` /var/lib/vmplane/images
(the images pool, where the template's disk image is uploaded): the same folders on every host.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from vmplane.core.driver import DiskSpec, DomainSpec, DriverError, MigrationParams, PoolSpec
from vmplane.hosts import localhosts
from vmplane.hosts.guest import build as guest

from .realguest import require_libvirt

LOCAL, IMAGES = localhosts.LOCAL_PATH, localhosts.IMAGES_PATH
SHARED = f"{localhosts.SHARED_PATH}/pool1"  # a shared pool is a subfolder of the shared export
MEMORY_MIB = 256


def _mounted(host: localhosts.LocalHost, path: str) -> bool:
    """Whether `path` is a mount point in the host's mount namespace (its daemon's view)."""
    try:
        return any(line.split()[4] == path for line in Path(f"/proc/{host.pid()}/mountinfo").read_text().splitlines())
    except OSError:
        return False


class Cluster:
    def __init__(self, base: Path):
        from vmplane.hosts.drivers.libvirt import LibvirtDriver

        netns = localhosts.netns_available()
        self.base = base
        self.local_hosts = [localhosts.start(base, f"st{i + 1}", i, netns=netns) for i in range(2)]
        self.drivers = []
        for h in self.local_hosts:
            d = LibvirtDriver(h.name, h.uri)
            d.migration_address = h.address
            self.drivers.append(d)
        self.shared_path, self.images_path = SHARED, IMAGES
        self.template_path = ""

    def close(self) -> None:
        for d in self.drivers:
            d.close()
        for h in self.local_hosts:
            localhosts.stop(h)
        localhosts.stop_switch(self.base)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = localhosts.available()
    if reason:
        print(f"storage driver test skipped: {reason}")
    require_libvirt()
    c = Cluster(tmp_path_factory.mktemp("storage") / "hosts")
    try:
        missing = [p for h in c.local_hosts for p in (LOCAL, localhosts.SHARED_PATH, IMAGES) if not _mounted(h, p)]
        if missing:
            print(f"storage driver test skipped: the local hosts lack the storage bind mounts {missing}")
            pytest.skip(f"real-QEMU storage test skipped: the local hosts lack the storage bind mounts {missing}")
        # the template's disk image, uploaded once into the images pool every host sees
        for d in c.drivers:
            d.define_pool(PoolSpec("images", c.images_path))
            d.define_pool(PoolSpec("shared", c.shared_path))
        image = c.drivers[0].upload_volume("images", "tiny-linux.qcow2", str(guest.root_disk_image()), "qcow2")
        c.template_path = image.path
        guest.build()
        yield c
    finally:
        c.close()


def spec(name: str, *disks: DiskSpec) -> DomainSpec:
    return DomainSpec(name, 1, 1, MEMORY_MIB, MEMORY_MIB, guest.IMAGE_NAME, disks=disks)


def run(driver, name: str, command: str, timeout: float = 120) -> str:
    out, code = driver.guest_run(name, command, timeout)
    assert code == 0, f"{command}: exit {code}: {out}"
    return out.strip()


def test_a_pool_is_defined_read_back_and_redefined_idempotently(cluster):
    a, b = cluster.drivers
    info = a.define_pool(PoolSpec("shared", cluster.shared_path))
    assert info.state == "running" and info.path == cluster.shared_path
    assert info.capacity_mib > 0 and 0 < info.available_mib <= info.capacity_mib
    again = a.define_pool(PoolSpec("shared", cluster.shared_path))  # idempotent
    assert (again.name, again.path, again.state) == (info.name, info.path, info.state)
    with pytest.raises(DriverError, match=r"^st1: pool shared exists at .* not /elsewhere"):
        a.define_pool(PoolSpec("shared", "/elsewhere"))
    assert a.pool_info("no-such-pool") is None
    a.remove_pool("no-such-pool")  # absent is fine
    # a pool removed (files kept) and defined again finds its volumes
    assert any(v.name == "tiny-linux.qcow2" for v in b.volumes("images"))
    b.remove_pool("images")
    assert b.pool_info("images") is None
    b.define_pool(PoolSpec("images", cluster.images_path))
    assert b.volume("images", "tiny-linux.qcow2").format == "qcow2"
    with pytest.raises(DriverError, match=r"^st1: pool no-such-pool does not exist here"):
        a.volumes("no-such-pool")


def test_an_overlay_volume_is_created_read_back_resized_and_deleted(cluster, tmp_path):
    a, b = cluster.drivers
    template = a.volume("images", "tiny-linux.qcow2")
    assert template.format == "qcow2" and template.capacity_mib == guest.ROOT_DISK_MIB
    vol = a.create_volume("shared", "ov1.qcow2", 512, "qcow2", template.path, "qcow2")
    assert (vol.format, vol.capacity_mib, vol.backing) == ("qcow2", 512, template.path)
    assert vol.allocation_mib < 8  # thin: only the overlay's header
    assert a.create_volume("shared", "ov1.qcow2", 999, "qcow2", template.path, "qcow2") == vol  # returned as it is
    assert b.volume("shared", "ov1.qcow2").path == vol.path  # the other host sees it (shared)
    with pytest.raises(DriverError, match="smaller than its backing image"):
        a.create_volume("shared", "ov2.qcow2", 128, "qcow2", template.path, "qcow2")
    assert a.volume("shared", "ov2.qcow2") is None
    assert a.resize_volume("shared", "ov1.qcow2", 768).capacity_mib == 768
    with pytest.raises(DriverError, match="can not shrink"):
        a.resize_volume("shared", "ov1.qcow2", 600)
    a.delete_volume("shared", "ov1.qcow2")
    assert a.volume("shared", "ov1.qcow2") is None and b.volume("shared", "ov1.qcow2") is None
    a.delete_volume("shared", "ov1.qcow2")  # absent is fine
    junk = tmp_path / "junk.img"
    junk.write_bytes(b"not an image\n" * 1000)
    with pytest.raises(DriverError, match="is a raw image, not qcow2"):
        a.upload_volume("shared", "junk.qcow2", str(junk), "qcow2")
    assert a.volume("shared", "junk.qcow2") is None  # removed again


def test_libvirt_takes_a_domain_that_boots_from_its_first_disk(cluster):
    """image == "": no kernel, <boot dev='hd'/> (the test guest's disk has no boot loader: defined only)."""
    a, _ = cluster.drivers
    vol = a.create_volume("shared", "bootable.qcow2", 512, "qcow2", cluster.template_path, "qcow2")
    d = DomainSpec(
        "vmp-fromdisk", 1, 1, MEMORY_MIB, MEMORY_MIB, "", disks=(DiskSpec("shared", vol.name, vol.path, "vda"),)
    )
    dom = a.conn.defineXML(a.domain_xml(d))
    try:
        xml = dom.XMLDesc(0)
        assert "<boot dev='hd'/>" in xml and "<kernel>" not in xml
        assert a.domain_disks("vmp-fromdisk") == {"vda": vol.path}
        assert "cache='none'" in xml
    finally:
        a.stop("vmp-fromdisk")
    a.delete_volume("shared", vol.name)


def test_a_guest_boots_with_a_disk_and_its_data_survives_destroy_and_start(cluster):
    a, _ = cluster.drivers
    vol = a.create_volume("shared", "boot1.qcow2", 512, "qcow2", cluster.template_path, "qcow2")
    disk = DiskSpec("shared", vol.name, vol.path, "vda")
    a.start(spec("vmp-disk1", disk))
    try:
        assert a.domain_disks("vmp-disk1") == {"vda": vol.path}
        assert run(a, "vmp-disk1", "cat /data/etc/vmplane-template").startswith(f"image={guest.IMAGE_NAME}")
        run(a, "vmp-disk1", "echo kept-across-restart > /data/marker && sync")
        with pytest.raises(DriverError, match="in use by domain vmp-disk1"):
            a.delete_volume("shared", vol.name)
        a.stop("vmp-disk1")  # destroyed and undefined
        a.start(spec("vmp-disk1", disk))
        assert run(a, "vmp-disk1", "cat /data/marker") == "kept-across-restart"
        # the root disk grows live: the guest's kernel sees the new size
        a.grow_disk("vmp-disk1", "vda", 640)
        deadline = time.monotonic() + 20
        while int(run(a, "vmp-disk1", "cat /sys/block/vda/size")) * 512 != 640 << 20:
            assert time.monotonic() < deadline, "the guest did not see vda grow"
            time.sleep(0.5)
        with pytest.raises(DriverError, match="can not shrink"):
            a.grow_disk("vmp-disk1", "vda", 600)
    finally:
        a.stop("vmp-disk1")
    assert a.volume("shared", vol.name).capacity_mib == 640
    a.delete_volume("shared", vol.name)


def test_a_volume_is_hot_plugged_seen_by_the_guest_and_detached_confirmed(cluster):
    a, _ = cluster.drivers
    root = a.create_volume("shared", "hp-root.qcow2", 512, "qcow2", cluster.template_path, "qcow2")
    data = a.create_volume("shared", "hp-data.qcow2", 64, "qcow2")
    a.start(spec("vmp-hp", DiskSpec("shared", root.name, root.path, "vda")))
    try:
        run(a, "vmp-hp", "test -b /dev/vda")
        extra = DiskSpec("shared", data.name, data.path, "vdb")
        a.attach_disk("vmp-hp", extra)
        a.attach_disk("vmp-hp", extra)  # a retry: already there
        assert a.domain_disks("vmp-hp") == {"vda": root.path, "vdb": data.path}
        deadline = time.monotonic() + 30
        while run(a, "vmp-hp", "test -b /dev/vdb && echo yes || echo no") != "yes":
            assert time.monotonic() < deadline, "the guest never saw /dev/vdb"
            time.sleep(0.5)
        run(
            a,
            "vmp-hp",
            "mke2fs -q /dev/vdb && mkdir -p /mnt/v && mount /dev/vdb /mnt/v && "
            "echo on-the-volume > /mnt/v/f && umount /mnt/v",
        )
        with pytest.raises(DriverError, match="has another disk at vdb"):
            a.attach_disk("vmp-hp", DiskSpec("shared", "x", "/nowhere/x.qcow2", "vdb"))
        t0 = time.monotonic()
        a.detach_disk("vmp-hp", "vdb")
        detach_s = time.monotonic() - t0
        assert "vdb" not in a.domain_disks("vmp-hp")
        run(a, "vmp-hp", "test ! -b /dev/vdb")
        a.detach_disk("vmp-hp", "vdb")  # absent already: fine
        print(f"\ndetach confirmed in {detach_s:.1f} s")
        # attached again, the data is there
        a.attach_disk("vmp-hp", extra)
        deadline = time.monotonic() + 30
        while run(a, "vmp-hp", "test -b /dev/vdb && echo yes || echo no") != "yes":
            assert time.monotonic() < deadline, "the guest never saw /dev/vdb again"
            time.sleep(0.5)
        assert run(a, "vmp-hp", "mount /dev/vdb /mnt/v && cat /mnt/v/f && umount /mnt/v") == "on-the-volume"
        a.detach_disk("vmp-hp", "vdb")
    finally:
        a.stop("vmp-hp")
    a.delete_volume("shared", data.name)
    a.delete_volume("shared", root.name)


def _migrate(source, target, name: str, params: MigrationParams) -> tuple[object, list]:
    reports: list = []
    stats = source.migrate(name, target, params, progress=lambda p, m: reports.append((p, m)))
    return stats, reports


def _md5_from_disk(driver, name: str) -> str:
    """The md5 of /data/big read from the disk, not from the guest's page cache (which migrated with
    the memory)."""
    return run(driver, name, "sync; echo 3 > /proc/sys/vm/drop_caches; md5sum /data/big", 120).split()[0]


def _fill(driver, name: str) -> str:
    """A 64 MiB file of random data in /data; its md5."""
    run(driver, name, "dd if=/dev/urandom of=/data/big bs=1M count=64 2>/dev/null && sync", 300)
    return run(driver, name, "md5sum /data/big", 120).split()[0]


def test_a_shared_pool_disk_migrates_live_with_unsafe_and_keeps_its_data(cluster):
    a, b = cluster.drivers
    vol = a.create_volume("shared", "mig-shared.qcow2", 512, "qcow2", cluster.template_path, "qcow2")
    name = "vmp-shared"
    a.start(spec(name, DiskSpec("shared", vol.name, vol.path, "vda")))
    try:
        md5 = _fill(a, name)
        with pytest.raises(DriverError, match=r"(?i)unsafe"):  # libvirt's own check: ext4 is not shared
            a.migrate(name, b, MigrationParams())
        assert a.domain(name).running
        stats, _ = _migrate(a, b, name, MigrationParams(shared_disks=True))
        print(f"\nshared-pool migration: {stats.total_ms} ms, {stats.bytes_sent >> 20} MiB sent, {stats.extra}")
        assert a.domain(name) is None and b.domain(name).running
        assert _md5_from_disk(b, name) == md5
        assert stats.extra["disk_bytes"] == 0
    finally:
        a.stop(name)
        b.stop(name)
    a.delete_volume("shared", vol.name)


def test_a_local_pool_disk_is_copied_by_a_live_migration_while_the_guest_writes(cluster):
    a, b = cluster.drivers
    for d in (a, b):
        d.define_pool(PoolSpec("local", LOCAL))
    name = "vmp-local"
    vol = a.create_volume("local", "mig-local.qcow2", 512, "qcow2", cluster.template_path, "qcow2")
    assert b.volume("local", vol.name) is None  # a folder of its own per host
    a.start(spec(name, DiskSpec("local", vol.name, vol.path, "vda")))
    try:
        md5 = _fill(a, name)
        # the guest keeps writing (1 MiB every 0.2 s) while the disk and the memory are copied
        run(
            a,
            name,
            "(i=0; while [ ! -e /data/stop ]; do dd if=/dev/urandom of=/data/busy bs=1M count=1 seek=$((i % 32)) "
            "conv=notrunc 2>/dev/null; i=$((i+1)); echo $i > /data/busy.count; sleep 0.2; done) "
            ">/dev/null 2>&1 &",
        )
        # vmplane creates the overlay on the target first: same name, same path, same backing image
        made = b.create_volume("local", vol.name, 512, "qcow2", cluster.template_path, "qcow2")
        assert made.path == vol.path and made.allocation_mib < 8
        t0 = time.monotonic()
        stats, reports = _migrate(a, b, name, MigrationParams(copy_disks=("vda",)))
        wall = time.monotonic() - t0
        print(
            f"\nlocal-pool migration (disk copied): {wall:.1f} s wall, {stats.total_ms} ms, "
            f"{stats.bytes_sent >> 20} MiB sent, disk {stats.extra['disk_bytes'] >> 20} MiB "
            f"of {stats.extra['disk_total'] >> 20} MiB, memory {stats.extra['memory_bytes'] >> 20} MiB, "
            f"downtime {stats.downtime_ms} ms; reports: {reports[:2]} ... {reports[-2:]}"
        )
        assert a.domain(name) is None and b.domain(name).running
        assert stats.extra["disk_bytes"] >= 64 << 20  # the overlay's data crossed
        assert any(m.startswith("disks ") for _, m in reports)
        percents = [p for p, _ in reports]
        assert percents == sorted(percents)  # progress never goes back
        counted = int(run(b, name, "cat /data/busy.count"))
        time.sleep(1)
        assert int(run(b, name, "cat /data/busy.count")) > counted  # still writing, on the target
        run(b, name, "touch /data/stop; sleep 1; sync")
        assert _md5_from_disk(b, name) == md5
        assert b.domain_disks(name) == {"vda": vol.path}
        # what the guest wrote before, during and after the copy is in the target's disk file: the
        # domain started again there from that file finds it
        busy = run(b, name, "cat /data/busy.count; md5sum /data/busy")
        b.stop(name)
        b.start(spec(name, DiskSpec("local", vol.name, vol.path, "vda")))
        assert run(b, name, "cat /data/busy.count; md5sum /data/busy") == busy
        assert _md5_from_disk(b, name) == md5
        # the source's copy is the caller's to delete, once the guest answered on the target
        assert a.volume("local", vol.name) is not None
        a.delete_volume("local", vol.name)
    finally:
        a.stop(name)
        b.stop(name)
    b.delete_volume("local", vol.name)
