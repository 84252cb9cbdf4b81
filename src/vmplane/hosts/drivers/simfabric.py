"""Where sim hosts keep their domains: outside the control plane's memory, like a real hypervisor.

A control plane that is killed must find its sim hosts as it left them, with nothing re-seeded from
its own store (that would hide exactly the bugs a crash test looks for). So the domains of every sim
host live in one small SQLite file beside the store (`<store>.sim-hosts`), written on each change. A
migration moves a domain from one host to the other in one transaction, as libvirt hands a domain
over: it runs on the source or on the target, never on both and never on neither (except in fault
mode, after a post-copy failure: paused on both). A store that is not a SQLite file (PostgreSQL)
keeps its sim hosts in this process's memory, shared by every control plane of that store in the process.

Each domain has libvirt's state and reason (`running`/`booted`, `paused`/`postcopy-failed`,
`shutoff`/`crashed`). In fault mode (`faults`, drivers/simfaults.py) the fabric also keeps what is
under way in this process: DIMM unplugs the guest completes late, pauses that end, and it delivers
lifecycle events to the watchers (libvirt's numbers, as hostevents.py takes them) late, twice or not
at all. With faults off no event is sent (the sim then behaves exactly as before fault mode).

An incoming migration (begin_incoming) puts libvirt's incoming domain on the target for the whole
pre-copy: paused, reason `migration`, a QEMU that has never run the guest. The switch-over (move)
replaces it with the domain; a copy that fails removes it at once (end_incoming), except when its
source lost its power: no connection reset reaches the target then, and its libvirtd notices only by
its keepalive, `incoming_linger_s` later (libvirt's default: about 30 s; never with keepalive off).

A guest answers its console at once, unless made silent (`silence_guest`: for a while, as a guest
still booting, or until told otherwise); `guest_answers` waits for it (the migration's guest check).

Storage (pools, volumes, the disks of domains, the lock on open disk files) is modelled in
drivers/simstorage.py, in the same file: see there for shared vs local paths and the capacity knobs.
Host power and reachability (a host failed as power, daemon or network; the HA nemesis) is in
drivers/simhosts.py, in the same file too: no domain starts or arrives on a host that is off or whose
daemon is dead, and no event comes from a host the control plane does not reach.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from pathlib import Path

from sqlalchemy.engine import make_url

from vmplane.core.driver import CpuCap, DomainInfo, DomainSpec, NicSpec
from vmplane.hosts.drivers.simagent import AgentFabric
from vmplane.hosts.drivers.simevents import RESUMED
from vmplane.hosts.drivers.simfaults import SimFaults
from vmplane.hosts.drivers.simhosts import HostFabric
from vmplane.hosts.drivers.simnet import NetFabric
from vmplane.hosts.drivers.simstorage import SimStorageError, StorageFabric

_SCHEMA = """
CREATE TABLE IF NOT EXISTS domains (
    host TEXT NOT NULL, name TEXT NOT NULL,
    vcpus INTEGER NOT NULL, max_vcpus INTEGER NOT NULL,
    memory_mib INTEGER NOT NULL, max_memory_mib INTEGER NOT NULL,
    image TEXT NOT NULL, cap_period_us INTEGER, cap_quota_us INTEGER,
    state TEXT NOT NULL DEFAULT 'running', reason TEXT NOT NULL DEFAULT 'booted',
    PRIMARY KEY (host, name))
"""
_COLUMNS = "name, vcpus, max_vcpus, memory_mib, max_memory_mib, image, cap_period_us, cap_quota_us, state, reason"
_ACTIVE = "state NOT IN ('shutoff', 'crashed', 'nostate')"
INCOMING_REASON = "migration"  # libvirt's VIR_DOMAIN_PAUSED_MIGRATION, as the libvirt driver names it
INCOMING_LINGER_S = 30.0  # libvirtd's keepalive: interval 5 s x count 5, plus a little
_shared: dict[str, SimFabric] = {}
_shared_lock = threading.Lock()


def _sqlite_file(url: str) -> Path | None:
    """The file of a SQLite store's URL; None for another database or an in-memory one."""
    parsed = make_url(url)
    if not parsed.drivername.startswith("sqlite") or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database)


