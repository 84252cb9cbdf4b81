"""Read load on the API with 10,000 VMs in the store (sim hosts), from loopback, bounded in count:
p50/p99 latency per endpoint and requests/s overall.

usage: .venv/bin/python bench/load.py [--vms 10000] [--requests 3000] [--clients 16]
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import percentile, table, write_section  # noqa: E402

from vmplane.model import Offering, OfferingKind  # noqa: E402
from vmplane.orchestrator import InlineExecutor, Orchestrator  # noqa: E402
from vmplane.store import Database  # noqa: E402

TOKEN = "load-token"


def populate(db_url: str, vms: int, per_project: int = 100, hosts: int = 20) -> None:
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vms", type=int, default=10000)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--clients", type=int, default=16)
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory(prefix="vmplane-load-")
    db_url = f"sqlite:///{tmp.name}/load.db"
    t0 = time.perf_counter()
    populate(db_url, args.vms)
    populate_s = time.perf_counter() - t0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "VMPLANE_HOME": tmp.name}
    log = open(Path(tmp.name) / "up.log", "w")
    server = subprocess.Popen([str(Path(sys.executable).with_name("vmplane")), "up", "--driver", "sim", "--hosts", "20",
                               "--db", db_url, "--port", str(port), "--token", TOKEN], env=env,
                              stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    projects = args.vms // 100
    endpoints = {
        "GET /vms/{name}": lambda r: f"/api/v1/vms/p{r.randrange(projects)}-v{r.randrange(100)}",
        "GET /vms?project= (100 VMs)": lambda r: f"/api/v1/vms?project=p{r.randrange(projects)}",
        "GET /projects/{name}/usage": lambda r: f"/api/v1/projects/p{r.randrange(projects)}/usage",
        "GET /hosts (20)": lambda r: "/api/v1/hosts",
        "GET /operations?limit=50": lambda r: "/api/v1/operations?limit=50",
    }
    latencies: dict[str, list[float]] = {k: [] for k in endpoints}
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                if server.poll() is not None:
                    raise RuntimeError((Path(tmp.name) / "up.log").read_text()[-3000:])
                time.sleep(0.2)
        else:
            raise RuntimeError("vmplane up did not answer in 120 s")
        plan = [name for name in endpoints for _ in range(args.requests // len(endpoints))]
        random.Random(1).shuffle(plan)
        chunks = [plan[i::args.clients] for i in range(args.clients)]

        def client(names: list[str]) -> list[tuple[str, float, int]]:
            rng = random.Random(len(names))
            out = []
            with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as c:
                for name in names:
                    t = time.perf_counter()
                    status = c.get(endpoints[name](rng)).status_code
                    out.append((name, time.perf_counter() - t, status))
            return out

        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            results = [row for rows in pool.map(client, chunks) for row in rows]
        wall = time.perf_counter() - t0
    finally:
        server.terminate()
        server.wait(60)
        tmp.cleanup()
    errors = sum(status != 200 for _, _, status in results)
    for name, seconds, _ in results:
        latencies[name].append(seconds * 1000)
    rows = [[name, len(v), f"{percentile(v, 50):.1f}", f"{percentile(v, 99):.1f}"] for name, v in latencies.items()]
    rows.append(["all", len(results), f"{percentile([s * 1000 for _, s, _ in results], 50):.1f}",
                 f"{percentile([s * 1000 for _, s, _ in results], 99):.1f}"])
    body = table(["endpoint", "requests", "p50 ms", "p99 ms"], rows)
    body += (f"\n\n{len(results)} requests from {args.clients} concurrent clients on loopback in {wall:.1f} s = "
             f"**{len(results) / wall:.0f} requests/s**, {errors} non-200. Store: {args.vms} VMs (half running) in "
             f"{projects} projects on 20 sim hosts, SQLite (populated in {populate_s:.0f} s). One uvicorn worker "
             f"on this 2-core machine; the clients share the cores.")
    write_section(f"API read load with {args.vms} VMs (bench/load.py)", body)


if __name__ == "__main__":
    main()
