"""Items of issue 33's newcomer audit (ux-audit-2026-12-02.md), each with the test that failed on the code
before it: here, on simulated hosts."""

from __future__ import annotations

from .conftest import add_basics, add_sim_hosts


def test_a_vm_created_in_a_zone_without_start_gets_its_root_disk_in_that_zone_so_it_can_start(orch, api):
    """`vm create --zone Z` without --start put the root disk in another zone's shared pool (the first by
    name), so the VM could never start: a root disk not placed yet goes to a pool of the VM's zone."""
    o = orch
    o.catalog.create_zone("z2")
    o.catalog.create_cluster("c2", "z2")
    add_sim_hosts(o, 1, cluster="c1", prefix="near")
    add_sim_hosts(o, 1, cluster="c2", prefix="far")
    add_basics(o)
    o.catalog.create_template("disk", "tiny-linux", disk="tiny-linux")
    o.catalog.create_project("p", 8, 16384, 10)
    o.pools.create("a-far", "shared", cluster="c2")  # first by name, and as roomy: chosen before the fix
    body = {"name": "web", "project": "p", "offering": "small", "template": "disk", "zone": "z1"}
    r = api.post("/api/v1/vms", json=body)
    assert (r.status_code, r.json()["field"]) == (409, "pool")
    assert "a-far: is in cluster c2, outside the VM's zone" in r.text, r.text
    assert api.get("/api/v1/vms").json() == []  # nothing made

    o.pools.create("z-near", "shared", cluster="c1")
    assert api.post("/api/v1/vms", json=body).status_code in (200, 201)
    assert o.volumes.row("web-root").pool_name == "z-near"
    o.start_vm("web")
    assert o.vm("web").host.name == "near1" and o.audit() == []
