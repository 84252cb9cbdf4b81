"""Bad input gets a 4xx with {"error", "message", "field"} and changes nothing."""

import pytest

from .conftest import add_basics, add_sim_hosts


@pytest.fixture
def setup(orch, api):
    add_sim_hosts(orch, 2)
    add_basics(orch)
    orch.catalog.create_project("p", 8, 16384, 10)
    return api


def snapshot(api):
    return {
        noun: api.get(f"/api/v1/{noun}").json()
        for noun in ("zones", "clusters", "hosts", "projects", "offerings", "templates", "vms")
    }


def assert_error(r, status, field=None, words=()):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) <= {"error", "message", "field"} and body["error"] and body["message"]
    if field is not None:
        assert body.get("field") == field, body
    for w in words:
        assert w in body["message"], body


VM = {"name": "v1", "project": "p", "offering": "small", "template": "tiny"}

BAD_REQUESTS = [
    # (method, path, body, status, field, words)
    ("post", "/vms", {**VM, "offering": "nope"}, 404, "offering", ["nope"]),
    ("post", "/vms", {**VM, "template": "nope"}, 404, "template", []),
    ("post", "/vms", {**VM, "project": "nope"}, 404, "project", []),
    ("post", "/vms", {**VM, "offering": "ranged", "vcpus": 0, "memory_mib": 512}, 422, "vcpus", []),
    ("post", "/vms", {**VM, "offering": "ranged", "vcpus": -2, "memory_mib": 512}, 422, "vcpus", []),
    ("post", "/vms", {**VM, "offering": "ranged", "vcpus": 2, "memory_mib": 0}, 422, "memory_mib", []),
    ("post", "/vms", {**VM, "offering": "ranged", "vcpus": 2, "memory_mib": "16GB"}, 422, "memory_mib", []),
    ("post", "/vms", {**VM, "offering": "ranged", "vcpus": 9, "memory_mib": 512}, 422, "vcpus", ["1..4"]),
    ("post", "/vms", {**VM, "offering": "ranged", "vcpus": 2, "memory_mib": 9000}, 422, "memory_mib", ["256..8192"]),
    ("post", "/vms", {**VM, "offering": "small", "vcpus": 3}, 422, "vcpus", ["fixed"]),
    ("post", "/vms", {"name": "v1", "project": "p", "template": "tiny"}, 422, "offering", ["required"]),
    ("post", "/vms", {**VM, "name": "Bad Name!"}, 422, "name", []),
    ("post", "/vms", {**VM, "name": "../etc"}, 422, "name", []),
    ("post", "/vms", {**VM, "colour": "red"}, 422, "colour", ["unknown field"]),
    ("post", "/projects", {"name": "p", "vcpus": 1, "memory_mib": 1}, 409, "name", ["already exists"]),
    ("post", "/projects", {"name": "p2", "vcpus": -1, "memory_mib": 1}, 422, "vcpus", []),
    ("post", "/projects", {"name": "p2", "vcpus": 1}, 422, "memory_mib", ["required"]),
    ("post", "/offerings", {"name": "small", "kind": "fixed", "vcpus": 1, "memory_mib": 1}, 409, "name", []),
    ("post", "/offerings", {"name": "o2", "kind": "fixed", "vcpus": 1}, 422, "memory_mib", []),
    ("post", "/offerings", {"name": "o2", "kind": "huge"}, 422, "kind", []),
    (
        "post",
        "/offerings",
        {
            "name": "o2",
            "kind": "custom-constrained",
            "min_vcpus": 4,
            "max_vcpus": 2,
            "min_memory_mib": 1,
            "max_memory_mib": 2,
        },
        422,
        "min_vcpus",
        [],
    ),
    ("post", "/templates", {"name": "t2", "image": "<x/>"}, 422, "image", []),
    ("post", "/hosts", {"name": "h1", "cluster": "c1", "cores": 1, "cpu_mhz": 1, "memory_mib": 1}, 409, "name", []),
    (
        "post",
        "/hosts",
        {"name": "h9", "cluster": "nope", "cores": 1, "cpu_mhz": 1, "memory_mib": 1},
        404,
        "cluster",
        [],
    ),
    ("post", "/hosts", {"name": "h9", "cluster": "c1", "cores": 0, "cpu_mhz": 1, "memory_mib": 1}, 422, "cores", []),
    ("post", "/hosts", {"name": "h9", "cluster": "c1", "cpu_mhz": 1, "memory_mib": 1}, 422, "cores", []),
    ("post", "/clusters", {"name": "c2", "zone": "nope"}, 404, "zone", []),
    ("put", "/settings/cpu.overprovisioning.factor", {"value": "-1"}, 422, "value", []),
    ("put", "/settings/no.such.key", {"value": "1"}, 404, "key", []),
    (
        "put",
        "/settings/enable.dynamic.scale.vm",
        {"value": "true", "scope": "cluster", "scope_name": "c1"},
        422,
        "scope",
        [],
    ),
    (
        "put",
        "/settings/cpu.overprovisioning.factor",
        {"value": "2", "scope": "cluster", "scope_name": "nope"},
        404,
        "cluster",
        [],
    ),
    ("patch", "/projects/p/quota", {"vcpus": -1}, 422, "vcpus", []),
    ("patch", "/projects/nope/quota", {"vcpus": 1}, 404, "project", []),
    ("post", "/vms/nope/start", None, 404, "vm", []),
    ("get", "/operations/nope", None, 404, "operation", []),
]


