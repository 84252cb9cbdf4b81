"""The sim guests' QEMU guest agent (issue 30), in the fabric's file: every running sim guest has an agent
that answers, unless `silence_agent(name)` made it stop (a guest without one, or a hung one). It reports
`lo` and one `ethN` per NIC, in slot order, with the NIC's MAC and the address the host's filter holds for
it (the lease the guest would have), its prefix the network's (the bridge's address when the host's
networks were applied; /32 when unknown)."""

from __future__ import annotations

import sqlite3
import threading
import time
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from vmplane.core.driver import DomainInfo, GuestInterface

LOOPBACK = GuestInterface("lo", "00:00:00:00:00:00", ["127.0.0.1/8", "::1/128"])


class AgentFabric:
    if TYPE_CHECKING:
        _db: sqlite3.Connection
        _lock: threading.Lock

        def _tx(self) -> AbstractContextManager[sqlite3.Connection]: ...
        def domain(self, host: str, name: str) -> DomainInfo | None: ...
        def nics(self, host: str, name: str) -> list[list]: ...
        def ports(self, host: str) -> list[tuple[str, str, str]]: ...

    def _init_agents(self) -> None:
        self._db.execute("CREATE TABLE IF NOT EXISTS silent_agents (name TEXT PRIMARY KEY)")
        # a frozen guest's file systems, until when at the latest (the thaw guard's deadline, wall clock)
        self._db.execute("CREATE TABLE IF NOT EXISTS frozen_guests (name TEXT PRIMARY KEY, until REAL NOT NULL)")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS bridge_prefixes (host TEXT NOT NULL, bridge TEXT NOT NULL, "
            "prefix INTEGER NOT NULL, PRIMARY KEY (host, bridge))"
        )

    def silence_agent(self, name: str, silent: bool = True) -> None:
        """The guest agent of domain `name` (wherever it runs) stops answering (False: answers again).
        Kept in the file: every process sees it."""
        with self._tx() as db:
            if silent:
                db.execute("INSERT OR IGNORE INTO silent_agents (name) VALUES (?)", (name,))
            else:
                db.execute("DELETE FROM silent_agents WHERE name = ?", (name,))

    def agent_answers(self, host: str, name: str) -> bool:
        """Whether the guest of `name` runs on `host` and its agent answers."""
        info = self.domain(host, name)
        if info is None or not info.running:
            return False
        with self._lock:
            return self._db.execute("SELECT 1 FROM silent_agents WHERE name = ?", (name,)).fetchone() is None

    def set_bridge_prefixes(self, host: str, prefixes: dict[str, int]) -> None:
        """The prefix length of each network (by its bridge) on `host`, as its last apply gave them."""
        with self._tx() as db:
            db.execute("DELETE FROM bridge_prefixes WHERE host = ?", (host,))
            db.executemany(
                "INSERT INTO bridge_prefixes (host, bridge, prefix) VALUES (?, ?, ?)",
                [(host, bridge, prefix) for bridge, prefix in sorted(prefixes.items())],
            )

    def agent_interfaces(self, host: str, name: str) -> list[GuestInterface]:
        with self._lock:
            rows = self._db.execute("SELECT bridge, prefix FROM bridge_prefixes WHERE host = ?", (host,)).fetchall()
        prefixes = dict(rows)
        leases = {mac: ip for _tap, mac, ip in self.ports(host) if ip}
        out = [LOOPBACK]
        for i, (mac, bridge, *_rest) in enumerate(self.nics(host, name)):
            lease = leases.get(mac)
            out.append(GuestInterface(f"eth{i}", mac, [f"{lease}/{prefixes.get(bridge, 32)}"] if lease else []))
        return out

    def freeze(self, name: str, until: float) -> None:
        """The guest of `name` freezes its file systems, thawed by `thaw` or at `until` (time.time()) at the
        latest: the sim's thaw guard, which no process has to run."""
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO frozen_guests (name, until) VALUES (?, ?)", (name, until))

    def thaw(self, name: str) -> bool:
        """Thaw the guest of `name`; whether it was frozen."""
        frozen = self.frozen(name)
        with self._tx() as db:
            db.execute("DELETE FROM frozen_guests WHERE name = ?", (name,))
        return frozen

    def frozen(self, name: str) -> bool:
        with self._lock:
            row = self._db.execute("SELECT until FROM frozen_guests WHERE name = ?", (name,)).fetchone()
        return row is not None and row[0] > time.time()
