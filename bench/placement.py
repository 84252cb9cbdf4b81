"""Placement at scale: 2,000 sim hosts, 20,000 VMs admitted through the orchestrator (quota + placement +
claim committed to SQLite), pack vs spread vs a lower bound, and the cost of one placement decision.

usage: .venv/bin/python bench/placement.py [--hosts 2000] [--vms 20000]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import table, write_section  # noqa: E402

from vmplane.model import Offering, OfferingKind, PlacementRequest, Size  # noqa: E402
from vmplane.orchestrator import InlineExecutor, Orchestrator  # noqa: E402
from vmplane.placement import choose, lower_bound_hosts  # noqa: E402
from vmplane.quota import host_footprint_mib  # noqa: E402
from vmplane.store import Database  # noqa: E402

HOST_CORES, HOST_MEMORY = 32, 131072
SIZES = [("s1", 1, 1024), ("s2", 2, 4096), ("s4", 4, 8192), ("s8", 8, 16384)]
WEIGHTS = [50, 30, 15, 5]
PER_PROJECT = 100


class DeferredExecutor(InlineExecutor):
    """Queues operations so that admission and the driver work are timed apart."""

    def __init__(self):
        self.queue = []

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[override]
        self.queue.append((fn, args, kwargs))

    def drain(self) -> int:
        n = len(self.queue)
        for fn, args, kwargs in self.queue:
            fn(*args, **kwargs)
        self.queue.clear()
        return n


def build(hosts: int, strategy: str, tmp: str) -> Orchestrator:
    db = Database(f"sqlite:///{tmp}/bench-{strategy}.db")
    db.migrate()
    o = Orchestrator(db, DeferredExecutor())
    o.load()
    o.catalog.create_zone("z")
    o.catalog.create_cluster("c", "z")
    o.catalog.set_setting("vmplane.placement.strategy", strategy, "cluster", "c")
    for i in range(hosts):
        o.add_host(f"h{i:05d}", "c", "sim", HOST_CORES, 2400, HOST_MEMORY)
    for name, vcpus, memory in SIZES:
        o.catalog.create_offering(Offering(name, OfferingKind.fixed, vcpus=vcpus, memory_mib=memory))
    o.catalog.create_template("t", "tiny-linux")
    return o


def run(hosts: int, vms: int, strategy: str, tmp: str) -> dict:
    t0 = time.perf_counter()
    o = build(hosts, strategy, tmp)
    o.executor.drain()
    setup_s = time.perf_counter() - t0
    rng = random.Random(42)
    plan = rng.choices(SIZES, WEIGHTS, k=vms)
    for p in range(-(-vms // PER_PROJECT)):
        o.catalog.create_project(f"p{p}", 10**6, 10**9, PER_PROJECT, count_overhead=p % 2 == 0)
    t0 = time.perf_counter()
    for i, (offering, _, _) in enumerate(plan):
        o.create_vm(f"v{i}", f"p{i // PER_PROJECT}", offering, "t", start=True)
    admit_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    o.executor.drain()                   # the start operations: sim driver start + marked running
    start_s = time.perf_counter() - t0
    used = sum(1 for h in o.hosts() if h.used_vcpus)
    total_vcpus = sum(v for _, v, _ in plan)
    total_memory = sum(host_footprint_mib(Size(v, m)) for _, v, m in plan)
    bound = lower_bound_hosts(total_vcpus, total_memory, HOST_CORES, HOST_MEMORY)
    # one placement decision on the full index, without committing
    req = PlacementRequest(Size(2, 4096))
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        choose(o.index, req)
    decision_us = (time.perf_counter() - t0) / n * 1e6
    problems = o.audit()
    running = sum(1 for v in o.vms() if v.state == "running")
    o.close()
    return {"strategy": strategy, "setup_s": setup_s, "admit_s": admit_s, "vms_per_s": vms / admit_s,
            "e2e_per_s": vms / (admit_s + start_s),
            "hosts_used": used, "lower_bound": bound, "decision_us": decision_us, "audit": "ok" if not problems
            else f"{len(problems)} problems", "running": running}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=2000)
    ap.add_argument("--vms", type=int, default=20000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(args.hosts, args.vms, s, tmp) for s in ("pack", "spread")]
    rows = [[r["strategy"], args.hosts, r["running"], f"{r['admit_s']:.1f}", f"{r['vms_per_s']:.0f}",
             f"{r['e2e_per_s']:.0f}",
             r["hosts_used"], r["lower_bound"], f"{r['hosts_used'] / r['lower_bound']:.3f}",
             f"{r['decision_us']:.0f}", r["audit"]] for r in results]
    body = table(["strategy", "hosts", "VMs running", "admit s", "admitted VMs/s", "end-to-end VMs/s", "hosts used", "lower bound",
                  "used / bound", "decision us", "ledger audit"], rows)
    body += (f"\n\n'admitted VMs/s': create-and-start requests committed, each one write transaction (project row "
             f"locked, quota checked, host chosen from the in-memory index, host row locked and re-checked, VM + "
             f"claim + ledger + operation written, commit) on SQLite (WAL). 'end-to-end' adds each start "
             f"operation: persisted step, sim driver start, VM marked running (two more transactions). "
             f"Hosts {HOST_CORES} cores / "
             f"{HOST_MEMORY} MiB; VM sizes {SIZES} with weights {WEIGHTS}; half the projects count overhead. "
             f"'decision us' = one placement decision at {args.hosts} hosts with the index full. "
             f"Target: >= 1,000 VMs/s.")
    write_section(f"Placement: {args.hosts} hosts, {args.vms} VMs (bench/placement.py)", body)


if __name__ == "__main__":
    main()
