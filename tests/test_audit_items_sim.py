"""Items of issue 33's newcomer audit (ux-audit-2026-12-02.md), each with the test that failed on the code
before it: here, on simulated hosts."""

from __future__ import annotations

from vmplane.core.model import HostState, Offering, OfferingKind
from vmplane.store import events
from vmplane.store.listing import Page

from .conftest import add_basics, add_sim_hosts
from .ui_serverkit import ADMIN, ALPHA, build, csrf


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


def test_actions_taken_in_the_console_are_recorded_as_caused_by_the_sessions_token(db):
    """Console actions were recorded with cause `vmplane` (only /api/ requests named their token): every
    event of a console action names the token of the session, an admin's and a member's alike, as the
    API's do; a migration's events (run later, in other threads) too."""
    con = build(db)
    try:
        admin, member = con.client(ADMIN), con.client(ALPHA)
        assert admin.post("/ui/vms/a1/stop", data={"force": "on", "csrf": csrf(ADMIN)}).status_code == 200
        assert member.post("/ui/vms/a1/start", data={"csrf": csrf(ALPHA)}).status_code == 200
        assert admin.post("/ui/vms/a2/migrate", data={"to": "", "csrf": csrf(ADMIN)}).status_code == 200
        rows, _ = events.page(con.o.db, Page(limit=100))  # newest first: each change's latest cause
        causes: dict = {}
        for e in rows:
            causes.setdefault((e["kind"], e["subject"], e["old_state"], e["new_state"]), e["cause"])
        assert causes[("vm", "a1", "running", "stopping")] == "user admin"
        assert causes[("vm", "a1", "stopped", "starting")] == "user alpha-user"
        assert causes[("vm", "a1", "starting", "running")] == "user alpha-user"
        moved = [c for (kind, _s, _o, _n), c in causes.items() if kind == "migration"]
        assert moved and set(moved) == {"user admin"}
    finally:
        con.o.close()


def test_host_add_makes_its_local_pool_so_a_new_vm_with_a_disk_starts_there(orch, api):
    """`host add` made no pool (a VM with a root disk was then refused with "can not open the VM's disks"):
    it makes `local-NAME`, as `vmplane up` does; `host delete` takes the empty pool with it, and a host
    whose pool still holds a volume is refused naming it, nothing deleted."""
    o = orch
    add_basics(o)
    o.catalog.create_template("disk", "tiny-linux", disk="tiny-linux")
    o.catalog.create_project("p", 8, 16384, 10)
    sim = {"cluster": "c1", "cores": 4, "cpu_mhz": 2000, "memory_mib": 8192}
    assert api.post("/api/v1/hosts", json={"name": "n1", **sim}).status_code == 201
    pools = {p["name"]: p for p in api.get("/api/v1/pools").json()}
    assert pools["local-n1"]["kind"] == "local" and pools["local-n1"]["host"] == "n1"
    body = {"name": "web", "project": "p", "offering": "small", "template": "disk", "start": True}
    assert api.post("/api/v1/vms", json=body).status_code in (201, 202)
    assert o.vm("web").host.name == "n1" and o.volumes.row("web-root").pool_name == "local-n1"

    assert api.post("/api/v1/vms/web/stop", json={"force": True}).status_code == 202
    r = api.delete("/api/v1/hosts/n1")  # web's stopped disk is on its pool
    assert r.status_code == 409 and "web-root" in r.json()["message"], r.text
    assert api.get("/api/v1/hosts/n1").status_code == 200 and api.get("/api/v1/pools/local-n1").status_code == 200
    assert api.delete("/api/v1/vms/web").status_code == 204
    assert api.delete("/api/v1/hosts/n1").status_code == 204
    assert api.get("/api/v1/pools/local-n1").status_code == 404

    assert api.post("/api/v1/hosts", json={"name": "n2", "local_pool": False, **sim}).status_code == 201
    assert api.get("/api/v1/pools/local-n2").status_code == 404
    assert api.post("/api/v1/hosts", json={"name": "n3", "local_pool": "no", **sim}).json()["field"] == "local_pool"
    assert api.get("/api/v1/hosts/n3").status_code == 404


