"""The domain XML of a VM with disks (pure): virtio disks, cache mode, read-only, boot from a disk."""

from xml.etree import ElementTree

import pytest

from vmplane.core.driver import DiskSpec, DomainSpec, PoolSpec
from vmplane.hosts.drivers.domainxml import HOTPLUG_PORTS, disk_xml, domain_xml
from vmplane.hosts.drivers.libvirtstorage import disks_of, pool_xml, volume_xml

ROOT = DiskSpec("local", "vm1-root.qcow2", "/var/lib/vmplane/local/vm1-root.qcow2", "vda")
DATA = DiskSpec("shared", "data.qcow2", "/var/lib/vmplane/shared/p/data.qcow2", "vdb", readonly=True)


def spec(image="tiny-linux", disks=(ROOT,)):
    return DomainSpec("vm1", 1, 1, 256, 256, image, disks=disks)


def test_a_disk_is_a_virtio_qcow2_file_without_host_cache():
    disk = ElementTree.fromstring(disk_xml(ROOT))
    assert (disk.get("type"), disk.get("device")) == ("file", "disk")
    assert disk.find("driver").attrib == {
        "name": "qemu",
        "type": "qcow2",
        "cache": "none",
        "io": "native",
        "discard": "unmap",
    }
    assert disk.find("source").get("file") == ROOT.path
    assert disk.find("target").attrib == {"dev": "vda", "bus": "virtio"}
    assert disk.find("readonly") is None
    assert ElementTree.fromstring(disk_xml(DATA)).find("readonly") is not None


def test_disk_values_are_escaped_and_checked():
    odd = DiskSpec("p", "v", "/pool/a'b<c>&\"d.qcow2", "vdc")
    assert ElementTree.fromstring(disk_xml(odd)).find("source").get("file") == odd.path
    with pytest.raises(ValueError, match="vd \\+ letters"):
        disk_xml(DiskSpec("p", "v", "/x", "sda"))
    with pytest.raises(ValueError, match="vd \\+ letters"):
        disk_xml(DiskSpec("p", "v", "/x", "vd1'/>"))
    with pytest.raises(ValueError, match="format"):
        disk_xml(DiskSpec("p", "v", "/x", "vdb", format="vmdk"))


def test_a_kernel_booted_domain_keeps_its_kernel_and_lists_its_disks_in_order():
    root = ElementTree.fromstring(domain_xml(spec(disks=(ROOT, DATA)), "/k", "/i", "console=ttyS0"))
    assert root.findtext("os/kernel") == "/k" and root.find("os/boot") is None
    assert {t: src for t, (src, _a, _e) in disks_of(ElementTree.tostring(root, encoding="unicode")).items()} == {
        "vda": ROOT.path,
        "vdb": DATA.path,
    }
    assert [d.find("target").get("dev") for d in root.findall("devices/disk")] == ["vda", "vdb"]
    # free PCIe root ports for hot-plugged disks, behind the root complex
    models = [c.get("model") for c in root.findall("devices/controller[@type='pci']")]
    assert models == ["pcie-root"] + ["pcie-root-port"] * HOTPLUG_PORTS


def test_an_empty_image_boots_from_the_first_disk_without_a_kernel():
    root = ElementTree.fromstring(domain_xml(spec(image=""), None, None, None))
    assert root.find("os/boot").get("dev") == "hd"
    assert root.find("os/kernel") is None and root.find("os/initrd") is None and root.find("os/cmdline") is None
    with pytest.raises(ValueError, match="first disk but has none"):
        domain_xml(spec(image="", disks=()), None, None, None)
    with pytest.raises(ValueError, match="a kernel is booted exactly"):
        domain_xml(spec(image=""), "/k", "/i", "c")
    with pytest.raises(ValueError, match="a kernel is booted exactly"):
        domain_xml(spec(), None, None, None)


def test_two_disks_on_one_target_are_refused():
    with pytest.raises(ValueError, match="same target"):
        domain_xml(spec(disks=(ROOT, DiskSpec("p", "v", "/y", "vda"))), "/k", "/i", "c")


