"""The sim guests' serial console (issue 31): a small line terminal, enough to drive the console's sessions
without a real guest. It echoes what is typed (a carriage return as CR LF, as a tty does), answers a line
`echo WORDS` with WORDS, prints a prompt `# ` after each line, and closes (DriverError) once its domain no
longer runs on its host: a migration's source, a stop. Real consoles: drivers/libvirtconsole.py."""

from __future__ import annotations

import threading
import time
from typing import Any

from vmplane.core.driver import DriverError

PROMPT = b"# "
LOOK_S = 0.2  # how often a read looks whether the domain still runs here (the fabric is a file)


class SimConsole:
    def __init__(self, driver: Any, name: str):
        self.driver, self.name, self.host = driver, name, driver.host
        driver._spec(name)  # running here, or a DriverError
        self._out = bytearray(PROMPT)
        self._line = bytearray()
        self._lock = threading.Lock()
        self._more = threading.Event()
        self._closed = False
        self._looked = time.monotonic()

    def _alive(self) -> None:
        if self._closed:
            raise DriverError(self.host, f"the console of {self.name} was closed")
        if time.monotonic() - self._looked >= LOOK_S:
            self._looked = time.monotonic()
            if self.driver.fabric.spec(self.host, self.name) is None:
                raise DriverError(self.host, f"the console of {self.name} closed: the domain stopped or left")

    def read(self, timeout_s: float) -> bytes:
        deadline = time.monotonic() + timeout_s
        while True:
            self._alive()
            with self._lock:
                if self._out:
                    data, self._out = bytes(self._out), bytearray()
                    self._more.clear()
                    return data
            left = deadline - time.monotonic()
            if left <= 0:
                return b""
            self._more.wait(min(left, LOOK_S))

    def write(self, data: bytes) -> None:
        self._alive()
        with self._lock:
            for byte in data:
                char = bytes([byte])
                if char in (b"\r", b"\n"):
                    self._out += b"\r\n"
                    line = self._line.decode(errors="replace")
                    self._line = bytearray()
                    if line.startswith("echo "):
                        self._out += line[5:].encode() + b"\r\n"
                    self._out += PROMPT
                else:
                    self._line += char
                    self._out += char
            self._more.set()

    def close(self) -> None:
        self._closed = True
