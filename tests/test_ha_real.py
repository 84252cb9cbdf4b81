"""High availability on real QEMU guests (local libvirtd hosts): a host's power failure, its libvirtd
killed, its network cut, a blip, the control plane killed mid-recovery. Each time the HA VMs run and
answer on other hosts exactly once (one QEMU per VM on the whole machine), never before their host is
fenced; VMs without HA are stopped with their charge released; the quota usage of the HA VMs does not
change; the audit is clean."""

from __future__ import annotations

import time

import pytest

from .realguest import crash_at, guest, libvirt_cluster, qemu_pids, run_json, settled

GRACE_S = 3


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server = libvirt_cluster(tmp_path_factory.mktemp("ha"), hosts=3)
    run_json(server, "setting", "set", "vmplane.host.check.interval", "1")
    run_json(server, "setting", "set", "vmplane.ha.grace", str(GRACE_S), "--cluster", "cluster1")
    run_json(server, "offering", "create", "ha", "--kind", "fixed", "--vcpus", "1", "--memory", "384MiB")
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def tidy(live):
    """After each test, whatever it left when it failed: a failed host recovered, hosts out of maintenance,
    no VM left. One failure stays one (these tests share one cluster)."""
    yield
    for h in run_json(live, "host", "list"):
        if h["state"] in ("down", "fencing", "fenced") or (live.home / "hosts" / h["name"] / "failed").exists():
            live.cli("host", "recover", h["name"])
        elif h["state"] == "maintenance":
            live.cli("host", "maintenance", "exit", h["name"])
    for v in run_json(live, "vm", "list", "--limit", "200"):
        if v["state"] == "running":
            live.cli("vm", "stop", v["name"], "--force")
        live.cli("vm", "delete", v["name"])


def wait(predicate, timeout: float, what: str, live=None):
    t0 = time.monotonic()
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() - t0 > timeout:
            log = live.log.read_text()[-3000:] if live else ""
            raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{log}")
        time.sleep(0.5)


def host(live, name: str) -> dict:
    return run_json(live, "host", "show", name)


def vm(live, name: str) -> dict:
    return run_json(live, "vm", "show", name)


def create_on(live, where: str, specs: list[tuple[str, str, int]]) -> None:
    """Start VMs (name, ha, priority) on host `where` (the other hosts in maintenance meanwhile); each with
    its root disk on the shared pool."""
    others = [h for h in ("lv1", "lv2", "lv3") if h != where]
    for h in others:
        run_json(live, "host", "maintenance", "enter", h)
    try:
        for name, ha, priority in specs:
            run_json(live, "vm", "create", name, "--project", "p", "--offering", "ha", "--template", "tiny-linux",
                     "--pool", "shared", "--ha", ha, "--ha-priority", str(priority), "--start")
            assert vm(live, name)["host"] == where
    finally:
        for h in others:
            run_json(live, "host", "maintenance", "exit", h)


def running_elsewhere(live, names: list[str], dead: str):
    def check():
        vms = [vm(live, n) for n in names]
        return vms if all(v["state"] == "running" and v["host"] not in (dead, None) for v in vms) else None
    return check


def once_and_answering(live, names: list[str]) -> None:
    for name in names:
        assert len(qemu_pids(f"vmplane-{name}")) == 1, f"{name}: QEMU processes {qemu_pids(f'vmplane-{name}')}"
        assert "ok" in guest(live, name, "echo ok")


def operations(live, kind: str) -> list[dict]:
    ops = [o for o in run_json(live, "operation", "list", "--limit", "200") if o["kind"] == kind]
    return sorted(ops, key=lambda o: o["created_at"])


def bring_back(live, name: str) -> None:
    run_json(live, "host", "recover", name)
    wait(lambda: host(live, name)["state"] == "enabled", 60, f"{name} back", live)


def clean(live, names: list[str]) -> None:
    for name in names:
        if vm(live, name)["state"] == "running":
            run_json(live, "vm", "stop", name, "--force")
        run_json(live, "vm", "delete", name)


