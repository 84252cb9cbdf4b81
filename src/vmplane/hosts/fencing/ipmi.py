"""The IPMI fence agent: a host's BMC through `ipmitool` (IPMI 2.0, lanplus).

power_off sends `chassis power off` (a hard power-off, as pulling the plug), then reads
`chassis power status` until the BMC says off: the command's success alone confirms nothing. The
password goes through the environment (`-E`), never the command line, where `ps` would show it.
Cipher suite 3 (the one every IPMI 2.0 BMC has) is asked outright: letting ipmitool negotiate costs
seconds against BMCs that do not list their suites. Any failure is a FenceError with ipmitool's own
words ("Unable to establish IPMI v2 / RMCP+ session" for a wrong password or a BMC out of reach).
"""

from __future__ import annotations

import os
import subprocess
import time

from vmplane.hosts.fencing.base import Fenced, FenceError


class IpmiAgent:
    kind = "ipmi"

    def __init__(self, address: str, port: int, username: str, password: str, cipher: int = 3):
        self.address, self.port, self.username, self.password, self.cipher = address, port, username, password, cipher

    def _run(self, host: str, *args: str, timeout_s: float = 20.0) -> str:
        cmd = [
            "ipmitool",
            "-I",
            "lanplus",
            "-C",
            str(self.cipher),
            "-N",
            "2",
            "-R",
            "3",
            "-H",
            self.address,
            "-p",
            str(self.port),
            "-U",
            self.username,
            "-E",
            "chassis",
            "power",
            *args,
        ]
        try:
            done = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                env={**os.environ, "IPMI_PASSWORD": self.password},
            )
        except FileNotFoundError:
            raise FenceError(self.kind, host, "ipmitool is not installed") from None
        except subprocess.TimeoutExpired:
            raise FenceError(
                self.kind, host, f"ipmitool chassis power {args[0]}: no answer in {timeout_s:g} s"
            ) from None
        if done.returncode != 0:
            words = " ".join((done.stderr + done.stdout).split()) or f"exit status {done.returncode}"
            raise FenceError(
                self.kind, host, f"ipmitool chassis power {args[0]} at {self.address}:{self.port}: {words}"
            )
        return done.stdout.strip()

    def status(self, host: str) -> str:
        out = self._run(host, "status")
        if out.endswith(" off"):
            return "off"
        if out.endswith(" on"):
            return "on"
        raise FenceError(self.kind, host, f"unexpected power status from ipmitool: {out!r}")

    def power_off(self, host: str, timeout_s: float = 30.0) -> Fenced:
        start = time.monotonic()
        self._run(host, "off")
        while True:
            if self.status(host) == "off":
                return Fenced(self.kind, host, "chassis power is off (ipmitool)", time.monotonic() - start)
            if time.monotonic() - start > timeout_s:
                raise FenceError(self.kind, host, f"chassis power still on {timeout_s:g} s after power off")
            time.sleep(0.5)


def from_config(config: dict, uri: str | None, name: str) -> IpmiAgent:
    return IpmiAgent(config["address"], config["port"], config["username"], config["password"], config["cipher"])
