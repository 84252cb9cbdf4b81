"""Graphs over time, the rules (issue 33), pure: what a host says of its domains (cumulative counters), the
rates drawn from two such readings, and the tiers that keep the points downsampled and bounded.

- A host reports counters that only grow while a domain runs: CPU time (ns, all vCPUs), bytes read and
  written by its disks, bytes received and sent by its NICs. A rate is (now - before) / seconds between the
  two readings. A counter that went backwards (the domain restarted, or migrated: its QEMU is a new process)
  gives no rate, never a negative one; the next reading starts again from there.
- CPU is a percentage of the domain's vCPUs (100: every vCPU busy all the time), and `cpu_cores` the cores it
  kept busy (what a project's or a host's sum adds up).
- Tiers: a point per FINE.step_s kept FINE.keep_s, and a point per COARSE.step_s (the mean of the fine points
  of its span) kept COARSE.keep_s. An object holds at most `max_points(tier)` points per tier, whatever the
  sampling interval: a shorter interval overwrites its bucket's point with the newer reading.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields

NS = 1_000_000_000


@dataclass(frozen=True)
class DomainCounters:
    """One domain at one reading, as its host reports it (libvirt's bulk stats). Counters are cumulative;
    memory is a level (KiB): `memory_kib` what the domain has now (balloon), `used_kib` what the guest uses
    when its balloon driver says so, else what QEMU holds (RSS), else None."""

    name: str
    vcpus: int
    cpu_ns: int
    memory_kib: int
    used_kib: int | None = None
    rd_bytes: int = 0
    wr_bytes: int = 0
    rx_bytes: int = 0
    tx_bytes: int = 0


@dataclass(frozen=True)
class HostCounters:
    """One host at one reading (`at`: seconds since 1970, the reader's clock): its CPUs, their cumulative
    busy and total time when the host says (else None), its memory, and every running domain's counters."""

    at: float
    cpus: int
    memory_kib: int
    free_kib: int | None = None  # free + buffers + page cache: what a guest could still get
    cpu_busy_ns: int | None = None
    cpu_total_ns: int | None = None
    domains: tuple[DomainCounters, ...] = ()


@dataclass(frozen=True)
class Point:
    """One object's values in one bucket: rates per second, levels in MiB. None: not known (no earlier
    reading, a counter that went backwards, or the host did not say)."""

    cpu_pct: float | None = None
    cpu_cores: float | None = None
    mem_used_mib: float | None = None
    mem_total_mib: float | None = None
    disk_rd_bps: float | None = None
    disk_wr_bps: float | None = None
    net_rx_bps: float | None = None
    net_tx_bps: float | None = None


FIELDS = tuple(f.name for f in fields(Point))


@dataclass(frozen=True)
class Tier:
    name: str
    step_s: int
    keep_s: int


FINE = Tier("1m", 60, 24 * 3600)
COARSE = Tier("10m", 600, 31 * 24 * 3600)
TIERS = (FINE, COARSE)


def bucket(at: float, tier: Tier) -> int:
    """The start of the bucket holding time `at` (seconds since 1970)."""
    return int(at // tier.step_s) * tier.step_s


def oldest_kept(now: float, tier: Tier) -> int:
    """Buckets that start before this are pruned: the tier keeps `keep_s` back from now's bucket."""
    return bucket(now, tier) - tier.keep_s + tier.step_s


def max_points(tier: Tier) -> int:
    return tier.keep_s // tier.step_s


def folded_bucket(now: float) -> int:
    """The coarse bucket that is complete at `now` (the one before now's) and due to be folded."""
    return bucket(now, COARSE) - COARSE.step_s


def rate(before: int | None, after: int | None, seconds: float) -> float | None:
    """Per second between two readings of a counter; None when not known or when it went backwards."""
    if before is None or after is None or seconds <= 0 or after < before:
        return None
    return (after - before) / seconds


def _mib(kib: int | None) -> float | None:
    return None if kib is None else kib / 1024


def domain_point(before: DomainCounters | None, after: DomainCounters, seconds: float) -> Point:
    """A domain's point from its reading `seconds` after `before` (None: its first reading, levels only)."""
    b = before
    cpu = rate(b.cpu_ns if b else None, after.cpu_ns, seconds)
    cores = None if cpu is None else cpu / NS
    return Point(
        cpu_pct=None if cores is None else min(100.0 * cores / max(after.vcpus, 1), 100.0),
        cpu_cores=cores,
        mem_used_mib=_mib(after.used_kib if after.used_kib is not None else after.memory_kib),
        mem_total_mib=_mib(after.memory_kib),
        disk_rd_bps=rate(b.rd_bytes if b else None, after.rd_bytes, seconds),
        disk_wr_bps=rate(b.wr_bytes if b else None, after.wr_bytes, seconds),
        net_rx_bps=rate(b.rx_bytes if b else None, after.rx_bytes, seconds),
        net_tx_bps=rate(b.tx_bytes if b else None, after.tx_bytes, seconds),
    )


def host_point(before: HostCounters | None, after: HostCounters, guests: Sequence[Point]) -> Point:
    """A host's point: its own CPU and memory when it says them (else its guests' sum), and its guests'
    disk and network traffic summed."""
    busy = total = None
    if before is not None and after.at > before.at:
        busy = rate(before.cpu_busy_ns, after.cpu_busy_ns, 1.0)
        total = rate(before.cpu_total_ns, after.cpu_total_ns, 1.0)
    summed = sum_points(guests)
    pct: float | None
    cores: float | None
    if busy is not None and total:
        pct = min(100.0 * busy / total, 100.0)
        cores = pct * after.cpus / 100.0
    else:
        cores = summed.cpu_cores
        pct = None if cores is None else min(100.0 * cores / max(after.cpus, 1), 100.0)
    used = after.memory_kib - after.free_kib if after.free_kib is not None else None
    return Point(
        cpu_pct=pct,
        cpu_cores=cores,
        mem_used_mib=_mib(used) if used is not None else summed.mem_used_mib,
        mem_total_mib=_mib(after.memory_kib),
        disk_rd_bps=summed.disk_rd_bps,
        disk_wr_bps=summed.disk_wr_bps,
        net_rx_bps=summed.net_rx_bps,
        net_tx_bps=summed.net_tx_bps,
    )


def sum_points(points: Iterable[Point]) -> Point:
    """Field by field, the sum of the known values (None where none is known); a percentage is not summed."""
    sums: dict[str, float | None] = dict.fromkeys(FIELDS)
    for p in points:
        for name in FIELDS:
            value = getattr(p, name)
            if value is not None and name != "cpu_pct":
                sums[name] = (sums[name] or 0.0) + value
    return Point(**sums)


def mean_point(points: Iterable[Point]) -> Point:
    """Field by field, the mean of the known values (a coarse bucket from its fine points)."""
    totals: dict[str, list[float]] = {name: [] for name in FIELDS}
    for p in points:
        for name in FIELDS:
            value = getattr(p, name)
            if value is not None:
                totals[name].append(value)
    return Point(**{name: (math.fsum(v) / len(v) if v else None) for name, v in totals.items()})


def latest(series: Sequence[tuple[int, Point]], field: str) -> float | None:
    """The newest known value of `field` in a series sorted by bucket."""
    for _at, point in reversed(series):
        value = getattr(point, field)
        if value is not None:
            return float(value)
    return None
