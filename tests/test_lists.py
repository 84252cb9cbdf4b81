"""Lists an operator can use (filters, paging, sorting in SQL, unknown parameters refused), one error shape,
one vocabulary (`vm`, `host`, null `waiting_for`, timezone-aware timestamps), ids by unique prefix."""

from __future__ import annotations

import datetime as dt

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from vmplane.store import ledger as L

from .conftest import ADMIN_TOKEN, add_basics, add_sim_hosts, in_process_cli

V1 = "/api/v1"
ERROR_KEYS = {"error", "message", "field"}


@pytest.fixture
def fleet(orch, api):
    """Two zones: z1 (c1: h1..h3) and z2 (c2: g1); projects acme and beta; VMs running and stopped; one
    finished migration and one drain; a member token of acme."""
    add_sim_hosts(orch, 3)
    orch.catalog.create_zone("z2")
    orch.catalog.create_cluster("c2", "z2")
    add_sim_hosts(orch, 1, cluster="c2", prefix="g")
    for driver in orch.drivers.values():
        driver.copy_rate_mib_s = 1 << 20
    add_basics(orch)
    orch.catalog.create_project("acme", 64, 1 << 20, 100)
    orch.catalog.create_project("beta", 64, 1 << 20, 100)
    for name, project, zone, start in [
        ("a-run1", "acme", "z1", True),
        ("a-run2", "acme", "z1", True),
        ("a-off1", "acme", "z1", False),
        ("a-off2", "acme", "z1", False),
        ("a-far", "acme", "z2", True),
        ("b-run", "beta", "z1", True),
        ("b-off", "beta", "z1", False),
    ]:
        orch.create_vm(name, project, "small", "tiny", start=start, zone=zone)
    mig = api.post(f"{V1}/vms/a-run1/migrate", json={}).json()
    source = mig["source"]
    drain = api.post(f"{V1}/hosts/h3/maintenance", json={"action": "enter"}).json()
    member = api.post(f"{V1}/tokens", json={"name": "dev", "project": "acme"}).json()["token"]
    return {"migration": mig, "source": source, "drain": drain, "member": {"Authorization": f"Bearer {member}"}}


def names(r) -> list[str]:
    assert r.status_code == 200, r.text
    return [row["name"] for row in r.json()]


