"""What each sim host holds for its guests' networks (issue 29), in the fabric's file: the bridges and ports
the last apply_networks left there. A domain whose NIC's bridge the host does not hold is refused at start,
as libvirt refuses one ("Cannot get interface MTU on 'vmpnN': No such device")."""

from __future__ import annotations

import json
import sqlite3
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from vmplane.core.hostnet import HostNetworks

_SCHEMA = "CREATE TABLE IF NOT EXISTS host_networks (host TEXT PRIMARY KEY, bridges TEXT NOT NULL, ports TEXT NOT NULL)"


class NetFabric:
    if TYPE_CHECKING:
        _db: sqlite3.Connection

        def _tx(self) -> AbstractContextManager[sqlite3.Connection]: ...

    def _init_networks(self) -> None:
        self._db.execute(_SCHEMA)

    def set_networks(self, host: str, want: HostNetworks) -> None:
        bridges = sorted(n.bridge for n in want.plan.networks)
        ports = sorted([p.tap, p.mac, p.ip] for p in want.ports)
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO host_networks (host, bridges, ports) VALUES (?, ?, ?)",
                (host, json.dumps(bridges), json.dumps(ports)),
            )

    def bridges(self, host: str) -> set[str]:
        """The bridges `host` holds now."""
        row = self._db.execute("SELECT bridges FROM host_networks WHERE host = ?", (host,)).fetchone()
        return set(json.loads(row[0])) if row else set()

    def ports(self, host: str) -> list[tuple[str, str, str]]:
        """(tap, MAC, address) of every NIC the host's filter knows."""
        row = self._db.execute("SELECT ports FROM host_networks WHERE host = ?", (host,)).fetchone()
        return [(tap, mac, ip) for tap, mac, ip in json.loads(row[0])] if row else []
