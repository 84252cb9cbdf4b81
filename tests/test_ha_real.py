"""High availability on real QEMU guests (local libvirtd hosts): a host's power failure, its libvirtd
killed, its network cut, a blip, the control plane killed mid-recovery. Each time the HA VMs run and
answer on other hosts exactly once (one QEMU per VM on the whole machine), never before their host is
fenced; VMs without HA are stopped with their charge released; the quota usage of the HA VMs does not
change; the audit is clean.

The tests read states through the API (a CLI call costs a second of CPU, which the TCG guests need) and
start their VMs without waiting for each in turn; each prints how long its phases took."""

from __future__ import annotations

import time

import pytest

from .realguest import crash_at, guest, libvirt_cluster, qemu_pids, run_json, settled

GRACE_S = 3
HOSTS = ("lv1", "lv2", "lv3")


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
    for h in api(live, "GET", "/hosts"):
        if h["state"] in ("down", "fencing", "fenced") or (live.home / "hosts" / h["name"] / "failed").exists():
            live.cli("host", "recover", h["name"])
        elif h["state"] == "maintenance":
            live.cli("host", "maintenance", "exit", h["name"])
    for v in api(live, "GET", "/vms", params={"limit": 200}):
        if v["state"] == "running":
            live.cli("vm", "stop", v["name"], "--force")
        live.cli("vm", "delete", v["name"])


class Phases:
    """Prints how long each phase of a test took (measurement only: nothing asserts a duration)."""

    def __init__(self, test: str):
        self.test, self.t0 = test, time.monotonic()
        self.last = self.t0

    def __call__(self, what: str) -> None:
        now = time.monotonic()
        print(f"[{self.test}] {what}: {now - self.last:.1f} s (at {now - self.t0:.1f} s)")
        self.last = now


def api(live, method: str, path: str, **kwargs):
    with live.client(timeout=120) as c:
        r = c.request(method, path, **kwargs)
    assert r.status_code < 300, f"{method} {path}: {r.status_code} {r.text}"
    return r.json() if r.content else None


def wait(predicate, timeout: float, what: str, live=None):
    t0 = time.monotonic()
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() - t0 > timeout:
            log = live.log.read_text()[-3000:] if live else ""
            raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{log}")
        time.sleep(0.3)


def host(live, name: str) -> dict:
    return api(live, "GET", f"/hosts/{name}")


def vm(live, name: str) -> dict:
    return api(live, "GET", f"/vms/{name}")


def start_vms(live, specs: list[tuple[str, str, int]], offering: str = "ha") -> list[dict]:
    """Create and start VMs (name, ha, priority), each with its root disk on the shared pool, one after
    the other at admission (placement sees each claim) but without waiting for each to run; returns
    them once all run."""
    for name, ha, priority in specs:
        api(
            live,
            "POST",
            "/vms",
            json={
                "name": name,
                "project": "p",
                "offering": offering,
                "template": "tiny-linux",
                "pool": "shared",
                "ha_policy": ha,
                "ha_priority": priority,
                "start": True,
            },
        )
    names = [name for name, _, _ in specs]
    return wait(lambda: all_running(live, names), 120, f"{', '.join(names)} to run", live)


def all_running(live, names: list[str]) -> list[dict] | None:
    vms = [vm(live, n) for n in names]
    assert all(v["state"] in ("starting", "running") for v in vms), vms
    return vms if all(v["state"] == "running" for v in vms) else None


def create_on(live, where: str, specs: list[tuple[str, str, int]]) -> None:
    """Start VMs (name, ha, priority) on host `where` (the other hosts in maintenance while they are
    placed: placement takes no host name)."""
    others = [h for h in HOSTS if h != where]
    for h in others:
        api(live, "POST", f"/hosts/{h}/maintenance", json={"action": "enter"})
    try:
        for name, ha, priority in specs:
            api(
                live,
                "POST",
                "/vms",
                json={
                    "name": name,
                    "project": "p",
                    "offering": "ha",
                    "template": "tiny-linux",
                    "pool": "shared",
                    "ha_policy": ha,
                    "ha_priority": priority,
                    "start": True,
                },
            )
    finally:
        for h in others:
            api(live, "POST", f"/hosts/{h}/maintenance", json={"action": "exit"})
    names = [name for name, _, _ in specs]
    for v in wait(lambda: all_running(live, names), 120, f"{', '.join(names)} to run", live):
        assert v["host"] == where, v


def running_elsewhere(live, names: list[str], dead: str):
    def check():
        vms = [vm(live, n) for n in names]
        return vms if all(v["state"] == "running" and v["host"] not in (dead, None) for v in vms) else None

    return check


