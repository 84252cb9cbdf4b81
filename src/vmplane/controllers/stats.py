"""The usage sampler (issue 33's graphs): every interval (INTERVAL_S, `$VMPLANE_STATS_INTERVAL_S`), each host this
process owns is asked for its running domains' counters in one bulk call (Driver.domain_stats: libvirt's
virConnectGetAllDomainStats), and the rates since the host's previous reading (core/stats.py) are written as
one fine-tier point per VM and per host, and one per project (the sum of its VMs' points in the store). Once a
coarse bucket is complete it is folded and old buckets are pruned (store/stats.py).

Across control-plane processes: a host is sampled by the process that owns it (its lease), so once per
interval cluster-wide; around a lease's hand-over two may sample it, and since every write is an upsert by
(object, tier, bucket) that leaves one point. A project's point is summed in the store from whatever VM
points its bucket holds, so processes that own different hosts add up rather than overwrite each other.

A host that does not answer (or answers after the round gave up on it) leaves a gap in its and its VMs'
graphs; nothing else is recorded. The previous readings live in memory: a new process (or a host newly
owned) has its first rates one interval later.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vmplane.core import stats as rules
from vmplane.core.driver import Driver, DriverError
from vmplane.core.model import UNREACHABLE_HOST_STATES
from vmplane.core.stats import HostCounters, Point
from vmplane.plane.loops import every
from vmplane.store import stats as store

if TYPE_CHECKING:
    from vmplane.plane.capacity import Capacity
    from vmplane.plane.membership import Membership
    from vmplane.store import Database

log = logging.getLogger("vmplane.stats")
INTERVAL_S = 60.0  # between two rounds (the fine tier's step: a shorter interval overwrites its bucket)
READERS = 16  # hosts asked at once (libvirt: each call waits on its daemon)
# a round waits this long at least for its hosts' answers (a loaded host answers a bulk read in seconds); a host
# that did not answer by then is a gap, and its call still in flight refuses the next rounds' at once (no pile-up)
READ_BOUND_S = 10.0


def interval_s() -> float:
    """The sampling interval: $VMPLANE_STATS_INTERVAL_S (tests, benchmarks) or INTERVAL_S."""
    return float(os.environ.get("VMPLANE_STATS_INTERVAL_S") or INTERVAL_S)


@dataclass
class Round:
    """What one round did: hosts read, points written, hosts that did not answer (a gap each)."""

    at: float
    hosts: int = 0
    points: int = 0
    missed: list[str] = field(default_factory=list)
    folded: bool = False


class Stats:
    def __init__(
        self,
        db: Database,
        drivers: dict[str, Driver],
        capacity: Capacity,
        membership: Membership,
        interval: float | None = None,
    ):
        self.db, self.drivers, self.capacity, self.membership = db, drivers, capacity, membership
        self.interval_s = interval if interval is not None else interval_s()
        self._stop = threading.Event()
        self._before: dict[str, HostCounters] = {}  # host -> its previous reading
        self._folded = 0  # the last coarse bucket folded by this process
        self._readers: ThreadPoolExecutor | None = None
        self.last: Round | None = None

    def start(self) -> None:
        every(lambda: self.interval_s, self.sample, self._stop, "stats", log)

    def stop(self) -> None:
        self._stop.set()
        if self._readers is not None:
            self._readers.shutdown(wait=False, cancel_futures=True)

    # -- one round -------------------------------------------------------------------------------
    def sample(self, now: float | None = None) -> Round:
        """Read every owned, reachable host and write this round's points; fold and prune when due."""
        now = time.time() if now is None else now
        hosts = self._hosts()
        readings, missed = self._read(hosts)
        done = Round(at=now, hosts=len(readings), missed=missed)
        with self.db.read() as s:
            conn = s.connection()
            domains, host_ids = store.domains(conn), store.host_ids(conn)
        points = self._points(readings, domains, host_ids)
        bucket = rules.bucket(now, rules.FINE)
        due = rules.folded_bucket(now)
        with self.db.write() as s:
            conn = s.connection()
            done.points = store.write(conn, rules.FINE, bucket, points)
            done.points += store.sum_projects(conn, bucket)
            if due > self._folded:
                store.fold(conn, due)
                store.prune(conn, now)
                store.forget_gone(conn, due)
                done.folded = True
        if done.folded:
            self._folded = due
        self.last = done
        return done

    def _hosts(self) -> list[str]:
        index = self.capacity.index
        return [
            h
            for h in list(self.drivers)
            if h in index and self.membership.owns_host(h) and index.host(h).state not in UNREACHABLE_HOST_STATES
        ]

    def _read(self, hosts: list[str]) -> tuple[dict[str, HostCounters], list[str]]:
        """Each host's reading; the hosts that did not answer within the round (a gap, logged quietly)."""
        readings: dict[str, HostCounters] = {}
        missed: list[str] = []
        lock = threading.Lock()  # a late reader may still add its answer after the round gave up on it

        def one(host: str) -> None:
            try:
                reading = self.drivers[host].domain_stats()
            except DriverError as exc:
                log.debug("usage counters of %s: %s", host, exc)
                with lock:
                    missed.append(host)
                return
            with lock:
                readings[host] = reading

        blocking = [h for h in hosts if self.drivers[h].blocking_calls]
        for host in hosts:
            if host not in blocking:
                one(host)
        if blocking:
            if self._readers is None:
                self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="vmplane-stats")
            futures = {self._readers.submit(one, h): h for h in blocking}
            _done, late = wait(futures, timeout=max(self.interval_s * 0.8, READ_BOUND_S))
            with lock:
                missed += [futures[f] for f in late]  # its call goes on; the driver refuses a second one meanwhile
        with lock:
            return {h: r for h, r in readings.items() if h not in missed}, sorted(missed)

    def _points(
        self,
        readings: dict[str, HostCounters],
        domains: dict[tuple[int, str], tuple[int, int]],
        host_ids: dict[str, int],
    ) -> list[tuple[str, int, Point]]:
        """VM and host points from this round's readings and each host's previous one."""
        out: list[tuple[str, int, Point]] = []
        for host, after in readings.items():
            host_id = host_ids.get(host)
            if host_id is None:
                continue
            before = self._before.get(host)
            earlier = {d.name: d for d in before.domains} if before is not None else {}
            seconds = after.at - before.at if before is not None else 0.0
            guests = []
            for d in after.domains:
                vm = domains.get((host_id, d.name))
                if vm is None:  # not vmplane's, or an incoming migration's domain: not this VM's host yet
                    continue
                point = rules.domain_point(earlier.get(d.name), d, seconds)
                guests.append(point)
                out.append(("vm", vm[0], point))
            out.append(("host", host_id, rules.host_point(before, after, guests)))
            self._before[host] = after
        for gone in set(self._before) - set(self.drivers):
            del self._before[gone]
        return out
