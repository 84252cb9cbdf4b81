"""Placement scope (issue 15): a VM stays in its zone, and in its cluster unless moved there explicitly.

Two zones, two clusters in z1. The hosts out of scope are the biggest and emptiest, so placement
without the scope filters would pick them: each test here fails without the fix.
"""

import pytest

from vmplane.core.errors import Conflict, InsufficientCapacity, Invalid
from vmplane.core.model import HostCapacity, HostState, Offering, OfferingKind, PlacementRequest, Size
from vmplane.core.placement import CapacityIndex, choose, explain, fit_on
from vmplane.core.scope import Scope, vm_scope

from .conftest import ledger_usage as usage

GIB = 1024


# -- pure: the zone filter and a new VM's scope ---------------------------------------------------
def host(name, zone="z1", cluster="c1", cores=16, memory=65536, state=HostState.enabled):
    return HostCapacity(name, cluster, state, cores, memory, zone=zone)


def test_the_zone_filter_keeps_placement_in_the_zone_and_says_why_others_are_refused():
    index = CapacityIndex([host("a"), host("b", zone="z2", cluster="c3", cores=64, memory=262144)])
    assert choose(index, PlacementRequest(Size(1, 512))).host == "b"  # the roomier host, unscoped
    assert choose(index, PlacementRequest(Size(1, 512), zone="z1")).host == "a"
    reasons = {r.host: (r.filter, r.reason) for r in explain(index, PlacementRequest(Size(1, 512), zone="z1"))}
    assert reasons == {"b": ("zone", "in zone z2, not z1")}
    with pytest.raises(InsufficientCapacity, match="b: in zone z2, not z1"):
        fit_on(index, PlacementRequest(Size(1, 512), zone="z1"), "b")


def test_zone_and_cluster_filters_combine_and_a_zone_without_hosts_refuses_everything():
    index = CapacityIndex([host("a"), host("k", cluster="c2", cores=32), host("s", zone="z2", cluster="c3", cores=64)])
    assert choose(index, PlacementRequest(Size(1, 512), zone="z1")).host == "k"
    assert choose(index, PlacementRequest(Size(1, 512), zone="z1", cluster="c1")).host == "a"
    with pytest.raises(InsufficientCapacity, match=r"a: in zone z1, not z9.*s: in zone z2, not z9"):
        choose(index, PlacementRequest(Size(1, 512), zone="z9"))


def test_the_zone_filter_costs_nothing_when_not_asked_and_grows_with_the_index():
    index = CapacityIndex([host(f"h{i}", zone=f"z{i % 3}") for i in range(200)])  # past the first growth
    rows = {choose(index, PlacementRequest(Size(1, 512), zone="z2")).host for _ in range(3)}
    assert all(int(name[1:]) % 3 == 2 for name in rows)


ZONES = {"z1": ["c1", "c2"], "z2": ["c3"], "empty": []}


@pytest.mark.parametrize(
    "zone,cluster,expected",
    [
        ("z1", None, Scope("z1", None)),
        ("z1", "c2", Scope("z1", "c2")),
        (None, "c3", Scope("z2", "c3")),  # the cluster says which zone
    ],
)
def test_a_new_vm_scope(zone, cluster, expected):
    assert vm_scope(ZONES, zone, cluster) == expected


def test_the_only_zone_is_the_default_and_several_zones_are_refused_naming_the_choices():
    assert vm_scope({"only": ["c"]}, None, None) == Scope("only", None)
    with pytest.raises(Invalid, match="3 zones exist; choose the VM's zone: empty, z1, z2") as refused:
        vm_scope(ZONES, None, None)
    assert refused.value.field == "zone"


def test_a_cluster_of_another_zone_or_an_unknown_name_is_refused_naming_both():
    with pytest.raises(Invalid, match="cluster c3 is in zone z2, not in zone z1") as refused:
        vm_scope(ZONES, "z1", "c3")
    assert refused.value.field == "cluster"
    with pytest.raises(Invalid, match="zone 'z9' does not exist; zones: empty, z1, z2"):
        vm_scope(ZONES, "z9", None)
    with pytest.raises(Invalid, match="cluster 'c9' does not exist"):
        vm_scope(ZONES, "z1", "c9")


