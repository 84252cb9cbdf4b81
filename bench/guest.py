"""Real guests on a local libvirt host: how long from the API call until the VM runs, and until its guest
answers on the console (boot), repeated; the stop latency and the QEMU process's memory; and how long until
a domain destroyed behind vmplane's back (virsh destroy) is recorded stopped by its libvirt lifecycle event
(the periodic full sync off), which tests/test_host_events_real.py checks without timing it.

usage: .venv/bin/python bench/guest.py [--runs 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import LocalCluster, percentile, table, write_section


def wait_operation(c, op_id: str) -> dict:
    while True:
        op = c.get(f"/operations/{op_id}").json()
        if op["state"] in ("succeeded", "failed"):
            return op
        time.sleep(0.02)


def qemu_rss_mib(domain: str) -> float:
    import os

    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
                if b"qemu-system" in cmd and f"guest={domain},".encode() in cmd:
                    for line in Path(f"/proc/{entry}/status").read_text().splitlines():
                        if line.startswith("VmRSS:"):
                            return int(line.split()[1]) / 1024
            except OSError:
                continue
    return float("nan")


def destroyed_recorded_s(c, cluster, name: str) -> float:
    """Start the VM again, destroy its domain with virsh, and time until vmplane records it stopped."""
    import json
    import subprocess

    from vmplane.hosts import localhosts

    op = wait_operation(c, c.post(f"/vms/{name}/start").json()["operation"]["id"])
    assert op["state"] == "succeeded", op
    host = c.get(f"/vms/{name}").json()["host"]
    hosts = Path(cluster.tmp.name) / "hosts"
    saved = json.loads((hosts / host / "host.json").read_text())
    uri = localhosts.describe(hosts, host, saved["index"], saved["netns"]).uri
    t0 = time.perf_counter()
    subprocess.run(["virsh", "-c", uri, "destroy", f"vmplane-{name}"], check=True, capture_output=True, timeout=30)
    while c.get(f"/vms/{name}").json()["state"] != "stopped":
        if time.perf_counter() - t0 > 120:
            return float("nan")
        time.sleep(0.02)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    cluster = LocalCluster("libvirt", hosts=1)
    rows = {
        "create -> running (domain started)": [],
        "create -> guest answers (boot)": [],
        "stop --force -> stopped": [],
        "QEMU RSS after boot, MiB": [],
        "virsh destroy -> recorded stopped (event)": [],
    }
    try:
        cluster.wait_ready()
        with cluster.client() as c:
            c.post("/projects", json={"name": "b", "vcpus": 8, "memory_mib": 8192}).raise_for_status()
            # the full sync (default 30 s) must not be what records a destroy: only the lifecycle event
            c.put("/settings/vmplane.host.sync.interval", json={"value": "3600"}).raise_for_status()
            c.post("/offerings", json={"name": "o", "kind": "fixed", "vcpus": 1, "memory_mib": 512}).raise_for_status()
            # warm-up: libvirt probes QEMU on its first start, and the accelerator is probed once
            c.post(
                "/vms", json={"name": "warm", "project": "b", "offering": "o", "template": "tiny-linux", "start": True}
            ).raise_for_status()
            c.post("/vms/warm/exec", json={"command": "true", "timeout_s": 120}).raise_for_status()
            c.post("/vms/warm/stop", json={"force": True})
            for i in range(args.runs):
                name = f"g{i}"
                t0 = time.perf_counter()
                r = c.post(
                    "/vms",
                    json={"name": name, "project": "b", "offering": "o", "template": "tiny-linux", "start": True},
                )
                r.raise_for_status()
                op = wait_operation(c, r.json()["operation"]["id"])
                assert op["state"] == "succeeded", op
                t_running = time.perf_counter() - t0
                c.post(f"/vms/{name}/exec", json={"command": "true", "timeout_s": 120}).raise_for_status()
                t_boot = time.perf_counter() - t0
                rss = qemu_rss_mib(f"vmplane-{name}")
                t1 = time.perf_counter()
                op = wait_operation(c, c.post(f"/vms/{name}/stop", json={"force": True}).json()["operation"]["id"])
                t_stop = time.perf_counter() - t1
                t_event = destroyed_recorded_s(c, cluster, name)
                c.delete(f"/vms/{name}")
                for key, value in zip(rows, (t_running, t_boot, t_stop, rss, t_event)):
                    rows[key].append(value)
                print(
                    f"run {i}: running {t_running:.2f} s, guest answers {t_boot:.2f} s, stop {t_stop:.2f} s, "
                    f"RSS {rss:.0f} MiB, destroy recorded {t_event:.2f} s",
                    flush=True,
                )
    finally:
        cluster.stop()
    body = table(
        ["measure", "runs", "p50", "p95", "min", "max"],
        [
            [k, len(v), f"{percentile(v, 50):.2f}", f"{percentile(v, 95):.2f}", f"{min(v):.2f}", f"{max(v):.2f}"]
            for k, v in rows.items()
        ],
    )
    body += (
        "\n\nSeconds unless stated. One local libvirtd host (own mount and network namespace), the tiny-linux "
        "guest (Debian cloud kernel + busybox initramfs), 1 vCPU / 512 MiB, TCG (this machine's KVM can not "
        "boot Linux). 'guest answers' = the API call until a command run through the serial console "
        "(virDomainOpenConsole) returns. A warm-up VM runs first (libvirt's one-time QEMU probe)."
    )
    write_section("Real guests: boot and start latency (bench/guest.py)", body)


if __name__ == "__main__":
    main()
