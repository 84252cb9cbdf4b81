"""High availability on real guests (TCG): a local host's power is cut (`host fail --mode power`) while it
runs N HA VMs (root disks on the shared pool); timed from the cut to every HA VM answering on its new host,
over repeated runs, with the phases apart: detection (the monitor marks the host down), declaration (down
for `vmplane.ha.grace`), fencing (the local agent confirms no process is left), restarts (every guest
answers `vm exec`). Default settings (host check every 5 s, grace 10 s, 4 restarts at once), 3 hosts.

usage: .venv/bin/python bench/ha.py [--runs 5] [--vms 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import LocalCluster, percentile, table, write_section


def wait(predicate, timeout_s: float, what: str):
    t0 = time.monotonic()
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.2)


def answers(c, vm: str) -> bool:
    r = c.post(f"/vms/{vm}/exec", json={"command": "echo ok", "timeout_s": 5}, timeout=30)
    return r.status_code == 200 and "ok" in r.json()["output"]


def one_run(c, run: int, vms: int) -> dict:
    names = [f"r{run}-{i}" for i in range(vms)]
    for other in ("lv2", "lv3"):
        c.post(f"/hosts/{other}/maintenance", json={"action": "enter"}).raise_for_status()
    for name in names:
        c.post(
            "/vms",
            json={
                "name": name,
                "project": "b",
                "offering": "o",
                "template": "tiny-linux",
                "pool": "shared",
                "ha_policy": "restart",
                "start": True,
            },
        ).raise_for_status()
    for name in names:
        wait(lambda name=name: c.get(f"/vms/{name}").json()["state"] == "running", 120, f"{name} running")
        wait(lambda name=name: answers(c, name), 120, f"{name} answering")
    for other in ("lv2", "lv3"):
        c.post(f"/hosts/{other}/maintenance", json={"action": "exit"}).raise_for_status()
    marks: dict[str, float] = {}
    t0 = time.monotonic()
    c.post("/hosts/lv1/fail", json={"mode": "power"}).raise_for_status()
    pending = set(names)
    while pending or len(marks) < 3:
        state = c.get("/hosts/lv1").json()["state"]
        now = time.monotonic() - t0
        for phase in ("down", "fencing", "fenced"):
            if (
                phase not in marks
                and state
                in {"down": ("down", "fencing", "fenced"), "fencing": ("fencing", "fenced"), "fenced": ("fenced",)}[
                    phase
                ]
            ):
                marks[phase] = now
        for name in list(pending):
            vm = c.get(f"/vms/{name}").json()
            if vm["state"] == "running" and vm["host"] != "lv1" and answers(c, name):
                pending.discard(name)
        if now > 300:
            raise RuntimeError(f"run {run}: not recovered after 300 s: {pending}, {marks}")
        time.sleep(0.2)
    total = time.monotonic() - t0
    c.post("/hosts/lv1/recover").raise_for_status()
    wait(lambda: c.get("/hosts/lv1").json()["state"] == "enabled", 120, "lv1 back")
    for name in names:
        c.post(f"/vms/{name}/stop", json={"force": True})
        wait(lambda name=name: c.get(f"/vms/{name}").json()["state"] == "stopped", 60, f"{name} stopped")
        c.delete(f"/vms/{name}")
    return {
        "detect": marks["down"],
        "declare": marks["fencing"] - marks["down"],
        "fence": marks["fenced"] - marks["fencing"],
        "restart": total - marks["fenced"],
        "total": total,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--vms", type=int, default=3)
    args = ap.parse_args()
    cluster = LocalCluster("libvirt", hosts=3)
    results = []
    try:
        cluster.wait_ready()
        with cluster.client() as c:
            c.put(
                "/settings/cpu.overprovisioning.factor",
                json={"value": "4", "scope": "cluster", "scope_name": "cluster1"},
            ).raise_for_status()
            c.post("/projects", json={"name": "b", "vcpus": 64, "memory_mib": 65536, "vms": 100}).raise_for_status()
            c.post("/offerings", json={"name": "o", "kind": "fixed", "vcpus": 1, "memory_mib": 384}).raise_for_status()
            for run in range(args.runs):
                results.append(one_run(c, run, args.vms))
                print(f"run {run}: " + ", ".join(f"{k} {v:.1f} s" for k, v in results[-1].items()), flush=True)
    finally:
        cluster.stop()
    phases = ["detect", "declare", "fence", "restart", "total"]
    rows = [
        [
            phase,
            f"{percentile([r[phase] for r in results], 50):.1f}",
            f"{percentile([r[phase] for r in results], 95):.1f}",
            f"{min(r[phase] for r in results):.1f}",
            f"{max(r[phase] for r in results):.1f}",
        ]
        for phase in phases
    ]
    body = (
        f"{args.runs} runs, {args.vms} HA VMs (1 vCPU, 384 MiB, root disk on the shared pool) on lv1 of 3 local "
        f"hosts; lv1's power cut (`host fail --mode power`); seconds from the cut. detect: until the monitor "
        f"marks lv1 down (check every 5 s); declare: down for vmplane.ha.grace (10 s) until fencing; fence: the "
        f"local agent until confirmed off; restart: until every HA VM answers `vm exec` on its new host; "
        f"total: cut to the last VM answering. Goal: total p95 under 60 s.\n\n"
        + table(["phase", "p50 s", "p95 s", "min s", "max s"], rows)
    )
    write_section("High availability: power failure to HA VMs answering elsewhere (bench/ha.py)", body)


if __name__ == "__main__":
    main()
