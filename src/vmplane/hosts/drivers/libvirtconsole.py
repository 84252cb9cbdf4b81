"""A person's serial console on a libvirt host (issue 31): `virDomainOpenConsole` on a connection of its own
(a guest that powers off while its console is open takes the connection that carries the stream with it:
drivers/libvirt.py `_console_conn`), never with the FORCE flag: a `virsh console` already open is not taken
over, the open fails saying so. The stream is non-blocking and polled: `read` waits at most its timeout."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import libvirt

from vmplane.core.driver import DriverError

POLL_S = 0.01  # between two looks at a stream with nothing to read


class LibvirtConsole:
    def __init__(self, driver: Any, name: str):
        self.driver, self.name, self.host = driver, name, driver.host
        self._conn = driver._console_conn()
        try:
            dom = driver._call(f"looking up domain {name}", self._conn.lookupByName, name)
            self._stream = driver._call("open a console stream", self._conn.newStream, libvirt.VIR_STREAM_NONBLOCK)
            try:
                dom.openConsole(None, self._stream, 0)
            except libvirt.libvirtError as exc:
                held = "active console session" in (exc.get_error_message() or "").lower()
                why = "it is held by someone else (a `virsh console`?)" if held else exc.get_error_message()
                raise DriverError(self.host, f"open the serial console of {name}: {why}") from None
        except BaseException:
            driver._let_go(self._conn)
            raise

    def read(self, timeout_s: float) -> bytes:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                data = self._stream.recv(65536)
            except libvirt.libvirtError as exc:
                raise DriverError(self.host, f"console of {self.name}: {exc.get_error_message()}") from None
            if isinstance(data, bytes):
                if data == b"":
                    raise DriverError(self.host, f"the console of {self.name} closed: the domain stopped or left")
                return data
            if time.monotonic() >= deadline:
                return b""
            time.sleep(POLL_S)

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        deadline = time.monotonic() + 5.0
        while view:
            try:
                sent = self._stream.send(bytes(view))
            except libvirt.libvirtError as exc:
                raise DriverError(self.host, f"console of {self.name}: {exc.get_error_message()}") from None
            if sent < 0:  # -2: the stream would block
                if time.monotonic() > deadline:
                    raise DriverError(self.host, f"the console of {self.name} takes no input")
                time.sleep(POLL_S)
                continue
            view = view[sent:]

    def close(self) -> None:
        try:
            self._stream.abort()
        except libvirt.libvirtError:
            pass
        self.driver._let_go(self._conn)


class ConsoleMixin:
    if TYPE_CHECKING:
        host: str

    def open_console(self, name: str) -> LibvirtConsole:
        return LibvirtConsole(self, name)