def watch_until_elsewhere(live, name: str, dead: str, timeout: float = 180) -> None:
    """Until `name` runs on another host than `dead`: never two QEMUs of it, never before `dead` is
    fenced."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v, h = vm(live, name), host(live, dead)
        assert len(qemus(live, name)) <= 1
        if v["state"] == "running" and v["host"] != dead:
            assert h["state"] == "fenced", h
            return
        time.sleep(0.2)
    raise AssertionError(
        f"{name} did not run elsewhere: {vm(live, name)} {host(live, dead)}\n{live.log.read_text()[-4000:]}"
    )


def qemus(live, name: str) -> list[int]:
    """The QEMU processes of VM `name` on this module's cluster (another module's VM may share its name)."""
    return qemu_pids(f"vmplane-{name}", live.home)


def once_and_answering(live, names: list[str]) -> None:
    for name in names:
        assert len(qemus(live, name)) == 1, f"{name}: QEMU processes {qemus(live, name)}"
        assert "ok" in guest(live, name, "echo ok")


def operations(live, kind: str) -> list[dict]:
    ops = [o for o in api(live, "GET", "/operations", params={"limit": 200}) if o["kind"] == kind]
    return sorted(ops, key=lambda o: o["created_at"])


def bring_back(live, name: str) -> None:
    run_json(live, "host", "recover", name)
    wait(lambda: host(live, name)["state"] == "enabled", 60, f"{name} back", live)


def clean(live, names: list[str]) -> None:
    for name in names:
        if vm(live, name)["state"] == "running":
            api(live, "POST", f"/vms/{name}/stop", json={"force": True})
    wait(lambda: all(vm(live, n)["state"] == "stopped" for n in names), 60, f"{names} stopped", live)
    for name in names:
        api(live, "DELETE", f"/vms/{name}")


def set_grace(live, seconds: float) -> None:
    run_json(live, "setting", "set", "vmplane.ha.grace", str(seconds), "--cluster", "cluster1")


def test_a_blip_restarts_nothing_then_a_power_failure_restarts_the_ha_vms_elsewhere_by_priority_each_once(live):
    """One set of VMs on lv1 for both: a network blip shorter than the grace leaves them where they run;
    then lv1's power failure restarts the HA VMs elsewhere, highest priority first, and stops the other."""
    phase = Phases("blip+power")
    run_json(live, "setting", "set", "vmplane.ha.max.parallel", "1", "--cluster", "cluster1")
    names = ["p1", "p2", "p3"]
    create_on(live, "lv1", [("p1", "restart", 1), ("p2", "restart", 2), ("p3", "restart", 3), ("plain", "off", 0)])
    phase("4 VMs started on lv1")
    digest = guest(live, "p3", "echo kept > /data/f; sync; md5sum /data/f").split()[0]
    phase("p3 answered (booted)")

    restarts = len(operations(live, "restart"))
    set_grace(live, 60)
    try:
        run_json(live, "host", "fail", "lv1", "--mode", "network")
        wait(lambda: host(live, "lv1")["state"] == "down", 30, "lv1 down", live)
        time.sleep(3)  # a blip: down for a while, well within the grace
        run_json(live, "host", "recover", "lv1")
        wait(lambda: host(live, "lv1")["state"] == "enabled", 60, "lv1 back", live)
        phase("blip: lv1 down and back")
        for n in names + ["plain"]:
            v = vm(live, n)
            assert (v["state"], v["host"]) == ("running", "lv1"), v
        assert len(operations(live, "restart")) == restarts
        once_and_answering(live, names + ["plain"])
        phase("blip: every VM answered on lv1")
    finally:
        set_grace(live, GRACE_S)

    before = run_json(live, "project", "usage", "p")
    t0 = time.monotonic()
    run_json(live, "host", "fail", "lv1", "--mode", "power")
    wait(running_elsewhere(live, names, "lv1"), 180, "the HA VMs to run elsewhere", live)
    phase("power: HA VMs running elsewhere")
    once_and_answering(live, names)
    took = time.monotonic() - t0
    phase("power: HA VMs answered")
    assert [o["vm"] for o in operations(live, "restart")] == ["p3", "p2", "p1"]  # highest priority first
    lv1 = host(live, "lv1")
    assert lv1["state"] == "fenced" and "local agent" in lv1["state_reason"], lv1
    assert vm(live, "plain")["state"] == "stopped" and qemus(live, "plain") == []
    after = run_json(live, "project", "usage", "p")  # p counts no overhead: plain's 1 vCPU / 384 MiB went
    assert (after["vcpus"]["used"], after["memory_mib"]["used"]) == (
        before["vcpus"]["used"] - 1,
        before["memory_mib"]["used"] - 384,
    )
    assert guest(live, "p3", "md5sum /data/f").split()[0] == digest  # its disk kept its data
    assert run_json(live, "audit")["ok"]
    print(f"power failure to 3 HA VMs answering elsewhere: {took:.1f} s")
    bring_back(live, "lv1")
    run_json(live, "setting", "set", "vmplane.ha.max.parallel", "4", "--cluster", "cluster1")
    clean(live, names + ["plain"])
    phase("lv1 back, VMs deleted")


def test_a_host_whose_network_is_cut_is_fenced_before_its_guests_run_elsewhere(live):
    """(Its libvirtd killed: the next test, whose fencing fails first.)"""
    phase = Phases("network")
    create_on(live, "lv2", [("g1", "restart", 0)])
    phase("g1 started on lv2")
    run_json(live, "host", "fail", "lv2", "--mode", "network")
    watch_until_elsewhere(live, "g1", "lv2")
    phase("g1 running elsewhere")
    once_and_answering(live, ["g1"])
    phase("g1 answered")
    assert run_json(live, "audit")["ok"]
    bring_back(live, "lv2")
    clean(live, ["g1"])
    phase("lv2 back, g1 deleted")


