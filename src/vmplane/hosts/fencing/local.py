"""The fence agent of local hosts (localhosts): a power cut, done on the host's processes.

Its "BMC" is this machine's process table, which does not depend on the host's libvirtd: power_off
SIGKILLs the host's libvirtd, every QEMU it ran, its virtlockd and its heartbeat writer
(localhosts.cut_power, the nemesis's "power" mode), and the host is confirmed off once none of them
is alive (a zombie is dead). It is recorded as a power failure, so `host recover` starts it again.
"""

from __future__ import annotations

import time

from vmplane.hosts import localhosts
from vmplane.hosts.fencing.base import Fenced, FenceError


class LocalAgent:
    kind = "local"

    def __init__(self, host: localhosts.LocalHost):
        self.host = host

    def _left(self) -> list[str]:
        return [f"{role} {pid}" for role, pids in localhosts.processes(self.host).items() for pid in pids]

    def power_off(self, host: str, timeout_s: float = 30.0) -> Fenced:
        start = time.monotonic()
        try:
            localhosts.fail(self.host, "power")
        except OSError as exc:
            raise FenceError(self.kind, host, f"cutting the power: {exc}") from None
        while True:
            left = self._left()
            if not left:
                return Fenced(
                    self.kind, host, "no process left (libvirtd, QEMU, virtlockd, heartbeat)", time.monotonic() - start
                )
            if time.monotonic() - start > timeout_s:
                raise FenceError(self.kind, host, f"still alive after {timeout_s:g} s: {', '.join(left)}")
            time.sleep(0.05)

    def status(self, host: str) -> str:
        return "on" if self._left() else "off"


def from_config(config: dict, uri: str | None, name: str) -> LocalAgent:
    host = localhosts.from_uri(uri)
    if host is None:
        raise ValueError(f"agent: local fences only local hosts; {name}'s uri {uri!r} is not one")
    return LocalAgent(host)
