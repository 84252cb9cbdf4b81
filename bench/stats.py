"""The usage graphs' cost at scale (issue 33): 500 sim hosts and 10,000 VMs (half running) in SQLite, as bench/ui.py
builds them.

1. The sampler: `--rounds` rounds of controllers/stats.Stats.sample (every host's bulk counters, rates, one
   upsert of every VM's, host's and project's point, folding when a 10-minute bucket completed): time per round
   (p50/p95), split into the hosts' reading and the rest, and the points written per round.
2. A simulated day: the remaining rounds of 24 hours (1,440 a minute) written as the sampler's store work
   (each round's points copied to the next minute's bucket in one statement, folded every 10 minutes, pruned),
   then the store's size and the points per tier and per object (bounded: 1,440 + 4,464).
3. The console's VM, host and project pages with their graphs over that day (range hour and day): p50/p95,
   through the ASGI app in-process, as bench/ui.py measures (goal: p95 <= 200 ms).

usage: .venv/bin/python bench/stats.py [--hosts 500] [--vms 10000] [--rounds 20] [--requests 50] [--no-write]
       [--reuse FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from sqlalchemy import text

from common import percentile, table, write_section
from ui import PER_PROJECT, TOKEN, measure, populate, session_cookie
from vmplane.core import stats as rules
from vmplane.server import create_app
from vmplane.store import stats as store

GOAL_MS = 200
DAY_ROUNDS = 24 * 60


def sampler_rounds(o, rounds: int, start: float) -> tuple[list[float], list[float], list[int]]:
    """`rounds` sampler rounds a minute apart (in buckets): seconds per round, of it reading the hosts, points."""
    whole, reading, points = [], [], []
    read = o.stats._read

    def timed_read(hosts):
        t = time.perf_counter()
        try:
            return read(hosts)
        finally:
            reading.append(time.perf_counter() - t)

    o.stats._read = timed_read
    try:
        for i in range(rounds):
            t = time.perf_counter()
            done = o.stats.sample(start + i * 60)
            whole.append(time.perf_counter() - t)
            points.append(done.points)
    finally:
        o.stats._read = read
    return whole, reading, points


def simulate_day(o, start: float, first: int) -> list[float]:
    """Rounds `first`..DAY_ROUNDS of the day as the store's work only: the last round's points copied to each next
    minute (one INSERT ... SELECT), folded when a 10-minute bucket completed, pruned then. Seconds per round."""
    times = []
    fine = rules.FINE.name
    for i in range(first, DAY_ROUNDS):
        now = start + i * 60
        bucket, before = rules.bucket(now, rules.FINE), rules.bucket(now - 60, rules.FINE)
        t = time.perf_counter()
        with o.db.write() as s:
            conn = s.connection()
            conn.execute(
                text(
                    "INSERT OR REPLACE INTO stat_samples SELECT kind, obj_id, tier, :b, cpu_pct, cpu_cores, "
                    "mem_used_mib, mem_total_mib, disk_rd_bps, disk_wr_bps, net_rx_bps, net_tx_bps FROM stat_samples "
                    "WHERE tier = :t AND bucket = :p"
                ),
                {"b": bucket, "t": fine, "p": before},
            )
            if bucket % rules.COARSE.step_s == 0:  # as the sampler: the bucket before now's is complete
                store.fold(conn, rules.folded_bucket(now))
                store.prune(conn, now)
        times.append(time.perf_counter() - t)
    return times


def store_size(db_file: Path) -> int:
    return sum(p.stat().st_size for p in db_file.parent.glob(db_file.name + "*"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=500)
    ap.add_argument("--vms", type=int, default=10000)
    ap.add_argument("--rounds", type=int, default=20, help="real sampler rounds (the rest of the day: store only)")
    ap.add_argument("--requests", type=int, default=50, help="per page")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--reuse", help="keep the store in this file, or use it if it exists (trial runs)")
    args = ap.parse_args()
    from fastapi.testclient import TestClient

    with tempfile.TemporaryDirectory(prefix="vmplane-stats-bench-") as tmp:
        t0 = time.perf_counter()
        o, _built = populate(tmp, args.hosts, args.vms, args.reuse)
        db_file = Path(args.reuse or tmp + "/ui.db")
        print(f"populated in {time.perf_counter() - t0:.0f} s", flush=True)
        start = float(rules.bucket(time.time(), rules.COARSE) - DAY_ROUNDS * 60)  # a day ago, on a 10-minute mark
        try:
            before = store_size(db_file)
            whole, reading, points = sampler_rounds(o, args.rounds, start)
            print(f"{args.rounds} rounds: p50 {percentile(whole, 50):.2f} s", flush=True)
            t0 = time.perf_counter()
            day = simulate_day(o, start, args.rounds)
            day_s = time.perf_counter() - t0
            o.stats.sample(start + DAY_ROUNDS * 60)  # now: a real round, folding and pruning
            with o.db.read() as s:
                conn = s.connection()
                fine, coarse = store.rows(conn, rules.FINE), store.rows(conn, rules.COARSE)
                per_fine, per_coarse = store.per_object_max(conn, rules.FINE), store.per_object_max(conn, rules.COARSE)
            with o.db.engine.connect() as c:  # the WAL into the file (outside a transaction)
                c.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
            grown = store_size(db_file) - before
            print(f"a day simulated in {day_s:.0f} s: {fine} fine, {coarse} coarse points", flush=True)
            projects = -(-args.vms // PER_PROJECT)
            running = [f"p{p}-v{v}" for p in range(projects) for v in range(0, PER_PROJECT, 2)]  # (even: running)
            urls = {
                "VM page, graphs of the last hour": lambda r: f"/ui/vms/{r.choice(running)}",
                "VM page, graphs of the day": lambda r: f"/ui/vms/{r.choice(running)}?range=day",
                "host page, graphs of the last hour": lambda r: f"/ui/hosts/h{r.randrange(args.hosts):04d}",
                "host page, graphs of the day": lambda r: f"/ui/hosts/h{r.randrange(args.hosts):04d}?range=day",
                "project page, graphs of the day": lambda r: f"/ui/projects/p{r.randrange(projects)}?range=day",
                "/metrics (every VM's latest)": lambda r: "/metrics",
            }
            app = create_app(o)
            with TestClient(app, cookies=session_cookie(app), headers={"Authorization": f"Bearer {TOKEN}"}) as c:
                pages = measure(c.get, urls, args.requests)
        finally:
            o.close()
    ms = [t * 1000 for t in whole]
    read_ms = [t * 1000 for t in reading]
    rows = [
        [
            "sampler round (all hosts)",
            f"{percentile(ms, 50):.0f}",
            f"{percentile(ms, 95):.0f}",
            f"{max(points)} points",
        ],
        ["  of it: reading the hosts", f"{percentile(read_ms, 50):.0f}", f"{percentile(read_ms, 95):.0f}", ""],
        [
            "  store only, a round of the simulated day",
            f"{percentile([t * 1000 for t in day], 50):.0f}",
            f"{percentile([t * 1000 for t in day], 95):.0f}",
            f"{max(day) * 1000:.0f} ms max (folding rounds)",
        ],
    ]
    for label, times in pages.items():
        p = [t * 1000 for t in times]
        rows.append([label, f"{percentile(p, 50):.1f}", f"{percentile(p, 95):.1f}", _goal(label, p)])
    body = table(["what", "p50 ms", "p95 ms", "note"], rows)
    body += (
        f"\n\nStore after a simulated day: {fine:,} fine points (1 min), {coarse:,} coarse (10 min); at most "
        f"{per_fine} fine and {per_coarse} coarse per object (bounds {rules.max_points(rules.FINE)} and "
        f"{rules.max_points(rules.COARSE)}); the SQLite file grew by {grown / 2**20:,.0f} MiB "
        f"({grown / max(fine + coarse, 1):.0f} bytes a point). {args.hosts} sim hosts, {args.vms} VMs "
        f"({args.vms // 2} running: a point each per round, plus a point per host and per project). "
        f"{args.rounds} real sampler rounds (the sim's bulk counters of every host, rates, one upsert), then the "
        f"day's other {DAY_ROUNDS - args.rounds} rounds as the store's work only (each minute's points copied, "
        f"folded every 10 minutes, pruned). Pages: {args.requests} requests each, in-process ASGI, admin session, "
        f"random running VM / host / project. This 2-core machine, other work beside it (pid {os.getpid()})."
    )
    if args.no_write:
        print(body)
        return
    write_section(f"Usage graphs: {args.hosts} hosts, {args.vms} VMs (bench/stats.py)", body)


def _goal(label: str, p: list[float]) -> str:
    if label.startswith("/metrics"):
        return ""
    return f"p95 <= {GOAL_MS} ms: " + ("yes" if percentile(p, 95) <= GOAL_MS else "**no**")


if __name__ == "__main__":
    main()
