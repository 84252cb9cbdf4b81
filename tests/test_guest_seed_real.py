"""The test guest reads a cloud-init NoCloud seed, on plain QEMU (TCG, no libvirt): from an ISO 9660 CD-ROM
labelled cidata it takes its hostname and root's SSH keys, runs the user data (a `#!` script, or a
`#cloud-config`'s runcmd) and says `vmplane-guest: seed IID keys=N` on the console; a CD-ROM that is not
a seed is left alone and the guest boots as before. (A guest with no CD-ROM at all: the no-NIC guest of
test_guest_net_real.py, whose console has no `vmplane-guest:` line.)

The CD-ROM sits on virtio-scsi: the guest's Debian cloud kernel has no AHCI driver, so a CD-ROM on q35's
SATA bus would never be seen. The ISO is built here with pycdlib (Rock Ridge and Joliet names, as
cloud-localds' genisoimage writes them). The guest is driven over its serial console as in
test_guest_net_real.py, whose `Guest` this module uses. The YAML subset the guest reads (init.sh's
yaml.awk) is also checked without a boot, with the guest's own busybox awk run on this machine."""

import io
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from vmplane.hosts.guest import build

from .test_guest_disk import _cpio_files
from .test_guest_net_real import BOOT_S, QEMU, Guest

SEED_S = 180  # generous: TCG on a shared 2-core machine
KEY_A = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHZtcGxhbmUtc2VlZC10ZXN0LWtleS1hYWFhYWFhYWFh alice@vmplane"
KEY_B = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHZtcGxhbmUtc2VlZC10ZXN0LWtleS1iYmJiYmJiYmJi bob@vmplane"


def seed_iso(path: Path, files: dict[str, str], label: str = "cidata") -> Path:
    """An ISO 9660 image labelled `label` holding `files` (name: text) at its root."""
    pycdlib = pytest.importorskip("pycdlib")
    iso = pycdlib.PyCdlib()
    iso.new(interchange_level=3, joliet=3, rock_ridge="1.09", vol_ident=label)
    for name, text in files.items():
        data = text.encode()
        short = re.sub(r"[^A-Z0-9_]", "", name.upper())[:8]
        iso.add_fp(io.BytesIO(data), len(data), f"/{short}.;1", rr_name=name, joliet_path=f"/{name}")
    iso.write(str(path))
    iso.close()
    return path


def cdrom(iso: Path) -> list[str]:
    """QEMU's arguments for a read-only CD-ROM holding `iso`, on a virtio-scsi controller."""
    return [
        *("-device", "virtio-scsi-pci,id=scsi0"),
        *("-drive", f"file={iso},if=none,id=seed,media=cdrom,readonly=on,format=raw"),
        *("-device", "scsi-cd,bus=scsi0.0,drive=seed"),
    ]


def boot(image: build.GuestImage, iso: Path) -> Guest:
    vm = Guest(image, *cdrom(iso))
    try:
        vm.wait_for(r"^VMPLANE-BOOT-OK", BOOT_S, "the boot")
        vm.await_shell()
    except BaseException:
        vm.stop()
        raise
    return vm


def wait_for_file(vm: Guest, path: str) -> str:
    """The guest's file `path`, once it exists (user data runs after the seed line)."""
    deadline = time.monotonic() + SEED_S
    while not vm.run(f"[ -e {path} ] && echo present").strip():
        assert time.monotonic() < deadline, f"{path} never appeared; console:\n{vm.console[-2000:]}"
        time.sleep(0.5)
    return vm.run(f"cat {path}")


@pytest.fixture(scope="module")
def image():
    if shutil.which(QEMU) is None:
        reason = f"{QEMU} is not installed"
        print(f"SKIPPED: {reason}")
        pytest.skip(reason)
    return build.cached_image() or build.build()


def guest_awk(image: build.GuestImage, tmp_path: Path) -> list[str]:
    """A command running the guest's own YAML reader (init.sh's yaml.awk) with the guest's busybox awk."""
    files = _cpio_files(image.initrd)
    busybox = tmp_path / "busybox"
    busybox.write_bytes(files["bin/busybox"])
    busybox.chmod(0o755)
    init = files["init"].decode()
    program = init.split("cat > /run/seed/yaml.awk <<'EOF'\n", 1)[1].split("\nEOF\n", 1)[0]
    (tmp_path / "yaml.awk").write_text(program + "\n")
    return [str(busybox), "awk", "-f", str(tmp_path / "yaml.awk")]


