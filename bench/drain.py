"""Draining a 16-VM host on sim hosts: vmplane's limits vs one migration at a time (Nova's default
max_concurrent_live_migrations=1) vs KubeVirt's defaults (5 per cluster, 2 outbound per node, no inbound
limit), side by side in one run. Each VM copies at a fixed simulated rate, so the ratios measure the
scheduling of the queue, not the machine.

usage: .venv/bin/python bench/drain.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import table, write_section
from vmplane.core.model import HostState, Offering, OfferingKind
from vmplane.orchestrator import Orchestrator
from vmplane.store import Database

VMS, HOSTS, VM_MIB, RATE_MIB_S = 16, 9, 2048, 8192  # 0.25 s per VM copy
POLICIES = {
    "one at a time (Nova default)": {"per_cluster": 1, "outbound": 1, "inbound": 1},
    "KubeVirt defaults (5/cluster, 2 out)": {"per_cluster": 5, "outbound": 2, "inbound": 1000},
    "vmplane defaults (5/cluster, 2 out, 2 in)": {"per_cluster": 5, "outbound": 2, "inbound": 2},
    "vmplane, 4 out (operator raised)": {"per_cluster": 5, "outbound": 4, "inbound": 2},
}


def drain(name: str, limits: dict, tmp: str) -> dict:
    db = Database(f"sqlite:///{tmp}/{abs(hash(name))}.db")
    db.migrate()
    o = Orchestrator(db, ThreadPoolExecutor(32))
    o.load()
    o.catalog.create_zone("z")
    o.catalog.create_cluster("c", "z")
    for key, value in (
        ("vmplane.migration.max.per.cluster", limits["per_cluster"]),
        ("vmplane.migration.max.outbound.per.host", limits["outbound"]),
        ("vmplane.migration.max.inbound.per.host", limits["inbound"]),
    ):
        o.catalog.set_setting(key, str(value), "cluster", "c")
    for i in range(HOSTS):
        o.add_host(f"h{i}", "c", "sim", 64, 2400, 256 * 1024)
    o.catalog.create_offering(Offering("o", OfferingKind.fixed, vcpus=2, memory_mib=VM_MIB))
    o.catalog.create_template("t", "tiny-linux")
    o.catalog.create_project("p", 1000, 10**7, 1000)
    for i in range(1, HOSTS):
        o.set_host_state(f"h{i}", HostState.disabled)
    for i in range(VMS):
        o.create_vm(f"v{i}", "p", "o", "t", start=True)
    time.sleep(0.5)
    for i in range(1, HOSTS):
        o.set_host_state(f"h{i}", HostState.enabled)
    for d in o.drivers.values():
        d.copy_rate_mib_s = RATE_MIB_S
    t0 = time.perf_counter()
    plan = o.maintenance.enter("h0")
    ids = [m["migration"] for m in plan["migrations"]]
    while any(o.migrator.get(i)["state"] not in ("succeeded", "failed") for i in ids):
        time.sleep(0.01)
    seconds = time.perf_counter() - t0
    rows = [o.migrator.get(i) for i in ids]
    events = sorted([(r["started_at"], 1) for r in rows] + [(r["finished_at"], -1) for r in rows])
    peak = run = 0
    for _, d in events:
        run += d
        peak = max(peak, run)
    ok = sum(r["state"] == "succeeded" for r in rows)
    problems = o.audit()
    o.close()
    db.dispose()
    return {"seconds": seconds, "peak": peak, "ok": ok, "audit": "ok" if not problems else f"{len(problems)} problems"}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: drain(name, limits, tmp) for name, limits in POLICIES.items()}
    base = results["one at a time (Nova default)"]["seconds"]
    rows = [
        [name, f"{r['seconds']:.2f}", f"{base / r['seconds']:.2f}x", r["peak"], f"{r['ok']}/{VMS}", r["audit"]]
        for name, r in results.items()
    ]
    body = table(["limits", "drain s", "speed-up vs one at a time", "peak copies", "migrated", "ledger audit"], rows)
    body += (
        f"\n\n{VMS} VMs of {VM_MIB} MiB on one sim host, {HOSTS - 1} empty targets, each copy at "
        f"{RATE_MIB_S} MiB/s (so {VM_MIB / RATE_MIB_S:.2f} s per VM). Drain = `host maintenance enter` until "
        f"every migration ended. The per-host outbound limit sets the pace: vmplane's defaults match "
        f"KubeVirt's there (the inbound limit of 2 does not bind with 8 targets)."
    )
    write_section("Host drain: limits side by side (bench/drain.py)", body)


if __name__ == "__main__":
    main()
