"""The test guest's network, on plain QEMU (TCG, no libvirt): a guest with a virtio NIC brings it up by DHCP
at boot and says its address on the console, reaches the host through it, keeps an address set by hand
across a lease's release and renewal, brings up a NIC hot-plugged later; a guest with no NIC boots and
answers as before, with no DHCP client running.

QEMU's user network (slirp) is the DHCP server: 10.0.2.15/24, gateway 10.0.2.2 (the host's 127.0.0.1),
DNS 10.0.2.3. The guest is driven over its serial console (QEMU's stdio) the way vmplane's libvirt driver
does it: a probe until the shell answers, then each command between markers of its own."""

import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from vmplane.hosts.guest import build

QEMU = "qemu-system-x86_64"
MAC = "02:76:70:00:00:01"
HOTPLUG_MAC = "02:76:70:00:00:02"
BOOT_S = 240  # generous bounds: TCG on a shared 2-core machine
LEASE_S = 120
ETH0_LINE = r"^vmplane-guest: eth0 10\.0\.2\.15/24\r?$"  # the console line of the lease on eth0


def nic_lines(text: str, nic: str) -> list[str]:
    """The addresses the guest announced for `nic` (`vmplane-guest: eth0 10.0.2.15/24`), in order."""
    return re.findall(rf"^vmplane-guest: {nic} (\S+)\r?$", text, re.M)


class Guest:
    """One QEMU process booting the test guest, its serial console on stdio, its monitor on a socket."""

    def __init__(self, image: build.GuestImage, *extra: str):
        self._dir = tempfile.TemporaryDirectory(prefix="vmplane-guestnet-")
        self.monitor_path = Path(self._dir.name) / "monitor.sock"
        self._out = b""
        self._cond = threading.Condition()
        args = [QEMU, "-accel", "tcg", "-machine", "q35", "-m", "256", "-smp", "1", "-nodefaults"]
        args += ["-no-user-config", "-display", "none", "-serial", "stdio"]
        args += ["-monitor", f"unix:{self.monitor_path},server=on,wait=off"]
        args += ["-kernel", str(image.kernel), "-initrd", str(image.initrd), "-append", image.cmdline, *extra]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while chunk := os.read(fd, 65536):
            with self._cond:
                self._out += chunk
                self._cond.notify_all()

    @property
    def console(self) -> str:
        with self._cond:
            return self._out.decode(errors="replace")

    def wait_for(self, pattern: str, timeout: float, what: str) -> re.Match:
        """The first match of `pattern` in the console's output, waited for up to `timeout` s."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not (m := re.search(pattern, self._out.decode(errors="replace"), re.M | re.S)):
                left = deadline - time.monotonic()
                assert left > 0 and self.proc.poll() is None, f"{what}: not seen; console:\n{self.console[-2000:]}"
                self._cond.wait(min(left, 0.5))
            return m

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text.encode())
        self.proc.stdin.flush()

    def await_shell(self, timeout: float = BOOT_S) -> None:
        """Probe every second until the console's shell answers (input sent before it reads is lost)."""
        deadline = time.monotonic() + timeout
        tags: list[str] = []
        while True:
            tags.append(uuid.uuid4().hex[:8])
            self.send(f"echo __R''{tags[-1]}__\n")  # the quotes keep the echoed line from matching
            try:
                self.wait_for("|".join(f"__R{t}__" for t in tags), 1.0, "the shell")
                return
            except AssertionError:
                assert time.monotonic() < deadline, f"the shell did not answer; console:\n{self.console[-2000:]}"

    def run(self, command: str, timeout: float = 60) -> str:
        """A shell command's output, between markers of its own."""
        tag = uuid.uuid4().hex[:8]
        self.send(f"echo __B''{tag}__; {command}; echo __E''{tag}_$?__\n")
        m = self.wait_for(rf"__B{tag}__\r?\n(.*?)__E{tag}_(\d+)__", timeout, command)
        return m.group(1).replace("\r", "")

    def monitor(self, command: str) -> str:
        """One human-monitor command (device_add, netdev_add...); its answer."""
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(30)
            s.connect(str(self.monitor_path))
            answer = b""
            while not answer.endswith(b"(qemu) "):
                answer += s.recv(4096)
            s.sendall(command.encode() + b"\n")
            answer = b""
            while not answer.endswith(b"(qemu) "):
                answer += s.recv(4096)
        return answer.decode(errors="replace")

    def stop(self) -> None:
        self.proc.kill()  # this QEMU, by its pid
        self.proc.wait(timeout=30)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe:
                pipe.close()
        self._dir.cleanup()


