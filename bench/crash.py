"""The long crash run on sim hosts: the control plane is SIGKILLed at every named crash point (its workload
steered toward it) and at random moments, cycle after cycle of crashkit.schedule, restarted, and checked after
each kill (tests/crashkit.py). Several clusters, one per seed (--seed S: seeds S, S+1, ...; the same seed
replays the same schedule and workload choices); counts per cluster and in total. The suite's version
(tests/test_crash_sim.py) runs one cycle.

usage: .venv/bin/python bench/crash.py [rounds per cluster, default 250] [clusters, default 4] [--seed S, default 1]
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from common import table, write_section
from tests import crashkit


def main(rounds: int, clusters: int, first_seed: int = 1) -> None:
    rows, total = [], collections.Counter()
    per_point: collections.Counter = collections.Counter()
    points = crashkit.crash_points()
    for seed in range(first_seed, first_seed + clusters):
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.monotonic()
            report = crashkit.run(Path(tmp), seed=seed, rounds=rounds, stop_at_problem=False)
            seconds = time.monotonic() - t0
        kills = report.kills
        timed = sum(1 for r in kills if r.kill == "timed")
        unchecked = sum(1 for r in report.rounds if r.vms < 0)
        checks = len(report.rounds) - unchecked
        per_point.update(r.kill for r in kills)
        counts = dict(
            rounds=len(report.rounds),
            kills=len(kills),
            at_points=len(kills) - timed,
            timed=timed,
            unchecked=unchecked,
            checks=checks,
            problems=len(report.problems()),
        )
        total.update(counts)
        rows.append(
            [
                seed,
                *counts.values(),
                f"{len(report.points_hit())}/{len(points)}",
                max(r.vms for r in report.rounds),
                f"{seconds:.0f}",
            ]
        )
        for p in report.problems()[:10]:
            print("PROBLEM", p)
    rows.append(
        [
            "total",
            *(total[k] for k in ("rounds", "kills", "at_points", "timed", "unchecked", "checks", "problems")),
            "",
            "",
            "",
        ]
    )
    body = table(
        [
            "cluster (seed)",
            "rounds",
            "SIGKILLs",
            "at a crash point",
            "at a random moment",
            "restarted unchecked",
            "checks after restart",
            "problems found",
            "points hit",
            "max VMs",
            "seconds",
        ],
        rows,
    )
    body += (
        "\n\nKills per crash point (all clusters): "
        + ", ".join(f"{p} {per_point[p]}" for p in (*points, "timed"))
        + "\n\n"
        "A round: a forked control plane recovers, runs up to 60 operations (create/start, stop, delete, "
        "migrate, cancel, scale incl. past a full host, drain, quota changes, volumes, HA VMs and host "
        "failures; most of them steps toward its armed crash point) and is SIGKILLed at that point or after "
        "0-150 ms; each cycle of rounds arms every point once and has "
        f"{crashkit.TIMED_KILLS} kills at a random moment, in an order drawn from the seed. "
        '"Restarted unchecked": the next control plane recovers with a '
        "crash point armed (a crash "
        "during recovery). A check: a fresh control plane starts, waits for nothing to be in flight (30 s "
        "at most), then every VM runs exactly once where and at the size the store says, ledgers == "
        "recomputed and within quota, host usage == claims == what runs."
    )
    write_section("Crash safety (bench/crash.py, sim hosts)", body)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("rounds", nargs="?", type=int, default=250)
    ap.add_argument("clusters", nargs="?", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1, help="the first cluster's seed (the next: +1, ...)")
    a = ap.parse_args()
    main(a.rounds, a.clusters, a.seed)
