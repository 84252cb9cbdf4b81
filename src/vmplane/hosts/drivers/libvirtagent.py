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
import subprocess
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any
from xml.etree import ElementTree

import libvirt
import libvirt_qemu

from vmplane.core.driver import DriverError, GuestInterface
from vmplane.core.guestexec import HEALTH_COMMAND, NO_SHELL, exec_result
from vmplane.hosts.drivers.domainxml import AGENT_CHANNEL


class AgentUnavailable(DriverError):
    """The guest agent did not take a command (not connected, hung, or the guest has none): nothing ran."""


# guest-exec runs the command under a small runner (POSIX sh, busybox's applets only), as the serial
# console's runner does (drivers/libvirt.py): in a session of its own with /dev/null as standard input, its
# standard error merged into its output, killed with its whole session at the time limit (a timeout marker
# then). Its output goes to a file in the guest, printed once it ended: a process it leaves in the background
# (`daemon &`) would otherwise hold the agent's pipe open, and the agent reports a command exited only once
# its output closed.
SHELL = "/bin/sh"
AGENT_RUNNER = (
    "o=/tmp/.vmp-$3.o; t=/tmp/.vmp-$3.t; "
    'setsid sh -c "$2" </dev/null >$o 2>&1 & p=$!; '
    'setsid sh -c "sleep $1 && : >$t && kill -9 -$p" </dev/null >/dev/null 2>&1 & w=$!; '
    "wait $p 2>/dev/null; r=$?; kill -9 -$w 2>/dev/null; cat $o 2>/dev/null; rm -f $o; "
    'if [ -e $t ]; then rm -f $t; echo; echo __VMP""_T$3__; exit 124; fi; exit $r'
)
EXEC_GRACE_S = 5.0  # how long past the runner's own time limit its end is waited for
# guest-exec answers once the runner is forked (milliseconds): an agent silent this long is taken for hung
# and another way is tried, so a hung agent costs a command TAKE_S, never its whole timeout
TAKE_S = 4.0
POLL_FIRST_S, POLL_MAX_S = 0.05, 0.5  # guest-exec-status: soon after the start, then every half second
FREEZE_MAX_S = 10.0  # a freeze is thawed by its guard this long after it began, at the latest
SYNC_S = 1  # libvirt's guest-sync (the domain's agent response timeout): an agent answers it in milliseconds


