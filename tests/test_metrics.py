"""/metrics: counters and histograms moved by what happens, state gauges equal to what the API lists,
checked by promtool; the sample alert rules checked and unit-tested by promtool (deploy/prometheus)."""

from __future__ import annotations

import datetime as dt
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import event

from vmplane.api.metricscollect import StateCollector
from vmplane.core.model import Offering, OfferingKind
from vmplane.orchestrator import InlineExecutor, Orchestrator
from vmplane.server import create_app
from vmplane.store import Database
from vmplane.store import ledger as L
from vmplane.store.schema import utcnow

from .conftest import ADMIN_TOKEN, add_sim_hosts
from .stores import store_url

MIB = 1024 * 1024
RULES_DIR = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"
RULES = RULES_DIR / "vmplane-alerts.yml"
RULE_TESTS = RULES_DIR / "vmplane-alerts.test.yml"


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        print("promtool test skipped: promtool not installed (scripts/setup.sh --test installs prometheus)")
        pytest.skip("promtool not installed")
    return path


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of an exposition: (sample name, its labels) -> value."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(page: dict, name: str, **labels) -> float:
    """One sample's value (0 when absent: a counter or histogram child not created yet)."""
    return page.get((name, frozenset(labels.items())), 0.0)


def scrape(api) -> dict:
    r = api.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return samples(r.text)


@pytest.fixture
def cluster(orch, api):
    """Three sim hosts (vCPUs overcommitted x2), scalable offerings, two projects (one counts overhead)."""
    add_sim_hosts(orch, 3, cores=8, memory_mib=16384)
    orch.catalog.set_setting("cpu.overprovisioning.factor", "2", "cluster", "c1")
    orch.catalog.set_setting("enable.dynamic.scale.vm", "true", "zone", "z1")
    orch.catalog.create_offering(
        Offering(
            "dyn",
            OfferingKind.custom_constrained,
            min_vcpus=1,
            max_vcpus=4,
            min_memory_mib=256,
            max_memory_mib=8192,
            dynamic_scaling=True,
        )
    )
    orch.catalog.create_template("dt", "tiny-linux", dynamic_scaling=True)
    orch.catalog.create_project("p", 16, 32768, 10, count_overhead=True)
    orch.catalog.create_project("q", 4, 4096, 3)
    return orch, api


def test_a_live_migration_and_a_live_scale_move_the_counters_and_histograms_and_promtool_accepts_the_page(cluster):
    orch, api = cluster
    orch.create_vm("m1", "p", "dyn", "dt", vcpus=1, memory_mib=1024, start=True)
    before = scrape(api)
    source = api.get("/api/v1/vms/m1").json()["host"]
    assert api.post("/api/v1/vms/m1/migrate", json={}).status_code == 202
    mig = api.get("/api/v1/migrations", params={"vm": "m1"}).json()[0]
    assert mig["state"] == "succeeded" and mig["target"] != source
    assert api.post("/api/v1/vms/m1/scale", json={"vcpus": 2, "memory_mib": 2048}).status_code == 202
    assert (api.get("/api/v1/vms/m1").json()["vcpus"], api.get("/api/v1/vms/m1").json()["memory_mib"]) == (2, 2048)
    text = api.get("/metrics").text
    after = samples(text)

    check = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("vmplane_migrations_total", result="succeeded") == 1
    assert moved("vmplane_migration_duration_seconds_count", result="succeeded") == 1
    assert moved("vmplane_migration_downtime_seconds_count") == 1
    assert moved("vmplane_migration_transferred_bytes_count") == 1
    # the bytes the sim host reported for this migration (its guest memory), as the API shows them
    assert moved("vmplane_migration_transferred_bytes_sum") == mig["stats"]["bytes"] == 1024 * MIB
    assert moved("vmplane_scales_total", result="succeeded", path="in-place") == 1
    assert moved("vmplane_scales_total", result="succeeded", path="migrate-then-scale") == 0
    assert moved("vmplane_operations_total", kind="scale", state="succeeded") == 1
    for method, route in (
        ("POST", "/api/v1/vms/{name}/migrate"),
        ("POST", "/api/v1/vms/{name}/scale"),
        ("GET", "/api/v1/vms/{name}"),
        ("GET", "/api/v1/migrations"),
    ):
        assert moved("vmplane_api_request_duration_seconds_count", method=method, route=route, status="2xx") >= 1, route
    # the gauges followed: the VM is on the target, at its new size
    assert (
        value(after, "vmplane_host_vms", host=mig["target"]) == 1 and value(after, "vmplane_host_vms", host=source) == 0
    )
    assert value(after, "vmplane_host_vcpus_allocated", host=mig["target"]) == 2


