"""`vm exec` without a guest (review of 2026-12-02, issue 26): what a command becomes on the console
(guestexec.py), the driver's runner run by a POSIX shell on a terminal as the guest's console shell runs it
(an interactive shell on a pty), the API's `command` (an argv list or a shell line) and a console stream that
can not be opened (a DriverError, never a raw libvirtError). tests/test_review_exec_real.py does the same
on a real guest."""

from __future__ import annotations

import os
import pty
import random
import select
import shlex
import shutil
import threading
import time
import uuid

import pytest

from vmplane.core.driver import DriverError
from vmplane.core.guestexec import argv_line, cli_command, command_line, exec_lines, exec_result
from vmplane.core.model import Offering, OfferingKind

from .conftest import add_sim_hosts

pytest.importorskip("libvirt")
from vmplane.hosts.drivers.libvirt import _MARK, LibvirtDriver

RUNNER = LibvirtDriver._EXEC_RUNNER


# -- pure rules ----------------------------------------------------------------------------------------
def test_an_argv_keeps_its_boundaries_and_a_string_is_a_shell_line():
    assert command_line(["sh", "-c", "echo a; echo b"]) == "sh -c 'echo a; echo b'"
    assert shlex.split(argv_line(["printf", "%s\n", "it's", "$HOME", "*", ""])) == [
        "printf",
        "%s\n",
        "it's",
        "$HOME",
        "*",
        "",
    ]
    assert command_line("nproc; free -m") == "nproc; free -m"
    assert cli_command(["sh", "-c", "echo a; echo b"]) == ["sh", "-c", "echo a; echo b"]  # kubectl exec
    assert cli_command(["nproc; free -m"]) == "nproc; free -m"  # as ssh runs it


def test_a_long_command_arrives_in_console_lines_a_tty_can_hold():
    lines = exec_lines("echo " + "x" * 9000, "t1", 30, RUNNER, 2000)
    assert len(lines) == 8  # 12008 base64 characters: 7 pieces, then the command's own line
    assert all(len(line) < 4095 and line.endswith("\n") and line.count("\n") == 1 for line in lines)
    assert lines[-1].startswith("echo __VMP''_Bt1__; sh -c '") and ' vmp 30 "$_vmpc" t1;' in lines[-1]


def test_a_timeout_marker_becomes_an_error_that_says_so():
    assert exec_result(b"a\r\nb\r\n", 3, "t1", "x", "h1") == ("a\nb\n", 3)
    # a line the guest printed by itself meanwhile (a NIC's lease) is not the command's output
    assert exec_result(b"a\r\nvmplane-guest: eth0 10.0.2.15/24\r\nb\r\n", 0, "t1", "x", "h1") == ("a\nb\n", 0)
    with pytest.raises(DriverError, match=r"did not end in time.*'started\\n'"):
        exec_result(b"started\r\n\r\n__VMP_Tt1__\r\n", 124, "t1", "sleep 9", "h1")


# -- the runner on a terminal, as on the guest's console ----------------------------------------------
class Console:
    """An interactive POSIX shell on a pty, echo off and no prompt, as the guest's init starts it."""

    def __init__(self, shell: str):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:
            os.execv(shell, [shell, "-c", "stty -echo; PS1=''; export PS1; exec " + shell + " -i"])
        self.read_until(b"", 0.5)

    def read_until(self, wanted: bytes, timeout_s: float) -> bytes:
        out, deadline = b"", time.monotonic() + timeout_s
        while time.monotonic() < deadline and (not wanted or wanted not in out):
            ready, _, _ = select.select([self.fd], [], [], 0.05)
            if ready:
                out += os.read(self.fd, 65536)
        return out

    def run(self, command: str, limit_s: int = 10) -> tuple[str, int]:
        tag = uuid.uuid4().hex[:12]
        for line in exec_lines(command, tag, limit_s, RUNNER, 2000):
            os.write(self.fd, line.encode())
        out, deadline = b"", time.monotonic() + limit_s + 60  # a bounded wait for its result
        while not (match := next((m for m in _MARK.finditer(out) if m.group(1).decode() == tag), None)):
            assert time.monotonic() < deadline, out
            out += self.read_until(b"\n", 1)
        return exec_result(match.group(2), int(match.group(3)), tag, command, "pty")

    def close(self):
        os.kill(self.pid, 9)
        os.waitpid(self.pid, 0)
        os.close(self.fd)