class SimFabric(HostFabric, StorageFabric, NetFabric, AgentFabric):
    """The domains (and storage) of all sim hosts of one store. Thread-safe; several processes may
    share a file."""

    def __init__(self, path: Path | None = None):
        self.path = path
        target = ":memory:"
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            target = str(path)
        self._db = sqlite3.connect(target, check_same_thread=False, isolation_level=None, timeout=30)
        self._lock = threading.Lock()
        self.faults: SimFaults | None = None  # fault mode for every sim host of this fabric
        self._watchers: dict[str, list] = {}  # host -> lifecycle callbacks (fault mode only)
        self._unplugs: dict[tuple[str, str], tuple[int, float | None]] = {}  # (host, name) -> (MiB, due|never)
        self._pauses: dict[str, float] = {}  # name -> when its pause ends
        self._later: list[tuple[float, tuple]] = []  # (due, (host, name, event, detail)): late events
        # how long a target keeps an incoming domain after its source lost its power ($VMPLANE_SIM_INCOMING_LINGER_S)
        self.incoming_linger_s = float(os.environ.get("VMPLANE_SIM_INCOMING_LINGER_S") or INCOMING_LINGER_S)
        self._incoming_checked = 0.0  # when lingering incoming domains were last looked for
        self._booted: dict[str, float] = {}  # guest (domain name) -> when it last started (its uptime)
        with self._lock:
            if path is not None:
                self._db.execute("PRAGMA journal_mode=WAL")
                # each change is handed to the OS at commit: it survives the process being killed
                self._db.execute("PRAGMA synchronous=OFF")
            self._db.execute(_SCHEMA)
            # guests made silent (silence_guest): wall-clock end, NULL for never; every process sees it
            self._db.execute("CREATE TABLE IF NOT EXISTS silent_guests (name TEXT PRIMARY KEY, until REAL)")
            # incoming domains (begin_incoming): their source, and when the target's keepalive removes one whose
            # source lost its power (wall-clock; NULL: while its copy runs)
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS incoming (host TEXT NOT NULL, name TEXT NOT NULL, "
                "source TEXT NOT NULL, gone_at REAL, PRIMARY KEY (host, name))"
            )
            for column in (
                "state TEXT NOT NULL DEFAULT 'running'",
                "reason TEXT NOT NULL DEFAULT 'booted'",
                "nics TEXT NOT NULL DEFAULT '[]'",  # the domain's interfaces: [[mac, bridge, tap, mtu]]
                "cpu_model TEXT NOT NULL DEFAULT 'qemu64'",  # its guest CPU model (a migration carries it)
            ):
                try:  # a fabric file from before states
                    self._db.execute(f"ALTER TABLE domains ADD COLUMN {column}")
                except sqlite3.OperationalError:
                    pass
            self._init_storage()
            self._init_hosts()
            self._init_networks()
            self._init_agents()

    @classmethod
    def for_store(cls, url: str) -> SimFabric:
        """The fabric of a store: the file `$VMPLANE_SIM_HOSTS` when set (several control-plane processes
        on one PostgreSQL store share their sim hosts through it), else a file beside a SQLite store,
        else this process's memory (per URL)."""
        shared = os.environ.get("VMPLANE_SIM_HOSTS")
        db_file = Path(shared) if shared else _sqlite_file(url)
        if db_file is not None and not shared:
            db_file = db_file.with_name(db_file.name + ".sim-hosts")
        key = str(db_file) if db_file else url
        with _shared_lock:
            fabric = _shared.get(key)
            if fabric is None:
                fabric = _shared[key] = cls(Path(key) if db_file else None)
            return fabric

    # -- what is under way (fault mode) ----------------------------------------------------------
    def tick(self) -> None:
        """Complete what is due: late DIMM unplugs, pauses that end, late events."""
        self._expire_incoming()
        if not (self._unplugs or self._pauses or self._later or self._detaches):
            return
        now, events = time.monotonic(), []
        with self._lock:
            for key, (memory, due) in list(self._unplugs.items()):
                if due is not None and due <= now:
                    del self._unplugs[key]
                    self._db.execute(
                        "UPDATE domains SET memory_mib = ? WHERE host = ? AND name = ? AND memory_mib > ?",
                        (memory, *key, memory),
                    )
            for name, due in list(self._pauses.items()):
                if due <= now:
                    del self._pauses[name]
                    for (host,) in self._db.execute(
                        "SELECT host FROM domains WHERE name = ? AND state = 'paused' AND reason = 'ioerror'", (name,)
                    ).fetchall():
                        self._db.execute(
                            "UPDATE domains SET state = 'running', reason = 'unpaused' WHERE host = ? AND name = ?",
                            (host, name),
                        )
                        events.append((host, name, RESUMED, 0))
            self._tick_detaches(now)
            due_events = [e for due, e in self._later if due <= now]
            self._later = [(due, e) for due, e in self._later if due > now]
        for e in events:
            self.emit(*e)
        for e in due_events:
            self._deliver(*e)

    def pending_unplug(self, host: str, name: str) -> int | None:
        """The memory a sent DIMM unplug will leave (None: none pending that will complete)."""
        with self._lock:
            memory, due = self._unplugs.get((host, name), (None, None))
        return memory if due is not None else None

    def request_unplug(self, host: str, name: str, memory_mib: int, delay_s: float | None) -> None:
        """An unplug request the guest completes after `delay_s` (None: never, until asked again)."""
        with self._lock:
            self._unplugs[(host, name)] = (memory_mib, None if delay_s is None else time.monotonic() + delay_s)

    def settled(self) -> bool:
        """Nothing under way (what a quiet period waits for)."""
        return not (
            any(due is not None for _, due in self._unplugs.values())
            or self._pauses
            or self._later
            or any(due is not None for due in self._detaches.values())
            or self.hosts_failing_for_a_while()
        )

    # -- events (fault mode) -----------------------------------------------------------------------
    def watch(self, host: str, callback) -> None:
        with self._lock:
            self._watchers.setdefault(host, []).append(callback)

    def emit(self, host: str, name: str, event: int, detail: int) -> None:
        """A lifecycle event of a domain on `host`, as libvirt would send it; only in fault mode, where
        it may arrive late, twice or not at all."""
        f = self.faults
        if f is None or not self._watchers.get(host) or not self.host_answers(host):
            return  # (a host the control plane does not reach sends it nothing)
        if f.chance("event_lost"):
            return
        if f.chance("event_late"):
            with self._lock:
                self._later.append((time.monotonic() + f.delay(f.event_delay_s), (host, name, event, detail)))
        else:
            self._deliver(host, name, event, detail)
        if f.chance("event_twice"):
            with self._lock:
                self._later.append((time.monotonic() + f.delay(f.event_delay_s), (host, name, event, detail)))

    def _deliver(self, host: str, name: str, event: int, detail: int) -> None:
        if not self.host_answers(host):  # the connection it would come by is down: lost
            return
        for callback in list(self._watchers.get(host, ())):
            try:
                callback(host, name, event, detail)
            except Exception:  # noqa: BLE001 (a watcher's trouble is not the host's)
                pass

    # -- reads -----------------------------------------------------------------------------------
    @staticmethod
    def _info(row) -> DomainInfo:
        name, vcpus, _max_vcpus, memory, _max_memory, _image, period, quota, state, reason = row
        return DomainInfo(
            name,
            state in ("running", "blocked"),
            vcpus,
            memory,
            CpuCap(period, quota) if period else None,
            state=state,
            reason=reason,
        )

    def domains(self, host: str) -> list[DomainInfo]:
        self.tick()
        with self._lock:
            rows = self._db.execute(f"SELECT {_COLUMNS} FROM domains WHERE host = ? ORDER BY name", (host,)).fetchall()
        return [self._info(r) for r in rows]

    def domain(self, host: str, name: str) -> DomainInfo | None:
        self.tick()
        with self._lock:
            row = self._db.execute(
                f"SELECT {_COLUMNS} FROM domains WHERE host = ? AND name = ?", (host, name)
            ).fetchone()
        return None if row is None else self._info(row)

    def spec(self, host: str, name: str, active: bool = True) -> DomainSpec | None:
        """The domain's spec as it is now; None if it is not there (or, `active`, only defined)."""
        self.tick()
        with self._lock:
            row = self._db.execute(
                f"SELECT {_COLUMNS} FROM domains WHERE host = ? AND name = ?" + (f" AND {_ACTIVE}" if active else ""),
                (host, name),
            ).fetchone()
            if row is None:
                return None
            disks = self._disks(self._db, host, name)
            nics, cpu_model = self._db.execute(
                "SELECT nics, cpu_model FROM domains WHERE host = ? AND name = ?", (host, name)
            ).fetchone()
        name, vcpus, max_vcpus, memory, max_memory, image, period, quota, _state, _reason = row
        return DomainSpec(
            name,
            vcpus,
            max_vcpus,
            memory,
            max_memory,
            image,
            CpuCap(period, quota) if period else None,
            disks,
            tuple(NicSpec(*n) for n in json.loads(nics)),
            cpu_model,
        )

    def hosts_of(self, name: str) -> list[str]:
        """Every host that runs a domain of this name (a correct cluster has at most one)."""
        self.tick()
        with self._lock:
            return [
                h
                for (h,) in self._db.execute(
                    f"SELECT host FROM domains WHERE name = ? AND {_ACTIVE} ORDER BY host", (name,)
                )
            ]

    # -- changes ---------------------------------------------------------------------------------
    def put(self, host: str, spec: DomainSpec) -> bool:
        """Run `spec` on `host` (replacing a shut-off definition); False if a domain of that name is
        active there. Its disks must be there and free (else SimStorageError, nothing done)."""
        cap = spec.cpu_cap
        with self._tx() as db:
            if not self._runs(db, host):
                raise SimStorageError(f"host {host} is down")
            missing = sorted({n.bridge for n in spec.nics} - self.bridges(host))
            if missing:
                raise SimStorageError(f"cannot get interface MTU on {missing[0]!r}: No such device")
            if db.execute("SELECT 1 FROM domains WHERE host = ? AND name = ?", (host, spec.name)).fetchone():
                if db.execute(
                    f"SELECT 1 FROM domains WHERE host = ? AND name = ? AND {_ACTIVE}", (host, spec.name)
                ).fetchone():
                    return False
                db.execute("DELETE FROM domains WHERE host = ? AND name = ?", (host, spec.name))
            self._unplugs.pop((host, spec.name), None)
            self._forget_detaches(host, spec.name)
            self._booted[spec.name] = time.time()
            self.put_disks(db, host, spec.name, spec.disks)
            db.execute(
                f"INSERT INTO domains (host, {_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    host,
                    spec.name,
                    spec.vcpus,
                    spec.max_vcpus,
                    spec.memory_mib,
                    spec.max_memory_mib,
                    spec.image,
                    cap.period_us if cap else None,
                    cap.quota_us if cap else None,
                    "running",
                    "booted",
                ),
            )
            nics = json.dumps([[n.mac, n.bridge, n.tap, n.mtu] for n in spec.nics])
            db.execute(
                "UPDATE domains SET nics = ?, cpu_model = ? WHERE host = ? AND name = ?",
                (nics, spec.cpu_model, host, spec.name),
            )
        return True

    def remove(self, host: str, name: str, shut_off_only: bool = False) -> bool:
        """Destroy and undefine; whether there was such a domain. `shut_off_only`: undefine it only if it
        is not active (in one step: never destroys)."""
        with self._tx():
            only = f" AND NOT ({_ACTIVE})" if shut_off_only else ""
            cur = self._db.execute("DELETE FROM domains WHERE host = ? AND name = ?" + only, (host, name))
            if cur.rowcount or not shut_off_only:
                self._db.execute("DELETE FROM incoming WHERE host = ? AND name = ?", (host, name))
                self._unplugs.pop((host, name), None)
                self.drop_disks(self._db, host, name)
                self._forget_detaches(host, name)
        return cur.rowcount == 1

    def set_state(self, host: str, name: str, state: str, reason: str) -> bool:
        with self._tx():
            cur = self._db.execute(
                "UPDATE domains SET state = ?, reason = ? WHERE host = ? AND name = ?", (state, reason, host, name)
            )
            if state != "running":
                self._unplugs.pop((host, name), None)
                self._forget_detaches(host, name)
        return cur.rowcount == 1

    def pause_until(self, name: str, seconds: float) -> None:
        with self._lock:
            self._pauses[name] = time.monotonic() + seconds

    def update(self, host: str, name: str, **fields) -> bool:
        """Change vcpus / memory_mib / the cap of an active domain; False if it does not run there."""
        self.tick()
        if "cpu_cap" in fields:
            cap = fields.pop("cpu_cap")
            fields["cap_period_us"], fields["cap_quota_us"] = (cap.period_us, cap.quota_us) if cap else (None, None)
        assignments = ", ".join(f"{k} = ?" for k in fields)
        with self._lock:
            cur = self._db.execute(
                f"UPDATE domains SET {assignments} WHERE host = ? AND name = ? AND {_ACTIVE}",
                (*fields.values(), host, name),
            )
            if "memory_mib" in fields:
                self._unplugs.pop((host, name), None)  # a new size supersedes a request under way
        return cur.rowcount == 1

    # -- incoming migrations and guests ------------------------------------------------------------
    def begin_incoming(self, name: str, source: str, target: str) -> bool:
        """The target's incoming domain for a copy from `source`: paused (migration), never run; False if
        the target already runs a domain of that name (or is down, or the source has no such domain)."""
        with self._tx():
            row = self._db.execute(
                f"SELECT {_COLUMNS} FROM domains WHERE host = ? AND name = ? AND {_ACTIVE}", (source, name)
            ).fetchone()
            if row is None or not self._runs(self._db, source, target):
                return False
            self._db.execute(f"DELETE FROM domains WHERE host = ? AND name = ? AND NOT ({_ACTIVE})", (target, name))
            try:
                self._db.execute(
                    f"INSERT INTO domains (host, {_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (target, *row[:-2], "paused", INCOMING_REASON),
                )
            except sqlite3.IntegrityError:
                return False
            self._db.execute(
                "UPDATE domains SET (nics, cpu_model) = (SELECT nics, cpu_model FROM domains WHERE host = ? AND "
                "name = ?) WHERE host = ? AND name = ?",
                (source, name, target, name),
            )
            self._db.execute(
                "INSERT OR REPLACE INTO incoming (host, name, source, gone_at) VALUES (?, ?, ?, NULL)",
                (target, name, source),
            )
        return True

    def end_incoming(self, name: str, source: str, target: str) -> None:
        """A copy ended without its switch-over: the target's incoming domain goes at once (the source's
        libvirtd tells it), or, when the source lost its power, `incoming_linger_s` later (keepalive)."""
        with self._tx() as db:
            if self._host(db, source).power == "off":
                db.execute(
                    "UPDATE incoming SET gone_at = coalesce(gone_at, ?) WHERE host = ? AND name = ?",
                    (time.time() + self.incoming_linger_s, target, name),
                )
                self._incoming_checked = 0.0  # looked for at the next read
            else:
                self._drop_incoming(target, name)

    def _drop_incoming(self, target: str, name: str) -> None:
        self._db.execute(
            "DELETE FROM domains WHERE host = ? AND name = ? AND state = 'paused' AND reason = ?",
            (target, name, INCOMING_REASON),
        )
        self._db.execute("DELETE FROM incoming WHERE host = ? AND name = ?", (target, name))

    def _expire_incoming(self) -> None:
        """Remove the incoming domains whose target's keepalive noticed their source is gone (looked for at
        most every 0.2 s: every read comes by here)."""
        now = time.monotonic()
        if now - self._incoming_checked < 0.2:
            return
        self._incoming_checked = now
        with self._lock:
            due = self._db.execute("SELECT host, name FROM incoming WHERE gone_at <= ?", (time.time(),)).fetchall()
        if due:
            with self._tx():
                for host, name in due:
                    self._drop_incoming(host, name)

    def fail_host(self, host: str, mode: str, seconds: float | None = None):
        """HostFabric.fail_host; a power loss also leaves the incoming domains of copies from this host to
        their targets' keepalive (incoming_linger_s): no connection reset reaches them."""
        state = super().fail_host(host, mode, seconds)
        if state.power == "off":
            with self._tx() as db:
                db.execute("DELETE FROM incoming WHERE host = ?", (host,))  # gone with its domains
                db.execute(
                    "UPDATE incoming SET gone_at = coalesce(gone_at, ?) WHERE source = ?",
                    (time.time() + self.incoming_linger_s, host),
                )
            self._incoming_checked = 0.0
        return state

    def silence_guest(self, name: str, seconds: float | None = None) -> None:
        """The guest of domain `name` (wherever it runs) does not answer its console for `seconds` (still
        booting), or, None, until silence_guest(name, 0). Kept in the file: every process sees it."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO silent_guests (name, until) VALUES (?, ?) ON CONFLICT (name) DO UPDATE SET "
                "until = excluded.until",
                (name, None if seconds is None else time.time() + seconds),
            )

    def guest_answers(self, host: str, name: str, timeout_s: float) -> bool:
        """Whether the guest of `name` on `host` answers within `timeout_s` (waits for a silent one)."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.domain(host, name)
            if info is None or not info.running:
                return False
            with self._lock:
                row = self._db.execute("SELECT until FROM silent_guests WHERE name = ?", (name,)).fetchone()
            if row is None or (row[0] is not None and time.time() >= row[0]):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(0.05, max(deadline - time.monotonic(), 0.0)))

    def guest_uptime(self, name: str) -> float:
        """Seconds since the guest of `name` started (in this process's view; 0 if it did not see it)."""
        started = self._booted.get(name)
        return max(time.time() - started, 0.0) if started else 0.0

    def move(self, name: str, source: str, target: str) -> bool:
        """Hand a running domain from source to target in one step; False if it is not active on the
        source or the target already runs one of that name (a shut-off definition, or the copy's own
        incoming domain, there is replaced)."""
        with self._tx():
            if not self._runs(self._db, source, target):  # a dead daemon ends the migration
                return False
            self._db.execute(f"DELETE FROM domains WHERE host = ? AND name = ? AND NOT ({_ACTIVE})", (target, name))
            self._drop_incoming(target, name)
            try:
                cur = self._db.execute(
                    f"UPDATE domains SET host = ? WHERE host = ? AND name = ? AND {_ACTIVE}", (target, source, name)
                )
            except sqlite3.IntegrityError:
                return False
            if cur.rowcount == 1:
                pending = self._unplugs.pop((source, name), None)
                if pending is not None:  # the guest's answer follows the domain
                    self._unplugs[(target, name)] = pending
                self.move_disks(self._db, name, source, target)
                self._forget_detaches(source, name, to=target)
        return cur.rowcount == 1

    def copy_paused(self, name: str, source: str, target: str, reason: str) -> bool:
        """A post-copy failure: the domain left paused (`reason`) on the source and on the target."""
        with self._tx():
            row = self._db.execute(
                f"SELECT {_COLUMNS} FROM domains WHERE host = ? AND name = ? AND {_ACTIVE}", (source, name)
            ).fetchone()
            if row is None or not self._runs(self._db, source, target):
                return False
            self._db.execute(f"DELETE FROM domains WHERE host = ? AND name = ? AND NOT ({_ACTIVE})", (target, name))
            self._drop_incoming(target, name)
            try:
                self._db.execute(
                    f"INSERT INTO domains (host, {_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (target, *row[:-2], "paused", reason),
                )
            except sqlite3.IntegrityError:
                return False
            self._db.execute(
                "UPDATE domains SET (nics, cpu_model) = (SELECT nics, cpu_model FROM domains WHERE host = ? AND "
                "name = ?) WHERE host = ? AND name = ?",
                (source, name, target, name),
            )
            self._db.execute(
                "UPDATE domains SET state = 'paused', reason = ? WHERE host = ? AND name = ?", (reason, source, name)
            )
            self._unplugs.pop((source, name), None)
            self._forget_detaches(source, name)
            self.move_disks(self._db, name, source, target, copy=True)
        return True

    def resume_postcopy(self, name: str, source: str, target: str) -> bool:
        """Finish a failed post-copy: the target's copy runs, the source's goes. False unless both are
        paused with reason postcopy-failed."""
        with self._tx():
            rows = self._db.execute(
                "SELECT host FROM domains WHERE name = ? AND host IN (?, ?) AND state = 'paused' "
                "AND reason = 'postcopy-failed'",
                (name, source, target),
            ).fetchall()
            if len(rows) != 2 or not self._runs(self._db, source, target):
                return False
            self._db.execute("DELETE FROM domains WHERE host = ? AND name = ?", (source, name))
            self.drop_disks(self._db, source, name)
            self._db.execute(
                "UPDATE domains SET state = 'running', reason = 'migrated' WHERE host = ? AND name = ?", (target, name)
            )
        return True

    def close(self) -> None:
        with self._lock:
            self._db.close()


def forget_shared() -> None:
    """In a process just forked from one that used sim hosts: drop the inherited fabrics (an SQLite
    connection must not cross a fork) so this process opens its own."""
    with _shared_lock:
        _shared.clear()
