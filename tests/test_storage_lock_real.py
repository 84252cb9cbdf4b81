"""Never two writers: a second domain on a disk in use is refused, and libvirt's lockd holds the lease.

Real hosts, real QEMU, no vmplane in between: the second domain is started behind vmplane's back with
`virsh create`, as an operator might. Two layers lock a disk. QEMU takes its own OFD locks on the
image when it opens it; libvirt's lockd (virtlockd) takes the domain's lease, an fcntl lock on byte 0
of the disk file, when the CPUs start. Both hosts here are on one machine, so QEMU's lock, taken
first, refuses the second domain; the lease is checked in /proc/locks, and lockd's own refusal is
shown with the lease held as another machine's virtlockd would hold it (over NFS, where QEMU's locks
may not reach). The lease follows a live migration on the shared disk.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import time
from pathlib import Path

import pytest

from vmplane.hosts import localhosts
from vmplane.hosts.guest import build as guest

LOCKD_REFUSAL = "resource busy: lockspace resource"  # virtlockd's words
QEMU_REFUSAL = 'failed to get "write" lock'  # QEMU's image locking


def _skip_unless_hosts() -> None:
    reason = localhosts.available()
    if reason:
        print(f"storage lock test skipped: {reason}")
        pytest.skip(f"real-QEMU test skipped: {reason}")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    _skip_unless_hosts()
    base = tmp_path_factory.mktemp("lock") / "hosts"
    netns = localhosts.netns_available()
    started = []
    try:
        for i, name in enumerate(("h1", "h2")):
            started.append(localhosts.start(base, name, index=i, netns=netns))
        yield base, started
    finally:
        for host in started:
            localhosts.stop(host)
        localhosts.stop_switch(base)


def _domain_xml(name: str, disk: str) -> str:
    image = guest.cached_image() or guest.build()
    return f"""<domain type='qemu'>
  <name>{name}</name>
  <memory unit='MiB'>256</memory>
  <vcpu>1</vcpu>
  <os><type arch='x86_64' machine='q35'>hvm</type>
    <kernel>{image.kernel}</kernel><initrd>{image.initrd}</initrd><cmdline>{image.cmdline}</cmdline></os>
  <features><acpi/><apic/></features>
  <cpu mode='custom' match='exact' check='none'><model fallback='forbid'>qemu64</model></cpu>
  <on_poweroff>destroy</on_poweroff><on_reboot>destroy</on_reboot><on_crash>destroy</on_crash>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
    <disk type='file' device='disk'>
      <driver name='qemu' type='qcow2' cache='none' io='native'/>
      <source file='{disk}'/>
      <target dev='vda' bus='virtio'/>
    </disk>
    <controller type='usb' model='none'/>
    <serial type='pty'><target port='0'/></serial>
    <console type='pty'><target type='serial' port='0'/></console>
    <memballoon model='none'/>
  </devices>
</domain>
"""


def _shared_disk(base: Path, host, name: str) -> str:
    """A qcow2 overlay on the test template's disk image, made by libvirt in a pool on the shared
    folder; its in-host path."""
    import libvirt

    template = localhosts.storage_dirs(base, host.name)[localhosts.IMAGES_PATH] / "root.qcow2"
    if not template.exists():
        template.write_bytes(guest.root_disk_image().read_bytes())
    conn = libvirt.open(host.uri)
    try:
        if "shared" in conn.listStoragePools():
            pool = conn.storagePoolLookupByName("shared")
        else:
            pool = conn.storagePoolCreateXML(
                f"<pool type='dir'><name>shared</name><target><path>{localhosts.SHARED_PATH}</path></target></pool>", 0
            )
        pool.refresh(0)
        if name in pool.listVolumes():
            pool.storageVolLookupByName(name).delete(0)
        vol = pool.createXML(
            f"""<volume><name>{name}</name><capacity unit='MiB'>256</capacity>
  <target><format type='qcow2'/></target>
  <backingStore><path>{localhosts.IMAGES_PATH}/root.qcow2</path><format type='qcow2'/></backingStore>
