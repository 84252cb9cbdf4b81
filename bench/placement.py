"""Placement at scale: 2,000 sim hosts, 20,000 VMs admitted through the orchestrator (quota + placement +
claim committed to SQLite), pack vs spread vs a lower bound, and the cost of one placement decision;
beside it, in the same run, the storage floor: the same rows written through raw sqlite3, one
transaction each. `--pg`: the same admissions on PostgreSQL from 1, 2 and 4 processes.

usage: .venv/bin/python bench/placement.py [--hosts 2000] [--vms 20000] [--threads 16,40]
       .venv/bin/python bench/placement.py --pg [--pg-url postgresql+psycopg://...] [--procs 1,2,4]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import random
import sqlite3
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from common import table, write_section
from vmplane.core.errors import VmplaneError
from vmplane.core.model import Offering, OfferingKind, PlacementRequest, Size
from vmplane.core.placement import choose, lower_bound_hosts
from vmplane.core.quota import host_footprint_mib
from vmplane.orchestrator import InlineExecutor, Orchestrator
from vmplane.store import Database

HOST_CORES, HOST_MEMORY = 32, 131072
SIZES = [("s1", 1, 1024), ("s2", 2, 4096), ("s4", 4, 8192), ("s8", 8, 16384)]
WEIGHTS = [50, 30, 15, 5]
PER_PROJECT = 100


class DeferredExecutor(InlineExecutor):
    """Queues operations so that admission and the driver work are timed apart."""

    def __init__(self):
        self.queue = []

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[override]
        self.queue.append((fn, args, kwargs))  # list.append: safe from the client threads

    def drain(self) -> int:
        n = len(self.queue)
        for fn, args, kwargs in self.queue:
            fn(*args, **kwargs)
        self.queue.clear()
        return n


def build(hosts: int, strategy: str, url: str) -> Orchestrator:
    db = Database(url)
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


def admit_all(o: Orchestrator, requests: list[tuple[str, str, str]], threads: int) -> tuple[int, int]:
    """create_vm(start=True) for each (name, project, offering) from `threads` client threads (as the
    API's request threads do); returns (admitted, refused)."""

    def one(req) -> bool:
        try:
            o.create_vm(req[0], req[1], req[2], "t", start=True)
            return True
        except VmplaneError:
            return False

    if threads <= 1:
        ok = sum(one(r) for r in requests)
    else:  # each thread asks its share one request after another (no futures: they cost the GIL)
        counts = [0] * threads

        def client(k: int) -> None:
            counts[k] = sum(one(r) for r in requests[k::threads])

        clients = [threading.Thread(target=client, args=(k,)) for k in range(threads)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        ok = sum(counts)
    return ok, len(requests) - ok


# -- the storage floor: what one admission writes, through raw sqlite3 ---------------------------------
FLOOR_WRITES = [
    "UPDATE hosts (compare-and-add of the VM's vCPUs and memory)",
    "UPDATE projects (the quota ledger)",
    "INSERT vms",
    "INSERT events (the VM created, starting on its host)",
    "INSERT operations (the start, claimed)",
    "INSERT events (the operation pending)",
    "INSERT claims (the host claim)",
]


def storage_floor(path: str, n: int) -> float:
    """`n` admissions' rows written through raw sqlite3 on a copy of the benchmark's store (same schema and
    indexes, same hosts and projects), one transaction each (BEGIN IMMEDIATE .. COMMIT), WAL +
    synchronous=NORMAL + foreign keys, as vmplane opens it. Returns commits per second."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    for pragma in ("journal_mode=WAL", "synchronous=NORMAL", "foreign_keys=ON", "busy_timeout=30000"):
        conn.execute(f"PRAGMA {pragma}")
    hosts = [r[0] for r in conn.execute("SELECT id FROM hosts ORDER BY id")]
    projects = [r[0] for r in conn.execute("SELECT id FROM projects ORDER BY id")]
    offering, template = (
        conn.execute("SELECT id FROM offerings").fetchone()[0],
        conn.execute("SELECT id FROM templates").fetchone()[0],
    )
    zone, cluster = conn.execute("SELECT id, zone_id FROM clusters").fetchone()[1::-1]
    ev = (
        "INSERT INTO events (at, kind, subject, project_id, vm, host, old_state, new_state, cause, message) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
    )
    t0 = time.perf_counter()
    for i in range(n):
        now = dt.datetime.utcnow().isoformat(" ")
        host, project, name, op = (
            hosts[i % len(hosts)],
            projects[i // PER_PROJECT % len(projects)],
            f"f{i}",
            str(uuid.uuid4()),
        )
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            "UPDATE hosts SET used_vcpus = used_vcpus + ?, used_memory_mib = used_memory_mib + ? "
            "WHERE id = ? AND state = 'enabled' AND used_vcpus + ? <= ? AND used_memory_mib + ? <= ?",
            (1, 1029, host, 1, 10**6, 1029, 10**9),
        )
        conn.execute(
            "UPDATE projects SET used_vcpus = used_vcpus + ?, used_memory_mib = used_memory_mib + ?, "
            "used_vms = used_vms + ?, used_storage_mib = used_storage_mib + ? WHERE id = ?",
            (1, 1024, 1, 0, project),
        )
        vm = conn.execute(
            "INSERT INTO vms (name, project_id, offering_id, template_id, zone_id, cluster_id, vcpus, memory_mib, "
            "dynamically_scalable, max_vcpus, max_memory_mib, cpu_cap_percent, state, host_id, overhead_mib, "
            "charged_vcpus, charged_memory_mib, created_at, updated_at, prepared, boot_memory_mib, last_host_id, "
            "ha_policy, ha_priority, group_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, "
            "?, ?, ?, ?, ?)",
            (
                name,
                project,
                offering,
                template,
                zone,
                cluster,
                1,
                1024,
                1,
                32,
                131072,
                None,
                "starting",
                host,
                5,
                1,
                1024,
                now,
                now,
                1,
                1024,
                host,
                "off",
                0,
                None,
            ),
        ).lastrowid
        conn.execute(
            ev,
            (now, "vm", name, project, name, "h", None, "starting", "vmplane", "created with 1 vCPU / 1024 MiB; on h"),
        )
        conn.execute(
            "INSERT INTO operations (id, kind, target, vm_id, project_id, state, step, progress, message, "
            "result, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                op,
                "start",
                name,
                vm,
                project,
                "pending",
                "claimed",
                10,
                "claimed 1 vCPU(s) / 1029 MiB on h",
                json.dumps({"host": "h"}),
                now,
                now,
            ),
        )
        conn.execute(
            ev,
            (
                now,
                "operation",
                op,
                project,
                name,
                None,
                None,
                "pending",
                "vmplane",
                "start f: claimed 1 vCPU(s) / 1029 MiB on h",
            ),
        )
        conn.execute(
            "INSERT INTO claims (host_id, vm_id, operation_id, kind, vcpus, memory_mib) VALUES (?, ?, ?, ?, ?, ?)",
            (host, vm, op, "running", 1, 1029),
        )
        conn.execute("COMMIT")
    rate = n / (time.perf_counter() - t0)
    conn.close()
    return rate


def snapshot(o: Orchestrator, path: str) -> None:
    """A copy of the store as it is now (before the VMs), for the floor."""
    src = sqlite3.connect(str(o.db.engine.url.database))
    dst = sqlite3.connect(path)
    src.backup(dst)
    src.close()
    dst.close()


def run(hosts: int, vms: int, strategy: str, threads: int, tmp: str) -> dict:
    t0 = time.perf_counter()
    o = build(hosts, strategy, f"sqlite:///{tmp}/bench-{strategy}-{threads}.db")
    o.executor.drain()
    setup_s = time.perf_counter() - t0
    rng = random.Random(42)
    plan = rng.choices(SIZES, WEIGHTS, k=vms)
    for p in range(-(-vms // PER_PROJECT)):
        o.catalog.create_project(f"p{p}", 10**6, 10**9, PER_PROJECT, count_overhead=p % 2 == 0)
    snapshot(o, f"{tmp}/floor-{strategy}-{threads}.db")
    floor = storage_floor(f"{tmp}/floor-{strategy}-{threads}.db", vms)
    requests = [(f"v{i}", f"p{i // PER_PROJECT}", offering) for i, (offering, _, _) in enumerate(plan)]
    batches0, requests0 = o.admissions.batches, o.admissions.requests
    t0 = time.perf_counter()
    admitted, refused = admit_all(o, requests, threads)
    admit_s = time.perf_counter() - t0
    batches = o.admissions.batches - batches0
    per_batch = (o.admissions.requests - requests0) / max(batches, 1)
    t0 = time.perf_counter()
    o.executor.drain()  # the start controller's drain: the queued starts, in batches
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
    return {
        "strategy": strategy,
        "threads": threads,
        "setup_s": setup_s,
        "admit_s": admit_s,
        "vms_per_s": admitted / admit_s,
        "e2e_per_s": running / (admit_s + start_s),
        "refused": refused,
        "floor": floor,
        "per_batch": per_batch,
        "hosts_used": used,
        "lower_bound": bound,
        "decision_us": decision_us,
        "audit": "ok" if not problems else f"{len(problems)} problems: {problems[:3]}",
        "running": running,
    }


def sqlite_main(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(args.hosts, args.vms, s, t, tmp) for s in ("spread", "pack") for t in (1, *args.threads)]
    rows = [
        [
            r["strategy"],
            r["threads"],
            r["running"],
            f"{r['floor']:.0f}",
            f"{r['vms_per_s']:.0f}",
            f"{r['vms_per_s'] / r['floor']:.2f}x",
            f"{r['e2e_per_s']:.0f}",
            f"{r['e2e_per_s'] / r['floor']:.2f}x",
            f"{r['per_batch']:.1f}",
            r["hosts_used"],
            r["lower_bound"],
            f"{r['hosts_used'] / r['lower_bound']:.3f}",
            f"{r['decision_us']:.0f}",
            r["audit"],
        ]
        for r in results
    ]
    body = table(
        [
            "strategy",
            "client threads",
            "VMs running",
            "floor commits/s",
            "admitted VMs/s",
            "/ floor",
            "end-to-end VMs/s",
            "/ floor",
            "admissions per txn",
            "hosts used",
            "lower bound",
            "used / bound",
            "decision us",
            "ledger audit",
        ],
        rows,
    )
    body += (
        f"\n\n'floor commits/s': the rows one admission writes ({'; '.join(FLOOR_WRITES)}), written through "
        f"raw sqlite3 on a copy of the same store (schema, indexes, {args.hosts} hosts, projects), one "
        f"transaction each (BEGIN IMMEDIATE .. COMMIT; WAL, synchronous=NORMAL, foreign keys on, as vmplane "
        f"opens SQLite), measured in the same run just before the row's admissions. "
        f"'admitted VMs/s': create-and-start requests committed (project row locked, quota checked, host "
        f"chosen from the in-memory index, host row compare-and-add, VM + claim + ledger + operation + events "
        f"written), issued by 'client threads' at once as the API's request threads do (40 is the most it "
        f"serves at once: its endpoints run in anyio's default thread limiter of 40); concurrent requests "
        f"are admitted together (admission.Batcher: one transaction, in order, their events written by one "
        f"executemany before the commit; on SQLite no savepoints: a request refused before it writes is passed "
        f"over; 'admissions per txn' is the mean batch). 'end-to-end' adds each start operation: persisted step, "
        f"sim driver start, VM marked running, run by the start controller (starts.Starts) as the API's "
        f"process does: the queued starts in batches of up to 64, two transactions per batch). "
        f"Hosts {HOST_CORES} cores / {HOST_MEMORY} MiB; VM sizes {SIZES} with weights {WEIGHTS}; half the "
        f"projects count overhead. 'decision us' = one placement decision at {args.hosts} hosts with the "
        f"index full. 'spread' is vmplane's default strategy. Goal (issue 14): admitted >= 0.5x floor, "
        f"end-to-end >= 0.25x floor."
    )
    (write_section if args.write else _print)(
        f"Placement: {args.hosts} hosts, {args.vms} VMs (bench/placement.py)", body
    )


# -- PostgreSQL: the same admissions from several processes ------------------------------------------
PG_QUOTA_VMS, PG_QUOTA_VCPUS, PG_ASKED = 100, 180, 120  # per project: 120 asked, some refused by quota


def _pg_worker(url: str, k: int, requests: list, threads: int, barrier, out) -> None:
    # a name of its own: a process registering under a live one's name takes its place (a restart)
    o = Orchestrator(Database(url), DeferredExecutor(), name=f"bench-{k}")
    o.load(recover=False)
    barrier.wait()
    t0 = time.time()
    admitted, refused = admit_all(o, requests, threads)
    out.put((t0, time.time(), admitted, refused, o.admissions.batches))
    o.db.dispose()


def pg_run(url: str, hosts: int, vms: int, procs: int, threads: int) -> dict:
    o = build(hosts, "pack", url)
    rng = random.Random(42)
    projects = -(-vms // PG_ASKED)
    for p in range(projects):
        o.catalog.create_project(f"p{p}", PG_QUOTA_VCPUS, 10**9, PG_QUOTA_VMS, count_overhead=p % 2 == 0)
    plan = rng.choices(SIZES, WEIGHTS, k=vms)
    requests = [(f"v{i}", f"p{i % projects}", offering) for i, (offering, _, _) in enumerate(plan)]
    o.close()  # its lease released: the workers are the only live processes
    o.db.dispose()
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(procs), ctx.Queue()
    workers = [
        ctx.Process(target=_pg_worker, args=(url, k, requests[k::procs], threads, barrier, out)) for k in range(procs)
    ]
    for w in workers:
        w.start()
    results = [out.get(timeout=1800) for _ in workers]
    for w in workers:
        w.join(60)
    start, end = min(r[0] for r in results), max(r[1] for r in results)
    admitted, refused, batches = (sum(r[i] for r in results) for i in (2, 3, 4))
    check = Orchestrator(Database(url), InlineExecutor())
    check.load(recover=False)
    from vmplane.controllers import audit as audit_rules

    problems = audit_rules.audit(check.db, check.catalog.recomputed_usage, check.index)
    over = [p.name for p in check.catalog.projects() if p.used_vms > p.quota_vms or p.used_vcpus > p.quota_vcpus]
    check.db.dispose()
    return {
        "procs": procs,
        "admitted": admitted,
        "refused": refused,
        "rate": admitted / (end - start),
        "per_batch": admitted / max(batches, 1),
        "over": len(over),
        "audit": "ok" if not problems else f"{len(problems)} problems: {problems[:3]}",
    }


def pg_main(args) -> None:
    helper = None
    if args.pg_url is None:
        sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
        from pg import Postgres, unavailable_reason  # type: ignore[import-not-found]

        reason = unavailable_reason()
        if reason:
            sys.exit(reason)
        helper = Postgres().start()
    rows = []
    try:
        for procs in args.procs:
            if helper is not None:
                url = helper.create_database(f"bench_{procs}")
            else:
                url = args.pg_url
                from sqlalchemy import create_engine, text

                engine = create_engine(url)
                with engine.begin() as c:  # the database given is emptied for each run
                    c.execute(text("DROP SCHEMA public CASCADE"))
                    c.execute(text("CREATE SCHEMA public"))
                engine.dispose()
            r = pg_run(url, args.hosts, args.vms, procs, args.threads[0])
            print(r)
            rows.append(
                [
                    r["procs"],
                    args.threads[0],
                    r["admitted"],
                    r["refused"],
                    f"{r['rate']:.0f}",
                    f"{r['per_batch']:.1f}",
                    r["over"],
                    r["audit"],
                ]
            )
    finally:
        if helper is not None:
            helper.stop()
    body = table(
        [
            "processes",
            "client threads each",
            "admitted",
            "refused by quota",
            "admitted VMs/s (all)",
            "admissions per txn",
            "projects over quota",
            "ledger audit",
        ],
        rows,
    )
    server = (
        "a throwaway server, tests/pg.py: fsync off, synchronous_commit off"
        if args.pg_url is None
        else "given by --pg-url"
    )
    body += (
        f"\n\nThe same create-and-start admissions on one PostgreSQL database ({server}), from N "
        f"processes started together, each its own Orchestrator ({args.threads[0]} client threads each); "
        f"{args.hosts} sim hosts, {args.vms} requests spread round-robin over projects with quota "
        f"{PG_QUOTA_VMS} VMs / {PG_QUOTA_VCPUS} vCPUs that are each asked {PG_ASKED} VMs, so that every "
        f"process meets the quota in every project. 'projects over quota' must be 0; 'ledger audit' = "
        f"audit.audit (ledger == the sum of the VMs, host usage == its claims) after the run."
    )
    (write_section if args.write else _print)(
        f"Placement on PostgreSQL: {args.hosts} hosts, 1-{max(args.procs)} processes (bench/placement.py --pg)", body
    )


def _print(name: str, body: str) -> None:
    print(f"## {name}\n\n{body}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=2000)
    ap.add_argument("--vms", type=int, default=None, help="20000 (SQLite), 6000 (--pg)")
    ap.add_argument(
        "--threads",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[16, 40],
        help="client threads issuing requests at once (SQLite: a row each; --pg: the first)",
    )
    ap.add_argument("--pg", action="store_true", help="PostgreSQL, 1, 2 and 4 processes")
    ap.add_argument(
        "--pg-url", default=None, help="use this PostgreSQL database (emptied!) instead of a throwaway server"
    )
    ap.add_argument("--procs", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    ap.add_argument("--no-write", dest="write", action="store_false", help="print only, leave RESULTS.md")
    args = ap.parse_args()
    if args.pg or args.pg_url:
        args.vms = args.vms or 6000
        pg_main(args)
    else:
        args.vms = args.vms or 20000
        sqlite_main(args)


if __name__ == "__main__":
    main()