def test_a_new_vm_that_fits_nowhere_is_refused_in_terms_of_each_host_not_of_disks_it_does_not_have(orch, api):
    """A new VM on hosts without a pool was refused with "h1: can not open the VM's disks (their pools are
    not on it)" for a VM that had no disk yet: each host is said to have no pool with room for the new
    root disk (or not to open the pool asked for), and nothing is made."""
    o = orch
    add_sim_hosts(o, 2)
    add_basics(o)
    o.catalog.create_template("disk", "tiny-linux", disk="tiny-linux")
    o.catalog.create_project("p", 8, 16384, 10)
    o.pools.create("only-h1", "local", host="h1")
    o.set_host_state("h1", HostState.disabled)
    body = {"name": "web", "project": "p", "offering": "small", "template": "disk", "start": True}
    r = api.post("/api/v1/vms", json=body)
    assert r.status_code == 409 and r.json()["field"] == "host", r.text
    message = r.json()["message"]
    assert "h2: has no pool with room for the new VM's" in message and "root disk" in message, message
    assert "can not open the VM's disks" not in message
    r = api.post("/api/v1/vms", json={**body, "pool": "only-h1"})
    assert "h2: does not open pool only-h1" in r.json()["message"], r.text
    assert api.get("/api/v1/vms").json() == []


def test_vm_show_says_its_cpu_cap_disks_group_and_whether_it_can_really_be_live_scaled(orch, api):
    """`vm show` hid the CPU cap, the disks and the group, and said `dynamic_scaling yes` of a VM whose
    offering forbids scaling: it shows each, and `live_scaling` says yes and up to what, or which switch
    (offering, template, zone setting) is off."""
    o = orch
    add_sim_hosts(o, 1)
    add_basics(o)
    o.catalog.create_template("disk", "tiny-linux", disk="tiny-linux", dynamic_scaling=True)
    o.catalog.create_offering(
        Offering("capped", OfferingKind.fixed, vcpus=2, memory_mib=1024, cpu_cap=True, cpu_speed_mhz=1200)
    )
    o.catalog.create_offering(Offering("grow", OfferingKind.fixed, vcpus=1, memory_mib=1024, dynamic_scaling=True))
    o.catalog.create_project("p", 8, 16384, 10)
    o.pools.create("local-h1", "local", host="h1")
    assert api.post("/api/v1/groups", json={"name": "web-tier", "project": "p", "policy": "anti-affinity"}).is_success
    base = {"project": "p", "template": "disk", "start": True}
    assert api.post("/api/v1/vms", json={"name": "c", "offering": "capped", "group": "web-tier", **base}).is_success
    shown = api.get("/api/v1/vms/c").json()
    assert shown["cpu_cap_percent"] == 50.0  # 1200 MHz of a 2400 MHz host CPU, per vCPU
    assert shown["group"] == "web-tier"
    assert (
        len(shown["disks"]) == 1 and shown["disks"][0].startswith("vda c-root ") and "on local-h1" in shown["disks"][0]
    )
    assert shown["dynamic_scaling"] is True  # the VM's own flag; what counts is:
    assert shown["live_scaling"].startswith("no: it started unprepared (setting enable.dynamic.scale.vm is off)")

    o.catalog.set_setting("enable.dynamic.scale.vm", "true", "zone", "z1")
    assert api.post("/api/v1/vms", json={"name": "g", "offering": "grow", **base}).is_success
    assert api.get("/api/v1/vms/g").json()["live_scaling"].startswith("yes: up to ")
    assert api.post("/api/v1/vms", json={"name": "s", "offering": "small", **base}).is_success
    said = api.get("/api/v1/vms/s").json()["live_scaling"]
    assert said.startswith("no: it started unprepared (offering dynamic_scaling is off)"), said
    assert api.post("/api/v1/vms/s/stop", json={"force": True}).status_code == 202
    assert api.get("/api/v1/vms/s").json()["live_scaling"].startswith("no: offering dynamic_scaling is off")
    listed = {v["name"]: v for v in api.get("/api/v1/vms").json()}
    assert listed["c"]["group"] == "web-tier" and listed["c"]["cpu_cap_percent"] == 50.0
    assert listed["c"]["disks"] is None and listed["c"]["live_scaling"] is None  # vm show only
