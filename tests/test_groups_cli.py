"""`vmplane group ...` and `vmplane cluster show` against a live `vmplane up` (sim hosts)."""

import json


def run(live, *args):
    r = live.cli(*args, "--output", "json")
    assert r.returncode == 0, f"{args}: {r.stdout} {r.stderr}"
    return json.loads(r.stdout) if r.stdout.strip() else None


def test_group_commands_and_cluster_show(live):
    run(live, "project", "create", "acme", "--vcpus", "8", "--memory", "8GiB")
    g = run(live, "group", "create", "web", "--project", "acme", "--policy", "anti-affinity", "--soft")
    assert (g["policy"], g["hard"], g["rule"]) == ("anti-affinity", False, "anti-affinity (soft)")
    assert [x["name"] for x in run(live, "group", "list")] == ["web"]
    assert run(live, "group", "show", "web")["vms"] == []
    bad = live.cli("group", "create", "x", "--project", "acme", "--policy", "together")
    assert bad.returncode == 1 and "policy" in bad.stdout + bad.stderr
    table = live.cli("group", "list").stdout
    assert "anti-affinity (soft)" in table
    live.cli("group", "delete", "web")
    assert run(live, "group", "list") == []
    cluster = run(live, "cluster", "list")[0]["name"]
    shown = run(live, "cluster", "show", cluster)
    assert shown["failover"]["failures_tolerated"] == 0 and shown["failover"]["survives"] is True
    run(live, "setting", "set", "vmplane.ha.host.failures.tolerated", "1", "--cluster", cluster)
    table = live.cli("cluster", "show", cluster).stdout
    assert "1 (vmplane.ha.host.failures.tolerated)" in table and "0 vCPU / 0 MiB" in table and "yes" in table
