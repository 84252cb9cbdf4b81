"""The fence-agent interface: how vmplane makes sure a failed host runs nothing before its VMs are
started elsewhere (docs/design/ha.md).

An agent powers a host off and says whether it is off, through a path that does not depend on the
host's own libvirtd (a BMC over IPMI or Redfish, or, for local hosts, the processes themselves).
`power_off` returns only once the host is *confirmed* off (read back through the same path); anything
else raises FenceError with a reason an operator can act on. vmplane restarts nothing until then.

A host's agents are configured as a list of plain dicts (hosts.fence_agents), tried in order:
    {"agent": "local"}                                              a local host (localhosts)
    {"agent": "ipmi", "address": "10.0.0.5", "port": 623, "username": "...", "password": "..."}
    {"agent": "redfish", "address": "https://bmc:8000", "system": "/redfish/v1/Systems/1",
     "username": "...", "password": "...", "verify": false}
    {"agent": "sim"}                                                a simulated host (the sim fabric)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class FenceError(Exception):
    """The agent could not power the host off, or could not confirm it is off."""

    def __init__(self, agent: str, host: str, message: str):
        super().__init__(f"{agent} agent for {host}: {message}")
        self.agent, self.host, self.message = agent, host, message


@dataclass(frozen=True)
class Fenced:
    """A confirmed power-off: which agent did it and what it read back."""

    agent: str
    host: str
    detail: str  # e.g. "chassis power is off (ipmitool)", "PowerState Off", "no process left"
    seconds: float  # from the request to the confirmation


class FenceAgent(Protocol):
    kind: str

    def power_off(self, host: str, timeout_s: float = 30.0) -> Fenced:
        """Power the host off and wait (up to timeout_s) until it is confirmed off."""
        ...

    def status(self, host: str) -> str:
        """ "on" or "off", read now; FenceError when it can not be read."""
        ...