def test_pool_and_volume_xml():
    pool = ElementTree.fromstring(pool_xml(PoolSpec("local<1>", "/var/lib/vmplane/local")))
    assert pool.get("type") == "dir" and pool.findtext("name") == "local<1>"
    assert pool.findtext("target/path") == "/var/lib/vmplane/local"
    with pytest.raises(ValueError, match="absolute"):
        pool_xml(PoolSpec("p", "relative/dir"))
    vol = ElementTree.fromstring(volume_xml("vm1-root.qcow2", 8 << 30, "qcow2", "/images/t.qcow2", "qcow2"))
    assert vol.findtext("capacity") == str(8 << 30) and vol.find("capacity").get("unit") == "bytes"
    assert vol.find("target/format").get("type") == "qcow2"
    assert vol.findtext("target/compat") == "1.1"  # qcow2 v3: it keeps the persistent bitmaps of backups
    assert ElementTree.fromstring(volume_xml("v", 1 << 20, "raw")).find("target/compat") is None
    assert vol.findtext("backingStore/path") == "/images/t.qcow2"
    assert vol.find("backingStore/format").get("type") == "qcow2"
    assert ElementTree.fromstring(volume_xml("v", 1 << 20, "raw")).find("backingStore") is None
    for bad in (dict(name="../x"), dict(format="vmdk"), dict(format="raw", backing="/b")):
        args = {"name": "v", "capacity_bytes": 1 << 20, "format": "qcow2", **bad}
        with pytest.raises(ValueError):
            volume_xml(**args)


# -- the pure driver side of a migration with storage (no host is asked) ---------------------------
def _drivers():
    from vmplane.hosts.drivers.libvirt import LibvirtDriver

    source = LibvirtDriver("src", "qemu+tcp://10.0.0.1/system", accel="qemu")
    target = LibvirtDriver("dst", "qemu+tcp://10.0.0.2/system", accel="qemu")
    target.migration_address = "10.88.0.2"
    return source, target


def test_copied_disks_ask_for_an_incremental_nbd_copy_at_the_targets_migration_address():
    import libvirt

    from vmplane.core.driver import MigrationParams

    source, target = _drivers()
    flags, params = source._migration_args(target, MigrationParams(copy_disks=("vda", "vdb")))
    assert flags & libvirt.VIR_MIGRATE_NON_SHARED_INC and not flags & libvirt.VIR_MIGRATE_NON_SHARED_DISK
    assert not flags & libvirt.VIR_MIGRATE_UNSAFE
    assert params[libvirt.VIR_MIGRATE_PARAM_MIGRATE_DISKS] == ["vda", "vdb"]
    assert params[libvirt.VIR_MIGRATE_PARAM_DISKS_URI] == "tcp://10.88.0.2"
    flags, params = source._migration_args(target, MigrationParams(shared_disks=True))
    assert flags & libvirt.VIR_MIGRATE_UNSAFE and not flags & libvirt.VIR_MIGRATE_NON_SHARED_INC
    assert libvirt.VIR_MIGRATE_PARAM_MIGRATE_DISKS not in params
    flags, _ = source._migration_args(target, MigrationParams())
    assert not flags & (libvirt.VIR_MIGRATE_UNSAFE | libvirt.VIR_MIGRATE_NON_SHARED_INC)


def test_progress_counts_disk_bytes_and_never_goes_back():
    from vmplane.core.driver import MigrationParams
    from vmplane.hosts.drivers.libvirt import _CopyWatch

    class Dom:
        def info(self):
            return [1, 262144, 262144, 1, 0]  # 256 MiB

    source, _ = _drivers()
    watch = _CopyWatch(source, Dom(), "vm1", MigrationParams(copy_disks=("vda",)), lambda p, m: None, 0.0)
    mib = 1 << 20
    reports = [
        watch.describe(stats)
        for stats in (
            {"disk_total": 256 * mib, "disk_processed": 0, "disk_remaining": 256 * mib},
            {"disk_total": 256 * mib, "disk_processed": 256 * mib, "disk_remaining": 0},
            # memory starts: its real total (a little above the estimate) must not pull the percentage back
            {
                "disk_total": 256 * mib,
                "disk_processed": 256 * mib,
                "disk_remaining": 0,
                "memory_total": 300 * mib,
                "memory_remaining": 300 * mib,
                "memory_iteration": 1,
            },
            {
                "disk_total": 256 * mib,
                "disk_processed": 256 * mib,
                "disk_remaining": 0,
                "memory_total": 300 * mib,
                "memory_remaining": 0,
                "memory_iteration": 2,
            },
        )
    ]
    percents = [p for p, _ in reports]
    assert percents == [0, 50, 50, 99]
    assert reports[1][1].startswith("disks 256/256 MiB")
    assert watch.disk_bytes == 256 * mib
