"""SSH into the small test guest (issue 30): a VM created with `vm create --ssh-key` on a provider network,
on a real local libvirtd host, is reached from this machine with `ssh -i KEY root@IP` (the guest's dropbear,
the key from its cloud-init seed) and answers its hostname; a key that was not given is refused. The
network's gateway is this machine's side of the hosts' switch (docs/operations/networks.md); the project's
`default` group lets in only its own members, so the VM is also in a group opening tcp/22 to that address.
The guest's initramfs is also checked without a boot: dropbear runs from its files alone, and root's entry is
the one dropbear needs."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from vmplane.hosts.guest import build

from .realguest import keypair, libvirt_cluster, run_json, ssh, wait_until
from .test_guest_disk import _cpio_files

# not test_networks_real.py's 10.40.0.0/24 (nor bench/network.py's): the gateway address is this machine's,
# and two clusters up at once must not both hold it
PROVIDER = "10.44.0.0/24"
GATEWAY = "10.44.0.1"
HOSTNAME = "ssh-guest-1"
SSH_S = 240  # generous: boot, DHCP and the seed under TCG on a shared 2-core machine


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("ssh-keys")
    return {"given": keypair(folder, "given"), "other": keypair(folder, "other")}


@pytest.fixture(scope="module")
def address(tmp_path_factory, keys):
    """The address of a running VM on the provider network, created with the `given` key."""
    live = libvirt_cluster(tmp_path_factory.mktemp("ssh"), hosts=1)
    try:
        run_json(live, "offering", "create", "ssh", "--kind", "fixed", "--vcpus", "1", "--memory", "256")
        run_json(live, "network", "create", "pub", "--provider", "--shared", "--cidr", PROVIDER)
        run_json(live, "secgroup", "create", "ssh", "--project", "p")
        rule = ("--direction", "in", "--proto", "tcp", "--port", "22", "--from", f"{GATEWAY}/32")
        run_json(live, "secgroup", "rule", "add", "ssh", "--project", "p", *rule)
        run_json(
            live,
            *("vm", "create", "s1", "--project", "p", "--offering", "ssh", "--template", "tiny-linux"),
            *("--network", "pub", "--secgroup", "default", "--secgroup", "ssh"),
            *("--ssh-key", f"{keys['given']}.pub", "--hostname", HOSTNAME, "--start"),
        )
        vm = wait_until(lambda: (v := run_json(live, "vm", "show", "s1"))["state"] == "running" and v, 300, "s1 up")
        yield vm["nics"][0]["ip"]
    finally:
        live.stop()


@pytest.fixture(scope="module")
def answered(keys, address) -> str:
    """What `hostname; id -u` over SSH with the given key answered, once it answered: until the guest is up
    and its seed's key in place, the connection is refused, times out or the key is not accepted."""
    t0 = time.monotonic()
    while (last := ssh(keys["given"], address, "hostname; id -u")).returncode != 0:
        assert time.monotonic() - t0 < SSH_S, f"ssh root@{address}: not within {SSH_S} s; last: {last.stderr}"
        time.sleep(1)
    print(f"\n  ssh answered {time.monotonic() - t0:.1f} s after the VM was running")
    return last.stdout


def test_ssh_with_the_key_given_at_create_reaches_the_guest_as_root(answered):
    assert answered.split() == [HOSTNAME, "0"]


def test_a_key_not_given_is_refused_and_no_password_is_asked(keys, address, answered):
    r = ssh(keys["other"], address, "hostname")
    assert r.returncode == 255 and r.stdout == "", r.stdout + r.stderr
    assert "Permission denied (publickey)" in r.stderr, r.stderr  # publickey is the only method offered


def test_dropbear_runs_from_the_initramfs_files_alone_and_root_has_a_home_and_a_shell(tmp_path):
    files = _cpio_files((build.cached_image() or build.build()).initrd)
    assert files["etc/passwd"].decode().splitlines() == ["root:x:0:0:root:/root:/bin/sh"]
    assert files["etc/shells"].decode().split() == ["/bin/sh"]  # dropbear refuses a user whose shell is not listed
    if os.geteuid() != 0 or shutil.which("chroot") is None:
        pytest.skip("needs root and chroot")
    for name, data in files.items():
        if name == build.SSH_BINARY or name.startswith(("lib/x86_64-linux-gnu/", "lib64/")):
            path = tmp_path / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            path.chmod(0o755)
    out = subprocess.run(["chroot", str(tmp_path), f"/{build.SSH_BINARY}", "-V"], capture_output=True, text=True)
    assert out.returncode == 0 and "Dropbear" in out.stderr, out.stdout + out.stderr
