"""What each sim host holds for its guests' networks (issue 29), in the fabric's file: the bridges and ports
the last apply_networks left there. A domain whose NIC's bridge the host does not hold is refused at start,
as libvirt refuses one ("Cannot get interface MTU on 'vmpnN': No such device")."""

from __future__ import annotations

import json
import sqlite3
import time
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
        self._nic_unplugs: dict[tuple[str, str, str], float | None] = {}  # (host, domain, MAC) -> due | never

    # -- a domain's NICs ---------------------------------------------------------------------------------
    def nics(self, host: str, name: str) -> list[list]:
        """[[MAC, bridge, tap, mtu]] of a domain now ([] when it is not there); a late unplug that is due
        completes first."""
        now = time.monotonic()
        for key, due in list(self._nic_unplugs.items()):
            if key[:2] == (host, name) and due is not None and due <= now:
                self._nic_unplugs.pop(key, None)
                self._write_nics(host, name, [n for n in self._read_nics(host, name) if n[0] != key[2]])
        return self._read_nics(host, name)

    def _read_nics(self, host: str, name: str) -> list[list]:
        row = self._db.execute("SELECT nics FROM domains WHERE host = ? AND name = ?", (host, name)).fetchone()
        return json.loads(row[0]) if row else []

    def _write_nics(self, host: str, name: str, nics: list[list]) -> None:
        with self._tx() as db:
            db.execute("UPDATE domains SET nics = ? WHERE host = ? AND name = ?", (json.dumps(nics), host, name))

    def plug_nic(self, host: str, name: str, nic: list) -> None:
        if nic[1] not in self.bridges(host):
            raise ValueError(f"cannot get interface MTU on {nic[1]!r}: No such device")
        self._write_nics(host, name, [*self._read_nics(host, name), nic])

    def request_nic_unplug(self, host: str, name: str, mac: str, after_s: float | None) -> None:
        """The guest lets the NIC go at once (0), `after_s` later, or never (None)."""
        if after_s == 0:
            self._nic_unplugs.pop((host, name, mac), None)
            self._write_nics(host, name, [n for n in self._read_nics(host, name) if n[0] != mac])
        else:
            self._nic_unplugs[(host, name, mac)] = None if after_s is None else time.monotonic() + after_s

    def nic_unplug_pending(self, host: str, name: str, mac: str) -> bool:
        return (host, name, mac) in self._nic_unplugs

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