def test_a_scale_that_fails_is_counted_as_failed_with_its_path(cluster, monkeypatch):
    orch, api = cluster
    orch.create_vm("m1", "p", "dyn", "dt", vcpus=1, memory_mib=1024, start=True)

    def broken(name, vcpus):
        raise RuntimeError("QEMU refused the vCPU")

    monkeypatch.setattr(orch.drivers[orch.vm("m1").host.name], "set_vcpus", broken)
    before = scrape(api)
    r = api.post("/api/v1/vms/m1/scale", json={"vcpus": 2, "memory_mib": 1024})
    assert r.status_code == 202
    assert api.get(f"/api/v1/operations/{r.json()['operation']['id']}").json()["state"] == "failed"
    after = scrape(api)

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("vmplane_scales_total", result="failed", path="in-place") == 1
    assert moved("vmplane_scales_total", result="succeeded", path="in-place") == 0
    assert moved("vmplane_operations_total", kind="scale", state="failed") == 1


def test_the_state_gauges_equal_what_the_api_lists(cluster):
    orch, api = cluster
    for name, project, vcpus, memory in (("a1", "p", 1, 1024), ("a2", "p", 2, 2048), ("b1", "q", 1, 512)):
        orch.create_vm(name, project, "dyn", "dt", vcpus=vcpus, memory_mib=memory, start=True)
    orch.create_vm("a3", "p", "dyn", "dt", vcpus=1, memory_mib=256)  # stopped
    orch.create_vm("b2", "q", "dyn", "dt", vcpus=1, memory_mib=256, start=True)
    orch.stop_vm("b2", force=True)
    page = scrape(api)

    for state in ("stopped", "starting", "running", "stopping", "migrating", "scaling", "error", "unknown"):
        listed = int(api.get("/api/v1/vms", params={"state": state, "limit": 1}).headers["X-Total-Count"])
        assert value(page, "vmplane_vms", state=state) == listed, state
    assert value(page, "vmplane_vms", state="running") == 3 and value(page, "vmplane_vms", state="stopped") == 2

    vms = api.get("/api/v1/vms").json()
    for project in ("p", "q"):
        shown = api.get(f"/api/v1/projects/{project}").json()
        for resource, unit in (("vcpus", 1), ("memory_mib", MIB), ("vms", 1), ("storage_mib", MIB)):
            metric = resource.replace("_mib", "_bytes")
            assert (
                value(page, "vmplane_project_usage", project=project, resource=metric)
                == shown["usage"][resource] * unit
            )
            assert (
                value(page, "vmplane_project_quota", project=project, resource=metric)
                == shown["quota"][resource] * unit
            )
        footprint = sum(v["memory_mib"] + v["overhead_mib"] for v in vms if v["project"] == project and v["host"])
        assert (
            value(page, "vmplane_project_usage", project=project, resource="memory_with_overhead_bytes")
            == footprint * MIB
        )
    # p counts overhead, q does not: its ledger is guest memory only, its footprint is more
    assert value(page, "vmplane_project_usage", project="q", resource="memory_bytes") == 512 * MIB
    assert value(page, "vmplane_project_usage", project="q", resource="memory_with_overhead_bytes") > 512 * MIB

    for host in api.get("/api/v1/hosts").json():
        name = host["name"]
        assert value(page, "vmplane_host_vcpus_capacity", host=name) == host["vcpus_capacity"] == 16  # 8 cores x 2
        assert value(page, "vmplane_host_memory_capacity_bytes", host=name) == host["memory_capacity_mib"] * MIB
        assert value(page, "vmplane_host_vcpus_allocated", host=name) == host["used_vcpus"]
        assert value(page, "vmplane_host_memory_allocated_bytes", host=name) == host["used_memory_mib"] * MIB
        on_host = [v for v in vms if v["host"] == name]
        assert value(page, "vmplane_host_vms", host=name) == len(on_host)
        assert (
            value(page, "vmplane_host_memory_overhead_bytes", host=name)
            == sum(v["overhead_mib"] for v in on_host) * MIB
        )
        assert host["used_memory_mib"] == sum(v["memory_mib"] + v["overhead_mib"] for v in on_host)
        assert value(page, "vmplane_host_state", host=name, state=host["state"]) == 1
        assert value(page, "vmplane_host_info", host=name, cluster="c1", zone="z1", driver="sim") == 1
    assert (
        sum(value(page, "vmplane_host_vcpus_allocated", host=h["name"]) for h in api.get("/api/v1/hosts").json()) == 4
    )

    assert api.post("/api/v1/hosts/h3/maintenance", json={"action": "enter"}).status_code == 200
    page = scrape(api)
    assert value(page, "vmplane_host_state", host="h3", state="maintenance") == 1
    assert ("vmplane_host_state", frozenset({"host": "h3", "state": "enabled"}.items())) not in page
    assert value(page, "vmplane_hosts", state="maintenance") == 1 and value(page, "vmplane_hosts", state="enabled") == 2


