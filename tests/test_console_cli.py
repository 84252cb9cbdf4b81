"""`vmplane vm console NAME` (issue 31), the real CLI process against `vmplane up --driver sim` (the sim's
console is a line terminal: drivers/simconsole.py), its stdin a pipe: what is typed comes back and Ctrl-]
leaves with exit 0; a read-only session's keys are not sent; a stopped VM's ticket is refused (409) and a
revoked token's session is closed, each with its reason and a non-zero exit. The protocol itself:
test_console_sim.py."""

from __future__ import annotations

import json
import select
import subprocess
import threading
import time

import pytest

from .conftest import VMPLANE, LiveServer

WAIT_S = 60  # an upper bound on each awaited condition, not a measure


class Console:
    """`vmplane vm console` in its own process: its stdin a pipe; stdout and stderr gathered as they come."""

    def __init__(self, live: LiveServer, *args: str, token: str | None = None):
        env = {**live.env, **({"VMPLANE_TOKEN": token} if token else {})}
        self.proc = subprocess.Popen(
            [VMPLANE, "vm", "console", *args],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.out, self.err = bytearray(), bytearray()
        self.threads = [
            threading.Thread(target=self._gather, args=(self.proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._gather, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for t in self.threads:
            t.start()

    @staticmethod
    def _gather(pipe, into: bytearray) -> None:
        while chunk := pipe.read1(4096):
            into += chunk

    def type(self, data: bytes) -> None:
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def wait_for(self, text: str, stream: str = "out") -> None:
        """Until `text` shows on stdout (or stderr), or the process ended without it."""
        seen = self.out if stream == "out" else self.err
        deadline = time.monotonic() + WAIT_S
        while text.encode() not in seen:
            ended = self.proc.poll() is not None
            if ended or time.monotonic() > deadline:
                if not ended:
                    self.proc.kill()
                self.finish()  # all it wrote, gathered
                if text.encode() not in seen:
                    raise AssertionError(f"{text!r} never came on std{stream}: {self.texts()}")
            time.sleep(0.02)

    def finish(self) -> int:
        code = self.proc.wait(WAIT_S)
        for t in self.threads:
            t.join(WAIT_S)
        return code

    def texts(self) -> str:
        return f"stdout {bytes(self.out)!r}, stderr {bytes(self.err)!r}"


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server = LiveServer(tmp_path_factory.mktemp("console-cli"), hosts=1).start()
    for args in (
        ("project", "create", "p", "--vcpus", "4", "--memory", "4GiB", "--vms", "4"),
        ("offering", "create", "f", "--kind", "fixed", "--vcpus", "1", "--memory", "256MiB"),
        ("vm", "create", "v1", "--project", "p", "--offering", "f", "--template", "tiny-linux", "--start"),
        ("vm", "create", "off", "--project", "p", "--offering", "f", "--template", "tiny-linux", "--no-start"),
    ):
        r = server.cli(*args, "-o", "json")
        assert r.returncode == 0, r.stderr + r.stdout
    yield server
    server.stop()


def test_what_is_typed_comes_back_and_ctrl_close_bracket_leaves(live):
    c = Console(live, "v1")
    c.wait_for("you hold the keyboard", "err")
    c.type(b"echo hello\r")
    c.wait_for("\r\nhello\r\n")  # the guest's answer, not only the echo of the keys
    c.type(b"\x1d")
    assert c.finish() == 0, c.texts()
    assert b"Ctrl-]" in c.err


def test_the_end_of_the_input_leaves_too(live):
    c = Console(live, "v1")
    c.wait_for("console attached", "err")
    c.proc.stdin.close()
    assert c.finish() == 0, c.texts()


def test_a_read_only_sessions_keys_are_not_sent(live):
    writer = Console(live, "v1")
    writer.wait_for("you hold the keyboard", "err")
    viewer = Console(live, "v1", "--read-only")
    viewer.wait_for("read-only: keys are not sent", "err")
    viewer.type(b"echo secret\r\x1d")
    assert viewer.finish() == 0, viewer.texts()  # gone: any key it had sent reached the guest before what follows
    writer.type(b"echo visible\r")
    writer.wait_for("\r\nvisible\r\n")
    writer.type(b"\x1d")
    assert writer.finish() == 0, writer.texts()
    assert b"secret" not in writer.out and b"secret" not in viewer.out


def test_a_viewer_sees_the_writers_session(live):
    writer = Console(live, "v1")
    writer.wait_for("you hold the keyboard", "err")
    viewer = Console(live, "v1", "--read-only")
    viewer.wait_for("read-only: keys are not sent", "err")
    writer.type(b"echo shared\r")
    viewer.wait_for("\r\nshared\r\n")
    for c in (viewer, writer):
        c.type(b"\x1d")
        assert c.finish() == 0, c.texts()


def test_take_moves_the_keyboard_and_the_previous_writers_keys_are_refused(live):
    first = Console(live, "v1")
    first.wait_for("you hold the keyboard", "err")
    second = Console(live, "v1", "--take")
    second.wait_for("you hold the keyboard", "err")
    first.wait_for("the keyboard was taken by up-admin", "err")
    first.type(b"echo nope\r")
    first.wait_for("read-only: take the keyboard to type", "err")  # the server's answer to its keys
    second.type(b"echo mine\r")
    first.wait_for("\r\nmine\r\n")
    for c in (first, second):
        c.type(b"\x1d")
        assert c.finish() == 0, c.texts()
    assert b"nope" not in second.out


def test_a_stopped_vms_ticket_is_refused_with_its_reason(live):
    c = Console(live, "off")
    c.proc.stdin.close()
    assert c.finish() == 1, c.texts()
    assert b"vm off is stopped: its console opens while it runs" in c.err, c.texts()
    assert not c.out


def test_a_revoked_tokens_session_closes_with_its_reason(live):
    r = live.cli("token", "create", "dev", "--project", "p", "-o", "json")
    assert r.returncode == 0, r.stderr
    c = Console(live, "v1", token=json.loads(r.stdout)["token"])
    c.wait_for("you hold the keyboard", "err")
    assert live.cli("token", "revoke", "dev").returncode == 0
    assert c.finish() == 1, c.texts()
    assert b"(4401): its token was revoked" in c.err, c.texts()


def test_a_terminal_is_raw_while_attached_and_restored_after(live):
    """stdin a terminal: keys go as typed (Ctrl-C to the guest, not to the CLI), Ctrl-] leaves, and the
    terminal's settings are as before."""
    import fcntl
    import os
    import pty
    import termios

    master, slave = pty.openpty()
    before = termios.tcgetattr(slave)
    proc = subprocess.Popen(
        [VMPLANE, "vm", "console", "v1"],
        env=live.env,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
        preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),  # its controlling terminal: Ctrl-C would stop it
    )
    seen = bytearray()

    def wait_for(text: bytes) -> None:
        deadline = time.monotonic() + WAIT_S
        while text not in seen:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise AssertionError(f"{text!r} never came: {bytes(seen)!r}")
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                seen.extend(os.read(master, 4096))

    try:
        wait_for(b"Ctrl-] leaves]\r\n")  # the terminal's line: no "end of the input"
        os.write(master, b"\x03")  # Ctrl-C: a key for the guest, echoed by it as the byte (a cooked tty: ^C)
        wait_for(b"\x03")
        os.write(master, b"\r")  # the sim's line terminal drops that line
        os.write(master, b"echo hi\r")
        wait_for(b"\r\nhi\r\n")
        assert proc.poll() is None
        os.write(master, b"\x1d")
        assert proc.wait(WAIT_S) == 0, bytes(seen)
        assert termios.tcgetattr(slave) == before
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
        os.close(slave)
