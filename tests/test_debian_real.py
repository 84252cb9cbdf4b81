"""A real Debian guest (issue 30): the image scripts/build-debian-image.sh builds from Debian's packages
(cloud-init, openssh-server, qemu-guest-agent; GRUB on its own disk) is uploaded (`image upload`), made a
template (`template create --from-image`), and a VM from it is created on a provider network with
`--ssh-key`, `--hostname` and `--user-data` on a real local libvirtd host. Stock cloud-init reads
vmplane's NoCloud seed: it writes the user data's file and runs its runcmd, puts the key in root's
authorized_keys and configures the NIC from the seed's network-config (no DHCP), so that `ssh -i KEY
root@IP` from this machine works; its qemu-guest-agent answers and reports the VM's recorded address (to
the driver, and in `vm show`), and `vm exec` runs through it.

The guest gives no shell on its serial console (a login prompt, as a stock image): the checks inside it go
over ssh, and `vm exec` can only work through the agent. Boot under TCG with systemd and cloud-init takes
one to two minutes; the bounds are generous and the times are printed, never asserted. The image is built by
`scripts/setup.sh --test`: a machine that could build it but has not fails here; one that cannot (not root,
no apt) skips, saying why."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from .realguest import guest, host_of, keypair, libvirt_cluster, require_libvirt, run_json, ssh, wait_until

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "build-debian-image.sh"
# not the 10.40 (test_networks_real.py) nor 10.44 (test_guest_ssh_real.py) provider networks: the gateway
# address is this machine's, and two clusters up at once must not both hold it
PROVIDER = "10.46.0.0/24"
GATEWAY = "10.46.0.1"
HOSTNAME = "debian-one"
MARKER = "/var/lib/vmplane-test/marker"
RAN = "/var/lib/vmplane-test/runcmd"
USER_DATA = f"""#cloud-config
write_files:
  - path: {MARKER}
    content: "written by cloud-init\\n"
runcmd:
  - [sh, -c, "echo runcmd ran as $(id -u) > {RAN}"]
