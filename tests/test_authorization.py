"""Who may do what: admin vs project member, over every endpoint, and tenants kept apart."""

import pytest

from vmplane.core.model import Offering, OfferingKind

from .conftest import ADMIN_TOKEN, add_sim_hosts

# every /api/v1 route is one of these; a new route must be classified here or the test fails
ADMIN_ONLY = {
    ("POST", "/backup-stores"),
    ("DELETE", "/backup-stores/{name}"),
    ("POST", "/zones"),
    ("GET", "/zones"),
    ("POST", "/clusters"),
    ("GET", "/clusters"),
    ("POST", "/hosts"),
    ("GET", "/hosts"),
    ("GET", "/hosts/{name}"),
    ("POST", "/hosts/{name}/maintenance"),
    ("POST", "/projects"),
    ("PATCH", "/projects/{name}/quota"),
    ("POST", "/offerings"),
    ("POST", "/templates"),
    ("GET", "/settings"),
    ("GET", "/settings/{key}"),
    ("PUT", "/settings/{key}"),
    ("GET", "/audit"),
    ("POST", "/tokens"),
    ("GET", "/controllers"),
    ("DELETE", "/settings/{key}"),
    ("DELETE", "/projects/{name}"),
    ("DELETE", "/offerings/{name}"),
    ("POST", "/offerings/{name}/retire"),
    ("DELETE", "/templates/{name}"),
    ("POST", "/templates/{name}/retire"),
    ("POST", "/images/{name}"),
    ("GET", "/images"),
    ("GET", "/images/{name}"),
    ("DELETE", "/images/{name}"),
    ("DELETE", "/zones/{name}"),
    ("DELETE", "/clusters/{name}"),
    ("DELETE", "/hosts/{name}"),
    ("POST", "/pools"),
    ("GET", "/pools"),
    ("GET", "/pools/{name}"),
    ("DELETE", "/pools/{name}"),
    ("GET", "/clusters/{name}"),
    ("PATCH", "/clusters/{name}"),
    ("POST", "/hosts/{name}/fence"),
    ("PUT", "/hosts/{name}/fence-agents"),
    ("POST", "/hosts/{name}/fail"),
    ("POST", "/hosts/{name}/recover"),
    ("GET", "/hosts/{name}/stats"),
}
MEMBER_SCOPED = {
    ("GET", "/projects"),
    ("GET", "/projects/{name}"),
    ("GET", "/projects/{name}/usage"),
    ("GET", "/offerings"),
    ("GET", "/offerings/{name}"),
    ("GET", "/templates"),
    ("GET", "/templates/{name}"),
    ("POST", "/vms"),
    ("GET", "/vms"),
    ("GET", "/vms/{name}"),
    ("POST", "/vms/{name}/start"),
    ("POST", "/vms/{name}/stop"),
    ("POST", "/vms/{name}/reboot"),
    ("DELETE", "/vms/{name}"),
    ("POST", "/vms/{name}/exec"),
    ("POST", "/vms/{name}/console/ticket"),
    ("POST", "/vms/{name}/snapshots"),
    ("GET", "/vms/{name}/snapshots"),
    ("GET", "/vms/{name}/stats"),
    ("POST", "/vms/{name}/snapshots/{snapshot}/revert"),
    ("DELETE", "/vms/{name}/snapshots/{snapshot}"),
    ("POST", "/vms/{name}/clone"),
    ("GET", "/backup-stores"),
    ("POST", "/vms/{name}/backups"),
    ("POST", "/vms/{name}/backups/prune"),
    ("PUT", "/vms/{name}/backup-schedule"),
    ("DELETE", "/vms/{name}/backup-schedule"),
    ("PUT", "/projects/{name}/backup-schedule"),
    ("DELETE", "/projects/{name}/backup-schedule"),
    ("GET", "/backup-schedules"),
    ("GET", "/backups"),
    ("GET", "/backups/{backup_id}"),
    ("POST", "/backups/{backup_id}/verify"),
    ("POST", "/backups/{backup_id}/restore"),
    ("DELETE", "/backups/{backup_id}"),
    ("POST", "/vms/{name}/migrate"),
    ("POST", "/vms/{name}/migrate/cancel"),
    ("PATCH", "/vms/{name}"),
    ("POST", "/vms/{name}/scale"),
    ("POST", "/vms/{name}/sync"),
    ("GET", "/migrations"),
    ("GET", "/migrations/{migration_id}"),
    ("GET", "/operations"),
    ("GET", "/operations/{op_id}"),
    ("GET", "/tokens"),
    ("DELETE", "/tokens/{name}"),
    ("GET", "/events"),
    ("GET", "/recovery"),
    ("POST", "/volumes"),
    ("GET", "/volumes"),
    ("GET", "/volumes/{name}"),
    ("DELETE", "/volumes/{name}"),
    ("POST", "/volumes/{name}/attach"),
    ("POST", "/volumes/{name}/detach"),
    ("POST", "/volumes/{name}/resize"),
    ("POST", "/volumes/{name}/move"),
    ("POST", "/groups"),
    ("GET", "/groups"),
    ("GET", "/groups/{name}"),
    ("DELETE", "/groups/{name}"),
    # networks: a member's own project's (a provider network's create and delete are an admin's: 403)
    ("POST", "/networks"),
    ("GET", "/networks"),
    ("GET", "/networks/{name}"),
    ("DELETE", "/networks/{name}"),
    ("POST", "/secgroups"),
    ("GET", "/secgroups"),
    ("GET", "/secgroups/{project}/{name}"),
    ("DELETE", "/secgroups/{project}/{name}"),
    ("POST", "/secgroups/{project}/{name}/rules"),
    ("DELETE", "/secgroups/{project}/{name}/rules/{rule_id}"),
    ("POST", "/vms/{name}/secgroups"),
    ("DELETE", "/vms/{name}/secgroups/{group}"),
    ("POST", "/vms/{name}/nics"),
    ("POST", "/projects/{name}/keys"),
    ("GET", "/projects/{name}/keys"),
    ("DELETE", "/projects/{name}/keys/{key}"),
    ("DELETE", "/vms/{name}/nics/{mac}"),
}


