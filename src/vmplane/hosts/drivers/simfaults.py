"""Fault mode for sim hosts: a seeded source of libvirt's worst behaviour (off by default).

A `SimFaults` is switched on for one driver (`SimDriver(..., faults=f)`) or for every sim host of a
fabric (`fabric.faults = f`). With it on, the sim behaves as libvirt does at its worst, each fault by
its own probability, drawn from one `random.Random(seed)`:
- `transient`: any call (domain()/domains() included) raises DriverError "daemon restarting", and so
  does every call to that host for `restart_s` after it (counted as `transient_call`);
- `partial`: a change (start, stop, set_vcpus, set_memory, set_cpu_cap) has its effect, then raises;
- `unplug_late` / `unplug_never`: a DIMM unplug request is only *sent*: the guest completes it after
  `unplug_delay_s` or never (each new request draws again, as a guest asked again may comply);
- `lost_connection`: the client connection is lost mid-copy; migrate raises, but the copy goes on
  and the domain moves to the target a little later (`migration_active` says so meanwhile);
- `postcopy_failed`: the copy fails in post-copy: the domain is left PAUSED (postcopy-failed) on the
  source and on the target, and migrate raises;
- `guest_poweroff` / `guest_crash` / `guest_pause`: on any call, a guest of that host powers itself
  off (its domain goes), crashes (left defined, shut off, reason crashed) or pauses (resumed after
  `pause_s`);
- `event_late` / `event_twice` / `event_lost`: a lifecycle event arrives after `event_delay_s`, twice,
  or not at all;
- storage (drivers/simstorage.py): `detach_late` / `detach_never`: a disk detach the guest completes
  after `unplug_delay_s` or never (as DIMM unplugs); `disk_copy_error`: a migration copying disks fails
  with an I/O error part-way through the disks, leaving the target's overlays partly written; volume
  calls get `transient` and `partial` (e.g. a volume created, then an error) as every call does;
- hosts (drivers/simhosts.py; off in `nasty` too, the HA harness turns them on): `host_flap`: on a
  call, the host becomes unreachable from the control plane for `flap_s` (a blip: its guests run on);
  `host_partition`: the same for `partition_s` (long enough to be taken for dead); `host_reboot`: its
  power fails (every domain gone, no event) and it is back, empty, after `reboot_s`. Each is kept in
  the fabric (every process sees it) and ends by itself; calls refused meanwhile count as `host_call`.
A burst (`burst(host, seconds)`, e.g. a libvirtd restart timed between two host checks): every call to
that host raises the `transient` error until it ends (counted as `transient_call`).
`counts` says how many of each were injected. `enabled = False` stops new faults (a quiet period);
what is already under way (a late unplug, a copy going on, a late event, a pause) still completes.
"""

from __future__ import annotations

import collections
import math
import random
import threading
import time
from dataclasses import dataclass, field

KINDS = (
    "transient",
    "transient_call",
    "partial",
    "unplug_late",
    "unplug_never",
    "lost_connection",
    "postcopy_failed",
    "guest_poweroff",
    "guest_crash",
    "guest_pause",
    "event_late",
    "event_twice",
    "event_lost",
    "detach_late",
    "detach_never",
    "disk_copy_error",
    "host_flap",
    "host_partition",
    "host_reboot",
    "host_call",
)


@dataclass
class SimFaults:
    seed: int = 0
    transient: float = 0.0
    partial: float = 0.0
    unplug_late: float = 0.0
    unplug_never: float = 0.0
    lost_connection: float = 0.0
    postcopy_failed: float = 0.0
    guest_poweroff: float = 0.0
    guest_crash: float = 0.0
    guest_pause: float = 0.0
    event_late: float = 0.0
    event_twice: float = 0.0
    event_lost: float = 0.0
    detach_late: float = 0.0
    detach_never: float = 0.0
    disk_copy_error: float = 0.0
    host_flap: float = 0.0
    host_partition: float = 0.0
    host_reboot: float = 0.0
    unplug_delay_s: tuple[float, float] = (0.05, 1.0)
    copy_delay_s: tuple[float, float] = (0.02, 0.5)  # a copy that goes on after the connection was lost
    event_delay_s: tuple[float, float] = (0.05, 1.5)
    pause_s: tuple[float, float] = (0.05, 1.0)
    restart_s: tuple[float, float] = (0.05, 0.4)
    flap_s: tuple[float, float] = (0.05, 0.5)  # a blip: far shorter than vmplane.ha.grace
    partition_s: tuple[float, float] = (1.0, 5.0)
    reboot_s: tuple[float, float] = (0.5, 3.0)
    enabled: bool = True
    counts: collections.Counter = field(default_factory=collections.Counter)
    bursts: dict = field(default_factory=dict)  # host -> when its burst ends (time.monotonic())

    def __post_init__(self):
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()

    @classmethod
    def nasty(cls, seed: int, scale: float = 1.0, **overrides) -> SimFaults:
        """Every kind on, at rates that make a busy minute see each of them many times."""
        rates = dict(
            transient=0.02,
            partial=0.05,
            unplug_late=0.3,
            unplug_never=0.15,
            lost_connection=0.1,
            postcopy_failed=0.05,
            guest_poweroff=0.002,
            guest_crash=0.002,
            guest_pause=0.003,
            event_late=0.2,
            event_twice=0.1,
            event_lost=0.1,
            detach_late=0.3,
            detach_never=0.15,
            disk_copy_error=0.1,
        )
        return cls(seed=seed, **{k: v * scale for k, v in rates.items()} | overrides)

    def chance(self, kind: str) -> bool:
        """Whether fault `kind` happens now (counted when it does)."""
        p = getattr(self, kind)
        if not self.enabled or p <= 0:
            return False
        with self._lock:
            hit = self._rng.random() < p
            if hit:
                self.counts[kind] += 1
        return hit

    def burst(self, host: str, seconds: float = math.inf) -> None:
        """Every call to `host` fails (transient) for `seconds`, or until faults are switched off."""
        with self._lock:
            self.bursts[host] = time.monotonic() + seconds

    def bursting(self, host: str) -> bool:
        """Whether a burst of `host` is on now (never while faults are off)."""
        return self.enabled and time.monotonic() < self.bursts.get(host, 0.0)

    def count(self, kind: str) -> None:
        with self._lock:
            self.counts[kind] += 1

    def delay(self, span: tuple[float, float]) -> float:
        with self._lock:
            return self._rng.uniform(*span)

    def pick(self, items: list):
        with self._lock:
            return self._rng.choice(items)

    def total(self) -> int:
        return sum(self.counts.values())
