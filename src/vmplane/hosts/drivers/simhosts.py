"""Power and reachability of sim hosts: the sim's side of the HA nemesis (issue 12).

Kept in the fabric's SQLite file (table `hosts`, one row per host that ever failed), so every process
of a store sees a host fail and come back, as every control plane sees a real host go dark. A host
without a row, or whose failure has run out (`until` passed), is healthy.

Modes (`fabric.fail_host(host, mode)`), as localhosts.fail does on local hosts:
- "power": the host's power is cut: every QEMU dies at once (all its domains, running or defined, are
  gone, their disk locks released, unless `set_lock_hold(host, s)` keeps the locks of its shared disks
  held s seconds more, as an NFS server does until the dead client's lease expires) and no event is sent
  (the daemon died too). Nothing runs on it
  until `recover_host`, which brings it back empty.
- "daemon": libvirtd is killed; its guests run on (they stay in the fabric, running), but every call
  to the host fails ("connection refused"), no event comes from it, and no migration to or from it
  can start or finish (the source's daemon drives a migration; the target's receives it).
- "network": the host is unreachable from the control plane; its guests run on and a migration it
  already copies without the control plane (SimFaults.lost_connection) still completes.
`recover_host(host)` makes it answer again ("power": with no domain; else with its domains as they
were). Fault mode (SimFaults host_flap / host_partition / host_reboot) sets the same modes with an
end time: the host answers again by itself (a reboot comes back empty).

The control plane reaches a host through SimDriver: while the host does not answer, every call raises
DriverError (a retry-able "cannot connect" / "connection reset"). The fence knob
(`set_fence_broken`) is read by the sim fence agent (fencing/sim.py): "dead" (the BMC answers
nothing: power_off and status fail) or "ignores" (the BMC accepts the power-off but the host stays
on, so the read-back never confirms it).

Time is wall-clock (`time.time()`): an end time written by one process is read by another.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vmplane.core.driver import DriverError
from vmplane.hosts.drivers.simstorage import SHARED

MODES = ("power", "daemon", "network")
FENCE_BROKEN = ("dead", "ignores")
HOSTS_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS hosts (host TEXT PRIMARY KEY, mode TEXT, until REAL, "
    "since REAL, fence_broken TEXT, fence_mode TEXT, died REAL)",
)


@dataclass(frozen=True)
class SimHostState:
    """A sim host's power and reachability, read now."""

    host: str
    power: str  # "on" | "off"
    reachable: bool  # whether the control plane reaches its daemon
    mode: str | None  # None (healthy) | "power" | "daemon" | "network"
    until: float | None  # wall-clock end of a fault-mode failure; None: until recover_host
    fence_broken: str | None  # why fencing this host fails (None: it works)
    fence_mode: str | None = None  # "dead" | "ignores" (with fence_broken)

    @property
    def daemon(self) -> bool:
        """Whether its libvirtd runs (host-to-host migration needs both daemons)."""
        return self.mode not in ("power", "daemon")


def _state(host: str, row, now: float) -> SimHostState:
    mode, until, fence_broken, fence_mode = row if row is not None else (None, None, None, None)
    if mode is not None and until is not None and until <= now:
        mode, until = None, None  # the failure ran out: a flap ended, a rebooted host is back
    return SimHostState(
        host,
        "off" if mode == "power" else "on",
        mode is None,
        mode,
        until,
        fence_broken,
        fence_mode if fence_broken else None,
    )


_CAUSES = {
    "power": "unable to connect to server: No route to host",
    "daemon": "Failed to connect socket: Connection refused",
    "network": "Cannot recv data: Connection reset by peer",
}


