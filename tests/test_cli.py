"""Every CLI command of DESIGN section 9 that needs no migration or scaling, against `vmplane up --driver sim`."""

import json

import pytest


def run_json(live, *args):
    r = live.cli(*args, "--output", "json")
    assert r.returncode == 0, f"{args}: {r.stdout} {r.stderr}"
    return json.loads(r.stdout)


def test_walkthrough_with_json_output(live):
    hosts = run_json(live, "host", "list")
    assert [h["name"] for h in hosts] == ["sim1", "sim2", "sim3"]
    assert (
        run_json(
            live,
            "host",
            "add",
            "extra",
            "--cluster",
            "cluster1",
            "--sim",
            "--cores",
            "8",
            "--mhz",
            "2000",
            "--memory",
            "32GiB",
        )["memory_mib"]
        == 32768
    )
    assert run_json(live, "host", "show", "extra")["cores"] == 8
    assert run_json(live, "zone", "create", "z2")["name"] == "z2"
    assert run_json(live, "cluster", "create", "c2", "--zone", "z2")["zone"] == "z2"
    assert {c["name"] for c in run_json(live, "cluster", "list")} == {"cluster1", "c2"}

    p = run_json(
        live,
        "project",
        "create",
        "acme",
        "--vcpus",
        "8",
        "--memory",
        "16GiB",
        "--vms",
        "5",
        "--count-overhead",
        "--max-concurrent-migrations",
        "2",
    )
    assert (
        p["quota"] == {"vcpus": 8, "memory_mib": 16384, "vms": 5, "storage_mib": 1048576, "backups_mib": 1048576}
        and p["count_overhead"] is True
    )
    assert (
        run_json(
            live,
            "offering",
            "create",
            "small",
            "--kind",
            "fixed",
            "--vcpus",
            "1",
            "--memory",
            "512MiB",
            "--cpu-speed",
            "1000",
            "--cpu-cap",
            "--dynamic-scaling",
        )["cpu_cap"]
        is True
    )
    o = run_json(
        live,
        "offering",
        "create",
        "flex",
        "--kind",
        "custom-constrained",
        "--min-vcpus",
        "1",
        "--max-vcpus",
        "4",
        "--min-memory",
        "256MiB",
        "--max-memory",
        "4GiB",
    )
    assert o["max_memory_mib"] == 4096
    assert run_json(live, "offering", "show", "flex")["kind"] == "custom-constrained"
    assert len(run_json(live, "offering", "list")) == 2
    assert (
        run_json(live, "template", "create", "tiny", "--image", "tiny-linux", "--dynamic-scaling")["dynamic_scaling"]
        is True
    )
    assert run_json(live, "template", "show", "tiny")["image"] == "tiny-linux"
    assert [t["name"] for t in run_json(live, "template", "list")] == ["tiny", "tiny-linux"]  # up registers tiny-linux

    assert (
        run_json(live, "setting", "set", "mem.overprovisioning.factor", "1.5", "--cluster", "cluster1")["value"] == 1.5
    )
    assert run_json(live, "setting", "set", "enable.dynamic.scale.vm", "true", "--zone", "zone1")["value"] is True
    got = run_json(live, "setting", "get", "mem.overprovisioning.factor", "--cluster", "cluster1")
    assert got["value"] == 1.5 and got["source"] == "cluster cluster1"
    assert run_json(live, "setting", "get", "mem.overprovisioning.factor")["value"] == 1.0
    assert run_json(live, "host", "show", "sim1")["memory_capacity_mib"] == 65536 * 3 // 2

    r = live.cli("vm", "create", "web1", "--project", "acme", "--offering", "small", "--template", "tiny", "--start")
    assert r.returncode == 1 and "z2, zone1" in r.stderr, r.stderr  # two zones now: say which
    vm = run_json(
        live,
        "vm",
        "create",
        "web1",
        "--project",
        "acme",
        "--offering",
        "small",
        "--template",
        "tiny",
        "--zone",
        "zone1",
        "--start",
    )
    assert vm["state"] == "running" and vm["host"].startswith("sim") and vm["zone"] == "zone1"
    vm = run_json(
        live,
        "vm",
        "create",
        "db1",
        "--project",
        "acme",
        "--offering",
        "flex",
        "--template",
        "tiny",
        "--vcpus",
        "2",
        "--memory",
        "1GiB",
        "--no-dynamic-scaling",
        "--cluster",
        "cluster1",
    )
    assert vm["state"] == "stopped" and vm["dynamic_scaling"] is False
    assert (vm["zone"], vm["cluster"]) == ("zone1", "cluster1")
    assert run_json(live, "vm", "start", "db1")["state"] == "running"
    assert {v["name"] for v in run_json(live, "vm", "list", "--project", "acme")} == {"web1", "db1"}
    assert run_json(live, "vm", "show", "db1")["vcpus"] == 2

    usage = run_json(live, "project", "usage", "acme")
    assert usage["vcpus"]["used"] == 3 and usage["vms"]["used"] == 2 and usage["consistent"] is True
    assert usage["memory_mib"]["used"] == 512 + 269 + 1024 + 278  # overhead counted
    assert run_json(live, "project", "quota", "acme", "--vcpus", "4")["quota"]["vcpus"] == 4
    assert run_json(live, "project", "show", "acme")["usage"]["vcpus"] == 3
    assert [p["name"] for p in run_json(live, "project", "list")] == ["acme"]

    assert run_json(live, "vm", "stop", "db1")["state"] == "stopped"
    assert run_json(live, "vm", "delete", "db1") == {"deleted": "db1"}
    ops = run_json(live, "operation", "list")
    assert {(o["kind"], o["vm"], o["state"]) for o in ops} >= {
        ("start", "web1", "succeeded"),
        ("stop", "db1", "succeeded"),
    }
    assert run_json(live, "operation", "show", ops[0]["id"])["id"] == ops[0]["id"]
    assert run_json(live, "audit") == {"ok": True, "problems": []}
    member = run_json(live, "token", "create", "dev", "--project", "acme")
    assert member["role"] == "member" and len(member["token"]) > 20
    assert len(run_json(live, "zone", "list")) == 2


