"""The event log: every state change of a VM, host, migration and operation, with its cause; the API,
who sees what, filters and paging, retention, and `vmplane events` (with --follow) against a live server."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from vmplane.core.driver import DriverError
from vmplane.core.model import HostState, Offering, OfferingKind
from vmplane.core.names import domain_name
from vmplane.orchestrator import Orchestrator
from vmplane.server import create_app
from vmplane.store import events
from vmplane.store.listing import Page

from .conftest import ADMIN_TOKEN, VMPLANE, add_sim_hosts

V1 = "/api/v1"


def setup_catalog(o: Orchestrator) -> None:
    o.catalog.set_setting("enable.dynamic.scale.vm", "true", "zone", "z1")
    o.catalog.create_offering(Offering("o", OfferingKind.fixed, vcpus=1, memory_mib=512, dynamic_scaling=True))
    o.catalog.create_offering(Offering("o2", OfferingKind.fixed, vcpus=2, memory_mib=1024, dynamic_scaling=True))
    o.catalog.create_template("t", "tiny-linux", dynamic_scaling=True)
    for project in ("a", "b"):
        o.catalog.create_project(project, 16, 32768, 10)


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def member_token(api, name: str, project: str) -> dict:
    r = api.post(f"{V1}/tokens", json={"name": name, "role": "member", "project": project})
    assert r.status_code == 201, r.text
    return bearer(r.json()["token"])


def log(api, headers: dict | None = None, **params) -> list[dict]:
    r = api.get(f"{V1}/events", params=params, headers=headers or {})
    assert r.status_code == 200, r.text
    return r.json()


def changes(rows: list[dict], kind: str) -> list[tuple]:
    """(old, new) of one kind of event, oldest first."""
    return [(e["old_state"], e["new_state"]) for e in sorted(rows, key=lambda e: e["id"]) if e["kind"] == kind]


def wait_op(api, op_id: str, headers: dict | None = None, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        op = api.get(f"{V1}/operations/{op_id}", headers=headers or {}).json()
        if op["state"] in ("succeeded", "failed") or time.monotonic() > deadline:
            return op
        time.sleep(0.05)


def wait_vm(api, name: str, state: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        vm = api.get(f"{V1}/vms/{name}").json()
        if vm.get("state") == state or time.monotonic() > deadline:
            return vm
        time.sleep(0.05)


@pytest.fixture
def cloud(orch, api):
    add_sim_hosts(orch, 2)
    setup_catalog(orch)
    return api


# -- what is recorded, with which cause -----------------------------------------------------------------
def test_a_vm_lifecycle_leaves_its_events_with_the_users_token_as_cause(cloud):
    api = cloud
    dev = member_token(api, "dev-a", "a")
    r = api.post(
        f"{V1}/vms", json={"name": "app", "project": "a", "offering": "o", "template": "t", "start": True}, headers=dev
    )
    assert r.status_code in (201, 202), r.text
    assert api.get(f"{V1}/vms/app", headers=dev).json()["state"] == "running"
    first_host = api.get(f"{V1}/vms/app").json()["host"]
    assert api.post(f"{V1}/vms/app/scale", json={"offering": "o2"}, headers=dev).status_code == 202
    assert api.post(f"{V1}/vms/app/migrate", json={}, headers=dev).status_code == 202
    second_host = api.get(f"{V1}/vms/app").json()["host"]
    assert second_host != first_host
    assert api.post(f"{V1}/vms/app/stop", json={}, headers=dev).status_code == 202
    assert api.delete(f"{V1}/vms/app", headers=dev).status_code in (200, 204)

    rows = log(api, vm="app")
    assert {e["cause"] for e in rows} == {"user dev-a"}  # the executor's work too
    assert changes(rows, "vm") == [
        (None, "starting"),
        ("starting", "running"),
        ("running", "scaling"),
        ("scaling", "running"),
        ("running", "migrating"),
        ("migrating", "running"),
        ("running", "stopping"),
        ("stopping", "stopped"),
        ("stopped", "deleted"),
    ]
    vm_rows = sorted((e for e in rows if e["kind"] == "vm"), key=lambda e: e["id"])
    assert vm_rows[0]["message"].startswith("created with 1 vCPU / 512 MiB") and vm_rows[0]["host"] == first_host
    assert "2 vCPUs / 1024 MiB" in vm_rows[3]["message"]  # scaled
    assert f"moved from {first_host} to {second_host}" in vm_rows[5]["message"]  # migrated
    assert {e["project"] for e in rows} == {"a"} and {e["vm"] for e in rows} == {"app"}
    assert changes(rows, "migration") == [
        (None, "queued"),
        ("queued", "copying"),
        ("copying", "checking"),
        ("checking", "succeeded"),
    ]
    ops = [e for e in rows if e["kind"] == "operation"]
    kinds = {e["message"].split()[0] for e in ops}
    assert kinds == {"start", "scale", "stop"}
    for kind in kinds:  # each operation: pending -> running -> succeeded
        assert [
            (e["old_state"], e["new_state"])
            for e in sorted(ops, key=lambda e: e["id"])
            if e["message"].startswith(kind)
        ] == [(None, "pending"), ("pending", "running"), ("running", "succeeded")]
    assert all(len(e["subject"]) == 36 for e in ops)  # an operation's id
    # newest first by default; timestamps are UTC with an offset
    assert [e["id"] for e in rows] == sorted((e["id"] for e in rows), reverse=True)
    assert rows[0]["at"].endswith("+00:00")


@pytest.mark.parametrize("remembered", [4096, 0], ids=["in-memory", "from-the-log"])
def test_work_done_in_executor_threads_carries_the_requests_cause(db, monkeypatch, remembered):
    """A real thread pool: contextvars do not cross it by themselves; the start, the migration's copy and
    the stop still name the token of the request that asked for them (remembered by this process, or
    read from the log as another process or a restart would)."""
    monkeypatch.setattr(events, "REMEMBERED", remembered)
    o = Orchestrator(db, ThreadPoolExecutor(4, thread_name_prefix="test-op"))
    o.load()
    try:
        o.catalog.create_zone("z1")
        o.catalog.create_cluster("c1", "z1")
        add_sim_hosts(o, 2)
        setup_catalog(o)
        o.catalog.ensure_admin_token("ops-admin", ADMIN_TOKEN)
        with TestClient(create_app(o), headers=bearer(ADMIN_TOKEN)) as api:
            r = api.post(
                f"{V1}/vms", json={"name": "bg", "project": "b", "offering": "o", "template": "t", "start": True}
            )
            assert wait_op(api, r.json()["operation"]["id"])["state"] == "succeeded"
            assert api.post(f"{V1}/vms/bg/migrate", json={}).status_code == 202
            assert wait_vm(api, "bg", "running")["state"] == "running"
            mig = api.get(f"{V1}/migrations", params={"vm": "bg"}).json()[0]
            deadline = time.monotonic() + 30
            while mig["state"] != "succeeded" and time.monotonic() < deadline:
                time.sleep(0.05)
                mig = api.get(f"{V1}/migrations/{mig['id']}").json()
            op = api.post(f"{V1}/vms/bg/stop", json={"force": True}).json()["operation"]
            assert wait_op(api, op["id"])["state"] == "succeeded"
            rows = log(api, vm="bg")
        threads = {e["cause"] for e in rows}
        assert threads == {"user ops-admin"}, rows
        assert ("starting", "running") in changes(rows, "vm") and ("stopping", "stopped") in changes(rows, "vm")
        assert ("checking", "succeeded") in changes(rows, "migration")
    finally:
        o.close()


def test_a_failed_start_records_its_failure_and_the_vm_stopped(cloud, orch, monkeypatch):
    api = cloud

    def broken(spec):
        raise DriverError("h", "the emulator would not start")

    for driver in orch.drivers.values():
        monkeypatch.setattr(driver, "start", broken)
    r = api.post(f"{V1}/vms", json={"name": "bad", "project": "a", "offering": "o", "template": "t", "start": True})
    assert r.status_code in (201, 202), r.text
    rows = log(api, vm="bad")
    op = next(e for e in rows if e["kind"] == "operation")  # newest first: the failure
    assert (op["old_state"], op["new_state"]) == ("running", "failed")
    assert "the emulator would not start" in op["message"] and op["cause"] == "user admin"
    assert changes(rows, "vm") == [(None, "starting"), ("starting", "stopped")]
    stopped = next(e for e in rows if e["kind"] == "vm" and e["new_state"] == "stopped")
    assert "start failed: h: the emulator would not start" in stopped["message"] and stopped["cause"] == "user admin"


def test_host_maintenance_and_drain_are_recorded(cloud, orch):
    api = cloud
    orch.create_vm("w1", "a", "o", "t", start=True)
    host = orch.vm("w1").host.name
    assert api.post(f"{V1}/hosts/{host}/maintenance", json={"action": "enter"}).status_code == 200
    assert api.post(f"{V1}/hosts/{host}/maintenance", json={"action": "exit"}).status_code == 200
    rows = log(api, kind="host")
    assert changes(rows, "host") == [("enabled", "maintenance"), ("maintenance", "enabled")]
    assert {(e["subject"], e["host"], e["project"], e["cause"]) for e in rows} == {(host, host, None, "user admin")}
    drain = [e for e in log(api, host=host, kind="operation") if e["message"].startswith("drain")]
    assert [e["new_state"] for e in reversed(drain)] == ["pending", "running", "succeeded"]
    assert ("running", "migrating") in changes(log(api, vm="w1"), "vm")


def test_background_work_names_its_loop(db, orch):
    """Start-up recovery records what it finds as `recovery`; code run under acting_as() names its loop."""
    add_sim_hosts(orch, 1)
    setup_catalog(orch)
    orch.create_vm("gone", "a", "o", "t", start=True)
    orch.drivers["h1"].stop(domain_name("gone"), timeout_s=0)  # behind vmplane's back
    orch.close()
    again = Orchestrator(db, orch.executor)
    again.load()
    try:
        rows, _ = events.page(again.db, Page(), vm="gone")
        stopped = [e for e in rows if e["kind"] == "vm" and e["new_state"] == "stopped"]
        assert stopped and stopped[0]["cause"] == "recovery" and "not running on h1" in stopped[0]["message"]
        assert events.current_cause() == "vmplane"
        with events.acting_as("monitor"):
            again.set_host_state("h1", HostState.down)
        rows, _ = events.page(again.db, Page(), kind="host")
        assert (rows[0]["new_state"], rows[0]["cause"]) == ("down", "monitor")
    finally:
        again.close()


# -- who sees what -------------------------------------------------------------------------------------
def test_a_member_sees_only_its_projects_events(cloud, orch):
    api = cloud
    dev_a, dev_b = member_token(api, "dev-a", "a"), member_token(api, "dev-b", "b")
    api.post(
        f"{V1}/vms", json={"name": "a1", "project": "a", "offering": "o", "template": "t", "start": True}, headers=dev_a
    )
    api.post(
        f"{V1}/vms", json={"name": "b1", "project": "b", "offering": "o", "template": "t", "start": True}, headers=dev_b
    )
    orch.set_host_state("h2", HostState.disabled)
    mine = log(api, dev_a)
    assert mine and {e["project"] for e in mine} == {"a"} and {e["vm"] for e in mine} == {"a1"}
    assert log(api, dev_a, vm="b1") == [] and log(api, dev_a, kind="host") == []
    assert log(api, dev_a, host="h2") == [] or {e["project"] for e in log(api, dev_a, host="h2")} == {"a"}
    everything = log(api)
    assert {e["project"] for e in everything} == {"a", "b", None}
    assert {e["vm"] for e in everything if e["vm"]} == {"a1", "b1"}
    assert any(e["kind"] == "host" and e["subject"] == "h2" for e in everything)
    assert api.get(f"{V1}/events", params={"vm": "b1"}, headers=dev_a).headers["x-total-count"] == "0"


# -- filters, since, paging ----------------------------------------------------------------------------
def test_filters_since_and_paging(cloud, orch):
    api = cloud
    for name in ("p1", "p2", "p3"):
        orch.create_vm(name, "a", "o", "t", start=True)
    everything = log(api, limit=1000)
    total = int(api.get(f"{V1}/events").headers["x-total-count"])
    assert total == len(everything) >= 15
    ids = [e["id"] for e in everything]
    assert ids == sorted(ids, reverse=True)

    assert {e["vm"] for e in log(api, vm="p2")} == {"p2"}
    assert {e["kind"] for e in log(api, kind="operation")} == {"operation"}
    on_h1 = log(api, host="h1")
    assert on_h1 and {e["host"] for e in on_h1} == {"h1"}

    page1, page2 = log(api, limit=4), log(api, limit=4, offset=4)
    assert [e["id"] for e in page1 + page2] == ids[:8]
    oldest_first = log(api, sort="id", limit=3)
    assert [e["id"] for e in oldest_first] == sorted(ids)[:3]

    middle = ids[len(ids) // 2]
    after = log(api, since=str(middle), sort="id", limit=1000)
    assert [e["id"] for e in after] == sorted(i for i in ids if i > middle)
    assert log(api, since=str(ids[0])) == []

    at = next(e for e in everything if e["id"] == middle)["at"]
    assert {e["id"] for e in log(api, since=at, limit=1000)} >= {i for i in ids if i >= middle}
    assert log(api, since="2999-01-01T00:00:00+00:00") == []
    assert len(log(api, since="2000-01-01T00:00:00Z", limit=1000)) == total

    for bad in ({"since": "yesterday"}, {"kind": "disk"}, {"sort": "cause"}, {"vmm": "p1"}, {"limit": 0}):
        r = api.get(f"{V1}/events", params=bad)
        assert r.status_code == 422 and r.json()["error"] == "invalid", (bad, r.text)


# -- retention -----------------------------------------------------------------------------------------
def test_history_is_bounded_by_a_setting(cloud, orch, monkeypatch):
    api = cloud
    r = api.put(f"{V1}/settings/vmplane.event.history", json={"value": -1})
    assert r.status_code == 422 and "0..10000000" in r.json()["message"]
    assert api.get(f"{V1}/settings/vmplane.event.history").json()["value"] == 100000
    assert api.put(f"{V1}/settings/vmplane.event.history", json={"value": 6}).status_code == 200
    monkeypatch.setattr(events, "PRUNE_EVERY", 1)
    for name in ("r1", "r2", "r3"):
        orch.create_vm(name, "a", "o", "t", start=True)
    rows = log(api, limit=1000)
    assert len(rows) == 6
    assert rows[0]["vm"] == "r3" and rows[0]["new_state"] in ("running", "succeeded")  # the newest stay
    monkeypatch.setattr(events, "PRUNE_BATCH", 2)  # in batches: a prune deletes at most this many
    with orch.db.transaction() as conn:
        assert events.prune(conn, keep=0) == 2
        assert events.prune(conn, keep=0) == 2
    assert len(log(api, limit=1000)) == 2


# -- the CLI against a live server ---------------------------------------------------------------------
def _live_catalog(live):
    for args in (
        ("project", "create", "acme", "--vcpus", "8", "--memory", "16GiB", "--vms", "5"),
        ("offering", "create", "small", "--kind", "fixed", "--vcpus", "1", "--memory", "512MiB"),
    ):
        r = live.cli(*args)
        assert r.returncode == 0, r.stderr


def test_cli_events_of_a_vm(live):
    _live_catalog(live)
    for vm in ("web", "other"):
        r = live.cli(
            "vm", "create", vm, "--project", "acme", "--offering", "small", "--template", "tiny-linux", "--start"
        )
        assert r.returncode == 0, r.stderr
    r = live.cli("events", "--vm", "web", "--output", "json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert {e["vm"] for e in rows} == {"web"} and {e["cause"] for e in rows} == {"user up-admin"}
    assert ("starting", "running") in changes(rows, "vm")
    table = live.cli("events", "--vm", "web", "--kind", "vm", "--limit", "5")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    text = table.stdout
    assert "starting -> running" in text and "user up-admin" in text and "other" not in text
    # one line for the VM's start (its whole chain), the header saying the time zone; the date on each line
    assert "- -> starting -> running" in text, text  # created and started: one line
    assert re.match(r"time \(\w+\)", lines[0]) and re.match(r"\d\d-\d\d \d\d:\d\d:\d\d  vm ", lines[1]), text
    every = live.cli("events", "--vm", "web", "--kind", "vm", "--every").stdout
    assert len(every.splitlines()) > len(lines) and "- -> starting -> running" not in every
    assert live.cli("events", "--kind", "nope").returncode == 2


def test_cli_events_follow_prints_new_events_until_stopped(live):
    _live_catalog(live)
    r = live.cli(
        "vm", "create", "tail", "--project", "acme", "--offering", "small", "--template", "tiny-linux", "--start"
    )
    assert r.returncode == 0, r.stderr
    proc = subprocess.Popen(
        [VMPLANE, "events", "--vm", "tail", "--follow", "--limit", "2", "-o", "json"],
        env=live.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    got: list[dict] = []
    reader = threading.Thread(target=lambda: got.extend(json.loads(line) for line in proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 30
        while len(got) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(got) == 2 and got[0]["id"] < got[1]["id"], got  # the backlog, oldest first
        seen = got[-1]["id"]
        r = live.cli("vm", "stop", "tail", "--force")
        assert r.returncode == 0, r.stderr
        deadline = time.monotonic() + 30
        while not any(e["new_state"] == "stopped" and e["kind"] == "vm" for e in got) and time.monotonic() < deadline:
            time.sleep(0.05)
        new = [e for e in got if e["id"] > seen]
        assert ("running", "stopping") in changes(new, "vm") and ("stopping", "stopped") in changes(new, "vm")
        assert all(e["vm"] == "tail" for e in new)
        assert [e["id"] for e in got] == sorted(e["id"] for e in got)  # each once, in order
        assert proc.poll() is None  # still following
    finally:
        proc.terminate()
        proc.wait(10)
    assert proc.returncode is not None


def test_the_log_on_sqlite_and_postgresql(db_url, monkeypatch):
    """Recording in the change's transaction, host state changes, the page query with `since`, and pruning,
    on both stores."""
    from vmplane.orchestrator import InlineExecutor
    from vmplane.store import Database

    database = Database(db_url)
    database.migrate()
    o = Orchestrator(database, InlineExecutor())
    o.load()
    try:
        o.catalog.create_zone("z1")
        o.catalog.create_cluster("c1", "z1")
        add_sim_hosts(o, 2)
        setup_catalog(o)
        with events.acting_as("user pg-test"):
            o.create_vm("x1", "a", "o", "t", start=True)
            o.migrator.migrate("x1")
            o.stop_vm("x1", force=True)
            o.delete_vm("x1")
            o.set_host_state("h2", HostState.maintenance)
        rows, total = events.page(database, Page(limit=1000), vm="x1")
        assert changes(rows, "vm")[-1] == ("stopped", "deleted") and {e["cause"] for e in rows} == {"user pg-test"}
        assert ("checking", "succeeded") in changes(rows, "migration")
        newest = rows[0]["id"]
        hosts, _ = events.page(database, Page(), kind="host", since=newest)
        assert [(e["subject"], e["new_state"]) for e in hosts] == [("h2", "maintenance")]
        import datetime as dt

        later, _ = events.page(database, Page(), since=dt.datetime.now(dt.UTC) + dt.timedelta(hours=1))
        assert later == []
        _, everything = events.page(database, Page())
        assert everything == total + 1  # x1's and the host's
        monkeypatch.setattr(events, "PRUNE_BATCH", 3)
        with database.transaction() as conn:
            assert events.prune(conn, keep=2) == 3  # a batch at a time
        assert events.page(database, Page())[1] == everything - 3
        with database.transaction() as conn:
            while events.prune(conn, keep=2):
                pass
        kept, count = events.page(database, Page())
        assert count == 2 and kept[0]["id"] == hosts[0]["id"]  # the newest stay
    finally:
        o.close()
        database.dispose()