@pytest.mark.parametrize(
    "method,path,body,status,field,words",
    BAD_REQUESTS,
    ids=[f"{m} {p} {status}-{f}" for m, p, _, status, f, _ in BAD_REQUESTS],
)
def test_bad_input_is_refused_and_changes_nothing(setup, method, path, body, status, field, words):
    before = snapshot(setup)
    kwargs = {"json": body} if body is not None else {}
    r = getattr(setup, method)(f"/api/v1{path}", **kwargs)
    assert_error(r, status, field, words)
    assert snapshot(setup) == before


def test_malformed_json_is_a_422(setup):
    r = setup.post("/api/v1/vms", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(r, 422, None, ["JSON"])


def test_quota_refusal_is_409_naming_the_resource_and_nothing_is_created(setup):
    setup.post("/api/v1/projects", json={"name": "tight", "vcpus": 1, "memory_mib": 65536})
    before = snapshot(setup)
    r = setup.post("/api/v1/vms", json={**VM, "project": "tight", "offering": "large", "start": True})
    assert_error(r, 409, "vcpus", ["vcpus quota exceeded", "used", "asked"])
    assert snapshot(setup) == before


def test_lowering_quota_below_usage_names_resource_used_and_asked(setup):
    r = setup.post("/api/v1/vms", json={**VM, "start": True})
    assert r.status_code == 202
    r = setup.patch("/api/v1/projects/p/quota", json={"memory_mib": 100})
    assert_error(r, 409, "memory_mib", ["used 1024", "asked 100"])
    assert setup.get("/api/v1/projects/p").json()["quota"]["memory_mib"] == 16384


def test_no_host_with_room_is_409_naming_hosts_and_numbers(setup):
    setup.patch("/api/v1/projects/p/quota", json={"vcpus": 100})
    r = setup.post("/api/v1/vms", json={**VM, "offering": "any", "vcpus": 32, "memory_mib": 1024, "start": True})
    assert_error(r, 409, "host", ["h1: vcpus 0 of 16 allocated, 32 needed"])
    assert setup.get("/api/v1/vms").json() == []


def test_every_call_needs_a_valid_bearer_token(orch, api):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}):
        r = api.get("/api/v1/vms", headers={**headers} if headers else {"Authorization": ""})
        assert r.status_code == 401 and r.json()["error"] == "unauthorized"


def test_a_member_token_cannot_use_admin_endpoints_or_other_projects(setup, orch):
    setup.post("/api/v1/projects", json={"name": "other", "vcpus": 4, "memory_mib": 8192})
    setup.post("/api/v1/vms", json={**VM, "name": "theirs", "project": "other"})
    token = setup.post("/api/v1/tokens", json={"name": "m1", "role": "member", "project": "p"}).json()["token"]
    member = {"Authorization": f"Bearer {token}"}
    assert setup.post("/api/v1/zones", json={"name": "z9"}, headers=member).status_code == 403
    assert setup.get("/api/v1/hosts", headers=member).status_code == 403
    assert setup.get("/api/v1/vms/theirs", headers=member).status_code == 404
    assert setup.post("/api/v1/vms/theirs/start", headers=member).status_code == 404
    assert setup.get("/api/v1/vms", headers=member).json() == []
    r = setup.post("/api/v1/vms", json={**VM, "name": "mine"}, headers=member)
    assert r.status_code == 201, r.text
    assert [v["name"] for v in setup.get("/api/v1/vms", headers=member).json()] == ["mine"]


def test_a_second_vm_with_the_same_name_is_409_and_the_ledger_is_unchanged(setup):
    assert setup.post("/api/v1/vms", json=VM).status_code == 201
    before = setup.get("/api/v1/projects/p/usage").json()
    r = setup.post("/api/v1/vms", json={**VM, "start": True})
    assert_error(r, 409, "name", ["already exists"])
    assert setup.get("/api/v1/projects/p/usage").json() == before


def test_metrics_count_admissions_and_refusals(setup):
    setup.post("/api/v1/vms", json={**VM, "start": True})
    setup.post(
        "/api/v1/vms", json={**VM, "name": "big", "offering": "any", "vcpus": 64, "memory_mib": 512, "start": True}
    )
    text = setup.get("/metrics").text
    assert 'vmplane_admissions_total{result="admitted"}' in text
    assert 'vmplane_admissions_total{result="quota_exceeded"}' in text
    assert 'vmplane_operations_total{kind="start",state="succeeded"}' in text


def test_a_nul_character_in_a_query_or_path_is_422_on_every_store(setup):
    """PostgreSQL refuses NUL in text (a 500 once, found by the hostile-input test on `?cluster=%00`):
    refused at the edge, naming the parameter, on SQLite too."""
    assert_error(setup.get("/api/v1/hosts?cluster=%00"), 422, "cluster", ["NUL"])
    assert_error(setup.get("/api/v1/vms?project=p%00q"), 422, "project", ["NUL"])
    r = setup.get("/api/v1/vms/a%00b")
    assert r.status_code == 422 and "NUL" in r.json()["message"], r.text
