"""This process among the control-plane processes of one store: its registration, its heartbeat, the leases
it holds, and the work of lapsed processes it takes over.

Each process registers a row in `controllers` with a fresh `epoch` (its fencing token, ownership.py) and
renews it every third of its lease period in a short transaction of its own. A row whose renewal has not
changed for its lease period, timed by another process's own monotonic clock (leases.observe: a wall
clock that steps lapses nobody), has lapsed: that process marks it `lapsed` (which waits for any write
that passed its fencing check to commit), and from then on that incarnation changes nothing; its leases,
operations and migrations are free to take. A process that finds its own row marked lapsed (it was
paused, or cut off from the database) registers again under a new epoch; its old threads stay fenced.

Leases (leases.py): the coordinator lease goes to whichever live process asks first; host leases follow
`leases.assign` over the live controllers' names, a holder releasing what it no longer should hold and
the others acquiring it at their next beat. The coordinator takes over the operations and migrations of
lapsed owners (Recovery.take_over: claimed with FOR UPDATE SKIP LOCKED, then resumed or settled).

A restart of the same named process (`vmplane serve --name`, by default HOSTNAME:PORT) marks its previous
incarnation lapsed at once: what it left is recovered without waiting a lease period. If that previous
incarnation was in fact alive (two processes given one --name), it finds its place taken at its next renewal
and registers again as NAME#EPOCH (its old epoch), so that the two never share one name (leases are shared
out by name).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import ColumnClause, and_, insert, literal_column, or_, select, text, update
from sqlalchemy.exc import DBAPIError, IntegrityError

from vmplane.core import leases as rules
from vmplane.core.migration import SETTLING
from vmplane.core.model import IN_FLIGHT_OPERATION_VALUES as IN_FLIGHT
from vmplane.store import Database, pgsessions
from vmplane.store import ledger as L
from vmplane.store.ownership import db_now, now_sql
from vmplane.store.schema import Controller, Lease

log = logging.getLogger("vmplane.controllers")

CONTROLLERS, LEASES = Controller.__table__, Lease.__table__
DEFAULT_LEASE_S = rules.DEFAULT_LEASE_S
SETTLING_MIGRATIONS = sorted(st.value for st in SETTLING)


def default_name(port: int | None = None) -> str:
    return f"{socket.gethostname()}:{port}" if port else f"{socket.gethostname()}:{os.getpid()}"


def mark_lapsed(conn, which, limits: rules.SessionLimits | None = None) -> None:
    """Mark the live rows `which` selects lapsed. On PostgreSQL they are first locked FOR UPDATE, which
    waits for every write that passed its fencing check to commit (ownership.check holds FOR KEY SHARE);
    the UPDATE alone would not wait (an UPDATE of no key column does not conflict with KEY SHARE, which is
    what lets a renewal pass its own process's writes). That wait gives way (pgsessions.select_for_update):
    a write of a process frozen inside its transaction would hold it until its idle timeout, so the sessions
    working for the epochs being marked (judged lapsed by the caller) are ended, and it waits again."""
    c = CONTROLLERS.c
    where = [c.state == "live", which]
    if conn.dialect.name != "sqlite":
        epochs = [
            r.epoch
            for r in pgsessions.select_for_update(
                conn,
                select(c.epoch).where(*where).with_for_update(),
                limits or rules.session_limits(DEFAULT_LEASE_S),
                lambda: conn.execute(select(c.epoch).where(*where)).scalars().all(),
                "marking controllers lapsed",
            )
        ]
        if not epochs:
            return
        where = [c.state == "live", c.epoch.in_(epochs)]
    conn.execute(update(CONTROLLERS).where(*where).values(state="lapsed"))


@dataclass(frozen=True)
class Member:
    epoch: int
    name: str


class Membership:
    """This process among the control-plane processes of its store (its registration, lease and beat).

    What changes when peers come and go is told through hooks the composition root sets:
    `on_peers_changed` (another live process may have changed hosts or settings) and `on_orphans`
    (the coordinator found work of a lapsed process to take over)."""

    def __init__(
        self, db: Database, name: str | None = None, lease_s: float = DEFAULT_LEASE_S, api_url: str | None = None
    ):
        self.db = db
        self.on_peers_changed: list[Callable[[], object]] = []
        self.on_orphans: list[Callable[[], object]] = []
        self.name = name or "local"
        self.lease_s = float(lease_s)
        db.use_lease(self.lease_s)  # its PostgreSQL transactions' timeouts: a few leases (pgsessions)
        self.api_url = api_url
        self.epoch: int | None = None
        self.held: frozenset[str] = frozenset()  # leases this incarnation holds, as last read back
        self.live: tuple[Member, ...] = ()
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen: dict[int, rules.Sighting] = {}  # the others' renewals, as this process saw them

    # -- what the others ask -------------------------------------------------------------------
    def owns_host(self, host: str) -> bool:
        """Whether this process listens to `host` (monitor, sync, events)."""
        return self.epoch is None or rules.host_lease(host) in self.held

    def settles(self, host: str) -> bool:
        """Whether this process may settle what was left in flight on `host`: it listens to the host, or no
        other control-plane process lives (so no call of another one can still be in flight there)."""
        return self.owns_host(host) or self.alone()

    def coordinates(self) -> bool:
        """Whether this process runs the once-per-cluster loops."""
        return self.epoch is None or rules.COORDINATOR in self.held

    def alone(self) -> bool:
        """No other live control-plane process (start-up recovery may then treat all work as its own)."""
        return all(m.epoch == self.epoch for m in self.live)

    def is_live(self, epoch: int | None) -> bool:
        return epoch is not None and any(m.epoch == epoch for m in self.live)

    # -- registration and heartbeat ------------------------------------------------------------
    def register(self, reclaim: bool = True) -> int:
        """A new incarnation. At a process's start (`reclaim`) a previous live one of the same name is marked
        lapsed: a restart. Registering again after a lapse does not: a process of that name may have been
        started meanwhile, and the two must not take each other's place in turn."""
        c = CONTROLLERS.c
        with self._lock:
            with self.db.transaction() as conn:
                now = db_now(conn)
                if reclaim:
                    mark_lapsed(conn, c.name == self.name, self.db.limits)
                result = conn.execute(
                    insert(CONTROLLERS).values(
                        name=self.name,
                        hostname=socket.gethostname(),
                        pid=os.getpid(),
                        api_url=self.api_url,
                        state="live",
                        lease_s=self.lease_s,
                        started_at=now,
                        renewed_at=now,
                        expires_at=now + self.lease_s,
                    )
                )
                self.epoch = int(result.inserted_primary_key[0])  # type: ignore[index]  # an INSERT has its key
            # new operations are owned by it (ownership.owner_of reads this attribute vmplane puts on the engine)
            self.db.engine.vmplane_controller = self.epoch  # type: ignore[attr-defined]
            self.held = frozenset()
            self.start()
            log.info("controller %s registered as epoch %d (lease %g s)", self.name, self.epoch, self.lease_s)
            self.balance()
            return self.epoch

    def start(self) -> None:
        """Renew every third of the lease period, and balance as often, until stop(): each in a thread of its
        own, so that a balance that waits (for the index, the host list, a database lock) never delays the
        renewal."""
        if self._thread is not None:
            return
        self._thread = self._every("vmplane-lease", self.renew)
        self._every("vmplane-balance", self.balance)

    def _every(self, name: str, body) -> threading.Thread:
        def loop():
            while not self._stop.wait(self.lease_s / 3):
                try:
                    body()
                except Exception:  # a database that does not answer: the lease may lapse; retried
                    log.exception(name)

        thread = threading.Thread(target=loop, name=name, daemon=True)
        thread.start()
        return thread

    def renew(self) -> bool:
        """Extend this incarnation's lease; register again if it was marked lapsed (False then). One UPDATE of its own
        row on a connection of its own (Database.lease_transaction), under no lock of this process: neither
        a pool taken by requests nor an admission or balance that waits can hold it back."""
        epoch = self.epoch
        if self._stop.is_set() or epoch is None:
            return False  # stopped: never registered again
        c = CONTROLLERS.c
        with self.db.lease_transaction() as conn:
            now: ColumnClause[float] = literal_column(now_sql(conn))
            renewed = (
                conn.execute(
                    update(CONTROLLERS)
                    .where(c.epoch == epoch, c.state == "live")
                    .values(renewed_at=now, expires_at=now + self.lease_s)
                ).rowcount
                == 1
            )
        if renewed:
            return True
        with self._lock:
            if self._stop.is_set() or self.epoch != epoch:
                return False  # stopped, or registered again meanwhile
            taker = self._taken_by(epoch)
            if taker is not None:  # not a lapse: a process started under this name took its place
                log.error(
                    "controller %s: another process registered under this name (epoch %s) and took the place "
                    "of this one (epoch %s); registering as %s#%d: give each process its own --name",
                    self.name,
                    taker,
                    epoch,
                    self.name,
                    epoch,
                )
                self.name = f"{self.name}#{epoch}"  # (an epoch is never given twice: a name of its own)
            else:
                log.warning(
                    "controller %s: epoch %s lapsed (paused or cut off longer than %g s); its work is "
                    "another's now: registering again",
                    self.name,
                    epoch,
                    self.lease_s,
                )
            self.register(reclaim=False)
        return False

    def _taken_by(self, epoch: int) -> int | None:
        """The live incarnation of this name registered after `epoch`, if any: a second process started under
        this process's name (which takes a previous incarnation's place, as a restart does)."""
        c = CONTROLLERS.c
        with self.db.read() as s:
            return (
                s.connection()
                .execute(select(c.epoch).where(c.name == self.name, c.state == "live", c.epoch > epoch).limit(1))
                .scalar()
            )

    def stop(self) -> None:
        """A clean end: leases released and the row `stopped`, so others take over at once."""
        self._stop.set()
        if self.epoch is None:
            return
        try:
            with self._lock, self.db.transaction() as conn:
                conn.execute(update(LEASES).where(LEASES.c.holder == self.epoch).values(holder=None))
                conn.execute(
                    update(CONTROLLERS)
                    .where(CONTROLLERS.c.epoch == self.epoch, CONTROLLERS.c.state == "live")
                    .values(state="stopped")
                )
        except Exception:
            log.exception("controller %s: stopping", self.name)
        self.held = frozenset()

    # -- leases ---------------------------------------------------------------------------------
    def balance(self) -> None:
        """Mark lapsed rows (leases.observe), then take what is free and mine by the assignment, give back what
        is not mine; the coordinator takes over the work of lapsed owners."""
        c, ls = CONTROLLERS.c, LEASES.c
        try:
            with self._lock, self.db.transaction() as conn:
                now: ColumnClause[float] = literal_column(now_sql(conn))
                renewals = (
                    conn.execute(select(c.epoch, c.renewed_at, c.lease_s).where(c.state == "live")).tuples().all()
                )
                self._seen, stale = rules.observe(self._seen, renewals, self.epoch, time.monotonic())
                for epoch in stale:  # unless renewed since it was read
                    mark_lapsed(
                        conn, and_(c.epoch == epoch, c.renewed_at == self._seen[epoch].renewed_at), self.db.limits
                    )
                live = [
                    Member(r.epoch, r.name)
                    for r in conn.execute(select(c.epoch, c.name).where(c.state == "live").order_by(c.epoch))
                ]
                hosts = list(conn.execute(select(L.HOSTS.c.name)).scalars())
                current = {r.name: r.holder for r in conn.execute(select(ls.name, ls.holder))}
                live_epochs = {m.epoch for m in live}
                assignment = rules.assign(hosts, [m.name for m in live])
                held = {name for name, holder in current.items() if holder == self.epoch}
                release = list(rules.to_release(held, assignment, self.name))
                wanted = rules.to_acquire(held, assignment, self.name) + (
                    [] if rules.COORDINATOR in held else [rules.COORDINATOR]
                )
                free = [n for n in wanted if n in current and current[n] not in live_epochs]
                missing = [n for n in wanted if n not in current]
                if release:
                    conn.execute(
                        update(LEASES).where(ls.name.in_(release), ls.holder == self.epoch).values(holder=None)
                    )
                if free:
                    conn.execute(
                        update(LEASES)
                        .where(
                            ls.name.in_(free),
                            or_(ls.holder.is_(None), ls.holder.not_in(select(c.epoch).where(c.state == "live"))),
                        )
                        .values(holder=self.epoch, epoch=ls.epoch + 1, acquired_at=now)
                    )
                if missing:
                    conn.execute(
                        insert(LEASES),
                        [{"name": n, "holder": self.epoch, "epoch": 1, "acquired_at": db_now(conn)} for n in missing],
                    )
        except (IntegrityError, DBAPIError) as exc:  # another process took one at the same time: next beat
            log.info(
                "controller %s: leases changed under this beat (%s); again at the next one",
                self.name,
                type(exc).__name__,
            )
            return
        with self.db.read() as s:
            held_now = frozenset(s.connection().execute(select(ls.name).where(ls.holder == self.epoch)).scalars())
        gained = held_now - self.held
        self.held, self.live = held_now, tuple(live)
        if gained or release:
            log.info(
                "controller %s (epoch %s) holds %d lease(s): +%s -%s",
                self.name,
                self.epoch,
                len(held_now),
                sorted(gained)[:5],
                release[:5],
            )
        if len(live) > 1:  # what other processes changed: hosts, and settings (seen within a beat)
            for hook in self.on_peers_changed:
                hook()
        if self.coordinates() and self.orphans():
            for hook in self.on_orphans:
                hook()

    # -- work of lapsed owners -----------------------------------------------------------------
    def _orphan_of(self, owner_col):
        c = CONTROLLERS.c
        return or_(owner_col.is_(None), owner_col.not_in(select(c.epoch).where(c.state == "live")))

    def orphans(self) -> int:
        """In-flight operations and settling migrations whose owner is not live."""
        op, m = L.OPERATIONS.c, L.MIGRATIONS.c
        with self.db.read() as s:
            conn = s.connection()
            ops = conn.execute(select(op.id).where(op.state.in_(IN_FLIGHT), self._orphan_of(op.owner)).limit(1)).first()
            migs = conn.execute(
                select(m.id).where(m.state.in_(SETTLING_MIGRATIONS), self._orphan_of(m.owner)).limit(1)
            ).first()
        return int(ops is not None) + int(migs is not None)

    def claim_operations(self) -> list[tuple[str, str]]:
        """Take the in-flight operations of owners that are not live: (id, kind), oldest first. Rows another
        process is claiming at this moment are skipped (FOR UPDATE SKIP LOCKED), never waited for."""
        op = L.OPERATIONS.c
        with self.db.transaction() as conn:
            query = (
                select(op.id, op.kind).where(op.state.in_(IN_FLIGHT), self._orphan_of(op.owner)).order_by(op.created_at)
            )
            if conn.dialect.name != "sqlite":
                query = query.with_for_update(skip_locked=True, of=L.OPERATIONS)
            rows = conn.execute(query).all()
            if rows:
                conn.execute(update(L.OPERATIONS).where(op.id.in_([r.id for r in rows])).values(owner=self.epoch))
        return [(r.id, r.kind) for r in rows]

    def claim_migration(self, migration_id: str) -> bool:
        """Take a settling migration whose owner is not live (or is this process); False if a live other owns it."""
        m = L.MIGRATIONS.c
        with self.db.transaction() as conn:
            return (
                conn.execute(
                    update(L.MIGRATIONS)
                    .where(m.id == migration_id, or_(m.owner == self.epoch, self._orphan_of(m.owner)))
                    .values(owner=self.epoch)
                ).rowcount
                == 1
            )

    # -- what `vmplane controllers` shows --------------------------------------------------------
    def rows(self) -> list[dict]:
        """Every controller not stopped long ago: its state, lease and what it holds and runs."""
        c, ls, op, m = CONTROLLERS.c, LEASES.c, L.OPERATIONS.c, L.MIGRATIONS.c
        with self.db.read() as s:
            conn = s.connection()
            now = db_now(conn)
            rows = conn.execute(
                select(CONTROLLERS).where(or_(c.state == "live", c.renewed_at > now - 3600)).order_by(c.epoch)
            ).all()
            held: dict[int, list[str]] = {}
            for name, holder in conn.execute(select(ls.name, ls.holder).where(ls.holder.is_not(None))):
                held.setdefault(holder, []).append(name)
            ops: dict[int, int] = dict(
                conn.execute(
                    select(op.owner, text("count(*)"))
                    .where(op.state.in_(IN_FLIGHT), op.owner.is_not(None))
                    .group_by(op.owner)
                )
                .tuples()
                .all()
            )
            migs: dict[int, int] = dict(
                conn.execute(
                    select(m.owner, text("count(*)"))
                    .where(m.state.in_(SETTLING_MIGRATIONS), m.owner.is_not(None))
                    .group_by(m.owner)
                )
                .tuples()
                .all()
            )
        out = []
        for r in rows:
            names = sorted(held.get(r.epoch, []))
            out.append(
                {
                    "epoch": r.epoch,
                    "name": r.name,
                    "hostname": r.hostname,
                    "pid": r.pid,
                    "api_url": r.api_url,
                    "state": "expired" if r.state == "live" and rules.expired(r.expires_at, now) else r.state,
                    "lease_s": r.lease_s,
                    "expires_in_s": round(r.expires_at - now, 1) if r.state == "live" else None,
                    "started_at": r.started_at,
                    "coordinator": rules.COORDINATOR in names,
                    "hosts": [rules.host_of(n) for n in names if rules.host_of(n)],
                    "operations": ops.get(r.epoch, 0),
                    "migrations": migs.get(r.epoch, 0),
                    "this": r.epoch == self.epoch,
                }
            )
        return out
