"""Admission is atomic: concurrent starts never overrun a quota, on SQLite and on PostgreSQL."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from vmplane.core.errors import QuotaExceeded
from vmplane.orchestrator import InlineExecutor, Orchestrator
from vmplane.store import Database

from .conftest import LiveServer, add_basics, add_sim_hosts
from .multikit import storm_projects, storm_requests


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
            c.post(
                "/vms", json={"name": f"v{i}", "project": "p", "offering": "one", "template": "t"}
            ).raise_for_status()

    def start(i):
        with httpx.Client(
            base_url=live.url + "/api/v1", timeout=120, headers={"Authorization": f"Bearer {live.env['VMPLANE_TOKEN']}"}
        ) as c:
            return c.post(f"/vms/v{i}/start")

    with ThreadPoolExecutor(max_workers=100) as pool:
        results = list(pool.map(start, range(200)))
    codes = sorted(r.status_code for r in results)
    odd = [r.text for r in results if r.status_code not in (202, 409)]
    assert codes.count(202) == 50 and codes.count(409) == 150, (codes, odd[:3])
    assert all(
        r.json()["error"] == "quota_exceeded" and r.json()["field"] == "vcpus" for r in results if r.status_code == 409
    )

    with live.client() as c:
        for r in results:
            if r.status_code == 202:
                op = r.json()["operation"]["id"]
                for _ in range(200):
                    if c.get(f"/operations/{op}").json()["state"] == "succeeded":
                        break
        vms = c.get("/vms", params={"limit": 1000}).json()
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
    for i in range(7):
        o = Orchestrator(Database(db_url), InlineExecutor(), name=f"plane-{i}")  # a process of its own
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
            except Exception as exc:  # noqa: BLE001 (anything else is a bug, reported below)
                with lock:
                    errors.append(repr(exc))

    names = [f"v{i}" for i in range(120)]
    threads = [threading.Thread(target=worker, args=(o, names[k::16])) for k, o in enumerate([a, *others] * 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(started) == 40 and len(refused) == 80
    from vmplane.controllers.audit import audit

    assert audit(db_a, a.catalog.recomputed_usage) == []
    assert sum(h.used_vcpus for h in a.hosts()) == 40
    for o in [a, *others]:
        o.close()
        o.db.dispose()


def test_1000_concurrent_creates_starts_and_scales_never_overrun_tight_quotas(tmp_path):
    """A mixed storm over REST: creates with start, starts and live scale-ups from 100 clients, against
    three projects whose quotas fit a fraction; afterwards the ledger is exact and within quota."""
    live = LiveServer(tmp_path).start()
    try:
        with live.client() as c:
            c.put("/settings/cpu.overprovisioning.factor", json={"value": "8"}).raise_for_status()
            c.put("/settings/enable.dynamic.scale.vm", json={"value": "true"}).raise_for_status()
            c.post(
                "/offerings",
                json={"name": "one", "kind": "fixed", "vcpus": 1, "memory_mib": 256, "dynamic_scaling": True},
            ).raise_for_status()
            c.post(
                "/offerings",
                json={"name": "two", "kind": "fixed", "vcpus": 2, "memory_mib": 512, "dynamic_scaling": True},
            ).raise_for_status()
            c.post("/templates", json={"name": "t", "image": "tiny-linux", "dynamic_scaling": True}).raise_for_status()
            quotas = {"q1": (20, 8192, 60), "q2": (35, 6000, 80), "q3": (50, 1 << 20, 40)}
            storm_projects(c, quotas)  # with stopped VMs to start or scale

        requests = storm_requests()

        def send(req):
            method, path, body = req
            with httpx.Client(
                base_url=live.url + "/api/v1",
                timeout=120,
                headers={"Authorization": f"Bearer {live.env['VMPLANE_TOKEN']}"},
            ) as c:
                return c.request(method, path, json=body)

        with ThreadPoolExecutor(max_workers=100) as pool:
            results = list(pool.map(send, requests))
        codes = {r.status_code for r in results}
        assert codes <= {200, 201, 202, 404, 409, 422}, codes  # no 5xx, nothing unexpected
        assert all(set(r.json()) <= {"error", "message", "field"} for r in results if r.status_code >= 400)
        # 202: admitted work; 200: a stopped VM resized offline; 409: refused by quota, capacity or state
        assert (
            sum(r.status_code in (200, 202) for r in results) > 50 and sum(r.status_code == 409 for r in results) > 50
        )
        with live.client() as c:
            for _ in range(600):  # let the operations finish
                if (
                    not c.get("/operations", params={"state": "running"}).json()
                    and not c.get("/operations", params={"state": "pending"}).json()
                ):
                    break
                time.sleep(0.1)
            for name, (vcpus, memory, vms) in quotas.items():
                u = c.get(f"/projects/{name}/usage").json()
                assert u["consistent"] is True, u
                assert u["vcpus"]["used"] <= vcpus and u["memory_mib"]["used"] <= memory and u["vms"]["used"] <= vms
            assert c.get("/audit").json() == {"ok": True, "problems": []}
    finally:
        live.stop()
