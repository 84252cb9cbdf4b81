"""The web console's server time at scale: 500 sim hosts and 10,000 VMs (half running) in 100 projects, in
SQLite, admitted through the orchestrator (quota + placement + claim, one transaction each, as an API create
does). p50/p95 of the overview, the VM list (first page, a filtered page, a deep sorted page), a VM detail
and a few others, requested one after another:

- `asgi`: through the ASGI app in this process (Starlette's TestClient: routing, the session cookie check,
  SQL, Jinja2 rendering; no socket),
- `uvicorn`: a real uvicorn server on loopback (in a thread of this process) asked by an httpx client, so the
  HTTP parsing and the socket are in too.

usage: .venv/bin/python bench/ui.py [--hosts 500] [--vms 10000] [--requests 100] [--mode asgi,uvicorn]
       [--no-write] [--reuse FILE] [--profile PAGE] [--graphs ROUNDS]
  --profile: cProfile one page's requests, the top functions printed; nothing written
  --graphs: run the usage sampler ROUNDS times first (a minute apart): the pages draw an hour of usage graphs
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import percentile, table, write_section
from vmplane.core.model import Offering, OfferingKind
from vmplane.orchestrator import InlineExecutor, Orchestrator
from vmplane.server import create_app
from vmplane.store import Database

TOKEN = "ui-bench-token"
HOST_CORES, HOST_MEMORY = 32, 131072
SIZES = [("s1", 1, 1024), ("s2", 2, 2048), ("s4", 4, 8192)]
PER_PROJECT = 100
GOAL_MS = 200


def populate(tmp: str, hosts: int, vms: int, reuse: str | None = None) -> tuple[Orchestrator, dict]:
    if reuse and Path(reuse).exists():  # a store an earlier run kept (profiling runs)
        db = Database(f"sqlite:///{reuse}")
        o = Orchestrator(db, InlineExecutor())
        o.load()
        return o, {"hosts_s": 0.0, "vms_s": float("nan"), "events": count_events(db)}
    db = Database(f"sqlite:///{reuse or tmp + '/ui.db'}")
    db.migrate()
    o = Orchestrator(db, InlineExecutor())
    o.load()
    o.catalog.create_zone("zone1")
    o.catalog.create_cluster("cluster1", "zone1")
    t0 = time.perf_counter()
    for i in range(hosts):
        o.add_host(f"h{i:04d}", "cluster1", "sim", HOST_CORES, 2400, HOST_MEMORY)
    hosts_s = time.perf_counter() - t0
    for name, vcpus, memory in SIZES:
        o.catalog.create_offering(Offering(name, OfferingKind.fixed, vcpus=vcpus, memory_mib=memory))
    o.catalog.create_template("t", "tiny-linux")
    rng = random.Random(7)
    t0 = time.perf_counter()
    for p in range(-(-vms // PER_PROJECT)):
        o.catalog.create_project(f"p{p}", 10**5, 10**9, PER_PROJECT, count_overhead=p % 2 == 0)
    for i in range(vms):
        p = i // PER_PROJECT
        o.create_vm(f"p{p}-v{i % PER_PROJECT}", f"p{p}", rng.choice(SIZES)[0], "t", start=i % 2 == 0)
    vms_s = time.perf_counter() - t0
    o.catalog.ensure_admin_token("bench", TOKEN)
    return o, {"hosts_s": hosts_s, "vms_s": vms_s, "events": count_events(db)}


def count_events(db) -> int:
    from sqlalchemy import func, select

    from vmplane.store.schema import Event

    with db.read() as s:
        return s.execute(select(func.count()).select_from(Event)).scalar_one()


def pages(projects: int, hosts: int) -> dict:
    """What is measured: a label and a function of a random generator giving the URL."""
    return {
        "overview /ui": lambda r: "/ui",
        "VM list, first page /ui/vms": lambda r: "/ui/vms",
        "VM list, filtered (project + state + name prefix)": lambda r: (
            f"/ui/vms?project=p{(p := r.randrange(projects))}&state=running&name=p{p}-v1"
        ),
        "VM list, all running, by -memory, page 50": lambda r: "/ui/vms?state=running&sort=-memory_mib&offset=2500",
        "VM list fragment, host filter /ui/f/vms?host=": lambda r: f"/ui/f/vms?host=h{r.randrange(hosts):04d}",
        "VM detail /ui/vms/{name}": lambda r: f"/ui/vms/p{r.randrange(projects)}-v{r.randrange(PER_PROJECT)}",
        "hosts list /ui/hosts": lambda r: "/ui/hosts",
        "host detail /ui/hosts/{name}": lambda r: f"/ui/hosts/h{r.randrange(hosts):04d}",
        "project /ui/projects/{name}": lambda r: f"/ui/projects/p{r.randrange(projects)}",
        "projects /ui/projects": lambda r: "/ui/projects",
        "running now /ui/f/tasks": lambda r: "/ui/f/tasks",
        "live stream, one round /ui/stream?once=true": lambda r: "/ui/stream?once=true",
    }


def measure(get, urls: dict, n: int, warmup: int = 3) -> dict[str, list[float]]:
    """Each page `n` times (after `warmup` unmeasured), pages interleaved; seconds per request."""
    rng = random.Random(11)
    for label, url in urls.items():
        for _ in range(warmup):
            check(get(url(rng)), label)
    times: dict[str, list[float]] = {label: [] for label in urls}
    for _ in range(n):
        for label, url in urls.items():
            target = url(rng)
            t = time.perf_counter()
            r = get(target)
            times[label].append(time.perf_counter() - t)
            check(r, label)
    return times


def check(r, label: str) -> None:
    if r.status_code != 200 or len(r.content) < 40 or "login-form" in r.text:  # (not the login page)
        raise RuntimeError(f"{label}: {r.status_code} {r.text[:300]}")


def session_cookie(app) -> dict:
    """A console session of the admin token, logged in through the form (the cookie holds a session id kept
    in the store, not the token)."""
    from fastapi.testclient import TestClient

    from vmplane.ui.session import COOKIE

    with TestClient(app, follow_redirects=False, client=("127.0.0.1", 50000)) as c:
        r = c.post("/ui/login", data={"token": TOKEN})
        if r.status_code != 303:
            raise RuntimeError(f"login: {r.status_code} {r.text[:300]}")
        return {COOKIE: r.cookies[COOKIE]}


class ThreadedUvicorn:
    """uvicorn serving `app` on a free loopback port, in a thread of this process."""

    def __init__(self, app):
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=500)
    ap.add_argument("--vms", type=int, default=10000)
    ap.add_argument("--requests", type=int, default=100, help="per page and mode")
    ap.add_argument("--mode", default="asgi,uvicorn")
    ap.add_argument("--no-write", action="store_true", help="print the table only (trial runs)")
    ap.add_argument("--reuse", help="keep the store in this file, or use it if it exists (trial runs)")
    ap.add_argument("--profile", help="a page label's start (e.g. 'overview'): profile it in-process and stop")
    ap.add_argument("--graphs", type=int, default=0, help="usage sampler rounds first, a minute apart (60: an hour)")
    args = ap.parse_args()
    from fastapi.testclient import TestClient

    with tempfile.TemporaryDirectory(prefix="vmplane-ui-bench-") as tmp:
        t0 = time.perf_counter()
        o, built = populate(tmp, args.hosts, args.vms, args.reuse)
        print(
            f"populated in {time.perf_counter() - t0:.0f} s: {args.hosts} hosts in {built['hosts_s']:.0f} s, "
            f"{args.vms} VMs in {built['vms_s']:.0f} s, {built['events']} events",
            flush=True,
        )
        if args.graphs:  # the VM, host and project pages then draw their usage graphs with points
            start = time.time() - args.graphs * 60
            t0 = time.perf_counter()
            for i in range(args.graphs):
                o.stats.sample(start + i * 60)
            print(f"{args.graphs} usage sampler rounds in {time.perf_counter() - t0:.0f} s", flush=True)
        app = create_app(o)
        urls = pages(-(-args.vms // PER_PROJECT), args.hosts)
        cookies = session_cookie(app)
        results: dict[str, dict[str, list[float]]] = {}
        try:
            if args.profile:
                chosen = {k: v for k, v in urls.items() if k.startswith(args.profile)}
                with TestClient(app, cookies=cookies) as c:
                    measure(c.get, chosen, 2)
                    prof = cProfile.Profile()
                    prof.enable()
                    measure(c.get, chosen, args.requests, warmup=0)
                    prof.disable()
                pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
                return
            for mode in args.mode.split(","):
                print(f"measuring {mode} ...", flush=True)
                if mode == "asgi":
                    with TestClient(app, cookies=cookies) as c:
                        results[mode] = measure(c.get, urls, args.requests)
                elif mode == "uvicorn":
                    with ThreadedUvicorn(app) as url, httpx.Client(base_url=url, cookies=cookies, timeout=60) as c:
                        results[mode] = measure(c.get, urls, args.requests)
                else:
                    raise SystemExit(f"--mode: {mode!r} is not asgi or uvicorn")
        finally:
            o.close()
    modes = list(results)
    rows = []
    for label in urls:
        row = [label]
        for mode in modes:
            ms = [t * 1000 for t in results[mode][label]]
            row += [f"{percentile(ms, 50):.1f}", f"{percentile(ms, 95):.1f}"]
        worst = max(percentile([t * 1000 for t in results[m][label]], 95) for m in modes)
        rows.append(row + ["yes" if worst < GOAL_MS else "**no**"])
    headers = ["page"] + [f"{m} {p} ms" for m in modes for p in ("p50", "p95")] + [f"p95 < {GOAL_MS} ms"]
    body = table(headers, rows)
    body += (
        f"\n\n{args.requests} requests per page and mode, one after another (pages interleaved, 3 unmeasured "
        f"first), logged in as an admin (session cookie). `asgi`: through the ASGI app in-process (Starlette "
        f"TestClient, no socket); `uvicorn`: one uvicorn server on loopback in a thread of this process, asked "
        f"by an httpx client in another (the client's time is in the figure). Store: {args.hosts} sim hosts "
        f"({HOST_CORES} cores / {HOST_MEMORY} MiB), {args.vms} VMs ({PER_PROJECT} per project, half running, "
        f"sizes {[s[0] for s in SIZES]}) created through the orchestrator (`create_vm`, with start: quota, "
        f"placement, claim, events) on SQLite in {built['vms_s']:.0f} s, {built['events']} events in the log. "
        f"Random names per request (VM, host, project). This 2-core machine, other work running beside it."
    )
    if args.no_write:
        print(body)
        return
    if args.graphs:
        body += (
            f" Usage graphs: {args.graphs} sampler rounds first (the last hour's points of every running VM, host "
            f"and project), drawn on the VM, host and project pages."
        )
    graphs = f", graphs of {args.graphs} rounds" if args.graphs else ""
    write_section(f"Web console: {args.hosts} hosts, {args.vms} VMs{graphs} (bench/ui.py)", body)


if __name__ == "__main__":
    main()