def test_operations_and_migrations_in_flight_and_the_age_of_the_oldest(cluster):
    orch, api = cluster
    orch.create_vm("a1", "p", "dyn", "dt", vcpus=1, memory_mib=1024, start=True)
    vm = orch.vm("a1")
    hour_ago = utcnow() - dt.timedelta(hours=1)
    with orch.db.transaction() as conn:  # as a crash would leave them: in flight, nobody driving them
        for minutes in (60, 5):
            op = L.new_operation(conn, "stop", "a1", vm.id, vm.project_id, step="stopping")
            conn.execute(
                L.OPERATIONS.update()
                .where(L.OPERATIONS.c.id == op)
                .values(created_at=utcnow() - dt.timedelta(minutes=minutes))
            )
        conn.execute(
            L.MIGRATIONS.insert().values(
                id="0" * 36,
                vm_id=vm.id,
                vm_name="a1",
                project_id=vm.project_id,
                source_host_id=vm.host_id,
                target_host_id=vm.host_id,
                source="h1",
                target="h2",
                cluster="c1",
                state="copying",
                created_at=hour_ago,
                owner=orch.controllers.epoch,
            )
        )  # owned by this live process: not taken over as an orphan meanwhile
    page = scrape(api)
    listed = int(
        api.get("/api/v1/operations", params={"state": "pending", "kind": "stop", "limit": 1}).headers["X-Total-Count"]
    )
    assert value(page, "vmplane_operations_in_flight", kind="stop") == listed == 2
    assert value(page, "vmplane_operations_in_flight", kind="start") == 0
    assert 3590 <= value(page, "vmplane_operation_oldest_in_flight_seconds", kind="stop") <= 3700
    assert value(page, "vmplane_operation_oldest_in_flight_seconds", kind="scale") == 0
    active = int(api.get("/api/v1/migrations", params={"active": True, "limit": 1}).headers["X-Total-Count"])
    assert value(page, "vmplane_migrations_in_flight", state="copying") == active == 1
    assert value(page, "vmplane_migrations_in_flight", state="queued") == 0
    assert 3590 <= value(page, "vmplane_migration_oldest_in_flight_seconds", state="copying") <= 3700


