"""Live scaling latency on real guests: from the API call until the change is visible inside the guest
(nproc / MemTotal read with `vm exec`), for vCPU up, memory up, memory down and vCPU down, repeated; p50/p95.
Side by side in one run (issue 30): a guest whose QEMU guest agent answers (vmplane reads and onlines its
vCPUs through the agent, `vm exec` goes through guest-exec) and one whose agent was stopped (everything
through the serial console, as before the agent: the guest's own onliner brings a hot-plugged vCPU up).

usage: .venv/bin/python bench/scale.py [--runs 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import LocalCluster, percentile, table, write_section


def guest(c, vm: str, command: str) -> str:
    r = c.post(f"/vms/{vm}/exec", json={"command": command, "timeout_s": 60})
    r.raise_for_status()
    return r.json()["output"]


def wait_agent(c, vm: str, state: str) -> None:
    """Until `vm show` says its guest agent is `state` (the agent controller asks every second)."""
    t0 = time.perf_counter()
    while c.get(f"/vms/{vm}").json().get("agent") != state:
        assert time.perf_counter() - t0 < 180, f"the agent of {vm} is not {state}"
        time.sleep(0.2)


def timed(c, vm: str, body: dict, visible) -> tuple[float, str]:
    """Seconds from the scale call until `visible(guest output)` holds; and the method libvirt used."""
    t0 = time.perf_counter()
    r = c.post(f"/vms/{vm}/scale", json=body)
    assert r.status_code < 400, f"scale {vm} {body}: {r.status_code} {r.text}"
    op_id = r.json()["operation"]["id"]
    while True:
        out = guest(c, vm, "nproc; grep MemTotal /proc/meminfo")
        nproc, memtotal_kib = int(out.split()[0]), int(out.split()[2])
        if visible(nproc, memtotal_kib):
            seconds = time.perf_counter() - t0
            break
        assert time.perf_counter() - t0 < 60, out
    while (op := c.get(f"/operations/{op_id}").json())["state"] not in ("succeeded", "failed"):
        time.sleep(0.02)
    assert op["state"] == "succeeded", op
    return seconds, op["message"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    cluster = LocalCluster("libvirt", hosts=1)
    changes = ["vCPU up 1 -> 2", "memory up 256 -> 512 MiB", "memory down 512 -> 256 MiB", "vCPU down 2 -> 1"]
    ways = {"s": "guest agent", "c": "serial console (agent stopped)"}
    samples: dict[tuple[str, str], list[float]] = {(name, vm): [] for name in changes for vm in ways}
    methods: dict[tuple[str, str], str] = {}
    try:
        cluster.wait_ready()
        with cluster.client() as c:
            c.put("/settings/enable.dynamic.scale.vm", json={"value": "true"}).raise_for_status()
            # two guests on this machine's 2 cores, each scaled to 2 vCPUs in turn
            c.put("/settings/cpu.overprovisioning.factor", json={"value": "4"}).raise_for_status()
            c.put("/settings/kvm.cpu.dynamic.scaling.capacity", json={"value": "4"}).raise_for_status()
            c.put("/settings/kvm.memory.dynamic.scaling.capacity", json={"value": "2048"}).raise_for_status()
            c.post("/projects", json={"name": "b", "vcpus": 8, "memory_mib": 8192}).raise_for_status()
            c.post(
                "/offerings",
                json={
                    "name": "flex",
                    "kind": "custom-constrained",
                    "min_vcpus": 1,
                    "max_vcpus": 4,
                    "min_memory_mib": 256,
                    "max_memory_mib": 2048,
                    "dynamic_scaling": True,
                },
            ).raise_for_status()
            for vm in ways:
                c.post(
                    "/vms",
                    json={
                        "name": vm,
                        "project": "b",
                        "offering": "flex",
                        "template": "tiny-linux",
                        "vcpus": 1,
                        "memory_mib": 256,
                        "start": True,
                    },
                ).raise_for_status()
            wait_agent(c, "s", "connected")
            wait_agent(c, "c", "connected")
            # the agent of `c` stops a moment after this command returned (it runs through that agent), with
            # the test guest's loop that would start it again (its parent)
            guest(
                c,
                "c",
                "a=$(pidof qemu-ga); (sleep 1; kill $(cut -d' ' -f4 /proc/$a/stat) $a) </dev/null >/dev/null 2>&1 &",
            )
            wait_agent(c, "c", "none")
            base = int(guest(c, "s", "grep MemTotal /proc/meminfo").split()[1])
            steps = [
                ("vCPU up 1 -> 2", {"vcpus": 2}, lambda n, m: n == 2),
                ("memory up 256 -> 512 MiB", {"memory_mib": 512}, lambda n, m: m >= base + 256 * 1024),
                ("memory down 512 -> 256 MiB", {"memory_mib": 256}, lambda n, m: m <= base),
                ("vCPU down 2 -> 1", {"vcpus": 1}, lambda n, m: n == 1),
            ]
            for run in range(args.runs):
                for vm in ways:  # alternated: the same machine's noise for both
                    for name, body, visible in steps:
                        seconds, message = timed(c, vm, body, visible)
                        samples[(name, vm)].append(seconds)
                        methods[(name, vm)] = message
                        print(f"run {run}: {vm}: {name}: {seconds:.2f} s ({message})", flush=True)
    finally:
        cluster.stop()
    rows = [
        [
            name,
            ways[vm],
            len(v),
            f"{percentile(v, 50):.2f}",
            f"{percentile(v, 95):.2f}",
            f"{min(v):.2f}",
            f"{max(v):.2f}",
            methods.get((name, vm), ""),
        ]
        for (name, vm), v in samples.items()
    ]
    for name in changes:
        agent, console = (percentile(samples[(name, vm)], 50) for vm in ways)
        rows.append([name, "p50 agent / console", "", f"{agent / console:.2f}", "", "", "", ""])
    body = table(["change", "guest reached through", "runs", "p50 s", "p95 s", "min s", "max s", "how (libvirt)"], rows)
    body += (
        "\n\nFrom `POST /vms/NAME/scale` until the guest itself reports the new size (nproc, MemTotal read with "
        "`vm exec`, polled: through the guest agent, or the serial console when its agent was stopped; each poll "
        "is included). Two guests (tiny-linux, TCG), each prepared with a ceiling of 4 vCPUs / 2048 MiB, scaled "
        "in turn. vCPU down is 'soft' under TCG (the guest offlines the "
        "vCPU, a domain CPU cap of one CPU holds it), since real vCPU unplug is broken in QEMU 7.2 under TCG; "
        "vCPU up after a soft down onlines it again."
    )
    write_section("Live scaling latency on a real guest (bench/scale.py)", body)


if __name__ == "__main__":
    main()