# -- on sim hosts -------------------------------------------------------------------------------
@pytest.fixture
def scoped(orch):
    """z1: c1 (h1, h2: 16 cores, 64 GiB) and c2 (k1: 32 cores, 128 GiB); z2: c3 (s1: 64 cores, 256 GiB)."""
    o = orch
    o.catalog.create_cluster("c2", "z1")
    o.catalog.create_zone("z2")
    o.catalog.create_cluster("c3", "z2")
    for name, cluster, cores, memory in (
        ("h1", "c1", 16, 64),
        ("h2", "c1", 16, 64),
        ("k1", "c2", 32, 128),
        ("s1", "c3", 64, 256),
    ):
        o.add_host(name, cluster, "sim", cores, 2400, memory * GIB)
    o.catalog.create_offering(Offering("any", OfferingKind.custom_unconstrained, dynamic_scaling=True))
    o.catalog.create_template("t", "tiny-linux", True)  # live-scalable
    o.catalog.create_project("p", 256, 512 * GIB, 50)
    return o


def start_on(o, name, host, vcpus=1, memory_mib=1024, **scope):
    """Create and start `name` on `host` (the other hosts taken out of placement meanwhile)."""
    others = [h.name for h in o.hosts() if h.name != host and h.state == "enabled"]
    for h in others:
        o.set_host_state(h, HostState.disabled)
    try:
        o.create_vm(name, "p", "any", "t", vcpus=vcpus, memory_mib=memory_mib, start=True, **scope)
    finally:
        for h in others:
            o.set_host_state(h, HostState.enabled)
    assert o.vm(name).host.name == host and o.vm(name).state == "running"


def test_create_without_a_zone_is_refused_naming_the_choices_when_there_are_two(scoped, api):
    body = {"name": "w", "project": "p", "offering": "any", "template": "t", "vcpus": 1, "memory_mib": 512}
    r = api.post("/api/v1/vms", json=body)
    assert r.status_code == 422 and r.json()["field"] == "zone" and "z1, z2" in r.json()["message"], r.json()
    r = api.post("/api/v1/vms", json={**body, "zone": "z2", "cluster": "c1"})
    assert r.status_code == 422 and r.json()["field"] == "cluster"
    assert "cluster c1 is in zone z1, not in zone z2" in r.json()["message"]
    assert api.get("/api/v1/vms").json() == [] and usage(scoped, "p").vms == 0  # nothing created
    r = api.post("/api/v1/vms", json={**body, "zone": "z1", "dynamic_scaling": False})
    assert r.status_code == 201
    vm = r.json()["vm"]
    assert (vm["zone"], vm["cluster"], vm["dynamic_scaling"], vm["boot_memory_mib"]) == ("z1", None, False, None)
    assert "dynamically_scalable" not in vm


def test_start_places_within_the_vm_zone_and_its_pinned_cluster(scoped, api):
    o = scoped
    o.create_vm("inzone", "p", "any", "t", vcpus=1, memory_mib=1024, zone="z1", start=True)
    assert o.vm("inzone").host.name == "k1"  # the roomiest of z1, not s1 of z2
    o.create_vm("pinned", "p", "any", "t", vcpus=1, memory_mib=1024, cluster="c1", start=True)
    assert o.vm("pinned").host.name in ("h1", "h2")
    vm = api.get("/api/v1/vms/pinned").json()
    assert (vm["zone"], vm["cluster"], vm["boot_memory_mib"]) == ("z1", "c1", 1024)
    o.stop_vm("pinned")
    for h in ("h1", "h2"):
        o.set_host_state(h, HostState.disabled)
    with pytest.raises(InsufficientCapacity, match="k1: in cluster c2, not c1") as refused:
        o.start_vm("pinned")  # restart: still in its cluster, or nowhere
    assert "s1: in zone z2, not z1" in refused.value.message
    assert o.vm("pinned").state == "stopped" and o.audit() == []


