"""The Redfish fence agent: a host's BMC over HTTP(S), through `sushy`, Ironic's Redfish client.

power_off asks the system for a ForceOff reset (a hard power-off), then reads its PowerState until
it is Off. `address` is the BMC's base URL ("https://bmc:8000"); `system` the system's path
("/redfish/v1/Systems/1"), or empty for a BMC with one system. Every sushy error (a 401 for a wrong
password, a refused connection, a system that is not there) becomes a FenceError with its words.
"""

from __future__ import annotations

import time

from vmplane.hosts.fencing.base import Fenced, FenceError


class RedfishAgent:
    kind = "redfish"

    def __init__(self, address: str, username: str, password: str, system: str = "", verify: bool = True):
        self.address = address.rstrip("/")
        self.username, self.password, self.system_path, self.verify = username, password, system, verify

    def _system(self, host: str):
        import sushy

        try:
            root = sushy.Sushy(
                self.address + "/redfish/v1",
                username=self.username,
                password=self.password,
                verify=self.verify,
                server_side_retries=1,
                server_side_retries_delay=1,
                read_timeout=15,
                connect_timeout=5,
            )
            return root.get_system(self.system_path or None)
        except sushy.exceptions.SushyError as exc:
            raise FenceError(self.kind, host, f"{self.address}: {exc}") from None

    def _state(self, host: str, system) -> str:
        import sushy

        try:
            system.refresh(force=True)
        except sushy.exceptions.SushyError as exc:
            raise FenceError(self.kind, host, f"reading PowerState: {exc}") from None
        return "off" if system.power_state == sushy.PowerState.OFF else "on"

    def status(self, host: str) -> str:
        return self._state(host, self._system(host))

    def power_off(self, host: str, timeout_s: float = 30.0) -> Fenced:
        import sushy

        start = time.monotonic()
        system = self._system(host)
        try:
            system.reset_system(sushy.ResetType.FORCE_OFF)
        except sushy.exceptions.SushyError as exc:
            raise FenceError(self.kind, host, f"ForceOff: {exc}") from None
        while True:
            if self._state(host, system) == "off":
                return Fenced(self.kind, host, "PowerState Off (Redfish)", time.monotonic() - start)
            if time.monotonic() - start > timeout_s:
                raise FenceError(self.kind, host, f"PowerState still not Off {timeout_s:g} s after ForceOff")
            time.sleep(0.5)


def from_config(config: dict, uri: str | None, name: str) -> RedfishAgent:
    return RedfishAgent(config["address"], config["username"], config["password"], config["system"], config["verify"])
