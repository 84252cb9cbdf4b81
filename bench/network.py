"""Guest networks on real guests (TCG) between two local libvirtd hosts in their own network namespaces
(issue 29), side by side in one run:

- the time from `vm create --start` to the guest answering at its address (DHCP at boot; pinged from this
  machine through a provider network's gateway);
- VM-to-VM TCP throughput across the hosts (busybox dd into nc over an isolated network, so over VXLAN),
  beside a veth-to-veth floor measured in the same run (two namespaces of this bench's own);
- the ping gap during a live migration: this machine pings the migrating guest every 10 ms; the gap is the
  longest time between two replies while the migration runs (QEMU's announcements move the guest's MAC).

usage: .venv/bin/python bench/network.py [--runs 5]
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import LocalCluster, percentile, table, write_section

PROVIDER = "10.41.0.0/24"
ISOLATED = "10.42.0.0/24"
# the receiver's nc reads from a pipe that stays open (on stdin's end busybox nc ends the connection); the
# sender's ends at its stdin's end; the guest's /proc/uptime times it (busybox date has no sub-second)
RECEIVE = "(sleep 300 | nc -l -p 5001 >/dev/null 2>&1 &)"
TRANSFER_MIB = 32
TRANSFER = (
    "a=$(cut -d' ' -f1 /proc/uptime); timeout 120 sh -c 'dd if=/dev/zero bs=64k count=512 2>/dev/null"
    " | nc {addr} 5001'; echo rc=$? $a $(cut -d' ' -f1 /proc/uptime)"
)


def veth_floor_mib_s(total_mib: int = 512) -> float:
    """TCP rate between two namespaces over one veth pair (the path's floor here), 1 MiB writes."""
    tag = f"vmpb{os.getpid() % 10000}"
    a, b = f"{tag}a", f"{tag}b"
    try:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "add", ns], check=True)
        subprocess.run(
            ["ip", "link", "add", "va", "netns", a, "type", "veth", "peer", "name", "vb", "netns", b], check=True
        )
        for ns, dev, addr in ((a, "va", "10.99.99.1/24"), (b, "vb", "10.99.99.2/24")):
            subprocess.run(["ip", "-n", ns, "addr", "add", addr, "dev", dev], check=True)
            subprocess.run(["ip", "-n", ns, "link", "set", dev, "up"], check=True)
        sink = subprocess.Popen(
            ["ip", "netns", "exec", b, sys.executable, "-c",
             "import socket; s=socket.socket(); s.bind(('10.99.99.2',5001)); s.listen(1); c,_=s.accept()\n"
             "while c.recv(1<<20): pass"]
        )  # fmt: skip
        time.sleep(0.5)
        out = subprocess.run(
            ["ip", "netns", "exec", a, sys.executable, "-c",
             "import socket,time; c=socket.create_connection(('10.99.99.2',5001))\n"
             "b=b'\\0'*(1<<20); t=time.perf_counter()\n"
             f"for _ in range({total_mib}): c.sendall(b)\n"
             "c.close(); print(time.perf_counter()-t)"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        sink.wait(30)
        return total_mib / float(out.stdout.strip())
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def pings_until(address: str, deadline_s: float) -> float | None:
    """Seconds until `address` answers a ping from this machine (None: not within the deadline)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        if subprocess.run(["ping", "-c", "1", "-W", "1", address], capture_output=True).returncode == 0:
            return time.monotonic() - t0
        time.sleep(0.1)
    return None


def exec_in(c, vm: str, command: str, timeout_s: int = 120) -> str:
    r = c.post(f"/vms/{vm}/exec", json={"command": command, "timeout_s": timeout_s})
    r.raise_for_status()
    return r.json()["output"]


def wait_running(c, vm: str) -> dict:
    deadline = time.monotonic() + 300
    while (v := c.get(f"/vms/{vm}").json())["state"] != "running":
        assert time.monotonic() < deadline, v
        time.sleep(0.3)
    return v


def ping_gap_ms(c, vm: str, address: str, target: str) -> tuple[float, str]:
    """Ping every 10 ms while `vm` live-migrates to `target`; the longest gap between two replies (ms)."""
    pinger = subprocess.Popen(["ping", "-D", "-i", "0.01", "-W", "1", address], stdout=subprocess.PIPE, text=True)
    replies: list[float] = []

    def read():
        assert pinger.stdout is not None
        for line in pinger.stdout:
            found = re.match(r"\[(\d+\.\d+)\].*bytes from", line)
            if found:
                replies.append(float(found.group(1)))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(1.0)
    r = c.post(f"/vms/{vm}/migrate", json={"to": target})
    r.raise_for_status()
    mig = r.json()
    while mig["state"] not in ("succeeded", "failed", "cancelled"):
        time.sleep(0.2)
        mig = c.get(f"/migrations/{mig['id']}").json()
    time.sleep(1.5)
    pinger.terminate()
    pinger.wait(10)
    reader.join(5)
    gaps = [b - a for a, b in itertools.pairwise(replies)]
    return (max(gaps) * 1000 if gaps else float("nan")), mig["state"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    floor = veth_floor_mib_s()
    cluster = LocalCluster("libvirt", hosts=2)
    boots, rates, gaps, states = [], [], [], []
    try:
        cluster.wait_ready()
        with cluster.client() as c:
            c.put("/settings/cpu.overprovisioning.factor", json={"value": "4"}).raise_for_status()
            c.post("/projects", json={"name": "b", "vcpus": 16, "memory_mib": 8192, "vms": 20}).raise_for_status()
            c.post("/offerings", json={"name": "o", "kind": "fixed", "vcpus": 1, "memory_mib": 256}).raise_for_status()
            c.post(
                "/networks", json={"name": "pub", "provider": True, "shared": True, "cidr": PROVIDER}
            ).raise_for_status()
            c.post("/networks", json={"name": "iso", "project": "b", "cidr": ISOLATED}).raise_for_status()
            c.post("/secgroups", json={"name": "open", "project": "b"}).raise_for_status()
            for rule in ({"direction": "in", "proto": "any", "from_cidr": "0.0.0.0/0"},
                         {"direction": "out", "proto": "any", "from_cidr": "0.0.0.0/0"}):  # fmt: skip
                c.post("/secgroups/b/open/rules", json=rule).raise_for_status()
            apart = {"name": "apart", "project": "b", "policy": "anti-affinity", "hard": False}  # (dst migrates)
            c.post("/groups", json=apart).raise_for_status()
            for vm in ("src", "dst"):
                body = {"name": vm, "project": "b", "offering": "o", "template": "tiny-linux", "start": True,
                        "group": "apart", "networks": ["pub", "iso"], "secgroups": ["open"]}  # fmt: skip
                t0 = time.monotonic()
                c.post("/vms", json=body).raise_for_status()
                address = wait_running(c, vm)["nics"][0]["ip"]
                answered = pings_until(address, 300)
                boots.append(None if answered is None else time.monotonic() - t0)
                print(f"{vm}: answered at {address} {boots[-1]} s after its create", flush=True)
            vms = {vm: c.get(f"/vms/{vm}").json() for vm in ("src", "dst")}
            dst_iso = vms["dst"]["nics"][1]["ip"]
            for run in range(args.runs):
                exec_in(c, "dst", RECEIVE)
                time.sleep(0.5)
                out = exec_in(c, "src", TRANSFER.format(addr=dst_iso), timeout_s=180)
                found = re.search(r"rc=0 ([\d.]+) ([\d.]+)", out)
                if found:
                    rates.append(TRANSFER_MIB / (float(found.group(2)) - float(found.group(1))))
                print(f"throughput run {run}: {out.strip()[-120:]}", flush=True)
            hosts = [h["name"] for h in c.get("/hosts").json()]
            for run in range(args.runs):
                here = c.get("/vms/dst").json()["host"]
                target = next(h for h in hosts if h != here)
                gap, state = ping_gap_ms(c, "dst", vms["dst"]["nics"][0]["ip"], target)
                gaps.append(gap)
                states.append(state)
                print(f"migration {run} to {target}: {state}, longest ping gap {gap:.0f} ms", flush=True)
    finally:
        cluster.stop()

    def p(values, q, fmt="{:.0f}"):
        values = [v for v in values if v is not None]
        return fmt.format(percentile(values, q)) if values else "-"

    body = table(
        ["measure", "runs", "p50", "p95", "floor / note"],
        [
            ["create --start to answering (s)", len(boots), p(boots, 50, "{:.1f}"), p(boots, 95, "{:.1f}"),
             "TCG boot + DHCP; pinged from this machine"],
            ["VM-to-VM TCP across hosts (MiB/s)", len(rates), p(rates, 50, "{:.1f}"), p(rates, 95, "{:.1f}"),
             f"veth-to-veth floor {floor:.0f} MiB/s (ratio {p(rates, 50, '{:.1f}')}/{floor:.0f})"],
            ["ping gap during live migration (ms)", len(gaps), p(gaps, 50), p(gaps, 95),
             f"10 ms pings; migrations {states.count('succeeded')}/{len(states)} succeeded"],
        ],
    )  # fmt: skip
    write_section("Guest networks (bench/network.py)", body)


if __name__ == "__main__":
    main()
