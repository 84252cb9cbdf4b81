"""A local libvirtd host with one real guest QEMU, at driver level, for the fencing and nemesis tests."""

from __future__ import annotations

import os
from pathlib import Path

from vmplane.core.driver import DomainSpec
from vmplane.hosts import localhosts

from .realguest import require_libvirt

GUEST = DomainSpec("g1", 1, 1, 128, 128, "tiny-linux")


class OneGuestHost:
    def __init__(self, base: Path):
        from vmplane.hosts.drivers.libvirt import LibvirtDriver

        self.base = base
        self.host = localhosts.start(base, "h1", 0)
        self.driver = LibvirtDriver("h1", self.host.uri)
        self.driver.start(GUEST)
        self.qemu = self.driver.qemu_pid("g1")

    def restore(self) -> None:
        """Undo what a test broke, so that tests can share one host: a failed, stopped or partitioned
        daemon is recovered (a daemon that runs is adopted as it is), and a guest lost with it (power cut,
        stop) is started again."""
        procs = self.processes()
        if localhosts.failed(self.host) or not all(procs[role] for role in ("libvirtd", "virtlockd", "heartbeat")):
            localhosts.recover(self.host)
        if self.qemu not in self.processes()["qemu"] or not alive(self.qemu):
            self.driver.start(GUEST)
            self.qemu = self.driver.qemu_pid("g1")

    def close(self) -> None:
        localhosts.stop(self.host)  # first: a partitioned daemon is let go before the driver says bye
        self.driver.close()

    def processes(self) -> dict[str, list[int]]:
        return localhosts.processes(self.host)


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def one_guest_host(tmp_path_factory):
    """The body of a test fixture: yields a OneGuestHost, then stops it and checks nothing is left."""
    reason = localhosts.available()
    if reason:
        print(f"fencing test skipped: {reason}")
    require_libvirt()
    h = OneGuestHost(tmp_path_factory.mktemp("ha") / "hosts")
    try:
        yield h
    finally:
        h.close()
        assert not any(h.processes().values()), h.processes()
        assert os.path.exists(h.host.dir)
