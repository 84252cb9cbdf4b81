"""A VM create's dry run (`dry_run` in the API, `vm create --dry-run`, the console's create form): the whole
admission runs (quota, placement, the root disk's pool) and is rolled back; the answer is the plan, or the
very refusal the create would meet. Nothing is written: no VM, no charge, no claim, no event."""

from __future__ import annotations

from vmplane.store import events
from vmplane.store.listing import Page

from .conftest import add_basics, add_sim_hosts


def _written(o) -> tuple:
    p = o.catalog.project("p")
    hosts = tuple((h.name, h.used_vcpus, h.used_memory_mib) for h in o.hosts())
    newest = events.page(o.db, Page(limit=1))[0]
    return (p.used_vcpus, p.used_memory_mib, p.used_vms, p.used_storage_mib), hosts, [v.name for v in o.vms()], newest


def test_a_dry_run_answers_the_plan_and_writes_nothing_then_the_create_does_as_planned(orch, api):
    o = orch
    add_sim_hosts(o, 2)
    add_basics(o)
    o.catalog.create_template("disk", "tiny-linux", disk="tiny-linux")
    o.catalog.create_project("p", 8, 16384, 10, count_overhead=True)
    o.pools.create("shared", "shared", cluster="c1")
    before = _written(o)
    body = {"name": "web", "project": "p", "offering": "small", "template": "disk", "start": True}
    r = api.post("/api/v1/vms", json={**body, "dry_run": True})
    assert r.status_code == 200, r.text
    plan = r.json()
    assert plan["dry_run"] is True and plan["host"] in ("h1", "h2") and plan["pool"] == "shared"
    assert plan["charge"]["vms"] == 1 and plan["charge"]["vcpus"] == 1
    assert plan["charge"]["memory_mib"] == 1024 + plan["overhead_mib"] and plan["overhead_mib"] > 0
    assert plan["charge"]["storage_mib"] > 0 and plan["host"] in plan["reason"]
    assert _written(o) == before and api.get("/api/v1/vms/web").status_code == 404
    assert o.audit() == []

    r = api.post("/api/v1/vms", json=body)
    assert r.status_code in (201, 202), r.text
    vm = o.vm("web")
    assert vm.host.name == plan["host"] and o.volumes.row("web-root").pool_name == "shared"
    p = o.catalog.project("p")
    assert (p.used_vms, p.used_vcpus, p.used_memory_mib) == (1, 1, plan["charge"]["memory_mib"])


def test_a_dry_run_meets_the_creates_refusals_and_a_stopped_create_plans_no_host(orch, api):
    o = orch
    add_sim_hosts(o, 1)
    add_basics(o)
    o.catalog.create_project("p", 2, 4096, 10)
    before = _written(o)
    over = {"name": "big", "project": "p", "offering": "large", "template": "tiny", "start": True}
    dry = api.post("/api/v1/vms", json={**over, "dry_run": True})
    real = api.post("/api/v1/vms", json=over)
    assert dry.status_code == real.status_code == 409 and dry.json() == real.json()
    assert dry.json()["error"] == "quota_exceeded"
    bad = api.post("/api/v1/vms", json={**over, "name": "Bad Name", "dry_run": True})
    assert bad.status_code == 422 and bad.json()["field"] == "name"
    assert api.post("/api/v1/vms", json={**over, "dry_run": "yes"}).json()["field"] == "dry_run"
    plan = api.post("/api/v1/vms", json={**over, "offering": "small", "start": False, "dry_run": True}).json()
    assert plan["host"] is None and plan["pool"] is None and plan["charge"]["vcpus"] == 0
    assert "created stopped" in plan["reason"]
    assert _written(o) == before