def test_metrics_need_an_admin_token_as_the_api_does(cluster):
    """Every project's names, quotas and usage are there: an admin's bearer token, as Prometheus sends it
    (README, "Metrics and alerts"; review of 2026-12-02)."""
    _orch, api = cluster
    member = api.post("/api/v1/tokens", json={"name": "m", "role": "member", "project": "q"}).json()["token"]
    anonymous = TestClient(api.app)
    for headers, status in (
        ({}, 401),
        ({"Authorization": "Bearer not-a-token"}, 401),
        ({"Authorization": f"Bearer {member}"}, 403),
    ):
        r = anonymous.get("/metrics", headers=headers)
        assert r.status_code == status and "vmplane_hosts" not in r.text, headers
    assert value(scrape(api), "vmplane_hosts", state="enabled") == 3
    assert anonymous.get("/api/v1/vms").status_code == 401  # the API itself wants a token too


def test_request_latency_is_labelled_by_route_template_never_by_path(cluster):
    _orch, api = cluster
    before = scrape(api)
    for name in ("x1", "x2", "x3"):
        assert api.get(f"/api/v1/vms/{name}").status_code == 404
    assert TestClient(api.app).get("/api/v1/vms").status_code == 401
    text = api.get("/metrics").text
    after = samples(text)
    assert (
        value(
            after, "vmplane_api_request_duration_seconds_count", method="GET", route="/api/v1/vms/{name}", status="4xx"
        )
        - value(
            before, "vmplane_api_request_duration_seconds_count", method="GET", route="/api/v1/vms/{name}", status="4xx"
        )
        == 3
    )
    assert (
        value(after, "vmplane_api_request_duration_seconds_count", method="GET", route="unmatched", status="4xx")
        - value(before, "vmplane_api_request_duration_seconds_count", method="GET", route="unmatched", status="4xx")
        >= 1
    )  # refused before routing
    routes = set(re.findall(r'route="([^"]*)"', text))
    assert not any(name in route for route in routes for name in ("x1", "x2", "x3")), routes


def test_the_collector_and_the_fast_text_agree(cluster):
    orch, _api = cluster
    orch.create_vm("a1", "p", "dyn", "dt", vcpus=1, memory_mib=1024, start=True)
    collector = StateCollector(orch)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    ignore = {"vmplane_state_scrape_duration_seconds"}
    through_library = {k: v for k, v in samples(generate_latest(registry).decode()).items() if k[0] not in ignore}
    direct = {k: v for k, v in samples(collector.text()).items() if k[0] not in ignore}
    assert direct == through_library and len(direct) > 40


def test_two_apps_in_one_process_each_serve_their_own_state(cluster, tmp_path):
    orch, api = cluster
    other_db = Database(store_url(tmp_path, "other.db"))
    other_db.migrate()
    other = Orchestrator(other_db, InlineExecutor())
    other.load()
    try:
        other.catalog.create_zone("z9")
        other.catalog.create_cluster("c9", "z9")
        add_sim_hosts(other, 1, cluster="c9", prefix="o")
        other.catalog.ensure_admin_token("admin", ADMIN_TOKEN)
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        with (
            TestClient(create_app(other), headers=admin) as second,
            TestClient(create_app(orch), headers=admin) as third,
        ):
            assert value(scrape(second), "vmplane_hosts", state="enabled") == 1
            assert value(scrape(second), "vmplane_host_info", host="o1", cluster="c9", zone="z9", driver="sim") == 1
            assert value(scrape(third), "vmplane_hosts", state="enabled") == 3
        assert value(scrape(api), "vmplane_hosts", state="enabled") == 3
    finally:
        other.close()
        other_db.dispose()