@pytest.fixture(scope="module")
def console():
    needed = ("setsid", "base64", "sleep")
    if not os.path.exists("/bin/sh") or any(shutil.which(tool) is None for tool in needed):
        pytest.skip(f"a POSIX sh with {', '.join(needed)} is needed")
    c = Console("/bin/sh")
    yield c
    c.close()


def test_the_runner_keeps_arguments_and_gives_an_empty_input(console):
    assert console.run(command_line(["sh", "-c", "echo a; echo b"])) == ("a\nb\n", 0)
    output, code = console.run("dd; echo dd-exit=$?")
    assert code == 0 and "0+0 records in" in output and "dd-exit=0" in output
    assert console.run("cat") == ("", 0)
    assert console.run("printf 'two\\nlines'; exit 7") == ("two\nlines", 7)
    assert console.run("echo " + "y" * 6000 + " | wc -c")[0].strip() == "6001"


def test_the_runner_stops_a_command_at_its_limit_and_the_shell_is_free_again(console):
    # durations no other process of this machine sleeps (`ps` sees them all): the ones this command started
    background, foreground = (f"sleep {n}" for n in random.sample(range(3001, 3999), 2))
    # the runner's own verdict (the sleeps would last an hour; the console waits at most limit + 60 s)
    with pytest.raises(DriverError, match=r"did not end in time.*started"):
        console.run(f"echo started; {background} & {foreground}; echo never", limit_s=1)
    assert console.run("echo free") == ("free\n", 0)
    ps = console.run("ps -eo args")[0]
    assert background not in ps and foreground not in ps, ps


# -- the API and the driver's errors ------------------------------------------------------------------
def test_the_api_takes_an_argv_or_a_line_and_names_the_field_when_neither(api, orch):
    add_sim_hosts(orch, 1)
    orch.catalog.create_template("t", "tiny-linux")
    orch.catalog.create_project("p", 4, 4096, 4)
    orch.catalog.create_offering(Offering("f", OfferingKind.fixed, vcpus=1, memory_mib=256))
    orch.create_vm("v1", "p", "f", "t", start=True)
    for command in (["sh", "-c", "echo a; echo b"], "echo a; echo b"):
        r = api.post("/api/v1/vms/v1/exec", json={"command": command})
        assert r.status_code == 409 and r.json()["field"] == "host", r.json()  # a sim host: no guest
    for command in ([], [1, 2], "", None, {"argv": ["x"]}, ["x"] * 257):
        r = api.post("/api/v1/vms/v1/exec", json={"command": command})
        assert r.status_code == 422 and r.json()["field"].startswith("command"), (command, r.json())


class _Conn:
    """A connection that drops between the domain's look-up and the console stream (the review's case)."""

    def __init__(self, error):
        self.error = error

    def isAlive(self):
        return True

    def lookupByName(self, name):
        return object()

    def newStream(self, flags):
        raise self.error

    def close(self):
        self.closed = True


def test_a_console_stream_that_can_not_be_opened_is_a_driver_error():
    import libvirt

    driver = LibvirtDriver.__new__(LibvirtDriver)
    driver.host, driver._console_locks, driver._conn_lock = "lv1", {}, threading.Lock()
    driver._conn = _Conn(libvirt.libvirtError("connection dropped"))
    console = _Conn(libvirt.libvirtError("connection dropped"))  # the exchange's own connection
    driver._console_conn = lambda: console
    with pytest.raises(DriverError, match="lv1: open a console stream"):
        driver.console_run("vmplane-v1", "true", 5)
    assert console.closed  # let go after the failure