def test_the_guest_reads_the_documented_yaml_subset_and_skips_the_rest(image, tmp_path):
    user = "\n".join(
        [
            "#cloud-config",
            "hostname: 'it''s-quoted'  # a comment",
            'ssh_authorized_keys: [ssh-rsa AAA one, "ssh-rsa BBB two"]',
            "users:",
            "  - name: bob",
            "    ssh_authorized_keys:",
            "      - ssh-rsa NESTED bob",  # under users: not root's, not read
            "write_files:",
            "  - path: /x",
            "    content: |",
            "      - not an item",
            "runcmd:",
            "- plain # with a comment",
            "- [ echo, \"a b\", 'it''s' ]",
            '- "say \\"hi\\""',
            "",
        ]
    )
    out = subprocess.run(guest_awk(image, tmp_path), input=user, capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [
        "hostname\tit's-quoted",
        "ssh_authorized_keys[]\tssh-rsa AAA one",
        "ssh_authorized_keys[]\tssh-rsa BBB two",
        "users[]\tname: bob",
        "write_files[]\tpath: /x",
        "runcmd[]\tplain",
        "runcmd[]\t'echo' 'a b' 'it'\\''s'",
        'runcmd[]\tsay "hi"',
    ], out


def test_a_cloud_config_as_vmplane_writes_it_gives_runcmd_entries_that_run_as_written(image, tmp_path):
    """vmplane writes the seed with PyYAML's block style (core/cloudinit.py): an argv entry is a nested
    block list, a string with a newline a quoted scalar over several lines."""
    runcmd = ["echo first", ["printf", "%s|", "a b", "it's", "x\ny"], "echo 'q: r' '# kept'", "echo two\necho lines"]
    config = {"hostname": "h", "runcmd": runcmd, "ssh_authorized_keys": [KEY_A]}
    user = "#cloud-config\n" + yaml.safe_dump(config, sort_keys=True, default_flow_style=False, width=1 << 20)
    (tmp_path / "user-data").write_text(user)
    command = guest_awk(image, tmp_path)
    script = subprocess.run(
        [*command[:2], "-v", "only=runcmd", *command[2:], str(tmp_path / "user-data")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    (tmp_path / "runcmd").write_text(script)
    ran = subprocess.run([command[0], "sh", str(tmp_path / "runcmd")], capture_output=True, text=True, check=True)
    assert ran.stdout == "first\na b|it's|x\ny|q: r # kept\ntwo\nlines\n", (user, script, ran.stdout)
    keys = [*command[:2], "-v", "only=ssh_authorized_keys", *command[2:], str(tmp_path / "user-data")]
    assert subprocess.run(keys, capture_output=True, text=True, check=True).stdout == KEY_A + "\n"


def test_a_cloud_config_seed_sets_the_hostname_and_keys_and_runs_runcmd_in_order(image, tmp_path):
    meta = f"instance-id: iid-cloudcfg-1\nlocal-hostname: from-meta\npublic-keys:\n  - {KEY_A}\n"
    user = "\n".join(
        [
            "#cloud-config",
            "hostname: seeded-guest  # user-data's wins over meta-data's, as in cloud-init",
            "ssh_authorized_keys:",
            f"  - {KEY_B}",
            f"  - '{KEY_A}'",  # given twice: written once
            "packages: [ignored]",
            "runcmd:",
            "  - echo first > /run/marker-runcmd",
            "  - [ sh, -c, \"echo 'second' >> /run/marker-runcmd\" ]",
            "  - touch /run/marker-done",
            "",
        ]
    )
    vm = boot(image, seed_iso(tmp_path / "seed.iso", {"meta-data": meta, "user-data": user}))
    try:
        vm.wait_for(r"^vmplane-guest: seed iid-cloudcfg-1 keys=2\r?$", SEED_S, "the seed line")
        assert vm.run("hostname").strip() == "seeded-guest"
        assert sorted(vm.run("cat /root/.ssh/authorized_keys").splitlines()) == sorted([KEY_A, KEY_B])
        modes = vm.run("stat -c '%a %n' /root/.ssh /root/.ssh/authorized_keys").split()
        assert modes == ["700", "/root/.ssh", "600", "/root/.ssh/authorized_keys"], modes
        wait_for_file(vm, "/run/marker-done")
        assert vm.run("cat /run/marker-runcmd").split() == ["first", "second"]
        assert len(re.findall(r"^vmplane-guest: seed ", vm.console, re.M)) == 1
    finally:
        vm.stop()


def test_a_script_seed_runs_its_user_data_script_and_sets_the_meta_data_hostname_and_key(image, tmp_path):
    meta = f"instance-id: iid-script-1\nlocal-hostname: script-guest.example.org\npublic-keys:\n - {KEY_A}\n"
    user = "#!/bin/sh\necho to-the-log\necho ran-as-$(id -u) > /run/marker-script\n"
    vm = boot(image, seed_iso(tmp_path / "seed.iso", {"meta-data": meta, "user-data": user}))
    try:
        vm.wait_for(r"^vmplane-guest: seed iid-script-1 keys=1\r?$", SEED_S, "the seed line")
        assert vm.run("hostname").strip() == "script-guest"  # the short name, as cloud-init sets it
        assert vm.run("cat /root/.ssh/authorized_keys").splitlines() == [KEY_A]
        assert wait_for_file(vm, "/run/marker-script").strip() == "ran-as-0"
        assert "to-the-log" in vm.run("cat /run/seed/user-data.log")  # written before the marker
    finally:
        vm.stop()


def test_a_cdrom_that_is_not_a_seed_is_left_alone_and_the_guest_boots_as_before(image, tmp_path):
    iso = seed_iso(tmp_path / "other.iso", {"meta-data": "instance-id: not-a-seed\n"}, label="INSTALLER")
    vm = boot(image, iso)
    try:
        # the CD-ROM is there for the guest to see; its label is not cidata
        deadline = time.monotonic() + SEED_S
        while not vm.run("[ -b /dev/sr0 ] && echo present").strip():
            assert time.monotonic() < deadline, f"/dev/sr0 never appeared; console:\n{vm.console[-2000:]}"
            time.sleep(0.5)
        assert vm.run("dd if=/dev/sr0 bs=1 skip=32808 count=9 2>/dev/null").strip() == "INSTALLER"
        assert vm.run("[ -e /root/.ssh ] || [ -e /run/seed ] || echo untouched").strip() == "untouched"
        assert vm.run("hostname").strip() == "(none)"
        assert "vmplane-guest:" not in vm.console
    finally:
        vm.stop()