def test_a_power_failure_restarts_the_ha_vms_elsewhere_by_priority_each_once(live):
    run_json(live, "setting", "set", "vmplane.ha.max.parallel", "1", "--cluster", "cluster1")
    names = ["p1", "p2", "p3"]
    create_on(live, "lv1", [("p1", "restart", 1), ("p2", "restart", 2), ("p3", "restart", 3), ("plain", "off", 0)])
    digest = guest(live, "p3", "echo kept > /data/f; sync; md5sum /data/f").split()[0]
    before = run_json(live, "project", "usage", "p")
    t0 = time.monotonic()
    run_json(live, "host", "fail", "lv1", "--mode", "power")
    wait(running_elsewhere(live, names, "lv1"), 180, "the HA VMs to run elsewhere", live)
    once_and_answering(live, names)
    took = time.monotonic() - t0
    assert [o["vm"] for o in operations(live, "restart")] == ["p3", "p2", "p1"]     # highest priority first
    lv1 = host(live, "lv1")
    assert lv1["state"] == "fenced" and "local agent" in lv1["state_reason"], lv1
    assert vm(live, "plain")["state"] == "stopped" and qemu_pids("vmplane-plain") == []
    after = run_json(live, "project", "usage", "p")      # p counts no overhead: plain's 1 vCPU / 384 MiB went
    assert (after["vcpus"]["used"], after["memory_mib"]["used"]) == (before["vcpus"]["used"] - 1,
                                                                     before["memory_mib"]["used"] - 384)
    assert guest(live, "p3", "md5sum /data/f").split()[0] == digest       # its disk kept its data
    assert run_json(live, "audit")["ok"]
    print(f"power failure to 3 HA VMs answering elsewhere: {took:.1f} s")
    bring_back(live, "lv1")
    run_json(live, "setting", "set", "vmplane.ha.max.parallel", "4", "--cluster", "cluster1")
    clean(live, names + ["plain"])


@pytest.mark.parametrize("mode", ["network", "daemon"])
def test_a_host_whose_guests_run_on_is_fenced_before_they_run_elsewhere(live, mode):
    create_on(live, "lv2", [("g1", "restart", 0)])
    run_json(live, "host", "fail", "lv2", "--mode", mode)
    seen_fenced = False
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:          # until it runs elsewhere: never two QEMUs, never before fenced
        v, h = vm(live, "g1"), host(live, "lv2")
        assert len(qemu_pids("vmplane-g1")) <= 1
        seen_fenced = seen_fenced or h["state"] == "fenced"
        if v["state"] == "running" and v["host"] != "lv2":
            assert h["state"] == "fenced", h
            break
        time.sleep(0.3)
    else:
        raise AssertionError(f"g1 did not run elsewhere: {vm(live, 'g1')} {host(live, 'lv2')}\n"
                             f"{live.log.read_text()[-4000:]}")
    once_and_answering(live, ["g1"])
    assert run_json(live, "audit")["ok"]
    bring_back(live, "lv2")
    clean(live, ["g1"])


def test_fencing_that_fails_restarts_nothing_and_is_retried_until_it_works(live):
    create_on(live, "lv3", [("f1", "restart", 0)])
    bad = '[{"agent": "ipmi", "address": "127.0.0.1", "port": 9, "username": "admin", "password": "wrong"}]'
    run_json(live, "host", "fence-agents", "lv3", bad)
    run_json(live, "host", "fail", "lv3", "--mode", "daemon")       # its guest runs on
    reason = wait(lambda: "fencing failed" in (host(live, "lv3")["state_reason"] or "") and
                  host(live, "lv3")["state_reason"], 90, "a failed fencing attempt", live)
    assert "ipmi" in reason
    time.sleep(GRACE_S)
    assert host(live, "lv3")["state"] == "fencing" and vm(live, "f1")["state"] == "unknown"
    assert len(qemu_pids("vmplane-f1")) == 1 and all(o["vm"] != "f1" for o in operations(live, "restart"))
    run_json(live, "host", "fence-agents", "lv3", '[{"agent": "local"}]')     # the BMC is repaired
    wait(running_elsewhere(live, ["f1"], "lv3"), 120, "f1 to run elsewhere", live)
    once_and_answering(live, ["f1"])
    assert run_json(live, "audit")["ok"]
    bring_back(live, "lv3")
    clean(live, ["f1"])


