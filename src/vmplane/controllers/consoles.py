"""The serial console controller (issue 31): people's console sessions, bridged to the VM's console on its
host. One console per VM is opened (a `Link`: its stream and a reader thread), shared by every session of
this process on that VM: one writer (the keyboard) and any number of read-only viewers; the keyboard is
taken over explicitly (`take`), and the previous writer is told.

The record says where the VM runs: when its console closes (the domain left its host: a live migration, an
HA restart elsewhere), the link opens it again where the store says the VM runs now, and every session
reads a line that says so. A watch pass (WATCH_S) ends sessions whose token was revoked, whose browser
session ended or whose caller lost access to the VM's project, and those past their idle or absolute limit
(settings), each with the reason. Sessions opening and closing are events of the VM."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vmplane.core import consoles as rules
from vmplane.core.driver import ConsoleStream, DriverError
from vmplane.core.names import domain_name
from vmplane.plane import metrics
from vmplane.store import events
from vmplane.store import ledger as L

if TYPE_CHECKING:
    from vmplane.plane.context import Plane

log = logging.getLogger("vmplane.consoles")
WATCH_S = 0.25  # between two watch passes: a revoked token closes its sessions within a second
READ_S = 0.05  # one read of a link's stream (its thread's pause when nothing came)
REOPEN_S = 0.2  # between two attempts to open a closed console again
READ_ONLY_TOLD_S = 5.0  # a read-only session's keys are refused in silence this long after it was told
HELD_WAIT_S = 2.0  # a console held by another is tried again this long (a link of this process closing)
CLOSE_REVOKED, CLOSE_LIMIT, CLOSE_GONE = 4401, 4408, 4410  # websocket close codes (4000-4999: the application's)


@dataclass(eq=False)
class Session:
    """One person's view of a VM's console (a websocket). `send(bytes | dict)` and `close(code, reason)` are
    thread-safe (the API's websocket task); `still_allowed()` says whether its caller may still see the VM."""

    vm: str
    who: str
    mode: str
    send: Callable[[Any], object]
    close: Callable[[int, str], object]
    still_allowed: Callable[[], str | None]
    opened: float = field(default_factory=time.monotonic)
    last_activity: float = field(default_factory=time.monotonic)
    id: int = 0
    ended: bool = False
    last_told: float = 0.0  # when it was last told it is read-only


class Link:
    """A VM's console on its host, and the sessions that share it."""

    def __init__(self, vm: str):
        self.vm = vm
        self.host: str | None = None
        self.stream: ConsoleStream | None = None
        self.sessions: dict[int, Session] = {}
        self.writer: int | None = None
        self.lock = threading.Lock()
        self.stop = threading.Event()


class Consoles:
    def __init__(self, plane: Plane):
        self.db, self.drivers, self.catalog, self.closing = plane.db, plane.drivers, plane.catalog, plane.closing
        self._links: dict[str, Link] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._stop = threading.Event()

    # -- the watch loop ---------------------------------------------------------------------------
    def start(self) -> None:
        threading.Thread(target=self._watch_loop, name="vmplane-consoles", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            links = list(self._links.values())
        for link in links:
            for s in list(link.sessions.values()):
                self._end(link, s, 1001, "the control plane is shutting down")

    def _watch_loop(self) -> None:
        while not self._stop.wait(WATCH_S):
            try:
                self.watch()
            except Exception:  # the next pass tries again
                log.exception("console watch")

    def watch(self) -> None:
        """End the sessions whose caller lost access (token revoked, browser session over, project) or that
        passed their limits."""
        with self._lock:
            links = list(self._links.values())
        if not links:
            return
        idle_s = float(self.catalog.effective("vmplane.console.idle.timeout"))  # type: ignore[arg-type]
        max_s = float(self.catalog.effective("vmplane.console.session.max"))  # type: ignore[arg-type]
        now = time.monotonic()
        for link in links:
            for s in list(link.sessions.values()):
                why = s.still_allowed()
                if why is not None:
                    self._end(link, s, CLOSE_REVOKED, why)
                elif (limit := rules.ended(now, s.opened, s.last_activity, idle_s, max_s)) is not None:
                    self._end(link, s, CLOSE_LIMIT, limit)

    # -- sessions -----------------------------------------------------------------------------------
    def attach(self, session: Session) -> Session:
        """Join `session` to its VM's console (opened on the VM's host when it is the first); a writer takes
        the keyboard when nobody holds it, else it is read-only until it takes it. DriverError when the
        console can not be opened (the VM does not run, a `virsh console` holds it)."""
        with self._lock:
            link = self._links.get(session.vm)
            if link is None:
                link = Link(session.vm)
                self._open(link)  # raises: nothing registered
                self._links[session.vm] = link
                threading.Thread(
                    target=self._pump, args=(link,), name=f"vmplane-console-{session.vm}", daemon=True
                ).start()
            session.id = next(self._ids)
            with link.lock:
                if session.mode == "write" and link.writer is None:
                    link.writer = session.id
                else:
                    session.mode = "read"
                link.sessions[session.id] = session
        metrics.CONSOLE_SESSIONS.labels(session.mode).inc()
        self._event(
            session.vm, f"console opened by {session.who} ({'keyboard' if session.mode == 'write' else 'read-only'})"
        )
        session.send({"type": "attached", "mode": session.mode, "host": link.host})
        return session

    def detach(self, session: Session, why: str = "closed by its viewer") -> None:
        link = self._links.get(session.vm)
        if link is not None:
            self._end(link, session, None, why)

    def write(self, session: Session, data: bytes) -> None:
        """Keys from `session`: to the guest when it holds the keyboard, else told it does not."""
        link = self._links.get(session.vm)
        if link is None or session.ended:
            return
        session.last_activity = time.monotonic()
        if link.writer != session.id:
            if session.last_told + READ_ONLY_TOLD_S <= time.monotonic():  # once in a while, not at every key
                session.last_told = time.monotonic()
                session.send({"type": "notice", "text": "read-only: take the keyboard to type"})
            return
        stream = link.stream
        if stream is None:
            session.send({"type": "notice", "text": "the console is being opened again: keys not sent"})
            return
        try:
            stream.write(data)
        except DriverError as exc:
            session.send({"type": "notice", "text": f"keys not sent: {exc}"})

    def take(self, session: Session) -> None:
        """`session` takes the keyboard; the previous writer becomes read-only and is told by whom."""
        link = self._links.get(session.vm)
        if link is None or session.ended:
            return
        with link.lock:
            before = link.sessions.get(link.writer) if link.writer is not None else None
            link.writer = session.id
        if before is session:
            return
        if before is not None:
            before.mode = "read"
            metrics.CONSOLE_SESSIONS.labels("write").dec()
            metrics.CONSOLE_SESSIONS.labels("read").inc()
            before.send({"type": "mode", "mode": "read", "text": f"the keyboard was taken by {session.who}"})
        metrics.CONSOLE_SESSIONS.labels("read").dec()
        metrics.CONSOLE_SESSIONS.labels("write").inc()
        session.mode = "write"
        session.send({"type": "mode", "mode": "write", "text": "you hold the keyboard"})

    def sessions(self, vm: str) -> list[Session]:
        link = self._links.get(vm)
        return list(link.sessions.values()) if link else []

    def _end(self, link: Link, s: Session, code: int | None, why: str) -> None:
        with link.lock:
            if s.ended:
                return
            s.ended = True
            link.sessions.pop(s.id, None)
            if link.writer == s.id:
                link.writer = None
            last = not link.sessions
        metrics.CONSOLE_SESSIONS.labels(s.mode).dec()
        if code is not None:
            s.close(code, why)
        self._event(link.vm, f"console closed for {s.who}: {why}")
        if last:
            with self._lock:
                if not link.sessions and self._links.get(link.vm) is link:
                    del self._links[link.vm]
                    link.stop.set()

    # -- the link: its host's console, opened again where the VM runs --------------------------------
    def _where(self, vm: str) -> tuple[str | None, str]:
        with self.db.read() as s:
            row = L.vm_row(s.connection(), name=vm)
        return row.host_name, row.state

    def _open(self, link: Link) -> None:
        host, state = self._where(link.vm)
        if host is None or state not in ("running", "scaling", "migrating"):
            raise DriverError(host or "-", f"vm {link.vm} is {state}: its console opens while it runs")
        driver = self.drivers.get(host)
        if driver is None:
            raise DriverError(host, f"host {host} is not connected")
        deadline = time.monotonic() + HELD_WAIT_S
        while True:
            try:
                link.stream, link.host = driver.open_console(domain_name(link.vm)), host
                return
            except DriverError as exc:  # held: perhaps by this process's link that is closing (its last viewer left)
                if "held by someone else" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(REOPEN_S)

    def _pump(self, link: Link) -> None:
        """The link's thread: guest output to every session; a closed console opened again where the record
        says the VM runs (told to every session), until the last session left."""
        while not link.stop.is_set():
            stream = link.stream
            try:
                if stream is None:
                    raise DriverError(link.host or "-", "not open")
                data = stream.read(READ_S)
            except DriverError as exc:
                self._reopen(link, stream, exc)
                continue
            if data:
                now = time.monotonic()
                for s in list(link.sessions.values()):
                    s.last_activity = now
                    s.send(data)
        if link.stream is not None:
            link.stream.close()

    def _reopen(self, link: Link, old: ConsoleStream | None, exc: DriverError) -> None:
        before = link.host
        if old is not None:
            old.close()
            link.stream = None
            log.info("console of %s on %s closed (%s): opening it again", link.vm, before, exc)
        told = False
        while not link.stop.is_set() and not self.closing.is_set():
            try:
                self._open(link)
            except Exception as exc:  # noqa: BLE001 - not yet (the record not moved yet, the domain starting)
                if not told and "its console opens while it runs" in str(exc):
                    told = True  # (a stop: said once; the session waits for the VM to run again)
                    for s in list(link.sessions.values()):
                        s.send({"type": "notice", "text": f"{exc}; the console waits for it to run again"})
                link.stop.wait(REOPEN_S)
                continue
            moved = f"on {link.host} (it was on {before})" if link.host != before else f"on {link.host}"
            for s in list(link.sessions.values()):
                s.send({"type": "notice", "text": f"the console was opened again {moved}"})
                s.send(f"\r\n[vmplane: console re-attached {moved}]\r\n".encode())
            return

    def _event(self, vm: str, message: str) -> None:
        try:
            with self.db.transaction() as conn:
                project_id = L.vm_row(conn, name=vm).project_id
                events.record(conn, "vm", vm, message=message, vm=vm, project_id=project_id)
        except Exception:
            log.exception("console event of %s", vm)
