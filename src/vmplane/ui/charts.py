"""The console's usage graphs (issue 33): small line charts of a VM's, a host's or a project's points over the
last hour, day or month, drawn on the server as SVG (fragments/graphs.html; no script, no build step).

This module reads a series (store/stats.py) and turns it into geometry: each line a list of polyline segments in
a VIEW_W x VIEW_H box (a missing bucket, a host that did not answer, breaks the line: a gap, never a made-up
slope), the y scale from 0 to a round maximum, and the words a screen reader says (the latest value). A long
range is averaged to at most MAX_SHOWN points (a day's 1,440 minutes as 288 five-minute points)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vmplane.core import stats as rules
from vmplane.core.stats import Point, Tier
from vmplane.store import stats as store

VIEW_W, VIEW_H = 300, 80
MAX_SHOWN = 288
RANGES: dict[str, tuple[Tier, int]] = {  # name -> (the tier read, seconds back from now)
    "hour": (rules.FINE, 3600),
    "day": (rules.FINE, 24 * 3600),
    "month": (rules.COARSE, 31 * 24 * 3600),
}
DEFAULT_RANGE = "hour"


def per_second(value: float) -> str:
    return _bytes(value) + "/s"


def _bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def mib(value: float) -> str:
    return _bytes(value * 1024 * 1024)


def percent(value: float) -> str:
    return f"{value:.1f} %"


def cores(value: float) -> str:
    return f"{value:.2f} cores"


@dataclass(frozen=True)
class Line:
    label: str
    field: str
    latest: str  # its newest value in words ("-": none yet)
    segments: list[str]  # SVG polyline `points`, one per unbroken run


@dataclass(frozen=True)
class Chart:
    title: str
    lines: list[Line]
    top: str  # the y axis' maximum, in words
    summary: str  # what a screen reader says: each line's latest value

    @property
    def empty(self) -> bool:
        return not any(line.segments for line in self.lines)


# (title, [(label, field)], format, fixed top or None)
ChartSpec = tuple[str, list[tuple[str, str]], Callable[[float], str], float | None]
VM_CHARTS: list[ChartSpec] = [
    ("CPU", [("used", "cpu_pct")], percent, 100.0),
    ("Memory", [("used", "mem_used_mib"), ("assigned", "mem_total_mib")], mib, None),
    ("Disk I/O", [("read", "disk_rd_bps"), ("write", "disk_wr_bps")], per_second, None),
    ("Network", [("in", "net_rx_bps"), ("out", "net_tx_bps")], per_second, None),
]
HOST_CHARTS: list[ChartSpec] = [
    ("CPU", [("used", "cpu_pct")], percent, 100.0),
    ("Memory", [("used", "mem_used_mib"), ("total", "mem_total_mib")], mib, None),
    ("Disk I/O (its VMs)", [("read", "disk_rd_bps"), ("write", "disk_wr_bps")], per_second, None),
    ("Network (its VMs)", [("in", "net_rx_bps"), ("out", "net_tx_bps")], per_second, None),
]
PROJECT_CHARTS: list[ChartSpec] = [
    ("CPU (its VMs)", [("used", "cpu_cores")], cores, None),
    ("Memory (its VMs)", [("used", "mem_used_mib"), ("assigned", "mem_total_mib")], mib, None),
]
SPECS = {"vm": VM_CHARTS, "host": HOST_CHARTS, "project": PROJECT_CHARTS}


def graphs(db, kind: str, obj_id: int, range_name: str | None = None, now: float | None = None) -> dict:
    """The template context of fragments/graphs.html for one object: its charts over `range_name`."""
    name = range_name if range_name in RANGES else DEFAULT_RANGE
    tier, back = RANGES[name]
    now = time.time() if now is None else now
    start, end = rules.bucket(now - back, tier), rules.bucket(now, tier) + tier.step_s
    with db.read() as s:
        series = store.series(s.connection(), kind, obj_id, tier, start)
    step = tier.step_s * max(1, math.ceil((end - start) / tier.step_s / MAX_SHOWN))
    shown = downsample(series, step)
    charts = [chart(title, lines, fmt, top, shown, start, end, step) for title, lines, fmt, top in SPECS[kind]]
    return dict(graphs=charts, graph_range=name, graph_ranges=list(RANGES), graph_empty=not series)


def downsample(series: Sequence[tuple[int, Point]], step: int) -> list[tuple[int, Point]]:
    """The series averaged into buckets of `step` seconds (as it is when that is its own step)."""
    grouped: dict[int, list[Point]] = {}
    for at, point in series:
        grouped.setdefault(at - at % step, []).append(point)
    return [(at, points[0] if len(points) == 1 else rules.mean_point(points)) for at, points in grouped.items()]


def chart(
    title: str,
    lines: list[tuple[str, str]],
    fmt: Callable[[float], str],
    top: float | None,
    series: Sequence[tuple[int, Point]],
    start: int,
    end: int,
    step: int,
) -> Chart:
    """One chart: its lines' segments scaled into the view box, from `start` to `end` (seconds)."""
    known = [v for _at, p in series for _label, f in lines if (v := getattr(p, f)) is not None]
    binary = fmt in (mib, per_second)  # sizes: a round number of their unit (4 GiB, not 4.9)
    high = top if top is not None else (nice_binary if binary else nice)(max(known, default=0.0))
    drawn = []
    for label, field in lines:
        last = rules.latest(series, field)
        drawn.append(
            Line(label, field, "-" if last is None else fmt(last), segments(series, field, start, end, step, high))
        )
    summary = f"{title}: " + ", ".join(f"{line.label} {line.latest}" for line in drawn) + " (latest)"
    return Chart(title, drawn, fmt(high), summary)


def segments(
    series: Sequence[tuple[int, Point]], field: str, start: int, end: int, step: int, high: float
) -> list[str]:
    """Polyline `points` strings of `field`: a new one after each missing bucket. A lone point is drawn as a
    short flat dash (one bucket wide) so that it shows."""
    out: list[list[str]] = []
    previous: int | None = None
    span = max(end - start, 1)
    for at, point in series:
        value = getattr(point, field)
        if value is None:
            previous = None
            continue
        x = VIEW_W * (at - start) / span
        y = VIEW_H - VIEW_H * min(max(value / high, 0.0), 1.0) if high > 0 else VIEW_H
        xy = f"{x:.1f},{y:.1f}"
        if previous is None or at - previous > step:
            out.append([xy])
        else:
            out[-1].append(xy)
        previous = at
    for run in out:
        if len(run) == 1:
            x, y = (float(v) for v in run[0].split(","))
            run.append(f"{min(x + max(VIEW_W * step / span, 1.5), VIEW_W):.1f},{y:.1f}")
    return [" ".join(run) for run in out]


def nice_binary(value: float) -> float:
    """`nice` in the unit (a power of 1,024) the value is shown in."""
    unit = 1.0
    while value >= 1024 * unit:
        unit *= 1024
    return nice(value / unit) * unit


def nice(value: float) -> float:
    """A round maximum at or above `value` (1, 2 or 5 times a power of ten); 1 for nothing."""
    if value <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    for factor in (1, 2, 5, 10):
        if value <= factor * power:
            return float(factor * power)
    return float(10 * power)
