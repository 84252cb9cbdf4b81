"""Placement groups: the pure rule (groups.py), placement with it, and groups through the orchestrator and API."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import update

from vmplane.core.errors import Conflict, InsufficientCapacity, NotFound
from vmplane.core.groups import AFFINITY, ANTI_AFFINITY, GroupRule, breaks, preference, refusal
from vmplane.core.model import HostCapacity, HostState, PlacementRequest, Size
from vmplane.core.placement import CapacityIndex, choose, explain
from vmplane.store import groupstore
from vmplane.store.schema import Vm

from .conftest import add_basics, add_sim_hosts

HOSTS = ["h1", "h2", "h3", "h4"]


@st.composite
def rules(draw):
    placed = draw(
        st.lists(
            st.tuples(st.sampled_from(["a", "b", "c", "d", "e"]), st.sampled_from(HOSTS)),
            max_size=5,
            unique_by=lambda p: p[0],
        )
    )
    return GroupRule("g", draw(st.sampled_from([AFFINITY, ANTI_AFFINITY])), draw(st.booleans()), tuple(placed))


@settings(max_examples=500, deadline=None)
@given(rules(), st.sampled_from(HOSTS))
def test_the_rule_refuses_exactly_the_hosts_that_break_a_hard_policy(rule, host):
    on_host = [vm for vm, h in rule.placed if h == host]
    broken = bool(on_host) if rule.policy == ANTI_AFFINITY else bool(rule.placed) and not on_host
    assert (breaks(rule, host) is not None) == broken
    assert (refusal(rule, host) is not None) == (broken and rule.hard)  # soft never refuses
    score = preference(rule, host)
    assert 0 <= score <= 1
    if rule.hard or (not broken and rule.policy == ANTI_AFFINITY):
        assert score == 1
    # a soft group prefers a host that keeps it over one that breaks it
    others = [preference(rule, h) for h in HOSTS if breaks(rule, h) is None]
    if not rule.hard and broken and others:
        assert score < max(others)


def test_refusals_name_the_group_and_the_members():
    anti = GroupRule("web", ANTI_AFFINITY, True, (("web-1", "h2"), ("web-2", "h3")))
    assert refusal(anti, "h2") == "anti-affinity group web already has web-1 on h2"
    assert refusal(anti, "h1") is None
    aff = GroupRule("db", AFFINITY, True, (("db-1", "h1"),))
    assert refusal(aff, "h2") == "affinity group db has its VMs elsewhere (db-1 on h1)"
    assert refusal(GroupRule("db", AFFINITY, True, ()), "h2") is None  # no member placed: any host


def _host(name):
    return HostCapacity(name, "c1", HostState.enabled, 16, 65536)


def test_placement_filters_hard_groups_and_weighs_soft_ones():
    index = CapacityIndex([_host(h) for h in ("h1", "h2", "h3")])
    anti = GroupRule("web", ANTI_AFFINITY, True, (("web-1", "h1"), ("web-2", "h2"), ("web-3", "h3")))
    request = PlacementRequest(Size(1, 512), group=anti)
    with pytest.raises(InsufficientCapacity, match="anti-affinity group web already has web-1 on h1"):
        choose(index, request)
    assert [r.filter for r in explain(index, request)] == ["group"] * 3
    soft = GroupRule("web", ANTI_AFFINITY, False, (("web-1", "h1"), ("web-2", "h2")))
    index.add_usage("h3", 8, 30000)  # h3 is the most loaded, but the only one without a member
    assert choose(index, PlacementRequest(Size(1, 512), group=soft)).host == "h3"


# -- through the orchestrator ---------------------------------------------------------------------------
@pytest.fixture
def cluster(orch):
    add_sim_hosts(orch, 3)
    add_basics(orch)
    orch.catalog.create_project("a", 64, 262144, 50)
    orch.catalog.create_project("b", 64, 262144, 50)
    return orch


def _in_group(orch, vm: str, group: str, project: str = "a") -> None:
    """A stopped VM joins a group (what `vm create --group` records)."""
    with orch.db.transaction() as conn:
        gid = groupstore.resolve_group(conn, group, orch.catalog.project(project).id)
        conn.execute(update(Vm.__table__).where(Vm.__table__.c.name == vm).values(group_id=gid))


def _start_members(orch, group: str, count: int, project: str = "a") -> list[str]:
    hosts = []
    for i in range(1, count + 1):
        orch.create_vm(f"{group}-{i}", project, "small", "tiny")
        _in_group(orch, f"{group}-{i}", group, project)
        orch.start_vm(f"{group}-{i}")
        hosts.append(orch.vm(f"{group}-{i}").host.name)
    return hosts


def test_hard_anti_affinity_refuses_the_fourth_vm_on_three_hosts_naming_the_group(cluster):
    groupstore.create(cluster.db, "web", "a", ANTI_AFFINITY, hard=True)
    assert sorted(_start_members(cluster, "web", 3)) == ["h1", "h2", "h3"]
    cluster.create_vm("web-4", "a", "small", "tiny")
    _in_group(cluster, "web-4", "web")
    with pytest.raises(InsufficientCapacity) as exc:
        cluster.start_vm("web-4")
    assert "anti-affinity group web already has web-1 on" in exc.value.message
    assert cluster.vm("web-4").state == "stopped"
    # a migration keeps it too: no other host is free of the group
    with pytest.raises(InsufficientCapacity, match="anti-affinity group web"):
        cluster.migrator.migrate("web-1")


def test_soft_anti_affinity_spreads_first_then_places_anyway(cluster):
    cluster.catalog.set_setting("vmplane.placement.strategy", "pack", "cluster", "c1")  # packing would co-locate
    groupstore.create(cluster.db, "web", "a", ANTI_AFFINITY, hard=False)
    hosts = _start_members(cluster, "web", 4)
    assert sorted(hosts[:3]) == ["h1", "h2", "h3"] and hosts[3] in hosts[:3]


def test_affinity_co_locates_and_refuses_when_its_host_is_full(cluster):
    groupstore.create(cluster.db, "db", "a", AFFINITY, hard=True)
    hosts = _start_members(cluster, "db", 3)  # spread would use three hosts
    assert len(set(hosts)) == 1
    for i, vcpus in enumerate((14, 14, 13)):  # the other hosts, then the group's host, full
        cluster.create_vm(f"filler-{i}", "b", "any", "tiny", vcpus=vcpus, memory_mib=1024, start=True)
    assert cluster.host_capacity(hosts[0]).used_vcpus == 16
    cluster.create_vm("db-4", "a", "small", "tiny")
    _in_group(cluster, "db-4", "db")
    with pytest.raises(InsufficientCapacity) as exc:
        cluster.start_vm("db-4")
    assert f"affinity group db has its VMs elsewhere (db-1, db-2, db-3 on {hosts[0]})" in exc.value.message
    assert f"{hosts[0]}: vcpus 16 of 16 allocated" in exc.value.message
    show = groupstore.show(cluster.db, "db")
    assert {p["host"] for p in show["placed"]} == {hosts[0]} and show["vms"] == ["db-1", "db-2", "db-3", "db-4"]


def test_a_group_with_vms_can_not_be_deleted_naming_them(cluster):
    groupstore.create(cluster.db, "web", "a", ANTI_AFFINITY)
    _start_members(cluster, "web", 2)
    with pytest.raises(Conflict, match="group web still has VMs: web-1, web-2"):
        groupstore.delete(cluster.db, "web")
    for vm in ("web-1", "web-2"):
        cluster.stop_vm(vm)
        cluster.delete_vm(vm)
    groupstore.delete(cluster.db, "web")
    assert groupstore.rows(cluster.db) == []


def test_a_vm_can_not_join_another_projects_group(cluster):
    groupstore.create(cluster.db, "gb", "b", ANTI_AFFINITY)
    with cluster.db.transaction() as conn, pytest.raises(NotFound) as exc:
        groupstore.resolve_group(conn, "gb", cluster.catalog.project("a").id)
    assert exc.value.field == "group" and exc.value.status == 404


def test_members_see_and_use_their_own_projects_groups_only(cluster, api):
    tokens = {
        p: api.post("/api/v1/tokens", json={"name": f"m-{p}", "role": "member", "project": p}).json()["token"]
        for p in ("a", "b")
    }
    as_a = {"Authorization": f"Bearer {tokens['a']}"}
    r = api.post(
        "/api/v1/groups",
        json={"name": "gb", "project": "b", "policy": "anti-affinity"},
        headers={"Authorization": f"Bearer {tokens['b']}"},
    )
    assert r.status_code == 201 and r.json()["rule"] == "anti-affinity (hard)"
    r = api.post(
        "/api/v1/groups", json={"name": "ga", "project": "a", "policy": "affinity", "hard": False}, headers=as_a
    )
    assert r.status_code == 201 and r.json()["rule"] == "affinity (soft)"
    assert [g["name"] for g in api.get("/api/v1/groups", headers=as_a).json()] == ["ga"]
    assert [g["name"] for g in api.get("/api/v1/groups").json()] == ["ga", "gb"]  # admin: all
    assert api.get("/api/v1/groups/gb", headers=as_a).status_code == 404
    assert api.delete("/api/v1/groups/gb", headers=as_a).status_code == 404
    r = api.post("/api/v1/groups", json={"name": "sneaky", "project": "b", "policy": "affinity"}, headers=as_a)
    assert r.status_code == 404 and r.json()["field"] == "project"
    r = api.post("/api/v1/groups", json={"name": "x", "project": "a", "policy": "together"}, headers=as_a)
    assert r.status_code == 422
    assert api.get("/api/v1/groups/gb").json()["project"] == "b"
    assert api.delete("/api/v1/groups/ga", headers=as_a).status_code == 204


def _force_state(o, host: str, state) -> None:
    """A host state only the monitor and HA set (an operator's set_host_state refuses it)."""
    from dataclasses import replace

    from vmplane.store import ledger as L

    with o.db.transaction() as conn:
        L.set_host_state(conn, host, state)
    o.index.upsert(replace(o.index.host(host), state=state))


def test_members_on_a_failed_host_do_not_hold_the_group(cluster):
    from vmplane.core.model import HostState

    groupstore.create(cluster.db, "db", "a", AFFINITY, hard=True)
    hosts = _start_members(cluster, "db", 2)
    _force_state(cluster, hosts[0], HostState.fenced)  # as HA records it
    with cluster.db.transaction() as conn:
        gid = groupstore.resolve_group(conn, "db", cluster.catalog.project("a").id)
        assert groupstore.group_rule_for(conn, group_id=gid).placed == ()  # restarts may go anywhere
    _force_state(cluster, hosts[0], HostState.enabled)
    with cluster.db.transaction() as conn:
        vm_id = cluster.vm("db-1").id
        assert groupstore.group_rule_for(conn, vm_id=vm_id).placed == (("db-2", hosts[0]),)  # itself left out


@settings(max_examples=200, deadline=None)
@given(rules())
def test_the_soft_group_weigher_is_groups_preference_for_every_host(rule):
    from vmplane.core.placement import _group_score, demand_for

    index = CapacityIndex([_host(h) for h in HOSTS])
    request = PlacementRequest(Size(1, 512), group=rule)
    got = _group_score(index, request, demand_for(index, request))
    want = [preference(rule, h) for h in HOSTS]
    if got is None:  # no preference: every host the same
        assert len(set(want)) == 1
    else:
        assert list(got) == pytest.approx(want)


@settings(max_examples=200, deadline=None)
@given(rules())
def test_the_group_filter_refuses_exactly_what_groups_refusal_refuses(rule):
    index = CapacityIndex([_host(h) for h in HOSTS])
    refused = {r.host: r.reason for r in explain(index, PlacementRequest(Size(1, 512), group=rule))}
    assert refused == {h: refusal(rule, h) for h in HOSTS if refusal(rule, h) is not None}
