"""API read load with 10,000 VMs in the store (sim hosts): `vmplane serve` against a minimal FastAPI app
doing the same database reads (bench/minimal_app.py, the stack's own limit), side by side in one run,
measured with wrk on loopback in interleaved rounds; req/s of each and their ratio per endpoint.

usage: .venv/bin/python bench/load.py [--vms 10000] [--rounds 4] [--seconds 5] [--connections 16]
                                      [--store PATH]   (a populated store kept between runs; copied per run)
Needs wrk (`apt-get install -y wrk`).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import table, write_section
from vmplane.core.model import Offering, OfferingKind
from vmplane.orchestrator import InlineExecutor, Orchestrator
from vmplane.store import Database

TOKEN = "load-token"
PER_PROJECT = 100
HOSTS = 20
GOAL = 0.7


def populate(db_url: str, vms: int, per_project: int = PER_PROJECT, hosts: int = HOSTS) -> None:
    db = Database(db_url)
    db.migrate()
    o = Orchestrator(db, InlineExecutor())
    o.load()
    o.catalog.create_zone("zone1")
    o.catalog.create_cluster("cluster1", "zone1")
    for i in range(1, hosts + 1):
        o.add_host(f"sim{i}", "cluster1", "sim", 256, 2400, 4 << 20)
    o.catalog.create_offering(Offering("o", OfferingKind.fixed, vcpus=1, memory_mib=512))
    o.catalog.create_template("t", "tiny-linux")
    for p in range(vms // per_project):
        o.catalog.create_project(f"p{p}", 10**4, 10**8, per_project)
        for i in range(per_project):
            o.create_vm(f"p{p}-v{i}", f"p{p}", "o", "t", start=i % 2 == 0)
    o.catalog.ensure_admin_token("load", TOKEN)
    o.close()
    db.dispose()


def copy_store(src: Path, dst: Path) -> None:
    """The store with the files beside it (the sim hosts' state: `load.db.sim-hosts`)."""
    for f in src.parent.glob(src.name + "*"):
        if f.name.endswith(("-wal", "-shm", "-journal")):
            continue  # SQLite's backup API copies what they hold
        source, target = sqlite3.connect(f), sqlite3.connect(dst.with_name(dst.name + f.name[len(src.name) :]))
        try:
            source.backup(target)
        finally:
            source.close()
            target.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited:\n" + log.read_text()[-3000:])
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer in {timeout_s:.0f} s")


def wrk(url: str, path: str, script: Path | None, seconds: int, connections: int, threads: int) -> tuple[float, int]:
    """(requests/s, non-2xx responses) of one wrk run."""
    cmd = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds}s", "-H", f"Authorization: Bearer {TOKEN}"]
    if script is not None:
        cmd += ["-s", str(script)]
    out = subprocess.run(cmd + [url + path], capture_output=True, text=True, check=True).stdout
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    return rate, (int(bad.group(1)) if bad else 0) + (sum(map(int, errors.groups())) if errors else 0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vms", type=int, default=10000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2, help="wrk threads")
    ap.add_argument("--store", type=Path, help="a populated store to reuse (made there when missing)")
    ap.add_argument("--no-results", action="store_true", help="print the table, leave RESULTS.md alone")
    args = ap.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("bench/load.py needs wrk, a C HTTP load generator: apt-get install -y wrk")
    tmp = tempfile.TemporaryDirectory(prefix="vmplane-load-")
    db_path = Path(tmp.name) / "load.db"
    t0 = time.perf_counter()
    if args.store is not None and args.store.exists():
        copy_store(args.store, db_path)
    else:
        populate(f"sqlite:///{db_path}", args.vms)
        if args.store is not None:
            copy_store(db_path, args.store)
    populate_s = time.perf_counter() - t0
    projects = args.vms // PER_PROJECT
    script = Path(tmp.name) / "vm_by_name.lua"
    script.write_text(f"""math.randomseed(1)
request = function()
  return wrk.format("GET", string.format("/api/v1/vms/p%d-v%d", math.random(0, {projects - 1}),
                                         math.random(0, {PER_PROJECT - 1})))
end
""")
    bin_dir = Path(sys.executable).parent
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    logs = {name: Path(tmp.name) / f"{name}.log" for name in ("vmplane", "minimal")}
    try:
        port = free_port()
        servers["vmplane"] = (
            subprocess.Popen(
                [
                    str(bin_dir / "vmplane"),
                    "serve",
                    "--db",
                    f"sqlite:///{db_path}",
                    "--port",
                    str(port),
                    "--token",
                    TOKEN,
                ],
                env={**os.environ, "VMPLANE_HOME": tmp.name},
                stdout=open(logs["vmplane"], "w"),  # noqa: SIM115 (the server writes it for its whole life)
                stderr=subprocess.STDOUT,
            ),
            f"http://127.0.0.1:{port}",
        )
        port = free_port()
        # the settings of `vmplane serve` (server.serve): one worker, default loop and parser, no access log
        servers["minimal"] = (
            subprocess.Popen(
                [
                    str(bin_dir / "uvicorn"),
                    "--app-dir",
                    str(Path(__file__).parent),
                    "minimal_app:app",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--log-level",
                    "warning",
                    "--no-access-log",
                ],
                env={**os.environ, "VMPLANE_DB": str(db_path)},
                stdout=open(logs["minimal"], "w"),  # noqa: SIM115 (the server writes it for its whole life)
                stderr=subprocess.STDOUT,
            ),
            f"http://127.0.0.1:{port}",
        )
        for name, (proc, url) in servers.items():
            wait_healthy(url, proc, logs[name])
        endpoints = {
            "GET /api/v1/vms/{name}": ("/api/v1/vms/p0-v0", script),
            "GET /healthz": ("/healthz", None),
            "GET /api/v1/vms?limit=50": ("/api/v1/vms?limit=50", None),
        }
        for _, (_, url) in servers.items():  # warm up both (first requests import and compile)
            for path, _ in endpoints.values():
                httpx.get(url + path, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).raise_for_status()
        rates: dict[str, dict[str, list[float]]] = {e: {"vmplane": [], "minimal": []} for e in endpoints}
        errors = 0
        for r in range(args.rounds):
            for endpoint, (path, lua) in endpoints.items():
                order = ("vmplane", "minimal") if r % 2 == 0 else ("minimal", "vmplane")  # A,B then B,A
                for name in order:
                    rate, bad = wrk(servers[name][1], path, lua, args.seconds, args.connections, args.threads)
                    rates[endpoint][name].append(rate)
                    errors += bad
                print(
                    f"round {r + 1} {endpoint}: vmplane {rates[endpoint]['vmplane'][-1]:.0f}/s, "
                    f"minimal {rates[endpoint]['minimal'][-1]:.0f}/s",
                    flush=True,
                )
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            proc.wait(60)
        tmp.cleanup()
    rows = []
    for endpoint, by_app in rates.items():
        for r, (a, b) in enumerate(zip(by_app["vmplane"], by_app["minimal"]), 1):
            rows.append([endpoint, r, f"{a:,.0f}", f"{b:,.0f}", f"{a / b:.2f}x"])
        a, b = statistics.median(by_app["vmplane"]), statistics.median(by_app["minimal"])
        rows.append([f"**{endpoint}**", "median", f"**{a:,.0f}**", f"**{b:,.0f}**", f"**{a / b:.2f}x**"])
    body = table(["endpoint", "round", "vmplane req/s", "minimal app req/s", "ratio"], rows)
    body += (
        f"\n\nwrk -t{args.threads} -c{args.connections}, {args.seconds} s per run, on loopback; the two apps "
        f"interleaved in each round (A,B then B,A), {errors} non-2xx or socket errors. Store: {args.vms} VMs "
        f"(half running) in {projects} projects on {HOSTS} sim hosts, SQLite (ready in {populate_s:.0f} s). "
        f"vmplane: `vmplane serve`; the minimal app: bench/minimal_app.py (plain sqlite3, the same token "
        f"check: SHA-256 and one indexed read; the same VM row with its names), both one uvicorn worker, "
        f"default loop and parser, access log off, on this {os.cpu_count()}-core machine shared with wrk. "
        f"The goal (issue 14): vmplane at least {GOAL}x of the minimal app on `/api/v1/vms/{{name}}` and "
        f"`/healthz`."
    )
    if args.no_results:
        print(body)
    else:
        write_section(f"API read load with {args.vms} VMs (bench/load.py)", body)


if __name__ == "__main__":
    main()
