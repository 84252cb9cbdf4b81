"""The `sim` fence agent: powers a simulated host off in the sim fabric (drivers/simhosts.py).

Config: {"agent": "sim"}. The fabric is the host's (`SimAgent(driver.fabric)`, or
`SimAgent(SimFabric.for_store(url))`): its file is shared by every process of the store, so a power-off
by one control plane is what every other one reads back.

As a BMC, it goes around the host's daemon: it works on a host whose daemon is dead or that the control
plane can not reach. `power_off` cuts the power (every domain of the host gone at once, no event) and
returns only once the state read back says off. `fabric.set_fence_broken(host, reason)` makes it fail
as a dead BMC would ("dead": power_off and status raise FenceError with the reason) or as a BMC that
accepts the order and does nothing ("ignores": power_off raises after `timeout_s` without a
confirmation; status reads "on").

`sim_signal(fabric, host)` is the sim host's own liveness signal, independent of its daemon (the
model of the shared-storage heartbeat): alive unless the host is powered off.
"""

from __future__ import annotations

import time

from vmplane.hosts.drivers.simfabric import SimFabric
from vmplane.hosts.fencing.base import Fenced, FenceError

POLL_S = 0.02


class SimAgent:
    kind = "sim"

    def __init__(self, fabric: SimFabric):
        self.fabric = fabric

    def _state(self, host: str):
        state = self.fabric.host_state(host)
        if state.fence_broken and state.fence_mode == "dead":
            raise FenceError(self.kind, host, f"the power controller does not answer: {state.fence_broken}")
        return state

    def power_off(self, host: str, timeout_s: float = 30.0) -> Fenced:
        """Cut the host's power and wait (up to timeout_s) until it reads back off."""
        t0 = time.monotonic()
        state = self._state(host)
        if not state.fence_broken:
            self.fabric.fail_host(host, "power")
        while True:
            state = self._state(host)
            if state.power == "off":
                return Fenced(
                    self.kind, host, "sim host power is off (read back from the fabric)", time.monotonic() - t0
                )
            if time.monotonic() - t0 >= timeout_s:
                why = f": {state.fence_broken}" if state.fence_broken else ""
                raise FenceError(
                    self.kind, host, f"power-off asked, but the host is still on after {timeout_s:g} s{why}"
                )
            time.sleep(POLL_S)

    def status(self, host: str) -> str:
        """ "on" or "off", read now; FenceError when the power controller does not answer."""
        return self._state(host).power


def sim_signal(fabric: SimFabric, host: str):
    """The sim host's own liveness (its heartbeat, independent of its daemon and of the control plane's
    network): alive unless it is powered off. A liveness.Signal(alive, detail); a plain (alive, detail)
    tuple while liveness.py does not exist yet."""
    state = fabric.host_state(host)
    if state.power == "off":
        alive, detail = False, "sim host is powered off" + (" (it comes back by itself)" if state.until else "")
    else:
        alive, detail = (
            True,
            {
                None: "sim host is on",
                "daemon": "sim host is on (its libvirtd is dead, its guests run on)",
                "network": "sim host is on (unreachable from the control plane, its guests run on)",
            }[state.mode],
        )
    try:
        from vmplane.hosts.liveness import Signal
    except ImportError:
        return alive, detail
    return Signal(alive, detail)