@pytest.fixture
def tenants(orch, api):
    return make_tenants(orch, api)


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """One cluster for the refusal matrices (each request is refused and changes nothing, which each test
    checks): a fresh cluster per route cost the suite more than the routes themselves."""
    from fastapi.testclient import TestClient

    from vmplane.server import create_app
    from vmplane.store import Database

    from .conftest import _orchestrator
    from .stores import store_url

    database = Database(store_url(tmp_path_factory.mktemp("refusals"), migrated=True))
    database.migrate()
    made = _orchestrator(database)
    orch = next(made)
    orch.catalog.ensure_admin_token("admin", ADMIN_TOKEN)
    with TestClient(create_app(orch), headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as api:
        yield make_tenants(orch, api)
    made.close()
    database.dispose()


def make_tenants(orch, api):
    add_sim_hosts(orch, 2)
    orch.catalog.set_setting("enable.dynamic.scale.vm", "true", "zone", "z1")
    orch.catalog.create_offering(Offering("o", OfferingKind.fixed, vcpus=1, memory_mib=512, dynamic_scaling=True))
    orch.catalog.create_offering(Offering("o2", OfferingKind.fixed, vcpus=2, memory_mib=1024, dynamic_scaling=True))
    orch.catalog.create_template("t", "tiny-linux", dynamic_scaling=True)
    orch.pools.create("s", "shared", cluster="c1")
    for project in ("a", "b"):
        orch.catalog.create_project(project, 8, 16384, 10)
        orch.create_vm(f"{project}-run", project, "o", "t", start=True)
        orch.create_vm(f"{project}-off", project, "o", "t")
        orch.volumes.create(f"{project}-vol", project, 64)
    mig = orch.migrator.migrate("b-run")
    tokens = {
        p: api.post("/api/v1/tokens", json={"name": f"m-{p}", "role": "member", "project": p}).json()["token"]
        for p in ("a", "b")
    }
    return api, tokens, mig


def as_member(token):
    return {"Authorization": f"Bearer {token}"}


def test_every_api_route_is_classified(tenants):
    api, _, _ = tenants
    paths = api.get("/openapi.json").json()["paths"]
    routes = {
        (method.upper(), path.removeprefix("/api/v1"))
        for path, ops in paths.items()
        if path.startswith("/api/v1")
        for method in ops
    }
    assert routes == ADMIN_ONLY | MEMBER_SCOPED and not ADMIN_ONLY & MEMBER_SCOPED


def test_the_api_schema_says_every_route_needs_the_bearer_token_and_health_does_not(tenants):
    api, _, _ = tenants
    schema = api.get("/openapi.json").json()
    assert schema["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            needs = path.startswith("/api/v1/") or path == "/metrics"  # /metrics: an admin's (review)
            assert (op.get("security") == [{"HTTPBearer": []}]) == needs, (method, path)


@pytest.mark.parametrize("method,path", sorted(ADMIN_ONLY))
def test_admin_only_routes_refuse_a_member_with_403_and_change_nothing(refusals, method, path):
    api, tokens, _ = refusals
    before = api.get("/api/v1/hosts").json(), api.get("/api/v1/projects").json()
    url = "/api/v1" + path.format(name="h1", key="cpu.overprovisioning.factor")
    body = {
        "name": "x",
        "zone": "z1",
        "action": "enter",
        "value": "2",
        "vcpus": 1,
        "memory_mib": 1,
        "kind": "fixed",
        "image": "tiny-linux",
        "cluster": "c1",
        "cores": 1,
        "cpu_mhz": 1,
        "role": "admin",
        "mode": "power",
        "agents": [{"agent": "sim"}],
        "confirm_off": True,
    }
    r = api.request(method, url, json=body if method != "GET" else None, headers=as_member(tokens["a"]))
    assert r.status_code == 403 and r.json()["error"] == "forbidden", (method, path, r.text)
    assert (api.get("/api/v1/hosts").json(), api.get("/api/v1/projects").json()) == before


@pytest.mark.parametrize(
    "method,path,body",
    [
        ("GET", "/vms/b-run", None),
        ("GET", "/vms/b-run/stats", None),
        ("POST", "/vms/b-off/start", None),
        ("POST", "/vms/b-run/stop", {}),
        ("DELETE", "/vms/b-off", None),
        ("POST", "/vms/b-run/exec", {"command": "true"}),
        ("POST", "/vms/b-run/reboot", {}),
        ("POST", "/vms/b-run/migrate", {}),
        ("POST", "/vms/b-run/migrate/cancel", None),
        ("POST", "/vms/b-run/scale", {"offering": "o2"}),
        ("POST", "/vms/b-run/sync", None),
        ("GET", "/projects/b", None),
        ("PATCH", "/vms/b-run", {"ha_priority": 5}),
        ("GET", "/projects/b/usage", None),
        ("POST", "/vms", {"name": "sneaky", "project": "b", "offering": "o", "template": "t"}),
        ("GET", "/volumes/b-vol", None),
        ("POST", "/volumes/b-vol/attach", {"vm": "a-run"}),
        ("POST", "/volumes/b-vol/resize", {"size_mib": 128}),
        ("POST", "/volumes/b-vol/move", {"pool": "nowhere"}),
        ("POST", "/vms/b-off/migrate", {}),
        ("DELETE", "/volumes/b-vol", None),
        ("POST", "/volumes", {"name": "sneaky", "project": "b", "size_mib": 64}),
    ],
)
def test_a_member_of_a_can_not_touch_project_b(refusals, method, path, body):
    api, tokens, _ = refusals
    before = api.get("/api/v1/vms").json(), api.get("/api/v1/projects/b/usage").json()
    r = api.request(method, "/api/v1" + path, json=body, headers=as_member(tokens["a"]))
    assert r.status_code in (403, 404), (method, path, r.status_code, r.text)
    assert "b-" not in r.text or "does not exist" in r.text
    assert (api.get("/api/v1/vms").json(), api.get("/api/v1/projects/b/usage").json()) == before


def test_lists_and_ids_of_other_projects_are_hidden(tenants):
    api, tokens, mig = tenants
    member = as_member(tokens["a"])
    assert {v["name"] for v in api.get("/api/v1/vms", headers=member).json()} == {"a-run", "a-off"}
    assert [v["name"] for v in api.get("/api/v1/volumes", headers=member).json()] == ["a-vol"]
    assert [p["name"] for p in api.get("/api/v1/projects", headers=member).json()] == ["a"]
    assert api.get("/api/v1/migrations", headers=member).json() == []
    assert api.get(f"/api/v1/migrations/{mig['id']}", headers=member).status_code == 404
    theirs = [o for o in api.get("/api/v1/operations").json() if (o["vm"] or "").startswith("b-")]
    assert theirs and all(api.get(f"/api/v1/operations/{o['id']}", headers=member).status_code == 404 for o in theirs)
    assert all(not (o["vm"] or "").startswith("b-") for o in api.get("/api/v1/operations", headers=member).json())


def test_a_member_runs_its_own_project(tenants):
    api, tokens, _ = tenants
    member = as_member(tokens["a"])
    assert api.post("/api/v1/vms/a-off/start", headers=member).status_code == 202
    assert api.post("/api/v1/vms/a-run/scale", json={"offering": "o2"}, headers=member).status_code == 202
    hosts = [h["name"] for h in api.get("/api/v1/hosts").json()]
    refused = api.post("/api/v1/vms/a-run/migrate", json={"to": hosts[-1]}, headers=member)
    assert refused.status_code == 403 and refused.json()["field"] == "to"  # tenants don't pick hypervisors
    assert api.post("/api/v1/vms/a-run/migrate", json={}, headers=member).status_code == 202
    assert api.get("/api/v1/projects/a/usage", headers=member).json()["consistent"] is True


def test_tokens_are_stored_hashed(orch, api):
    from sqlalchemy import select

    from vmplane.store.schema import Token

    with orch.db.read() as s:
        stored = [t.token_hash for t in s.scalars(select(Token))]
    assert ADMIN_TOKEN not in stored and all(len(h) == 64 for h in stored)


def test_up_token_reuse_never_promotes_a_member_token(orch, api):
    from vmplane.core.errors import Conflict

    orch.catalog.create_project("p", 1, 1, 1)
    member = orch.catalog.create_token("dev", "member", "p")
    with pytest.raises(Conflict, match="member token 'dev'"):
        orch.catalog.ensure_admin_token("up-admin", member)
    assert orch.catalog.authenticate(member)[1] == "member"
    orch.catalog.ensure_admin_token("up-admin", ADMIN_TOKEN)  # already an admin token: accepted as is
    assert orch.catalog.authenticate(ADMIN_TOKEN)[1] == "admin"
