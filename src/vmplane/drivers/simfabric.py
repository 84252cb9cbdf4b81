"""Where sim hosts keep their domains: outside the control plane's memory, like a real hypervisor.

A control plane that is killed must find its sim hosts as it left them, with nothing re-seeded from
its own store (that would hide exactly the bugs a crash test looks for). So the domains of every sim
host live in one small SQLite file beside the store (`<store>.sim-hosts`), written on each change. A
migration moves a domain from one host to the other in one transaction, as libvirt hands a domain
over: it runs on the source or on the target, never on both and never on neither. A store that is
not a SQLite file (PostgreSQL) keeps its sim hosts in this process's memory, shared by every
control plane of that store in the process.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

from .base import CpuCap, DomainInfo, DomainSpec

_SCHEMA = """
CREATE TABLE IF NOT EXISTS domains (
    host TEXT NOT NULL, name TEXT NOT NULL,
    vcpus INTEGER NOT NULL, max_vcpus INTEGER NOT NULL,
    memory_mib INTEGER NOT NULL, max_memory_mib INTEGER NOT NULL,
    image TEXT NOT NULL, cap_period_us INTEGER, cap_quota_us INTEGER,
    PRIMARY KEY (host, name))
"""
_COLUMNS = "name, vcpus, max_vcpus, memory_mib, max_memory_mib, image, cap_period_us, cap_quota_us"
_shared: dict[str, "SimFabric"] = {}
_shared_lock = threading.Lock()


class SimFabric:
    """The domains of all sim hosts of one store. Thread-safe; several processes may share a file."""

    def __init__(self, path: Path | None = None):
        self.path = path
        target = ":memory:"
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            target = str(path)
        self._db = sqlite3.connect(target, check_same_thread=False, isolation_level=None, timeout=30)
        self._lock = threading.Lock()
        with self._lock:
            if path is not None:
                self._db.execute("PRAGMA journal_mode=WAL")
                # each change is handed to the OS at commit: it survives the process being killed
                self._db.execute("PRAGMA synchronous=OFF")
            self._db.execute(_SCHEMA)

    @classmethod
    def for_store(cls, url: str) -> "SimFabric":
        """The fabric of a store: a file beside a SQLite store, else this process's memory (per URL)."""
        from ..store.db import _sqlite_file

        db_file = _sqlite_file(url)
        key = str(db_file.with_name(db_file.name + ".sim-hosts")) if db_file else url
        with _shared_lock:
            fabric = _shared.get(key)
            if fabric is None:
                fabric = _shared[key] = cls(Path(key) if db_file else None)
            return fabric

    # -- reads -----------------------------------------------------------------------------------
    @staticmethod
    def _info(row) -> DomainInfo:
        name, vcpus, _max_vcpus, memory, _max_memory, _image, period, quota = row
        return DomainInfo(name, True, vcpus, memory, CpuCap(period, quota) if period else None)

    def domains(self, host: str) -> list[DomainInfo]:
        with self._lock:
            rows = self._db.execute(f"SELECT {_COLUMNS} FROM domains WHERE host = ? ORDER BY name", (host,)).fetchall()
        return [self._info(r) for r in rows]

    def domain(self, host: str, name: str) -> DomainInfo | None:
        spec = self.spec(host, name)
        return None if spec is None else DomainInfo(name, True, spec.vcpus, spec.memory_mib, spec.cpu_cap)

    def spec(self, host: str, name: str) -> DomainSpec | None:
        with self._lock:
            row = self._db.execute(f"SELECT {_COLUMNS} FROM domains WHERE host = ? AND name = ?",
                                   (host, name)).fetchone()
        if row is None:
            return None
        name, vcpus, max_vcpus, memory, max_memory, image, period, quota = row
        return DomainSpec(name, vcpus, max_vcpus, memory, max_memory, image,
                          CpuCap(period, quota) if period else None)

    def hosts_of(self, name: str) -> list[str]:
        """Every host that runs a domain of this name (a correct cluster has at most one)."""
        with self._lock:
            return [h for (h,) in self._db.execute("SELECT host FROM domains WHERE name = ? ORDER BY host", (name,))]

    # -- changes ---------------------------------------------------------------------------------
    def put(self, host: str, spec: DomainSpec) -> bool:
        """Run `spec` on `host`; False if a domain of that name already runs there."""
        cap = spec.cpu_cap
        with self._lock:
            try:
                self._db.execute(f"INSERT INTO domains (host, {_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                                 (host, spec.name, spec.vcpus, spec.max_vcpus, spec.memory_mib, spec.max_memory_mib,
                                  spec.image, cap.period_us if cap else None, cap.quota_us if cap else None))
            except sqlite3.IntegrityError:
                return False
        return True

    def remove(self, host: str, name: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM domains WHERE host = ? AND name = ?", (host, name))

    def update(self, host: str, name: str, **fields) -> bool:
        """Change vcpus / memory_mib / the cap of a running domain; False if it does not run there."""
        if "cpu_cap" in fields:
            cap = fields.pop("cpu_cap")
            fields["cap_period_us"], fields["cap_quota_us"] = (cap.period_us, cap.quota_us) if cap else (None, None)
        assignments = ", ".join(f"{k} = ?" for k in fields)
        with self._lock:
            cur = self._db.execute(f"UPDATE domains SET {assignments} WHERE host = ? AND name = ?",
                                   (*fields.values(), host, name))
        return cur.rowcount == 1

    def move(self, name: str, source: str, target: str) -> bool:
        """Hand a running domain from source to target in one step; False if it is not on the source
        or the target already runs one of that name."""
        with self._lock:
            try:
                cur = self._db.execute("UPDATE domains SET host = ? WHERE host = ? AND name = ?", (target, source, name))
            except sqlite3.IntegrityError:
                return False
        return cur.rowcount == 1

    def close(self) -> None:
        with self._lock:
            self._db.close()


def forget_shared() -> None:
    """In a process just forked from one that used sim hosts: drop the inherited fabrics (an SQLite
    connection must not cross a fork) so this process opens its own."""
    with _shared_lock:
        _shared.clear()