class HostFabric:
    """The host part of SimFabric (a mixin: it uses the fabric's `_db`, `_lock` and `_tx`)."""

    if TYPE_CHECKING:  # what SimFabric (this and StorageFabric mixed) gives the methods here
        _db: sqlite3.Connection
        _lock: threading.Lock
        _unplugs: dict[tuple[str, str], tuple[int, float | None]]
        _later: list[tuple[float, tuple[Any, ...]]]

        @contextmanager
        def _tx(self) -> Iterator[sqlite3.Connection]: ...
        def drop_disks(self, db: sqlite3.Connection, host: str, name: str) -> None: ...
        def _forget_detaches(self, host: str, name: str, to: str | None = None) -> None: ...

    def _init_hosts(self) -> None:
        for statement in HOSTS_SCHEMA:
            self._db.execute(statement)
        for column in ("died REAL", "lock_hold REAL"):  # a fabric file from before them
            try:
                self._db.execute(f"ALTER TABLE hosts ADD COLUMN {column}")
            except sqlite3.OperationalError:
                pass

    # -- reads -------------------------------------------------------------------------------------
    def _host_row(self, db, host: str):
        return db.execute("SELECT mode, until, fence_broken, fence_mode FROM hosts WHERE host = ?", (host,)).fetchone()

    def _host(self, db, host: str) -> SimHostState:
        return _state(host, self._host_row(db, host), time.time())

    def host_state(self, host: str) -> SimHostState:
        with self._lock:
            return self._host(self._db, host)

    def host_answers(self, host: str) -> bool:
        """Whether the control plane reaches the host's daemon now."""
        return self.host_state(host).reachable

    def failed_hosts(self) -> dict[str, SimHostState]:
        """Every host that does not answer now, by name."""
        now = time.time()
        with self._lock:
            rows = self._db.execute(
                "SELECT host, mode, until, fence_broken, fence_mode FROM hosts WHERE mode IS NOT NULL"
            ).fetchall()
        states = {r[0]: _state(r[0], r[1:], now) for r in rows}
        return {h: s for h, s in states.items() if not s.reachable}

    def hosts_failing_for_a_while(self) -> bool:
        """A fault-mode failure is under way (it ends by itself): what a quiet period waits for."""
        with self._lock:
            return (
                self._db.execute(
                    "SELECT 1 FROM hosts WHERE mode IS NOT NULL AND until > ? LIMIT 1", (time.time(),)
                ).fetchone()
                is not None
            )

    def daemon_died_at(self, host: str) -> float:
        """When the host's libvirtd last died (its power or the daemon itself; 0: never). A migration into it
        that began before then lost its incoming domain, even if the host answers again now."""
        with self._lock:
            row = self._db.execute("SELECT died FROM hosts WHERE host = ?", (host,)).fetchone()
        return row[0] or 0.0 if row is not None else 0.0

    def check_host(self, host: str, what: str) -> None:
        """Raise DriverError as libvirt does when the host's daemon can not be reached."""
        state = self.host_state(host)
        if not state.reachable:
            assert state.mode is not None  # (an unreachable host has failed in some mode)
            raise DriverError(host, f"{what}: cannot connect to the hypervisor: {_CAUSES[state.mode]}; retry")

    def _runs(self, db, *hosts: str) -> bool:
        """Whether each host is on with its daemon running (in a transaction: what put/move need)."""
        return all(self._host(db, h).daemon for h in hosts)

    # -- changes -----------------------------------------------------------------------------------
    def fail_host(self, host: str, mode: str, seconds: float | None = None) -> SimHostState:
        """Fail a host as `mode` ("power", "daemon", "network"); `seconds`: it comes back by itself after
        that long (fault mode), else at recover_host. Power: every domain of the host is gone at once,
        with no event. A host already off stays off (its domains are already gone)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        now = time.time()
        until = None if seconds is None else now + seconds
        with self._tx() as db:
            current = self._host(db, host)
            if current.mode == "power" and mode != "power":
                mode = "power"  # a dead host's daemon can not die again; it stays off
                until = current.until if until is not None else None
            if mode == "power":
                self._hold_locks(db, host, now)
                names = [n for (n,) in db.execute("SELECT name FROM domains WHERE host = ?", (host,))]
                for name in names:
                    self.drop_disks(db, host, name)
                    self._unplugs.pop((host, name), None)
                    self._forget_detaches(host, name)
                db.execute("DELETE FROM domains WHERE host = ?", (host,))
                self._later = [(due, e) for due, e in self._later if e[0] != host]
            died = now if mode in ("power", "daemon") else None
            db.execute(
                "INSERT INTO hosts (host, mode, until, since, died) VALUES (?, ?, ?, ?, ?) ON CONFLICT (host) "
                "DO UPDATE SET mode = excluded.mode, until = excluded.until, since = excluded.since, "
                "died = coalesce(excluded.died, died)",
                (host, mode, until, now, died),
            )
            return self._host(db, host)

    def recover_host(self, host: str) -> SimHostState:
        """The host answers again: after a power failure, with no domain (its held locks released: it
        rebooted and told the storage); else its domains as they are."""
        with self._tx() as db:
            db.execute("UPDATE hosts SET mode = NULL, until = NULL, since = ? WHERE host = ?", (time.time(), host))
            db.execute("DELETE FROM held_locks WHERE host = ?", (host,))
            return self._host(db, host)

    def set_lock_hold(self, host: str, seconds: float) -> None:
        """A lock that outlives a power fence: when `host` loses its power, the write locks its running
        domains hold on the shared storage stay held for `seconds` (an NFS client's lease: about 90 s on
        NFSv4), refusing the disks to every other host meanwhile ("resource busy"). 0: released at once."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO hosts (host, lock_hold) VALUES (?, ?) ON CONFLICT (host) DO UPDATE SET "
                "lock_hold = excluded.lock_hold",
                (host, float(seconds)),
            )

    def _hold_locks(self, db, host: str, now: float) -> None:
        """(in the power-off's transaction) the shared disks its active domains write keep their lock."""
        row = db.execute("SELECT lock_hold FROM hosts WHERE host = ?", (host,)).fetchone()
        hold = row[0] if row is not None and row[0] else 0.0
        if hold <= 0:
            return
        db.execute(
            "INSERT INTO held_locks (storage, path, host, until) SELECT d.storage, d.path, d.host, ? FROM disks d "
            "JOIN domains m ON m.host = d.host AND m.name = d.domain WHERE d.host = ? AND d.readonly = 0 AND "
            "d.storage = ? AND m.state NOT IN ('shutoff', 'crashed', 'nostate')",
            (now + hold, host, SHARED),
        )

    def set_fence_broken(self, host: str, reason: str | None, mode: str = "dead") -> None:
        """Make fencing this host fail with `reason` (None: it works again). `mode` "dead": the BMC does not
        answer (power_off and status fail); "ignores": it accepts a power-off that never happens."""
        if mode not in FENCE_BROKEN:
            raise ValueError(f"mode must be one of {', '.join(FENCE_BROKEN)}, not {mode!r}")
        with self._tx() as db:
            db.execute(
                "INSERT INTO hosts (host, fence_broken, fence_mode) VALUES (?, ?, ?) ON CONFLICT (host) DO "
                "UPDATE SET fence_broken = excluded.fence_broken, fence_mode = excluded.fence_mode",
                (host, reason, mode if reason else None),
            )