class AgentMixin:
    if TYPE_CHECKING:
        host: str
        uri: str

        def _dom(self, name: str) -> Any: ...
        def _poll_dom(self, name: str) -> Any: ...

        _poll_lock: Any

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
        """The guest's interfaces. Asked every few seconds by the guest agent controller, so: on the poll's own
        connection (`_poll_dom`: never waiting beside another thread's call on the main one), one ask at a time."""
        with self._poll_lock:
            found = self._agent(self._poll_dom(name), name, "guest-network-get-interfaces", None, timeout_s)
        return [
            GuestInterface(
                str(iface.get("name", "")),
                str(iface.get("hardware-address", "")).lower(),
                [f"{a['ip-address']}/{a['prefix']}" for a in iface.get("ip-addresses", []) if "ip-address" in a],
            )
            for iface in found
        ]

    def agent_exec(self, name: str, command: str, timeout_s: float = 30.0) -> tuple[str, int]:
        """`guest-exec` of AGENT_RUNNER, then `guest-exec-status` until it exited. The runner stops the
        command at `timeout_s` (its whole session, as the console's runner does): DriverError says so. A
        guest-exec the agent did not take raises AgentUnavailable (nothing ran: another way may be tried)."""
        limit = max(1, math.ceil(timeout_s))
        deadline = time.monotonic() + limit + EXEC_GRACE_S
        dom = self._dom(name)
        tag = uuid.uuid4().hex[:12]
        args = {"path": SHELL, "arg": ["-c", AGENT_RUNNER, "vmp", str(limit), command, tag], "capture-output": True}
        try:
            pid = self._agent(dom, name, "guest-exec", args, min(TAKE_S, self._left(deadline)))["pid"]
        except DriverError as exc:
            raise AgentUnavailable(self.host, str(exc)) from None
        pause = POLL_FIRST_S
        while True:
            status = self._agent(dom, name, "guest-exec-status", {"pid": pid}, self._left(deadline))
            if status.get("exited"):
                output, code = exec_outcome(status)
                return exec_result(output.encode(), code, tag, command, self.host)
            if time.monotonic() + pause >= deadline:
                raise DriverError(
                    self.host,
                    f"{command!r} did not end in the guest of {name} within {timeout_s:g} s and its runner "
                    f"did not stop it (guest-exec pid {pid})",
                )
            time.sleep(pause)
            pause = min(pause * 2, POLL_MAX_S)

    def agent_online_vcpus(self, name: str, want: int | None = None, timeout_s: float = 5.0) -> int:
        """How many vCPUs the guest has online (`guest-get-vcpus`); with `want`, those of the first `want`
        the guest has but keeps offline (a hot-plugged one) are onlined first (`guest-set-vcpus`). Raises
        AgentUnavailable when the agent does not answer (the caller asks another way)."""
        dom = self._dom(name)
        try:
            cpus = self._agent(dom, name, "guest-get-vcpus", None, timeout_s)
        except DriverError as exc:
            raise AgentUnavailable(self.host, str(exc)) from None
        online = sum(1 for c in cpus if c.get("online"))
        wake = [{"logical-id": c["logical-id"], "online": True} for c in cpus
                if not c.get("online") and want is not None and c["logical-id"] < want]  # fmt: skip
        if wake:
            online += int(self._agent(dom, name, "guest-set-vcpus", {"vcpus": wake}, timeout_s))
        return online

    def guest_health(self, name: str, timeout_s: float = 60.0) -> str:
        """A migration's (an HA restart's) guest check, never through the serial console: HEALTH_COMMAND's
        answer through the guest agent when the guest holds the agent's channel open (waited for within
        `timeout_s`: a guest just moved may take a moment); else, for a guest without an agent (or still
        booting), `- 0`: its domain runs and its vCPUs advance. DriverError when neither holds."""
        deadline = time.monotonic() + timeout_s
        dom = self._dom(name)
        while self._agent_channel_connected(dom):
            try:
                return self.agent_exec(name, HEALTH_COMMAND, max(2.0, min(30.0, deadline - time.monotonic())))[0]
            except AgentUnavailable as exc:
                if time.monotonic() >= deadline:
                    raise DriverError(self.host, f"the guest agent of {name} did not answer: {exc}") from None
                time.sleep(0.5)
        return self._vcpus_advance(dom, name, min(deadline, time.monotonic() + 5.0))

    def _agent_channel_connected(self, dom: Any) -> bool:
        """Whether the guest holds its agent's channel open (libvirt's live XML says `state='connected'`)."""
        try:
            xml = dom.XMLDesc(0)
        except libvirt.libvirtError as exc:
            raise DriverError(self.host, f"read the live XML: {exc.get_error_message()}") from None
        return any(
            target.get("name") == AGENT_CHANNEL and target.get("state") == "connected"
            for target in ElementTree.fromstring(xml).iterfind("./devices/channel/target")
        )

    def _vcpus_advance(self, dom: Any, name: str, deadline: float) -> str:
        """`- 0` once the domain runs and its CPU time grew between two looks (a guest without an agent);
        DriverError when it did not by `deadline`."""
        try:
            first = dom.info()
            while time.monotonic() < deadline:
                time.sleep(0.5)
                now = dom.info()
                if now[0] == libvirt.VIR_DOMAIN_RUNNING and now[4] > first[4]:
                    return f"{NO_SHELL}\n0\n"
        except libvirt.libvirtError as exc:
            raise DriverError(self.host, f"read the state of {name}: {exc.get_error_message()}") from None
        raise DriverError(self.host, f"the domain of {name} does not run, or its vCPUs do not advance")

    def fs_freeze(self, name: str, thaw_after_s: float = FREEZE_MAX_S) -> int:
        """Freeze the guest's file systems through its agent (for a consistent snapshot); how many. A thaw
        guard (hosts/thawguard.py, a process of its own) thaws them `thaw_after_s` later unless `fs_thaw`
        came first: a freeze is thawed even when its caller fails or the control plane is killed. A freeze
        that failed is thawed at once (the agent may have frozen some)."""
        dom = self._dom(name)
        self._end_guard(name)
        guard = subprocess.Popen(
            [sys.executable, "-m", "vmplane.hosts.thawguard", self.uri, name, f"{thaw_after_s:g}"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # not killed with the control plane's process group
        )
        self._thaw_guards()[name] = guard
        try:
            dom.agentSetResponseTimeout(SYNC_S, 0)
            return int(dom.fsFreeze(None, 0))
        except libvirt.libvirtError as exc:
            try:
                self.fs_thaw(name)
            except DriverError:
                pass  # the guard thaws it
            raise DriverError(self.host, f"freeze the file systems of {name}: {exc.get_error_message()}") from None

    def fs_thaw(self, name: str) -> int:
        """Thaw the guest's file systems (how many were thawed); the freeze's guard is ended."""
        try:
            thawed = int(self._dom(name).fsThaw(None, 0))
        except libvirt.libvirtError as exc:
            raise DriverError(self.host, f"thaw the file systems of {name}: {exc.get_error_message()}") from None
        self._end_guard(name)
        return thawed

    def fs_frozen(self, name: str) -> bool:
        """Whether the guest's agent says its file systems are frozen (`guest-fsfreeze-status`)."""
        return self._agent(self._dom(name), name, "guest-fsfreeze-status", None, 5.0) == "frozen"

    def _thaw_guards(self) -> dict[str, subprocess.Popen]:
        guards = self.__dict__.setdefault("_guards", {})
        return guards

    def _end_guard(self, name: str) -> None:
        guard = self._thaw_guards().pop(name, None)
        if guard is not None and guard.poll() is None:
            guard.kill()  # by the pid this process started: nothing else is touched
        if guard is not None:
            guard.wait()

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
