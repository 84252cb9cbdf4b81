"""Live migration of real guests (TCG) between two local libvirtd hosts in their own network namespaces:
an idle guest and a guest writing memory continuously, each with the hypervisor's default parameters and
with vmplane's policy, side by side in one run; plus the copy floor (guest RAM / measured copy rate).

usage: .venv/bin/python bench/migration.py [--runs 2] [--timeout 60]
"""

from __future__ import annotations

import argparse
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import LocalCluster, percentile, table, write_section

GUEST_MIB = 512
BUSY = "(while :; do dd if=/dev/urandom of=/dev/shm/x bs=1M count=50 2>/dev/null; done) >/dev/null 2>&1 &"


def loopback_mib_s(total_mib: int = 1024) -> float:
    """TCP copy rate on loopback with 1 MiB writes: the floor a migration stream can reach here."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]

    def sink():
        conn, _ = server.accept()
        while conn.recv(1 << 20):
            pass
        conn.close()

    t = threading.Thread(target=sink)
    t.start()
    chunk = b"\0" * (1 << 20)
    with socket.create_connection(("127.0.0.1", port)) as c:
        t0 = time.perf_counter()
        for _ in range(total_mib):
            c.sendall(chunk)
    t.join()
    server.close()
    return total_mib / (time.perf_counter() - t0)


def migrate(c, vm: str, policy: str, timeout_s: float) -> dict:
    r = c.post(f"/vms/{vm}/migrate", json={"policy": policy})
    r.raise_for_status()
    mig = r.json()
    t0 = time.monotonic()
    while mig["state"] not in ("succeeded", "failed", "cancelled"):
        if time.monotonic() - t0 > timeout_s:
            c.post(f"/vms/{vm}/migrate/cancel")
            while mig["state"] not in ("succeeded", "failed", "cancelled"):
                time.sleep(0.2)
                mig = c.get(f"/migrations/{mig['id']}").json()
            mig["timed_out"] = True
            break
        time.sleep(0.2)
        mig = c.get(f"/migrations/{mig['id']}").json()
    return mig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=60)
    args = ap.parse_args()
    floor_rate = loopback_mib_s()
    cluster = LocalCluster("libvirt", hosts=2)
    cases = [(load, policy) for load in ("idle", "busy") for policy in ("hypervisor-default", "vmplane")]
    results: dict = {case: [] for case in cases}
    try:
        cluster.wait_ready()
        with cluster.client() as c:
            c.put("/settings/cpu.overprovisioning.factor", json={"value": "4"}).raise_for_status()
            c.post("/projects", json={"name": "b", "vcpus": 16, "memory_mib": 32768}).raise_for_status()
            c.post(
                "/offerings", json={"name": "o", "kind": "fixed", "vcpus": 1, "memory_mib": GUEST_MIB}
            ).raise_for_status()
            for run in range(args.runs):
                for load, policy in cases:  # interleaved: both policies see the same machine state
                    vm = f"{load}-{policy[:3]}-{run}"
                    c.post(
                        "/vms",
                        json={"name": vm, "project": "b", "offering": "o", "template": "tiny-linux", "start": True},
                    ).raise_for_status()
                    c.post(
                        f"/vms/{vm}/exec", json={"command": "echo m > /tmp/marker", "timeout_s": 120}
                    ).raise_for_status()
                    if load == "busy":
                        c.post(f"/vms/{vm}/exec", json={"command": BUSY}).raise_for_status()
                        time.sleep(1.5)
                    mig = migrate(c, vm, policy, args.timeout)
                    marker = c.post(f"/vms/{vm}/exec", json={"command": "cat /tmp/marker", "timeout_s": 30})
                    stats = mig.get("stats") or {}
                    healthy = (
                        mig["state"] == "succeeded"
                        and mig["stats"]["guest_check"].startswith("answered")
                        and marker.status_code == 200
                        and marker.json()["output"].strip() == "m"
                    )
                    converged = bool(stats.get("total_ms")) and not mig.get("timed_out")  # the copy completed
                    results[(load, policy)].append(
                        {
                            "converged": converged,
                            "healthy": healthy,
                            "total": stats.get("total_ms"),
                            "down": stats.get("downtime_ms"),
                            "mib": (stats.get("bytes") or 0) >> 20,
                        }
                    )
                    print(load, policy, mig["state"], stats, flush=True)
                    c.post(f"/vms/{vm}/stop", json={"force": True})
                    time.sleep(2.5)
                    c.delete(f"/vms/{vm}")
    finally:
        cluster.stop()

    def med(rows, key):
        values = [r[key] for r in rows if r[key] is not None and r["converged"]]
        return f"{percentile(values, 50):.0f}" if values else "-"

    rows = [
        [
            load,
            policy,
            f"{sum(r['converged'] for r in rs)}/{len(rs)}",
            f"{sum(r['healthy'] for r in rs)}/{len(rs)}",
            med(rs, "total"),
            med(rs, "down"),
            med(rs, "mib"),
        ]
        for (load, policy), rs in results.items()
    ]
    body = table(
        ["guest", "parameters", "converged", "guest healthy", "total ms (p50)", "downtime ms (p50)", "MiB sent (p50)"],
        rows,
    )
    body += (
        f"\n\nCopy floor: {GUEST_MIB} MiB guest / {floor_rate:.0f} MiB/s measured TCP copy rate on loopback = "
        f"{1000 * GUEST_MIB / floor_rate:.0f} ms. Guests: tiny-linux, 1 vCPU / {GUEST_MIB} MiB, TCG; 'busy' writes "
        f"50 MiB of random data into /dev/shm in a loop. 'hypervisor-default' = libvirt/QEMU defaults (pre-copy, "
        f"no bandwidth cap); 'vmplane' = the TCG policy: pre-copy capped at 64 MiB/s, post-copy switched on 1 s "
        f"into the first pass. Healthy = vmplane's check answered on the target (uptime, no kernel oops) and a "
        f"marker file survived. A migration not done in {args.timeout:.0f} s is cancelled (not converged)."
    )
    write_section("Live migration of real guests (bench/migration.py)", body)


if __name__ == "__main__":
    main()