"""
BOOT_S = 900  # generous: GRUB, systemd and cloud-init (Python) under TCG on a shared 2-core machine
AGENT_S = 300


def cannot_build() -> str | None:
    """Why this machine can not build the image (None when it can)."""
    if os.geteuid() != 0:
        return "building the Debian test image needs root (mmdebstrap's root mode)"
    if shutil.which("apt-get") is None:
        return "building the Debian test image needs apt-get (Debian's package registry)"
    return None


@pytest.fixture(scope="module")
def image() -> Path:
    """The built image: a failure when this machine could have built it, a skip when it can not."""
    require_libvirt()
    found = subprocess.run(["bash", str(SCRIPT), "--path"], capture_output=True, text=True)
    path = Path(found.stdout.strip())
    if found.returncode == 0:
        return path
    reason = cannot_build()
    if reason:
        print(f"SKIPPED: {reason}")
        pytest.skip(reason)
    pytest.fail(f"the Debian test image is not built ({path}): run {SCRIPT.name} (setup.sh --test does)")


@pytest.fixture(scope="module")
def debian(tmp_path_factory, image):
    """A running VM from the Debian image on the provider network: (live, its `vm show`, the private key,
    when it was started)."""
    folder = tmp_path_factory.mktemp("debian")
    key = keypair(folder, "debian-key")
    (folder / "user-data").write_text(USER_DATA)
    live = libvirt_cluster(tmp_path_factory.mktemp("cluster"), hosts=1)
    try:
        run_json(live, "offering", "create", "deb", "--kind", "fixed", "--vcpus", "1", "--memory", "768")
        t0 = time.monotonic()
        run_json(live, "image", "upload", "debian", str(image))
        run_json(live, "template", "create", "debian", "--from-image", "debian")
        print(f"\n  image upload + template: {time.monotonic() - t0:.1f} s ({image.stat().st_size >> 20} MiB)")
        run_json(live, "network", "create", "pub", "--provider", "--shared", "--cidr", PROVIDER)
        run_json(live, "secgroup", "create", "ssh", "--project", "p")
        rule = ("--direction", "in", "--proto", "tcp", "--port", "22", "--from", f"{GATEWAY}/32")
        run_json(live, "secgroup", "rule", "add", "ssh", "--project", "p", *rule)
        started = time.monotonic()
        run_json(
            live,
            *("vm", "create", "d1", "--project", "p", "--offering", "deb", "--template", "debian"),
            *("--network", "pub", "--secgroup", "default", "--secgroup", "ssh"),
            *("--ssh-key", f"{key}.pub", "--hostname", HOSTNAME, "--user-data", str(folder / "user-data"), "--start"),
        )
        vm = wait_until(lambda: (v := run_json(live, "vm", "show", "d1"))["state"] == "running" and v, 300, "d1 up")
        yield live, vm, key, started
    finally:
        live.stop()


def test_cloud_init_runs_the_user_data_and_installs_the_key_and_ssh_from_this_machine_works(debian):
    _, vm, key, started = debian
    address = vm["nics"][0]["ip"]

    def marker():
        r = ssh(key, address, f"cat {MARKER}")
        return r.stdout if r.returncode == 0 else None

    # refused or unanswered until the guest booted, cloud-init configured its NIC, key and user data
    assert wait_until(marker, BOOT_S, f"ssh root@{address} cat {MARKER}") == "written by cloud-init\n"
    uptime = ssh(key, address, "cut -d' ' -f1 /proc/uptime").stdout.strip()
    waited = time.monotonic() - started
    print(f"\n  ssh answered with the marker {waited:.1f} s after vm create --start (guest uptime {uptime} s)")
    status = ssh(key, address, "cloud-init status --wait")
    assert status.returncode == 0 and "status: done" in status.stdout, status.stdout + status.stderr
    r = ssh(key, address, f"cat {RAN}; hostname; cat /root/.ssh/authorized_keys")
    assert r.returncode == 0, r.stderr
    ran, hostname, *authorized = r.stdout.splitlines()
    assert (ran, hostname) == ("runcmd ran as 0", HOSTNAME)
    given = Path(f"{key}.pub").read_text().split()[:2]
    assert given in [line.split()[:2] for line in authorized], authorized  # as a plain key: no forced command
    r = ssh(key, address, "ip -4 -o addr show dev eth0")
    assert f"inet {address}/24" in r.stdout, r.stdout  # the seed's static address, on the NIC named eth0


def test_its_guest_agent_answers_and_reports_the_recorded_address(debian):
    from vmplane.hosts.drivers.libvirt import LibvirtDriver

    live, vm, key, _ = debian
    nic = vm["nics"][0]
    driver = LibvirtDriver(vm["host"], host_of(live, vm["host"]).uri)
    try:
        wait_until(lambda: driver.agent_ping("vmplane-d1"), AGENT_S, "the guest agent's ping")

        def reported():
            found = {i.mac: i.addresses for i in driver.agent_interfaces("vmplane-d1")}
            return found if f"{nic['ip']}/24" in found.get(nic["mac"].lower(), []) else None

        # the address comes once cloud-init configured the NIC, a while after the agent starts
        wait_until(reported, BOOT_S, f"the agent reporting {nic['ip']} on {nic['mac']}")
        # when systemd started it, in seconds of the guest's uptime (printed: a measurement, not a check)
        since = "systemctl show -p ActiveEnterTimestampMonotonic --value qemu-guest-agent"
        started_us = ssh(key, nic["ip"], since).stdout.strip()
        if started_us.isdigit():
            print(f"\n  qemu-ga started {int(started_us) / 1e6:.1f} s into the guest's boot")
    finally:
        driver.close()
    # what a user sees of it: `vm show` says the agent is connected, with the guest's address beside the
    # recorded one, and `vm exec` runs through it (the console has no shell to fall back on)
    shown = wait_until(
        lambda: (v := run_json(live, "vm", "show", "d1"))["agent"] == "connected" and v["guest_addresses"] and v,
        AGENT_S,
        "vm show: agent connected, with the guest's addresses",
    )
    assert f"eth0 {nic['ip']}/24" in shown["guest_addresses"], shown
    assert guest(live, "d1", f"cat {MARKER}; id -un") == "written by cloud-init\nroot\n"