def test_migrate_without_a_target_stays_in_the_source_cluster(scoped):
    o = scoped
    start_on(o, "w", "h1", zone="z1")  # unpinned: any cluster of z1
    plan = o.migrator.migrate("w", dry_run=True)
    assert plan["target"] == "h2"  # not k1 (c2) nor s1 (z2), though roomier
    done = o.migrator.migrate("w")
    assert o.migrator.get(done["id"])["state"] == "succeeded" and o.vm("w").host.name == "h2"
    o.set_host_state("h1", HostState.disabled)
    with pytest.raises(InsufficientCapacity, match="k1: in cluster c2, not c1"):
        o.migrator.migrate("w", dry_run=True)  # nowhere else in c1: refused, not moved out
    assert o.vm("w").host.name == "h2" and o.audit() == []


def test_the_drain_plan_and_the_drain_stay_in_the_source_cluster(scoped):
    o = scoped
    start_on(o, "a", "h1", zone="z1")
    start_on(o, "b", "h1", zone="z1", memory_mib=2048)
    plan = o.maintenance.enter("h1", dry_run=True)
    assert {m["target"] for m in plan["migrations"]} == {"h2"} and plan["unplaceable"] == []
    result = o.maintenance.enter("h1")
    assert {m["target"] for m in result["migrations"]} == {"h2"}
    assert {o.vm(n).host.name for n in ("a", "b")} == {"h2"} and o.audit() == []


def test_the_auto_migration_of_a_scale_stays_in_the_source_cluster(scoped):
    o = scoped
    o.catalog.set_setting("enable.dynamic.scale.vm", "true", "zone", "z1")
    start_on(o, "filler", "h1", vcpus=15, zone="z1")
    start_on(o, "v", "h1", vcpus=1, zone="z1")  # h1 is full: 16 of 16 vCPUs
    plan = o.scaler.scale("v", vcpus=2, dry_run=True)
    assert plan["path"] == "migrate-then-scale" and plan["migrate_to"] == "h2"
    result = o.scaler.scale("v", vcpus=2)
    assert o.operation(result["operation_id"]).state == "succeeded"
    assert (o.vm("v").host.name, o.vm("v").vcpus) == ("h2", 2) and o.audit() == []


def test_an_explicit_target_in_another_cluster_of_the_zone_is_allowed_and_the_pin_follows(scoped, api):
    o = scoped
    start_on(o, "w", "h1", cluster="c1")
    mig = o.migrator.migrate("w", to="k1")
    assert o.migrator.get(mig["id"])["state"] == "succeeded" and o.vm("w").host.name == "k1"
    assert api.get("/api/v1/vms/w").json()["cluster"] == "c2"  # pinned to where it now runs
    with pytest.raises(InsufficientCapacity, match="h2: in cluster c1, not c2"):
        o.migrator.migrate("w", dry_run=True)  # c2 has no other host: it stays in c2
    start_on(o, "u", "h2", zone="z1")
    o.migrator.migrate("u", to="k1")
    assert o.vm("u").host.name == "k1" and o.vm("u").cluster is None and o.audit() == []


def test_an_explicit_target_in_another_zone_is_refused_and_nothing_changes(scoped, api):
    o = scoped
    start_on(o, "w", "h1", zone="z1")
    before = {h.name: (h.used_vcpus, h.used_memory_mib) for h in o.hosts()}
    with pytest.raises(Invalid, match="host s1 is in zone z2; vm w belongs to zone z1") as refused:
        o.migrator.migrate("w", to="s1")
    assert refused.value.field == "to"
    r = api.post("/api/v1/vms/w/migrate", json={"to": "s1", "dry_run": True})
    assert r.status_code == 422 and r.json()["field"] == "to" and "zone z2" in r.json()["message"]
    r = api.post("/api/v1/vms/w/migrate", json={"to": "s1"})
    assert r.status_code == 422
    vm = o.vm("w")
    assert (vm.host.name, vm.state) == ("h1", "running")
    assert {h.name: (h.used_vcpus, h.used_memory_mib) for h in o.hosts()} == before  # no claim left on s1
    assert o.host_capacity("s1").used_vcpus == 0 and o.migrator.list(vm="w") == [] and o.audit() == []


