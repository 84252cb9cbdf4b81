"""The QEMU guest agent methods of LibvirtDriver (issue 30): ping, the guest's interfaces, a command run
through `guest-exec`, and a shutdown through `guest-shutdown`, over the domain's org.qemu.guest_agent.0
channel (domainxml.py gives every domain one).

libvirt speaks to the agent: `libvirt_qemu.qemuAgentCommand` sends one command with a timeout of its own.
Before it, once the agent was out of step (a call timed out), libvirt syncs with it (`guest-sync`), bounded
not by that timeout but by the domain's agent response timeout, 5 s by default (measured: a hung agent's
second ping took 5.00 s): every call first sets that to SYNC_S, and the command gets what is left of its
caller's bound. A domain whose guest runs no agent fails at once (libvirt knows the channel is not
connected), never after a timeout. The shutdown goes through libvirt's own agent shutdown
(virDomainShutdownFlags with the GUEST_AGENT flag), which knows that `guest-shutdown` never answers when
it works.
"""

from __future__ import annotations

import base64
import json
import math
import time
from typing import TYPE_CHECKING, Any

import libvirt
import libvirt_qemu

from vmplane.core.driver import DriverError, GuestInterface

# guest-exec's command runs under the guest's sh, its standard error merged into its output (as the
# serial console's runner does); the agent gives it /dev/null as standard input
SHELL = "/bin/sh"
POLL_FIRST_S, POLL_MAX_S = 0.05, 0.5  # guest-exec-status: soon after the start, then every half second
SYNC_S = 1  # libvirt's guest-sync (the domain's agent response timeout): an agent answers it in milliseconds


class AgentMixin:
    if TYPE_CHECKING:
        host: str

        def _dom(self, name: str) -> Any: ...
        def _is_active(self, dom: Any) -> bool: ...

    def _agent(self, dom: Any, name: str, execute: str, arguments: dict | None, timeout_s: float) -> Any:
        """One agent command's `return` value; DriverError naming the command when the agent did not answer
        within `timeout_s` (libvirt's sync and the command together; at least 2 s) or answered with an error."""
        request: dict[str, Any] = {"execute": execute}
        if arguments is not None:
            request["arguments"] = arguments
        seconds = max(1, math.floor(timeout_s - SYNC_S))  # libvirt's guest-sync may come first
        try:
            dom.agentSetResponseTimeout(SYNC_S, 0)  # (the domain's: a restart or a migration forgets it)
            reply = libvirt_qemu.qemuAgentCommand(dom, json.dumps(request), seconds, 0)
        except libvirt.libvirtError as exc:
            raise DriverError(self.host, f"guest agent of {name}: {execute}: {exc.get_error_message()}") from None
        try:
            return json.loads(reply)["return"]
        except (ValueError, KeyError, TypeError):
            what = f"guest agent of {name}: {execute}: unreadable answer {reply[:200]!r}"
            raise DriverError(self.host, what) from None

    def agent_ping(self, name: str, timeout_s: float = 2.0) -> bool:
        dom = self._dom(name)  # a domain this host does not have is an error, not "no agent"
        if not self._is_active(dom):
            return False
        try:
            self._agent(dom, name, "guest-ping", None, timeout_s)
        except DriverError:
            return False
        return True

    def agent_interfaces(self, name: str, timeout_s: float = 5.0) -> list[GuestInterface]:
        found = self._agent(self._dom(name), name, "guest-network-get-interfaces", None, timeout_s)
        return [
            GuestInterface(
                str(iface.get("name", "")),
                str(iface.get("hardware-address", "")).lower(),
                [f"{a['ip-address']}/{a['prefix']}" for a in iface.get("ip-addresses", []) if "ip-address" in a],
            )
            for iface in found
        ]

    def agent_exec(self, name: str, command: str, timeout_s: float = 30.0) -> tuple[str, int]:
        """`guest-exec` with its output captured, then `guest-exec-status` until the command exited. At the
        deadline the command is left running (the agent can not kill it): DriverError says its pid."""
        deadline = time.monotonic() + timeout_s
        dom = self._dom(name)
        args = {"path": SHELL, "arg": ["-c", "exec 2>&1\n" + command], "capture-output": True}
        pid = self._agent(dom, name, "guest-exec", args, self._left(deadline))["pid"]
        pause = POLL_FIRST_S
        while True:
            status = self._agent(dom, name, "guest-exec-status", {"pid": pid}, self._left(deadline))
            if status.get("exited"):
                return exec_outcome(status)
            if time.monotonic() + pause >= deadline:
                raise DriverError(
                    self.host,
                    f"{command!r} still runs in the guest of {name} after {timeout_s:g} s "
                    f"(guest-exec pid {pid}, left running: the agent does not kill it)",
                )
            time.sleep(pause)
            pause = min(pause * 2, POLL_MAX_S)

    @staticmethod
    def _left(deadline: float) -> float:
        """Seconds an agent call may take: what is left, at least 2 (one for the sync, one for the call)."""
        return max(2.0, deadline - time.monotonic())

    def agent_shutdown(self, name: str) -> None:
        dom = self._dom(name)
        try:
            dom.shutdownFlags(libvirt.VIR_DOMAIN_SHUTDOWN_GUEST_AGENT)
        except libvirt.libvirtError as exc:
            raise DriverError(
                self.host, f"guest agent of {name} did not take the shutdown: {exc.get_error_message()}"
            ) from None


def exec_outcome(status: dict) -> tuple[str, int]:
    """(output, exit code) of an exited `guest-exec-status`: standard output then error (the shell merged
    them already), a signal's end as a shell reports it (128 + its number)."""
    out = b"".join(base64.b64decode(status.get(key) or "") for key in ("out-data", "err-data"))
    text = out.decode(errors="replace")
    if status.get("out-truncated") or status.get("err-truncated"):
        text += "\n[output truncated by the guest agent]\n"
    if "exitcode" in status:
        return text, int(status["exitcode"])
    return text, 128 + int(status.get("signal", 0))