</volume>""",
            0,
        )
        return vol.path()
    finally:
        conn.close()


def _virsh(host, *args: str, xml: str | None = None, tmp: Path | None = None) -> subprocess.CompletedProcess:
    if xml is not None:
        path = tmp / f"{args[-1]}.xml"
        path.write_text(xml)
        args = (*args[:-1], str(path))
    return subprocess.run(["virsh", "-c", host.uri, *args], capture_output=True, text=True, timeout=120)


def _exec(host, domain: str, command: str) -> str:
    from vmplane.hosts.drivers.libvirt import LibvirtDriver

    return LibvirtDriver(host.name, host.uri).guest_exec(domain, command, timeout_s=120)


def _state(host, domain: str) -> str:
    r = _virsh(host, "domstate", domain)
    return r.stdout.strip() if r.returncode == 0 else "absent"


def _lease_holder(base: Path, name: str) -> int | None:
    """The pid holding an fcntl write lock on byte 0 of a shared disk file (what virtlockd takes)."""
    st = os.stat(base / "shared" / name)
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if fields[1:4] == ["POSIX", "ADVISORY", "WRITE"] and fields[5] == device and fields[6] == "0":
            return int(fields[4])
    return None


def test_second_domain_on_a_disk_in_use_is_refused_by_the_lock(hosts, tmp_path):
    base, (h1, h2) = hosts
    disk = _shared_disk(base, h1, "a.qcow2")
    r = _virsh(h1, "create", "a", xml=_domain_xml("lock-a", disk), tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    _exec(h1, "lock-a", "grep -q ' /data ' /proc/mounts && echo written-by-a > /data/owner && sync")
    assert _lease_holder(base, "a.qcow2") == h1.lockd_pid() is not None  # A's lease, in h1's virtlockd

    # behind vmplane's back: the same disk for a second domain on the other host
    r = _virsh(h2, "create", "b", xml=_domain_xml("lock-b", disk), tmp=tmp_path)
    assert r.returncode != 0, "a second domain started on a disk in use"
    assert QEMU_REFUSAL in r.stderr.lower() or LOCKD_REFUSAL in r.stderr.lower(), r.stderr
    assert _state(h2, "lock-b") == "absent"
    assert _state(h1, "lock-a") == "running"
    assert _exec(h1, "lock-a", "cat /data/owner").strip() == "written-by-a"

    # the lease goes with the domain: once A is gone B starts, takes it, and sees what A wrote
    assert _virsh(h1, "destroy", "lock-a").returncode == 0
    assert _lease_holder(base, "a.qcow2") is None
    r = _virsh(h2, "create", "b", xml=_domain_xml("lock-b", disk), tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    assert _lease_holder(base, "a.qcow2") == h2.lockd_pid()
    assert _exec(h2, "lock-b", "cat /data/owner").strip() == "written-by-a"
    assert _virsh(h2, "destroy", "lock-b").returncode == 0


def test_lockd_alone_refuses_a_disk_whose_lease_is_held_elsewhere(hosts, tmp_path):
    """The lease held as a virtlockd on another machine holds it (QEMU's own locks do not object)."""
    base, (_h1, h2) = hosts
    disk = _shared_disk(base, h2, "c.qcow2")
    fd = os.open(base / "shared" / "c.qcow2", os.O_RDWR)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
        r = _virsh(h2, "create", "c", xml=_domain_xml("lock-c", disk), tmp=tmp_path)
        assert r.returncode != 0 and LOCKD_REFUSAL in r.stderr.lower(), r.stderr
        assert _state(h2, "lock-c") == "absent"
    finally:
        os.close(fd)  # the other machine lets go
    r = _virsh(h2, "create", "c", xml=_domain_xml("lock-c", disk), tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    assert _virsh(h2, "destroy", "lock-c").returncode == 0


def test_the_lease_follows_a_live_migration_on_the_shared_disk(hosts, tmp_path):
    import libvirt

    base, (h1, h2) = hosts
    disk = _shared_disk(base, h1, "m.qcow2")
    assert _virsh(h1, "create", "m", xml=_domain_xml("lock-m", disk), tmp=tmp_path).returncode == 0
    _exec(h1, "lock-m", "echo before > /data/f; sync")
    src = libvirt.open(h1.uri)
    try:
        t0 = time.monotonic()
        # UNSAFE: the shared folder is ext4 to statfs(), so libvirt can not tell it is shared
        src.lookupByName("lock-m").migrateToURI3(
            h2.uri,
            {libvirt.VIR_MIGRATE_PARAM_URI: f"tcp://{h2.address}"},
            libvirt.VIR_MIGRATE_LIVE | libvirt.VIR_MIGRATE_PEER2PEER | libvirt.VIR_MIGRATE_UNSAFE,
        )
        print(f"shared-disk migration with lockd: {time.monotonic() - t0:.1f} s")
    finally:
        src.close()
    assert _state(h1, "lock-m") == "absent" and _state(h2, "lock-m") == "running"
    assert _lease_holder(base, "m.qcow2") == h2.lockd_pid()  # released on h1, taken on h2
    assert _exec(h2, "lock-m", "echo after >> /data/f; sync; cat /data/f").split() == ["before", "after"]

    # the target holds the disk now: the source host can not start another writer on it
    r = _virsh(h1, "create", "m2", xml=_domain_xml("lock-m2", disk), tmp=tmp_path)
    assert r.returncode != 0 and (QEMU_REFUSAL in r.stderr.lower() or LOCKD_REFUSAL in r.stderr.lower()), r.stderr
    assert _virsh(h2, "destroy", "lock-m").returncode == 0
