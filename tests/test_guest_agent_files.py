"""The test guest carries the QEMU guest agent (issue 30): Debian's qemu-ga, every library it loads, the
loader and the virtio_console module, in its initramfs; and every domain gets the agent's channel. Checked
without booting: the initramfs's files are read back, and qemu-ga is run in a chroot of them (the loader
then finds its libraries exactly as the guest's does). Booted guests: test_agent_real.py."""

from __future__ import annotations

import os
import shutil
import subprocess
from xml.etree import ElementTree

import pytest

from vmplane.core.driver import DomainSpec
from vmplane.hosts.drivers.domainxml import AGENT_CHANNEL, HOTPLUG_PORTS, domain_xml
from vmplane.hosts.guest import build

from .test_guest_disk import _cpio_files


@pytest.fixture(scope="module")
def files() -> dict[str, bytes]:
    image = build.cached_image()
    if image is None:
        pytest.skip("the guest image is not built (python -m vmplane.hosts.guest.build)")
    return _cpio_files(image.initrd)


def test_the_initramfs_holds_qemu_ga_and_every_library_it_loads(files):
    assert files[build.AGENT_BINARY].startswith(b"\x7fELF")
    assert files[f"lib64/{build.LOADER}"].startswith(b"\x7fELF")
    libs = {name.rsplit("/", 1)[1] for name in files if name.startswith("lib/x86_64-linux-gnu/")}
    for name in [build.AGENT_BINARY, *(f"lib/x86_64-linux-gnu/{lib}" for lib in libs)]:
        missing = set(build.elf_needed(files[name])) - libs - {build.LOADER}
        assert not missing, f"{name} needs {missing}, not in the initramfs"
    assert {"libc.so.6", "libglib-2.0.so.0"} <= libs
    agent = (build.AGENT_BINARY, "lib/x86_64-linux-gnu/", "lib64/")
    added = sum(len(data) for name, data in files.items() if name.startswith(agent))
    print(f"\nqemu-ga with {len(libs)} libraries and the loader: {added} bytes in the initramfs (uncompressed)")


def test_the_agents_port_driver_is_loaded(files):
    order = files["lib/modules/load-order"].decode().split()
    assert "virtio_console" in order and "lib/modules/virtio_console.ko" in files
    init = files["init"].decode()
    assert "qemu-ga -m virtio-serial -p /dev/virtio-ports/org.qemu.guest_agent.0" in init


def test_qemu_ga_runs_from_the_initramfs_files_alone(files, tmp_path):
    if os.geteuid() != 0 or shutil.which("chroot") is None:
        pytest.skip("needs root and chroot")
    for name, data in files.items():
        if name == build.AGENT_BINARY or name.startswith(("lib/x86_64-linux-gnu/", "lib64/")):
            path = tmp_path / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            path.chmod(0o755)
    out = subprocess.run(
        ["chroot", str(tmp_path), f"/{build.AGENT_BINARY}", "--version"], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0 and "QEMU Guest Agent" in out.stdout, out.stdout + out.stderr


def test_every_domain_has_the_guest_agents_channel_and_its_hotplug_ports():
    spec = DomainSpec("vm1", 1, 1, 256, 256, "tiny-linux")
    devices = ElementTree.fromstring(domain_xml(spec, "/k", "/i", "console=ttyS0")).find("devices")
    channels = devices.findall("channel")
    assert len(channels) == 1 and channels[0].get("type") == "unix"
    target = channels[0].find("target")
    assert (target.get("type"), target.get("name")) == ("virtio", AGENT_CHANNEL) == ("virtio", "org.qemu.guest_agent.0")
    assert channels[0].find("source") is None  # libvirt picks the socket's path
    ports = [c for c in devices.findall("controller") if c.get("model") == "pcie-root-port"]
    assert len(ports) == HOTPLUG_PORTS