@pytest.fixture(scope="module")
def image():
    if shutil.which(QEMU) is None:
        reason = f"{QEMU} is not installed"
        print(f"SKIPPED: {reason}")
        pytest.skip(reason)
    return build.cached_image() or build.build()


@pytest.fixture(scope="module")
def networked(image):
    """A guest with one virtio NIC on QEMU's user network and a free PCIe port for a hot-plugged one."""
    vm = Guest(
        image,
        *("-netdev", "user,id=n0", "-device", f"virtio-net-pci,netdev=n0,mac={MAC}"),
        *("-device", "pcie-root-port,id=rp1,chassis=1,slot=1"),
    )
    try:
        vm.wait_for(r"^VMPLANE-BOOT-OK", BOOT_S, "the boot")
        vm.await_shell()
        yield vm
    finally:
        vm.stop()


def test_a_guest_with_a_nic_gets_its_address_by_dhcp_at_boot_and_reaches_the_host(networked):
    networked.wait_for(ETH0_LINE, LEASE_S, "the eth0 line")
    shown = networked.run("ip addr show eth0")
    assert f"link/ether {MAC}" in shown and "inet 10.0.2.15/24" in shown and "UP" in shown, shown
    assert "default via 10.0.2.2 dev eth0" in networked.run("ip route"), networked.run("ip route")
    assert "nameserver 10.0.2.3" in networked.run("cat /etc/resolv.conf")
    # a TCP connection from the guest reaches this machine (slirp's 10.0.2.2 is the host's loopback)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(LEASE_S)
        port = server.getsockname()[1]
        # in a subshell of its own, in the background: the console's shell reports no job of it later
        networked.run(f"(echo hello-from-the-guest | nc -w 10 10.0.2.2 {port} >/dev/null 2>&1 &)")
        conn, _ = server.accept()
        with conn:
            conn.settimeout(60)
            assert conn.recv(100).startswith(b"hello-from-the-guest")


def test_an_address_set_by_hand_stays_through_a_lease_release_and_renewal(networked):
    networked.wait_for(ETH0_LINE, LEASE_S, "the eth0 line")
    networked.run("ip addr add 192.168.77.5/24 dev eth0")
    networked.run("kill -USR2 $(cat /run/net/eth0.pid)")  # release: the lease's address goes, by the script
    deadline = time.monotonic() + LEASE_S
    while "10.0.2.15/24" in (shown := networked.run("ip addr show eth0")):
        assert time.monotonic() < deadline, f"the released address stayed: {shown}"
        time.sleep(0.5)
    assert "inet 192.168.77.5/24" in shown, shown
    before = len(nic_lines(networked.console, "eth0"))
    networked.run("kill -USR1 $(cat /run/net/eth0.pid)")  # renew: a fresh lease, announced again
    networked.wait_for(f"(?:.*?{ETH0_LINE}){{{before + 1}}}", LEASE_S, "the eth0 line after the renewal")
    shown = networked.run("ip addr show eth0")
    assert "inet 10.0.2.15/24" in shown and "inet 192.168.77.5/24" in shown, shown
    networked.run("ip addr del 192.168.77.5/24 dev eth0")


def test_a_hot_plugged_nic_is_brought_up_by_dhcp_too(networked):
    assert "Error" not in networked.monitor("netdev_add user,id=n1,net=10.0.3.0/24")
    answer = networked.monitor(f"device_add virtio-net-pci,netdev=n1,id=nic1,bus=rp1,mac={HOTPLUG_MAC}")
    assert "Error" not in answer, answer
    networked.wait_for(r"^vmplane-guest: eth1 10\.0\.3\.15/24\r?$", LEASE_S, "the eth1 line")
    assert f"link/ether {HOTPLUG_MAC}" in networked.run("ip addr show eth1")
    routes = networked.run("ip route")
    # eth0's default route is still the one taken (the lower metric); eth1's is there behind it
    assert re.search(r"default via 10\.0\.2\.2 dev eth0 +metric 100", routes), routes
    assert re.search(r"default via 10\.0\.3\.2 dev eth1 +metric 101", routes), routes


def test_a_guest_with_no_nic_boots_answers_and_runs_no_dhcp_client(image):
    vm = Guest(image)
    try:
        vm.wait_for(r"^VMPLANE-BOOT-OK", BOOT_S, "the boot")
        vm.await_shell()
        assert vm.run("(cd /sys/class/net && echo *)").split() == ["lo"]
        assert vm.run("pidof udhcpc").strip() == ""
        assert "inet 127.0.0.1/8" in vm.run("ip addr show lo")
        assert "vmplane-guest:" not in vm.console
    finally:
        vm.stop()