def test_an_unreadable_store_still_serves_the_counters(cluster, monkeypatch):
    orch, api = cluster
    assert value(scrape(api), "vmplane_state_scrape_ok") == 1

    def down():
        raise OSError("database is gone")

    monkeypatch.setattr(orch.db, "read", down)
    r = api.get("/metrics")  # the token is still checked (a prepared read, not db.read)
    assert r.status_code == 200
    page = samples(r.text)
    assert value(page, "vmplane_state_scrape_ok") == 0
    assert not any(name == "vmplane_vms" for name, _ in page)
    assert any(name == "vmplane_api_request_duration_seconds_count" for name, _ in page)


def test_a_scrape_reads_aggregates_whatever_the_number_of_vms(cluster):
    orch, api = cluster
    statements: list[str] = []

    def record(conn, cursor, statement, parameters, context, executemany):
        statements.append(statement)

    def scrape_statements() -> list[str]:
        statements.clear()
        event.listen(orch.db.engine, "before_cursor_execute", record)
        try:
            api.get("/metrics")
        finally:
            event.remove(orch.db.engine, "before_cursor_execute", record)
        return list(statements)

    orch.create_vm("a1", "p", "dyn", "dt", vcpus=1, memory_mib=256, start=True)
    few = scrape_statements()
    for i in range(9):
        orch.create_vm(f"v{i}", "p", "dyn", "dt", vcpus=1, memory_mib=256, start=i % 2 == 0)
    many = scrape_statements()
    assert len(few) == len(many) <= 12
    for sql in many:
        if re.search(r"\bFROM vms\b|\bJOIN vms\b", sql) and "stat_samples" not in sql:  # (usage: a row a VM)
            assert "GROUP BY" in sql, sql


# -- the sample alert rules ------------------------------------------------------------------------------


def test_the_alert_rules_pass_promtool_check_and_their_unit_tests():
    tool = promtool()
    check = subprocess.run([tool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and "SUCCESS" in check.stdout, check.stdout + check.stderr
    unit = subprocess.run(
        [tool, "test", "rules", RULE_TESTS.name], cwd=RULES_DIR, capture_output=True, text=True, timeout=60
    )
    assert unit.returncode == 0 and "SUCCESS" in unit.stdout, unit.stdout + unit.stderr


@pytest.mark.parametrize(
    "alert,change",
    [
        (
            "VmplaneHostOverAllocated",
            (
                "vmplane_host_vcpus_allocated > vmplane_host_vcpus_capacity",
                "vmplane_host_vcpus_allocated > vmplane_host_vcpus_capacity * 2",
            ),
        ),
        (
            "VmplaneProjectAtQuota",
            ("vmplane_project_usage >= on(project, resource)", "vmplane_project_usage > on(project, resource)"),
        ),
    ],
)
def test_the_unit_tests_catch_a_broken_alert(tmp_path, alert, change):
    """The unit tests depend on the rules: the same tests against a rule changed fail, naming the alert."""
    tool = promtool()
    rules = RULES.read_text()
    assert change[0] in rules
    (tmp_path / RULES.name).write_text(rules.replace(change[0], change[1]))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    unit = subprocess.run(
        [tool, "test", "rules", RULE_TESTS.name], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert unit.returncode != 0 and alert in unit.stdout + unit.stderr, unit.stdout + unit.stderr


def test_every_metric_the_rules_use_is_served(cluster):
    orch, api = cluster
    orch.create_vm("a1", "p", "dyn", "dt", vcpus=1, memory_mib=256, start=True)
    assert api.get("/api/v1/vms/a1").status_code == 200  # a latency series exists
    served = {name for name, _ in scrape(api)}
    used = set(re.findall(r"\bvmplane_[a-z_]+", RULES.read_text()))
    assert used, "no vmplane metric in the rules?"
    for name in used:
        assert name in served or f"{name}_total" in served or name.removesuffix("_total") + "_total" in served, name