def test_fencing_that_fails_restarts_nothing_and_is_retried_until_it_works(live):
    """lv3's libvirtd is killed (its guest runs on) and it has no fence agent: fencing fails, nothing is
    restarted; once its agent is set, it is fenced, and only then does its guest run elsewhere (never two
    QEMUs). An agent that fails by itself (IPMI, Redfish: a wrong password) is test_fence_agents_real's."""
    phase = Phases("fencing fails")
    create_on(live, "lv3", [("f1", "restart", 0)])
    phase("f1 started on lv3")
    run_json(live, "host", "fence-agents", "lv3", "[]")
    run_json(live, "host", "fail", "lv3", "--mode", "daemon")  # its guest runs on
    reason = wait(
        lambda: "fencing failed" in (host(live, "lv3")["state_reason"] or "") and host(live, "lv3")["state_reason"],
        90,
        "a failed fencing attempt",
        live,
    )
    assert "no fence agent" in reason, reason
    phase("fencing failed")
    time.sleep(GRACE_S)
    assert host(live, "lv3")["state"] == "fencing" and vm(live, "f1")["state"] == "unknown"
    assert len(qemus(live, "f1")) == 1 and all(o["vm"] != "f1" for o in operations(live, "restart"))
    run_json(live, "host", "fence-agents", "lv3", '[{"agent": "local"}]')  # the BMC is repaired
    watch_until_elsewhere(live, "f1", "lv3")
    phase("f1 running elsewhere")
    once_and_answering(live, ["f1"])
    assert run_json(live, "audit")["ok"]
    bring_back(live, "lv3")
    clean(live, ["f1"])
    phase("lv3 back, f1 deleted")


def test_the_control_plane_killed_mid_recovery_is_finished_by_the_next_one(live):
    phase = Phases("killed mid-recovery")
    create_on(live, "lv2", [("k1", "restart", 0), ("k2", "restart", 0)])
    phase("k1 k2 started on lv2")
    crash_at(live, "ha.claimed", lambda c: c.post("/hosts/lv2/fail", json={"mode": "power"}))
    phase("control plane died at ha.claimed and started again")
    wait(running_elsewhere(live, ["k1", "k2"], "lv2"), 180, "k1 and k2 to run elsewhere", live)
    settled(live)
    phase("k1 k2 running elsewhere, settled")
    once_and_answering(live, ["k1", "k2"])
    phase("k1 k2 answered")
    assert run_json(live, "audit")["ok"]
    bring_back(live, "lv2")
    clean(live, ["k1", "k2"])
    phase("lv2 back, k1 k2 deleted")


def test_the_failover_reserve_refuses_the_start_that_breaks_it_and_every_ha_vm_restarts(live):
    # 2 cores x 2 = 4 vCPUs per host; HA VMs of 2 vCPUs; keep room for one host failure (k=1)
    phase = Phases("reserve")
    run_json(live, "setting", "set", "cpu.overprovisioning.factor", "2", "--cluster", "cluster1")
    run_json(live, "setting", "set", "vmplane.ha.host.failures.tolerated", "1", "--cluster", "cluster1")
    run_json(live, "offering", "create", "ha2", "--kind", "fixed", "--vcpus", "2", "--memory", "384MiB")
    names = ["r1", "r2", "r3", "r4"]
    try:
        # spread: 2/2/2 vCPUs, then one host holds 4 (each placed at admission, in turn)
        start_vms(live, [(n, "restart", 0) for n in names], offering="ha2")
        phase("r1-r4 started")
        r = live.cli(
            "vm",
            "create",
            "r5",
            "--project",
            "p",
            "--offering",
            "ha2",
            "--template",
            "tiny-linux",
            "--pool",
            "shared",
            "--ha",
            "restart",
            "--start",
        )
        assert r.returncode != 0 and "vmplane.ha.host.failures.tolerated=1" in r.stdout + r.stderr, r
        shown = run_json(live, "cluster", "show", "cluster1")
        assert shown["failover"]["survives"] is True, shown
        hosts = {h: [n for n in names if vm(live, n)["host"] == h] for h in HOSTS}
        two = next(h for h, on in hosts.items() if len(on) == 2)
        run_json(live, "host", "fail", two, "--mode", "power")
        wait(running_elsewhere(live, hosts[two], two), 180, f"{hosts[two]} to run elsewhere", live)
        phase(f"{hosts[two]} running elsewhere")
        once_and_answering(live, names)
        phase("r1-r4 answered")
        assert run_json(live, "audit")["ok"]
        bring_back(live, two)
    finally:
        run_json(live, "setting", "set", "vmplane.ha.host.failures.tolerated", "0", "--cluster", "cluster1")
        run_json(live, "setting", "set", "cpu.overprovisioning.factor", "4", "--cluster", "cluster1")
    clean(live, names)
    phase(f"{two} back, r1-r4 deleted")