def test_a_blip_shorter_than_the_grace_restarts_nothing(live):
    run_json(live, "setting", "set", "vmplane.ha.grace", "60", "--cluster", "cluster1")
    try:
        create_on(live, "lv1", [("b1", "restart", 0)])
        restarts = len(operations(live, "restart"))
        run_json(live, "host", "fail", "lv1", "--mode", "network")
        wait(lambda: host(live, "lv1")["state"] == "down", 30, "lv1 down", live)
        time.sleep(3)
        run_json(live, "host", "recover", "lv1")
        wait(lambda: host(live, "lv1")["state"] == "enabled", 60, "lv1 back", live)
        v = vm(live, "b1")
        assert (v["state"], v["host"]) == ("running", "lv1")
        assert len(operations(live, "restart")) == restarts and qemu_pids("vmplane-b1") != []
        once_and_answering(live, ["b1"])
    finally:
        run_json(live, "setting", "set", "vmplane.ha.grace", str(GRACE_S), "--cluster", "cluster1")
    clean(live, ["b1"])


def test_the_control_plane_killed_mid_recovery_is_finished_by_the_next_one(live):
    create_on(live, "lv2", [("k1", "restart", 0), ("k2", "restart", 0)])
    crash_at(live, "ha.claimed", lambda c: c.post("/hosts/lv2/fail", json={"mode": "power"}))
    wait(running_elsewhere(live, ["k1", "k2"], "lv2"), 180, "k1 and k2 to run elsewhere", live)
    settled(live)
    once_and_answering(live, ["k1", "k2"])
    assert run_json(live, "audit")["ok"]
    bring_back(live, "lv2")
    clean(live, ["k1", "k2"])


def test_the_failover_reserve_refuses_the_start_that_breaks_it_and_every_ha_vm_restarts(live):
    # 2 cores x 2 = 4 vCPUs per host; HA VMs of 2 vCPUs; keep room for one host failure (k=1)
    run_json(live, "setting", "set", "cpu.overprovisioning.factor", "2", "--cluster", "cluster1")
    run_json(live, "setting", "set", "vmplane.ha.host.failures.tolerated", "1", "--cluster", "cluster1")
    run_json(live, "offering", "create", "ha2", "--kind", "fixed", "--vcpus", "2", "--memory", "384MiB")
    names = ["r1", "r2", "r3", "r4"]
    try:
        for name in names:                  # spread: 2/2/2 vCPUs, then one host holds 4
            run_json(live, "vm", "create", name, "--project", "p", "--offering", "ha2", "--template", "tiny-linux",
                     "--pool", "shared", "--ha", "restart", "--start")
        r = live.cli("vm", "create", "r5", "--project", "p", "--offering", "ha2", "--template", "tiny-linux",
                     "--pool", "shared", "--ha", "restart", "--start")
        assert r.returncode != 0 and "vmplane.ha.host.failures.tolerated=1" in r.stdout + r.stderr, r
        shown = run_json(live, "cluster", "show", "cluster1")
        assert shown["failover"]["survives"] is True, shown
        hosts = {h: [n for n in names if vm(live, n)["host"] == h] for h in ("lv1", "lv2", "lv3")}
        two = next(h for h, on in hosts.items() if len(on) == 2)
        run_json(live, "host", "fail", two, "--mode", "power")
        wait(running_elsewhere(live, hosts[two], two), 180, f"{hosts[two]} to run elsewhere", live)
        once_and_answering(live, names)
        assert run_json(live, "audit")["ok"]
        bring_back(live, two)
    finally:
        run_json(live, "setting", "set", "vmplane.ha.host.failures.tolerated", "0", "--cluster", "cluster1")
        run_json(live, "setting", "set", "cpu.overprovisioning.factor", "4", "--cluster", "cluster1")
    clean(live, names)
