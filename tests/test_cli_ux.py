"""The CLI as an operator meets it at 80 columns: whole ids, exit codes, addresses, waiting and not waiting."""

import http.server
import json
import re
import threading

import pytest

from vmplane.core.driver import DomainSpec

from .conftest import LiveServer, free_port

UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def run_json(live, *args):
    r = live.cli(*args, "--output", "json")
    assert r.returncode == 0, f"{args}: {r.stdout} {r.stderr}"
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One sim cluster for the module (each test leaves it usable for the next)."""
    live = LiveServer(tmp_path_factory.mktemp("cli-ux")).start()
    run_json(live, "project", "create", "acme", "--vcpus", "8", "--memory", "8GiB")
    run_json(live, "offering", "create", "small", "--kind", "fixed", "--vcpus", "1", "--memory", "512MiB")
    for vm in ("w1", "w2", "w3"):
        run_json(
            live, "vm", "create", vm, "--project", "acme", "--offering", "small", "--template", "tiny-linux", "--start"
        )
    yield live
    live.stop()


def table(live, *args):
    r = live.cli(*args)  # not a terminal: Rich lays tables out for 80 columns
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_tables_fit_80_columns_and_never_cut_an_id(cluster):
    live = cluster
    run_json(live, "vm", "migrate", "w1")
    run_json(live, "vm", "stop", "w3", "--force")
    for args, ids in [
        (("operation", "list"), [o["id"] for o in run_json(live, "operation", "list")]),
        (("migration", "list"), [m["id"] for m in run_json(live, "migration", "list")]),
        (("host", "list"), [h["name"] for h in run_json(live, "host", "list")]),
        (("setting", "list"), [s["key"] for s in run_json(live, "setting", "list")]),
        (("vm", "list"), ["w1", "w2", "w3"]),
    ]:
        out = table(live, *args)
        assert ids and all(i in out.split() for i in ids), (args, out)  # each whole, on one line
        assert max(len(line) for line in out.splitlines()) <= 80, out
        assert "…" not in out, out
    wide = table(live, "host", "list", "--wide")
    assert "memory_capacity_mib" in wide and "…" not in wide
    ops = table(live, "operation", "list")  # when and who asked (issue 33's audit)
    assert "asked" in ops and "up-admin" in ops and re.search(r"\d\d-\d\d \d\d:\d\d", ops), ops


def test_an_operation_is_found_by_a_unique_prefix_of_its_id(cluster):
    op = run_json(cluster, "operation", "list")[0]
    assert run_json(cluster, "operation", "show", op["id"][:8])["id"] == op["id"]


def test_no_wait_says_the_operation_to_follow(cluster):
    r = cluster.cli("vm", "stop", "w2", "--no-wait", "--output", "json")
    assert r.returncode == 0, r.stderr
    accepted = json.loads(r.stdout)
    assert accepted["vm"]["name"] == "w2" and UUID.fullmatch(accepted["operation"]["id"])
    r = cluster.cli("vm", "start", "w2", "--no-wait")
    op_id = UUID.search(r.stderr).group(0)
    assert f"vmplane operation show {op_id}" in r.stderr
    assert run_json(cluster, "operation", "show", op_id)["kind"] == "start"


def test_audit_exits_non_zero_when_it_finds_a_problem(cluster):
    assert cluster.cli("audit").returncode == 0
    fabric = cluster.sim_fabric()
    fabric.put(
        "sim1",
        DomainSpec(name="vmplane-ghost", vcpus=1, max_vcpus=1, memory_mib=256, max_memory_mib=256, image="tiny-linux"),
    )
    r = cluster.cli("audit")
    assert r.returncode == 1 and "vmplane-ghost" in r.stdout
    r = cluster.cli("audit", "--output", "json")
    assert r.returncode == 1 and json.loads(r.stdout)["ok"] is False
    fabric.remove("sim1", "vmplane-ghost")
    assert cluster.cli("audit").returncode == 0


def test_the_api_address_may_end_in_api_v1(cluster):
    r = cluster.cli("vm", "list", "--api", cluster.url + "/api/v1/", "--output", "json")
    assert r.returncode == 0 and len(json.loads(r.stdout)) == 3


def test_a_server_that_is_not_vmplane_is_named_as_such(cluster):
    class NotVmplane(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"detail": "Not Found"}')

        def log_message(self, *args):
            pass

    port = free_port()
    server = http.server.HTTPServer(("127.0.0.1", port), NotVmplane)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        r = cluster.cli("vm", "list", "--api", f"http://127.0.0.1:{port}")
        assert r.returncode == 1 and "is not a vmplane API (HTTP 404" in r.stderr, r.stderr
        r = cluster.cli("vm", "list", "--api", f"http://127.0.0.1:{port}", "--output", "json")
        assert json.loads(r.stdout)["error"] == "not_vmplane"
    finally:
        server.shutdown()


def test_errors_speak_in_flags_and_stay_on_one_line(cluster):
    r = cluster.cli("vm", "scale", "w1")
    assert r.returncode == 2 and "--offering" in r.stderr and "--cpu-cap" in r.stderr
    run_json(cluster, "offering", "create", "flex", "--kind", "custom-unconstrained")
    r = cluster.cli(
        "vm", "create", "t10", "--project", "acme", "--offering", "flex", "--template", "tiny-linux", "--vcpus", "1"
    )
    assert r.returncode == 1 and "--memory" in r.stderr and "memory_mib" not in r.stderr, r.stderr
    r = cluster.cli("vm", "show", "a-name-long-enough-to-wrap-an-eighty-column-line-of-error-text")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_maintenance_ends_with_the_same_short_summary_with_or_without_wait(cluster):
    plan = table(cluster, "host", "maintenance", "enter", "sim2", "--dry-run")
    drained = table(cluster, "host", "maintenance", "enter", "sim2")
    for out in (plan, drained):
        header = next(line for line in out.splitlines() if line.split()[:2] == ["vm", "target"])
        assert header.split() == ["vm", "target", "migration", "state", "note"], out
    assert "sim2 is now in maintenance" in drained
    again = cluster.cli("host", "maintenance", "enter", "sim2")
    assert again.returncode == 1 and "already in maintenance" in again.stderr
    table(cluster, "host", "maintenance", "exit", "sim2")
    empty = table(cluster, "host", "maintenance", "enter", "sim2")
    assert "sim2 is now in maintenance; no running VMs to migrate" in empty


def test_up_prints_the_export_line_whole(tmp_path):
    server = LiveServer(tmp_path, hosts=1)
    server.start("--token", "")  # an empty --token: up makes one and prints it once
    try:
        text = server.log.read_text()
        line = next(line for line in text.splitlines() if "export VMPLANE_API=" in line)
        assert re.fullmatch(r"\s*export VMPLANE_API=http://127\.0\.0\.1:\d+ VMPLANE_TOKEN=\S+", line), text
    finally:
        server.stop()
