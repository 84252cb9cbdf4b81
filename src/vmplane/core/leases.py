"""Who does which background work, as pure rules over plain data (controllers.py applies them).

Work only one process may do is held through a lease: `coordinator` (start-up recovery and takeovers,
the settle loops, HA, the migration queue) and `host:NAME` (that host's monitor, full sync and libvirt
events: each host's events have exactly one listener). A lease is valid while its holder controller is
live; hosts are shared out among the live controllers by rendezvous hashing of (controller name, host
name), so a controller that joins or leaves moves only its share of the hosts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

COORDINATOR = "coordinator"
HOST_PREFIX = "host:"


def host_lease(host: str) -> str:
    return HOST_PREFIX + host


def host_of(lease: str) -> str | None:
    return lease[len(HOST_PREFIX) :] if lease.startswith(HOST_PREFIX) else None


def _weight(controller: str, host: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{controller}\0{host}".encode(), digest_size=8).digest(), "big")


def assign(hosts: Iterable[str], controllers: Iterable[str]) -> dict[str, str]:
    """Each host to exactly one of `controllers` (names): the one with the highest weight for it. Stable:
    the same sets give the same answer in every process; a controller added or removed moves only the
    hosts it gains or had."""
    names = sorted(set(controllers))
    if not names:
        return {}
    return {host: max(names, key=lambda c: (_weight(c, host), c)) for host in hosts}


def expired(expires_at: float, now: float) -> bool:
    return expires_at <= now


@dataclass(frozen=True)
class Sighting:
    """A controller's renewal as one observer saw it: the row's `renewed_at` and when (the observer's
    monotonic clock) that value was first seen."""

    renewed_at: float
    since: float


def observe(
    seen: Mapping[int, Sighting], live: Iterable[tuple[int, float, float]], me: int | None, now: float
) -> tuple[dict[int, Sighting], list[int]]:
    """Which live controllers (epoch, renewed_at, lease_s) have lapsed, as this observer judges: one whose
    renewal has not changed for its lease period of the observer's own monotonic clock (`now`). A wall
    clock that steps (NTP, a resumed virtual machine) lapses nobody: only the absence of renewals does, as
    in Kubernetes' leader election. The observer never judges itself, and needs a whole lease period of
    watching before it judges another. Returns the sightings to keep and the lapsed epochs."""
    kept: dict[int, Sighting] = {}
    lapsed = []
    for epoch, renewed_at, lease_s in live:
        if epoch == me:
            continue
        before = seen.get(epoch)
        sighting = before if before is not None and before.renewed_at == renewed_at else Sighting(renewed_at, now)
        kept[epoch] = sighting
        if now - sighting.since >= lease_s:
            lapsed.append(epoch)
    return kept, sorted(lapsed)


def to_release(held: Iterable[str], assignment: Mapping[str, str], me: str) -> list[str]:
    """Host leases this controller holds that the assignment gives to another (or whose host is gone)."""
    return sorted(lease for lease in held if (host := host_of(lease)) is not None and assignment.get(host) != me)


def to_acquire(held: Iterable[str], assignment: Mapping[str, str], me: str) -> list[str]:
    """Host leases the assignment gives this controller that it does not hold yet."""
    have = set(held)
    return sorted(host_lease(h) for h, owner in assignment.items() if owner == me and host_lease(h) not in have)


DEFAULT_LEASE_S = 15.0


@dataclass(frozen=True)
class SessionLimits:
    """How long this process's PostgreSQL transactions may wait for a lock and sit idle (milliseconds)."""

    lock_timeout_ms: int  # any statement's wait for a lock (lock_timeout)
    idle_ms: int  # a transaction that waits for its client (idle_in_transaction_session_timeout)
    give_way_ms: int  # one try of a wait that must give way (the admissions' lock, mark_lapsed)


def session_limits(lease_s: float) -> SessionLimits:
    """Limits a few lease periods long. A process frozen inside a transaction (SIGSTOP, a paused virtual machine)
    keeps its locks until PostgreSQL ends its session: idle for three leases, by when the others have long judged
    it lapsed. A plain wait lasts a lease longer, so that such a holder is ended before its waiters give up. The
    waits every admission and every takeover need give way after a third of a lease (a beat), to look whether
    their holder is a lapsed process whose session may be ended at once, then wait again."""
    lease_ms = max(1, round(lease_s * 1000))
    return SessionLimits(lock_timeout_ms=4 * lease_ms, idle_ms=3 * lease_ms, give_way_ms=max(100, lease_ms // 3))
