"""`vmplane vm console NAME`: the VM's serial console in this terminal (issue 31), over the API's websocket
(ui/consolesocket.py: a ticket from `POST /vms/NAME/console/ticket`, sent in the first message). A terminal is
put in raw mode (restored on every way out) and `Ctrl-]` leaves, as `virsh console` does; a pipe's bytes are
sent as they come, and its end or a `Ctrl-]` in it leaves."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from collections.abc import Iterator

import typer
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from vmplane.cli.client import ApiError, Client
from vmplane.cli.common import ApiOption, TokenOption, fail, groups

ESCAPE = b"\x1d"  # Ctrl-]
READ_BYTES = 4096


def websocket_url(base: str, path: str) -> str:
    """The websocket's URL on the API's own host: http -> ws, https -> wss."""
    scheme, _, rest = base.partition("://")
    return ("wss" if scheme == "https" else "ws") + "://" + rest.rstrip("/") + path


def say(text: str) -> None:
    """A line for the person at the terminal, on stderr (a raw terminal needs its CR)."""
    sys.stderr.write(f"[vmplane: {text}]" + ("\r\n" if sys.stdin.isatty() else "\n"))
    sys.stderr.flush()


@contextlib.contextmanager
def raw_terminal(fd: int) -> Iterator[None]:
    """The terminal in raw mode (keys as they are typed, Ctrl-C to the guest), restored however we leave."""
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


class Session:
    """One console session: guest output to stdout, stdin's keys to the guest, the server's notices to stderr."""

    def __init__(self, ws: ClientConnection, take: bool, terminal: bool, read_only: bool = False):
        self.ws, self.take, self.terminal = ws, take, terminal
        self.read_only = read_only  # --read-only: keys stay here (a writer whose keyboard was taken: the server says)
        self.left = threading.Event()  # the person left (Ctrl-] or the end of the input)
        self.keys_started = False

    def run(self) -> int:
        """Until either side ends: 0 when the person left, 1 when the server closed the session."""
        try:
            for message in self.ws:
                if isinstance(message, bytes):
                    sys.stdout.buffer.write(message)
                    sys.stdout.buffer.flush()
                else:
                    self._notice(message)
        except ConnectionClosed:
            pass
        except KeyboardInterrupt:  # stdin not a terminal (a raw terminal's Ctrl-C is the guest's key)
            self.left.set()
            self.ws.close(1000, "left by its viewer")
            return 130
        if self.left.is_set():
            if self.terminal:
                sys.stderr.write("\r\n")  # the shell's prompt on a line of its own
            return 0
        code, reason = self.ws.close_code, self.ws.close_reason
        say(f"console closed by the server ({code}): {reason or 'no reason given'}")
        return 1

    def _notice(self, text: str) -> None:
        try:
            notice = json.loads(text)
        except ValueError:
            return
        if notice.get("type") == "attached":
            self._attached(notice)
        elif notice.get("text"):
            say(notice["text"])
        else:
            say(json.dumps(notice))

    def _attached(self, notice: dict) -> None:
        mode = notice.get("mode")
        where = f" on {notice['host']}" if notice.get("host") else ""
        leave = "Ctrl-] leaves" if self.terminal else "Ctrl-] or the end of the input leaves"
        if mode == "write":
            holds = "you hold the keyboard"
        elif self.read_only:
            holds = "read-only: keys are not sent"
        else:
            holds = "read-only: another session holds the keyboard (--take takes it)"
        say(f"console attached{where}; {holds}; {leave}")
        if self.take:
            self.ws.send(json.dumps({"type": "take"}))
        if not self.keys_started:
            self.keys_started = True
            threading.Thread(target=self._keys, name="vmplane-console-keys", daemon=True).start()

    def _keys(self) -> None:
        """stdin to the guest as it comes (a raw terminal: each key); Ctrl-] or the end of input leaves."""
        fd = sys.stdin.fileno()
        try:
            while True:
                chunk = os.read(fd, READ_BYTES)
                data, escape, _ = chunk.partition(ESCAPE)
                if data and not self.read_only:
                    self.ws.send(data)
                if escape or not chunk:
                    break
        except (ConnectionClosed, OSError):
            return  # the server ended the session: run() says why
        self.left.set()
        self.ws.close(1000, "left by its viewer")


def open_console(client: Client, name: str, token: str | None, read_only: bool) -> ClientConnection:
    """A ticket, then the websocket with the ticket in its first message (never in the URL)."""
    ticket = client.post(f"/vms/{name}/console/ticket")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    ws = connect(websocket_url(client.base, ticket["websocket"]), additional_headers=headers, compression=None)
    ws.send(json.dumps({"ticket": ticket["ticket"], "mode": "read" if read_only else "write"}))
    return ws


@groups["vm"].command("console")
def vm_console(
    name: str,
    read_only: bool = typer.Option(False, "--read-only", help="watch only: keys are not sent"),
    take: bool = typer.Option(False, "--take", help="take the keyboard from whoever holds it (they are told)"),
    api: str = ApiOption,
    token: str | None = TokenOption,
):
    """Attach this terminal to a running VM's serial console (Ctrl-] leaves, as `virsh console`).

    One session holds the keyboard; others are read-only until they take it (--take). Exits 1 when the
    server closes the session (ticket refused, token revoked, a limit passed), with its reason on stderr."""
    if read_only and take:
        raise typer.BadParameter("a read-only session does not take the keyboard", param_hint="--take")
    client = Client(api, token)
    try:
        ws = open_console(client, name, token, read_only)
    except ApiError as exc:
        fail(exc, "table")
    except InvalidStatus as exc:
        say(f"the console's websocket was refused: HTTP {exc.response.status_code}")
        raise typer.Exit(1) from None
    except (InvalidHandshake, OSError, TimeoutError) as exc:
        say(f"cannot open the console's websocket at {client.base}: {exc}")
        raise typer.Exit(1) from None
    terminal = sys.stdin.isatty()
    with ws, raw_terminal(sys.stdin.fileno()) if terminal else contextlib.nullcontext():
        code = Session(ws, take, terminal, read_only).run()
    raise typer.Exit(code)