def assert_error(r, status: int, code: str, field: str | None, *words: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == ERROR_KEYS, body
    assert body["error"] == code and body["field"] == field, body
    for word in words:
        assert word in body["message"], body
    return body


# -- filters, paging, sorting ----------------------------------------------------------------------
def test_vm_filters_filter(api, fleet):
    assert names(api.get(f"{V1}/vms", params={"project": "acme", "state": "stopped"})) == ["a-off1", "a-off2"]
    assert set(names(api.get(f"{V1}/vms", params={"state": "running"}))) == {"a-run1", "a-run2", "a-far", "b-run"}
    on_g1 = names(api.get(f"{V1}/vms", params={"host": "g1"}))
    assert on_g1 == ["a-far"]
    assert "a-far" not in names(api.get(f"{V1}/vms", params={"zone": "z1"}))
    assert names(api.get(f"{V1}/vms", params={"zone": "z2"})) == ["a-far"]
    assert names(api.get(f"{V1}/vms", params={"name": "a-off"})) == ["a-off1", "a-off2"]
    assert names(api.get(f"{V1}/vms", params={"name": "a_%"})) == []  # a prefix, not a pattern


def test_limit_offset_sort_and_total(api, fleet):
    r = api.get(f"{V1}/vms", params={"limit": 2, "sort": "-name"})
    assert names(r) == ["b-run", "b-off"] and r.headers["X-Total-Count"] == "7"
    r = api.get(f"{V1}/vms", params={"limit": 2, "offset": 2, "sort": "-name"})
    assert names(r) == ["a-run2", "a-run1"] and r.headers["X-Total-Count"] == "7"
    r = api.get(f"{V1}/vms", params={"project": "acme", "state": "stopped", "limit": 1})
    assert names(r) == ["a-off1"] and r.headers["X-Total-Count"] == "2"
    assert names(api.get(f"{V1}/vms", params={"offset": 100})) == []
    by_project = names(api.get(f"{V1}/vms", params={"sort": "-project"}))
    assert set(by_project[:2]) == {"b-off", "b-run"}
    assert names(api.get(f"{V1}/hosts", params={"sort": "-name", "limit": 2})) == ["h3", "h2"]
    assert names(api.get(f"{V1}/hosts", params={"zone": "z2"})) == ["g1"]
    assert names(api.get(f"{V1}/hosts", params={"cluster": "c1", "state": "maintenance"})) == ["h3"]
    assert api.get(f"{V1}/hosts").headers["X-Total-Count"] == "4"
    for path in ("/vms", "/hosts", "/operations", "/migrations"):
        assert api.get(f"{V1}{path}", params={"limit": 1001}).status_code == 422
        assert api.get(f"{V1}{path}", params={"limit": 0}).status_code == 422
        assert api.get(f"{V1}{path}", params={"offset": -1}).status_code == 422
        assert "X-Total-Count" in api.get(f"{V1}{path}").headers


def test_sort_on_an_unknown_field_is_422_naming_the_allowed_ones(api, fleet):
    assert_error(api.get(f"{V1}/vms", params={"sort": "password"}), 422, "invalid", "sort", "name", "state")
    assert_error(api.get(f"{V1}/migrations", params={"sort": "-vm_name"}), 422, "invalid", "sort", "created_at")
    assert_error(api.get(f"{V1}/operations", params={"sort": "target"}), 422, "invalid", "sort", "kind")
    assert_error(api.get(f"{V1}/hosts", params={"sort": "uri"}), 422, "invalid", "sort", "cluster")


def test_a_filter_naming_nothing_gives_an_empty_list_on_every_list(api, fleet):
    for path, params in [
        ("/vms", {"project": "nope"}),
        ("/vms", {"host": "nope"}),
        ("/vms", {"zone": "nope"}),
        ("/hosts", {"cluster": "nope"}),
        ("/hosts", {"zone": "nope"}),
        ("/operations", {"vm": "nope"}),
        ("/operations", {"host": "nope"}),
        ("/migrations", {"vm": "nope"}),
        ("/migrations", {"host": "nope"}),
    ]:
        r = api.get(f"{V1}{path}", params=params)
        assert (r.status_code, r.json(), r.headers["X-Total-Count"]) == (200, [], "0"), (path, params, r.text)


def test_unknown_query_parameters_are_refused_on_every_route(api, fleet):
    body = assert_error(api.get(f"{V1}/vms", params={"stat": "running"}), 422, "invalid", "stat", "unknown")
    assert "state" in body["message"] and "project" in body["message"]
    assert_error(api.get(f"{V1}/vms/a-run2", params={"verbose": 1}), 422, "invalid", "verbose")
    assert_error(api.get(f"{V1}/zones", params={"x": 1}), 422, "invalid", "x")
    assert_error(api.post(f"{V1}/vms/a-off1/start", params={"force": 1}), 422, "invalid", "force")
    assert_error(api.get(f"{V1}/migrations", params={"vm_name": "a-run1"}), 422, "invalid", "vm_name")
    assert_error(api.get("/healthz", params={"deep": 1}), 422, "invalid", "deep")
    assert orch_state(api, "a-off1") == "stopped"  # refused: nothing done
    assert api.get(f"{V1}/settings/vmplane.overhead.ratio", params={"scope": "global"}).status_code == 200


def orch_state(api, vm: str) -> str:
    return api.get(f"{V1}/vms/{vm}").json()["state"]


def test_operation_and_migration_filters(api, fleet):
    ops = api.get(f"{V1}/operations", params={"kind": "start", "vm": "a-run2"}).json()
    assert [(o["kind"], o["vm"], o["host"]) for o in ops] == [("start", "a-run2", None)]
    drains = api.get(f"{V1}/operations", params={"kind": "drain"}).json()
    assert [(o["vm"], o["host"]) for o in drains] == [(None, "h3")]
    assert api.get(f"{V1}/operations", params={"host": "h3"}).json() == drains
    assert all(o["state"] == "succeeded" for o in api.get(f"{V1}/operations", params={"state": "succeeded"}).json())
    r = api.get(f"{V1}/operations", params={"sort": "created_at", "limit": 1})
    assert r.json()[0]["vm"] == "a-run1" and int(r.headers["X-Total-Count"]) >= 5

    migs = api.get(f"{V1}/migrations", params={"vm": "a-run1"}).json()
    assert [m["id"] for m in migs] == [fleet["migration"]["id"]]
    assert api.get(f"{V1}/migrations", params={"host": fleet["source"], "state": "succeeded"}).json() != []
    assert api.get(f"{V1}/migrations", params={"state": "failed"}).json() == []
    assert api.get(f"{V1}/migrations", params={"active": True, "vm": "a-run1"}).json() == []
    assert api.get(f"{V1}/migrations", params={"state": "flying"}).status_code == 422
    assert api.get(f"{V1}/vms", params={"state": "flying"}).status_code == 422


def test_a_member_still_sees_only_its_project(api, fleet):
    member = fleet["member"]
    r = api.get(f"{V1}/vms", headers=member)
    assert set(names(r)) == {"a-run1", "a-run2", "a-off1", "a-off2", "a-far"} and r.headers["X-Total-Count"] == "5"
    r = api.get(f"{V1}/vms", params={"project": "beta"}, headers=member)
    assert (r.json(), r.headers["X-Total-Count"]) == ([], "0")
    r = api.get(f"{V1}/vms", params={"limit": 2, "sort": "-name"}, headers=member)
    assert names(r) == ["a-run2", "a-run1"] and r.headers["X-Total-Count"] == "5"
    ops = api.get(f"{V1}/operations", headers=member).json()
    assert ops and all(o["vm"] and o["vm"].startswith("a-") for o in ops)  # no drain, no beta
    assert api.get(f"{V1}/operations", params={"vm": "b-run"}, headers=member).json() == []
    assert len(api.get(f"{V1}/migrations", headers=member).json()) == 1
    assert api.get(f"{V1}/hosts", headers=member).status_code == 403


# -- ids by prefix ---------------------------------------------------------------------------------
def test_operations_and_migrations_by_unique_prefix(api, fleet):
    op = api.get(f"{V1}/operations", params={"vm": "a-run2"}).json()[0]
    assert api.get(f"{V1}/operations/{op['id'][:8]}").json()["id"] == op["id"]
    assert api.get(f"{V1}/operations/{op['id']}").json()["id"] == op["id"]
    mig = fleet["migration"]["id"]
    assert api.get(f"{V1}/migrations/{mig[:6]}").json()["id"] == mig
    assert_error(api.get(f"{V1}/operations/{op['id'][:3]}"), 404, "not_found", "operation", "at least 4")
    assert_error(api.get(f"{V1}/migrations/zzzz"), 404, "not_found", "migration")
    assert_error(api.get(f"{V1}/operations/%25%25%25%25"), 404, "not_found", "operation")  # no LIKE pattern


def test_an_ambiguous_prefix_is_409_naming_the_matches(api, orch, fleet):
    ops = api.get(f"{V1}/operations", params={"kind": "start"}).json()[:3]
    with orch.db.transaction() as conn:
        for i, op in enumerate(ops):
            conn.execute(update(L.OPERATIONS).where(L.OPERATIONS.c.id == op["id"]).values(id=f"abcd{i}{op['id'][5:]}"))
    body = assert_error(api.get(f"{V1}/operations/abcd"), 409, "conflict", "operation", "ambiguous")
    assert all(f"abcd{i}" in body["message"] for i in range(3))
    assert api.get(f"{V1}/operations/abcd1").json()["id"].startswith("abcd1")
    # a member's prefix never matches (nor names) another project's operations
    beta = next(o for o in api.get(f"{V1}/operations", params={"vm": "b-run"}).json())
    assert_error(api.get(f"{V1}/operations/{beta['id'][:8]}", headers=fleet["member"]), 404, "not_found", "operation")


# -- one vocabulary --------------------------------------------------------------------------------
def tz_aware(value: str | None) -> bool:
    return value is None or (
        value.endswith("+00:00") and dt.datetime.fromisoformat(value).utcoffset() == dt.timedelta(0)
    )


def test_vm_and_host_keys_null_waiting_for_and_utc_timestamps(api, fleet):
    mig = api.get(f"{V1}/migrations/{fleet['migration']['id']}").json()
    assert mig["vm"] == "a-run1" and "vm_name" not in mig and mig["source"] != mig["target"]
    assert mig["waiting_for"] is None
    assert fleet["migration"]["vm"] == "a-run1" and "vm_name" not in fleet["migration"]
    assert all(tz_aware(mig[k]) for k in ("created_at", "started_at", "finished_at")), mig
    op = api.get(f"{V1}/operations", params={"vm": "a-run2"}).json()[0]
    assert "target" not in op and op["vm"] == "a-run2" and op["host"] is None
    assert tz_aware(op["created_at"]) and tz_aware(op["updated_at"])
    vm = api.get(f"{V1}/vms/a-run2").json()
    assert tz_aware(vm["created_at"])
    accepted = api.post(f"{V1}/vms/a-off1/start").json()
    assert tz_aware(accepted["vm"]["created_at"]) and accepted["operation"]["vm"] == "a-off1"


# -- one error shape -------------------------------------------------------------------------------
def test_every_error_class_has_the_three_keys(api, orch, fleet):
    assert_error(TestClient(api.app).get(f"{V1}/vms"), 401, "unauthorized", None)
    assert_error(
        TestClient(api.app).get(f"{V1}/vms", headers={"Authorization": "Bearer wrong"}), 401, "unauthorized", None
    )
    assert_error(api.get(f"{V1}/hosts", headers=fleet["member"]), 403, "forbidden", None)
    assert_error(api.get(f"{V1}/nothing"), 404, "not_found", None, "/api/v1/nothing")
    assert_error(api.get(f"{V1}/api/v1/vms"), 404, "not_found", None, "without /api/v1")
    assert_error(api.get(f"{V1}/vms/ghost"), 404, "not_found", "vm")
    assert_error(api.put(f"{V1}/vms"), 405, "method_not_allowed", None, "PUT")
    assert_error(api.post(f"{V1}/vms/a-run2/start"), 409, "conflict", "state")
    assert_error(api.post(f"{V1}/zones", json={"name": "z1"}), 409, "already_exists", "name")
    assert_error(api.post(f"{V1}/zones", json={"name": "Bad!"}), 422, "invalid", "name")
    assert_error(
        api.post(f"{V1}/zones", content=b"{", headers={"Content-Type": "application/json"}), 422, "invalid", None
    )
    assert_error(api.get(f"{V1}/operations", params={"limit": "many"}), 422, "invalid", "limit")

    def boom():
        raise RuntimeError("boom")

    orch.audit = boom
    with TestClient(
        api.app, raise_server_exceptions=False, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    ) as client:
        assert_error(client.get(f"{V1}/audit"), 500, "internal", None)


def test_every_error_response_of_the_openapi_schema_has_the_three_keys(api):
    spec = api.get("/openapi.json").json()

    def resolve(schema: dict) -> dict:
        while "$ref" in schema:
            name = schema["$ref"].rsplit("/", 1)[-1]
            schema = spec["components"]["schemas"][name]
        return schema

    seen = 0
    for path, methods in spec["paths"].items():
        for method, operation in methods.items():
            codes = [c for c in operation["responses"] if c[0] in "45"]
            needed = {"401", "404", "422", "500"} if path.startswith("/api/") else {"422", "500"}
            assert needed <= set(codes), (method, path, codes)
            for code in codes:
                content = operation["responses"][code].get("content", {}).get("application/json")
                assert content, (method, path, code)
                schema = resolve(content["schema"])
                assert set(schema["properties"]) >= ERROR_KEYS, (method, path, code, schema)
                assert set(schema.get("required", [])) >= ERROR_KEYS, (method, path, code, schema)
                seen += 1
    assert seen > 100
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    assert "method_not_allowed" in spec["info"]["description"]


# -- the CLI's lists -------------------------------------------------------------------------------
@pytest.fixture
def cli(api, monkeypatch):
    """The CLI against the in-process API."""
    return in_process_cli(api, monkeypatch)


def test_cli_list_filters_and_the_showing_caption(cli, fleet):
    import json

    rc, out = cli("vm", "list", "--project", "acme", "--state", "stopped", "-o", "json")
    assert rc == 0 and [v["name"] for v in json.loads(out)] == ["a-off1", "a-off2"]
    rc, out = cli("vm", "list", "--limit", "2", "--sort", "-name")
    assert rc == 0 and "showing 2 of 7 (use --limit/--offset)" in out and "b-run" in out and "a-off1" not in out
    rc, out = cli("vm", "list", "--zone", "z2")
    assert rc == 0 and "a-far" in out and "showing" not in out
    rc, out = cli("host", "list", "--zone", "z1", "--state", "maintenance", "-o", "json")
    assert rc == 0 and [h["name"] for h in json.loads(out)] == ["h3"]
    rc, out = cli("operation", "list", "--kind", "drain", "-o", "json")
    assert rc == 0 and [o["host"] for o in json.loads(out)] == ["h3"]
    rc, out = cli("migration", "list", "--vm", "a-run1", "--state", "succeeded", "--limit", "5", "-o", "json")
    assert rc == 0 and [m["vm"] for m in json.loads(out)] == ["a-run1"]
    rc, out = cli("vm", "list", "--sort", "colour", "-o", "json")
    assert rc == 1 and json.loads(out)["field"] == "sort"