def test_a_scale_refused_by_a_setting_names_the_scope_it_was_read_from(scoped):
    o = scoped
    o.catalog.set_setting("enable.dynamic.scale.vm", "true", "zone", "z1")
    o.create_vm("nd", "p", "any", "t", vcpus=1, memory_mib=1024, zone="z2", start=True)
    with pytest.raises(
        Conflict,
        match=r"setting enable.dynamic.scale.vm is false in zone z2 \(host s1; the "
        r"default\)",
    ):
        o.scaler.scale("nd", vcpus=2)
    o.catalog.set_setting("enable.dynamic.scale.vm", "false")
    with pytest.raises(Conflict, match=r"is false in zone z2 \(host s1; inherited from global\)"):
        o.scaler.scale("nd", vcpus=2, dry_run=True)


def test_memory_below_the_boot_size_is_refused_in_the_dry_run_and_at_admission(scoped):
    o = scoped
    o.catalog.set_setting("enable.dynamic.scale.vm", "true", "zone", "z1")
    o.create_vm("cx", "p", "any", "t", vcpus=1, memory_mib=512, zone="z1", start=True)
    assert o.vm("cx").boot_memory_mib == 512
    words = (
        "memory 256 MiB is below the 512 MiB vm cx booted with; it can not be released live "
        r"\(stop the VM to resize it\)"
    )
    with pytest.raises(Conflict, match=words) as refused:
        o.scaler.scale("cx", memory_mib=256, dry_run=True)
    assert refused.value.field == "memory_mib"
    before = usage(o, "p")
    with pytest.raises(Conflict, match=words):
        o.scaler.scale("cx", memory_mib=256)
    assert o.vm("cx").memory_mib == 512 and o.vm("cx").state == "running" and usage(o, "p") == before
    up = o.operation(o.scaler.scale("cx", memory_mib=1024)["operation_id"])
    down = o.operation(o.scaler.scale("cx", memory_mib=512)["operation_id"])  # back to the boot size: fine
    assert up.state == down.state == "succeeded", (up.message, down.message)
    assert "memory dimm" in up.message and "memory dimm-unplug" in down.message  # libvirt's words
    assert o.vm("cx").memory_mib == 512 and o.audit() == []


def test_repeated_commands_whose_goal_holds_answer_409(scoped, api):
    o = scoped
    start_on(o, "w", "h1", zone="z1")
    r = api.post("/api/v1/hosts/h2/maintenance", json={"action": "enter"})
    assert r.status_code == 200
    for body in ({"action": "enter"}, {"action": "enter", "dry_run": True}):
        r = api.post("/api/v1/hosts/h2/maintenance", json=body)
        assert r.status_code == 409 and r.json()["error"] == "conflict"
        assert r.json()["message"] == "host h2 is already in maintenance"
    assert api.post("/api/v1/hosts/h2/maintenance", json={"action": "exit"}).status_code == 200
    r = api.post("/api/v1/hosts/h2/maintenance", json={"action": "exit"})
    assert r.status_code == 409 and r.json()["error"] == "conflict" and "already enabled" in r.json()["message"]
    o.catalog.set_setting("enable.dynamic.scale.vm", "true", "zone", "z1")
    r = api.post("/api/v1/vms/w/scale", json={"vcpus": 1})
    assert r.status_code == 409 and r.json()["error"] == "conflict" and "nothing to change" in r.json()["message"]


def test_a_second_enter_names_the_vms_a_drain_left_behind(scoped):
    o = scoped
    start_on(o, "small", "h2", zone="z1")
    start_on(o, "big", "h1", vcpus=16, zone="z1")  # fits nowhere else in c1
    result = o.maintenance.enter("h1")
    assert [u["vm"] for u in result["unplaceable"]] == ["big"]
    with pytest.raises(
        Conflict,
        match="already in maintenance; 1 VM\\(s\\) still run on it \\(big\\): exit and enter maintenance again",
    ):
        o.maintenance.enter("h1")
