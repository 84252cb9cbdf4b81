"""Admission is atomic: concurrent starts never overrun a quota, on SQLite and on PostgreSQL."""

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx

from vmplane.errors import QuotaExceeded
from vmplane.orchestrator import InlineExecutor, Orchestrator
from vmplane.store import Database

from .conftest import LiveServer, add_basics, add_sim_hosts


def test_200_concurrent_starts_against_a_quota_for_50_start_exactly_50(tmp_path, db_url):
    live = LiveServer(tmp_path, db_url=db_url).start()
    try:
        _two_hundred_starts(live)
    finally:
        live.stop()


def _two_hundred_starts(live):
    with live.client() as c:
        # 3 sim hosts x 16 cores = 48 vCPUs: overcommit CPU so that the quota is the only limit
        c.put("/settings/cpu.overprovisioning.factor", json={"value": "4"}).raise_for_status()
        c.post("/projects", json={"name": "p", "vcpus": 50, "memory_mib": 1 << 20, "vms": 200}).raise_for_status()
        c.post("/offerings", json={"name": "one", "kind": "fixed", "vcpus": 1, "memory_mib": 256}).raise_for_status()
        c.post("/templates", json={"name": "t", "image": "tiny-linux"}).raise_for_status()
        for i in range(200):
            c.post("/vms", json={"name": f"v{i}", "project": "p", "offering": "one", "template": "t"}).raise_for_status()

    def start(i):
        with httpx.Client(base_url=live.url + "/api/v1", timeout=120,
                          headers={"Authorization": f"Bearer {live.env['VMPLANE_TOKEN']}"}) as c:
            return c.post(f"/vms/v{i}/start")

    with ThreadPoolExecutor(max_workers=100) as pool:
        results = list(pool.map(start, range(200)))
    codes = sorted(r.status_code for r in results)
    odd = [r.text for r in results if r.status_code not in (202, 409)]
    assert codes.count(202) == 50 and codes.count(409) == 150, (codes, odd[:3])
    assert all(r.json()["error"] == "quota_exceeded" and r.json()["field"] == "vcpus"
               for r in results if r.status_code == 409)

    with live.client() as c:
        for r in results:
            if r.status_code == 202:
                op = r.json()["operation"]["id"]
                for _ in range(200):
                    if c.get(f"/operations/{op}").json()["state"] == "succeeded":
                        break
        vms = c.get("/vms").json()
        assert sum(v["state"] == "running" for v in vms) == 50
        usage = c.get("/projects/p/usage").json()
        assert usage["vcpus"]["used"] == 50 and usage["consistent"] is True
        assert c.get("/audit").json() == {"ok": True, "problems": []}


def test_eight_control_planes_racing_never_overrun_quota_or_hosts(db_url):
    """Eight orchestrators on one database (eight API processes, each with its own capacity index), two
    threads each, starting 120 VMs against a quota of 40 vCPUs on hosts that hold 48: exactly 40 start."""
    db_a = Database(db_url)
    db_a.migrate()
    a = Orchestrator(db_a, InlineExecutor())
    a.load()
    a.catalog.create_zone("z1")
    a.catalog.create_cluster("c1", "z1")
    add_sim_hosts(a, 3, cores=16, memory_mib=65536)
    add_basics(a)
    a.catalog.create_project("p", 40, 10**6, 200)
    for i in range(120):
        a.create_vm(f"v{i}", "p", "small", "tiny")
    others = []
    for _ in range(7):
        o = Orchestrator(Database(db_url), InlineExecutor())
        o.load()
        others.append(o)
    started, refused, errors = [], [], []
    lock = threading.Lock()

    def worker(o, names):
        for name in names:
            try:
                o.start_vm(name)
                with lock:
                    started.append(name)
            except QuotaExceeded:
                with lock:
                    refused.append(name)
            except Exception as exc:  # anything else is a bug
                with lock:
                    errors.append(repr(exc))

    names = [f"v{i}" for i in range(120)]
    threads = [threading.Thread(target=worker, args=(o, names[k::16]))
               for k, o in enumerate([a, *others] * 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(started) == 40 and len(refused) == 80
    from vmplane.audit import audit
    assert audit(db_a, a.catalog.recomputed_usage) == []
    assert sum(h.used_vcpus for h in a.hosts()) == 40
    for o in [a, *others]:
        o.close()
        o.db.dispose()
