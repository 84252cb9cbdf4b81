"""A template made of a bootable disk image boots as it is, on real QEMU guests through vmplane: the image
(a raw disk with EXTLINUX, the test guest's kernel and initramfs: vmplane.guest.bootable) is imported with
`template create NAME --image FILE`, a VM boots it from its root disk (SeaBIOS -> EXTLINUX -> kernel, no
direct kernel boot) and keeps what it writes on that disk across stop/start. Files that are not standalone
disk images are refused."""

import subprocess
import time

import pytest

from vmplane.hosts.guest import bootable

from .realguest import guest, host_of, libvirt_cluster, require_libvirt, run_json


def skip(reason: str):
    print(f"SKIPPED: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def image():
    require_libvirt()
    try:
        return bootable.bootable_image()
    except bootable.BootLoaderUnavailable as exc:
        skip(f"no bootable disk image: {exc}")


@pytest.fixture(scope="module")
def live(tmp_path_factory, image):
    server = libvirt_cluster(tmp_path_factory.mktemp("bootable"))
    run_json(server, "offering", "create", "boot", "--kind", "fixed", "--vcpus", "1", "--memory", "384MiB")
    yield server
    server.stop()


def templates(live) -> list[str]:
    body = run_json(live, "template", "list")
    return [t["name"] for t in (body["items"] if isinstance(body, dict) else body)]


def domain_os(live, vm: str) -> str:
    """The <os> element of a VM's live domain XML."""
    import libvirt

    conn = libvirt.open(host_of(live, run_json(live, "vm", "show", vm)["host"]).uri)
    try:
        xml = conn.lookupByName(f"vmplane-{vm}").XMLDesc(0)
    finally:
        conn.close()
    return xml[xml.index("<os") : xml.index("</os>")]


def booted(live, vm: str) -> float:
    """Seconds until the guest answers on its console (from now: the VM was just started)."""
    t0 = time.monotonic()
    guest(live, vm, "true", timeout=180)
    return time.monotonic() - t0


def assert_booted_from_its_disk(live, vm: str) -> None:
    cmdline = guest(live, vm, "cat /proc/cmdline")
    # EXTLINUX's own config (and BOOT_IMAGE, which EXTLINUX adds): libvirt's direct kernel boot gives neither
    assert bootable.BOOT_MARKER in cmdline and "BOOT_IMAGE=/vmlinuz" in cmdline, cmdline
    os_xml = domain_os(live, vm)
    assert "<boot dev='hd'/>" in os_xml and "<kernel>" not in os_xml, os_xml
    # the boot disk is the VM's root disk, mounted by the guest's init at /data
    assert "/dev/vda /data " in guest(live, vm, "cat /proc/mounts")
    files = guest(live, vm, "ls /data").split()
    assert {"vmlinuz", "initrd.gz", "extlinux.conf", "ldlinux.sys"} <= set(files), files


def test_a_bootable_raw_image_is_imported_and_boots_as_it_is_keeping_what_it_writes(live, image):
    run_json(live, "template", "create", "boot", "--image", str(image))
    sha256 = subprocess.run(["sha256sum", str(image)], capture_output=True, text=True, check=True).stdout.split()[0]
    shown = run_json(live, "template", "show", "boot")
    assert shown["image"] == ""  # no kernel: it boots its disk
    assert (shown["disk_format"], shown["checksum"], shown["disk_mib"]) == ("raw", sha256, bootable.DISK_MIB), shown
    assert shown["disk_image"] != str(image)  # a copy in the image store

    t0 = time.monotonic()
    vm = run_json(
        live,
        "vm",
        "create",
        "bootie",
        "--project",
        "p",
        "--offering",
        "boot",
        "--template",
        "boot",
        "--pool",
        "shared",
        "--start",
    )
    created = time.monotonic() - t0
    assert vm["state"] == "running", vm
    answered = booted(live, "bootie")
    uptime = float(guest(live, "bootie", "cut -d' ' -f1 /proc/uptime").split()[0])
    print(
        f"bootable image: vm create --start {created:.1f} s, console answered {answered:.1f} s later, "
        f"guest uptime {uptime:.1f} s"
    )
    assert_booted_from_its_disk(live, "bootie")
    root = run_json(live, "volume", "show", "bootie-root")
    assert root["pool"] == "shared" and root["size_mib"] >= bootable.DISK_MIB, root

    guest(live, "bootie", "dd if=/dev/urandom of=/data/keep bs=1M count=4 2>/dev/null; sync")
    digest = guest(live, "bootie", "md5sum /data/keep").split()[0]
    # forced: the data is synced, and the guest's init ignores ACPI, so a clean stop would wait out
    # vmplane.vm.shutdown.timeout (30 s) and then force it anyway
    run_json(live, "vm", "stop", "bootie", "--force")
    t0 = time.monotonic()
    run_json(live, "vm", "start", "bootie")
    booted(live, "bootie")
    print(f"bootable image: restarted, console answered {time.monotonic() - t0:.1f} s after vm start was sent")
    assert_booted_from_its_disk(live, "bootie")  # it still boots after the guest wrote
    assert guest(live, "bootie", "sync; echo 3 > /proc/sys/vm/drop_caches; md5sum /data/keep").split()[0] == digest
    run_json(live, "vm", "stop", "bootie", "--force")
    run_json(live, "vm", "delete", "bootie")


def test_the_image_as_qcow2_boots_from_a_local_pool_and_boot_times_compare(live, image, tmp_path):
    qcow2 = tmp_path / "bootable.qcow2"
    subprocess.run(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(image), str(qcow2)], check=True)
    run_json(live, "template", "create", "bootq", "--image", str(qcow2))
    shown = run_json(live, "template", "show", "bootq")
    sha256 = subprocess.run(["sha256sum", str(qcow2)], capture_output=True, text=True, check=True).stdout.split()[0]
    assert (shown["disk_format"], shown["checksum"], shown["disk_mib"]) == ("qcow2", sha256, bootable.DISK_MIB)
    times = {}
    for vm, template in (("local", "bootq"), ("kernel", "tiny-linux")):
        run_json(
            live,
            "vm",
            "create",
            vm,
            "--project",
            "p",
            "--offering",
            "boot",
            "--template",
            template,
            "--pool",
            "local-lv1",
        )
        t0 = time.monotonic()
        run_json(live, "vm", "start", vm)
        booted(live, vm)
        times[template] = time.monotonic() - t0
    print("vm start until the console answers: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()))
    assert_booted_from_its_disk(live, "local")
    assert run_json(live, "volume", "show", "local-root")["pool"] == "local-lv1"
    assert bootable.BOOT_MARKER not in guest(live, "kernel", "cat /proc/cmdline")  # direct kernel boot
    for vm in ("local", "kernel"):
        run_json(live, "vm", "stop", vm, "--force")
        run_json(live, "vm", "delete", vm)
    assert run_json(live, "audit")["ok"]


def refused(live, name: str, path: str) -> str:
    r = live.cli("template", "create", name, "--image", path)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    with live.client() as c:
        status = c.post("/templates", json={"name": name, "image": path}).status_code
    assert 400 <= status < 500, status
    assert name not in templates(live)
    return out


def test_a_file_that_is_not_a_disk_image_is_refused_naming_it(live):
    out = refused(live, "x", "/etc/hostname")
    assert "/etc/hostname" in out and "not a disk image" in out, out


def test_a_qcow2_with_a_backing_file_is_refused(live, tmp_path):
    base, overlay = tmp_path / "base.qcow2", tmp_path / "overlay.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(base), "64M"], check=True)
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(base), "-F", "qcow2", str(overlay)], check=True
    )
    out = refused(live, "layered", str(overlay))
    assert str(overlay) in out and "backing file" in out, out


def test_an_image_path_that_does_not_exist_is_refused_naming_it(live, tmp_path):
    missing = str(tmp_path / "typo.qcow2")
    out = refused(live, "typo", missing)
    assert missing in out and "does not exist" in out, out