@pytest.mark.parametrize(
    "args,words",
    [
        (("project", "create", "x", "--vcpus", "1", "--memory", "16GB"), "ambiguous"),
        (("project", "create", "x", "--vcpus", "1", "--memory", "lots"), "not a size"),
        (("offering", "create", "x", "--kind", "fixed", "--vcpus", "1", "--memory", "-1GiB"), "not a size"),
    ],
)
def test_bad_sizes_are_usage_errors_that_name_the_option(live, args, words):
    r = live.cli(*args)
    assert r.returncode == 2 and words in r.stderr and "--memory" in r.stderr


def test_api_errors_are_shown_and_exit_1(live):
    r = live.cli("vm", "show", "ghost", "--output", "json")
    assert r.returncode == 1
    assert json.loads(r.stdout) == {"error": "not_found", "message": "vm 'ghost' does not exist", "field": "vm"}
    r = live.cli("vm", "show", "ghost")
    assert r.returncode == 1 and "does not exist" in r.stderr


def test_unreachable_api_says_so(live):
    r = live.cli("vm", "list", "--api", "http://127.0.0.1:9")
    assert r.returncode == 1 and "cannot reach the vmplane API" in r.stderr


def test_a_backup_is_taken_shown_and_restored_in_place_from_the_cli(live):
    """`backup create|show|restore --in-place` as a person types them (the in-place flag reaches the API)."""
    run_json(live, "project", "create", "bkp", "--vcpus", "4", "--memory", "4GiB")
    run_json(live, "offering", "create", "one", "--kind", "fixed", "--vcpus", "1", "--memory", "512MiB")
    run_json(live, "template", "create", "withdisk", "--image", "tiny-linux", "--disk", "tiny-linux")
    run_json(live, "backup", "store", "create", "bk", "--cluster", "cluster1")
    spec = ("--project", "bkp", "--offering", "one", "--template", "withdisk", "--pool", "shared", "--start")
    run_json(live, "vm", "create", "keep", *spec)
    b = run_json(live, "backup", "create", "keep")
    shown = run_json(live, "backup", "show", str(b["id"]))
    assert (shown["kind"], [d["device"] for d in shown["disks"]]) == ("full", ["vda"])
    r = live.cli("backup", "restore", str(b["id"]), "--in-place")
    assert r.returncode == 1 and "stop it before restoring it in place" in r.stderr, r.stderr
    run_json(live, "vm", "stop", "keep", "--force")
    done = run_json(live, "backup", "restore", str(b["id"]), "--in-place")
    assert (done["vm"], list(done["disks"])) == ("keep", ["vda"])
    assert run_json(live, "audit")["ok"]
