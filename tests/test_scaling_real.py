"""Live scaling of real QEMU guests (TCG): what the guest sees, what the QEMU process may use.

One guest, `fx`, is booted once and scaled by several tests (each finds it running at f1's size, uncapped: the
`fx` fixture boots it again only after a test left it otherwise); a test that needs a fresh boot or
breaks its guest on purpose boots its own. CPU caps are checked where the kernel keeps them (the
domain's cgroup: its quota, its throttling), never by a CPU share that depends on the machine's load."""

import json

import pytest

from vmplane.core.scaling import cpu_cap

from .realguest import (
    CALM,
    busy,
    calm,
    cap_cpus,
    cfs,
    cpu_cgroup,
    cpu_use,
    domain_memory,
    guest,
    qemu_pids,
    record_agrees_with_host,
    run_json,
    scalable_cluster,
    throttled,
    throttled_during,
    vcpu_cpu_use,
    wait_until,
)

THROTTLE_WAIT_S = 120  # a capped busy vCPU is held back within a few periods of 10 ms; a bound, not a speed


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server = scalable_cluster(tmp_path_factory.mktemp("scale"), 4, 2048, {"f1": (1, "256MiB"), "f2": (2, "512MiB")})
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def tidy(live):
    """After each test, whatever it left when it failed: the cluster's settings back, hosts out of
    maintenance, no VM but `fx`, and `fx` not busy. One failure stays one (the tests share one cluster)."""
    yield
    for key, value in (
        ("mem.overprovisioning.factor", "1.0"),
        ("auto.migrate.vm.on.live.scale.insufficient.capacity", "true"),
    ):
        live.cli("setting", "set", key, value, "--cluster", "cluster1")
    for h in run_json(live, "host", "list"):
        if h["state"] == "maintenance":
            live.cli("host", "maintenance", "exit", h["name"])
    for v in run_json(live, "vm", "list", "--limit", "200"):
        if v["name"] == "fx" and v["state"] == "running":
            live.cli("vm", "exec", "fx", "--timeout", "60", "--", CALM)
        elif v["name"] != "fx":
            live.cli("vm", "stop", v["name"], "--force")
            live.cli("vm", "delete", v["name"])


def fx_as_booted(live) -> bool:
    """`fx` runs at f1's size with what a fresh boot gives: 1 vCPU online, no DIMM, no cap of any kind."""
    show = json.loads(live.cli("vm", "show", "fx", "--output", "json").stdout or "{}")
    if (show.get("state"), show.get("vcpus"), show.get("memory_mib")) != ("running", 1, 256):
        return False
    try:
        [pid] = qemu_pids("vmplane-fx", live.home)
        group = cpu_cgroup(pid)
        return (
            domain_memory(live, show["host"], "fx") == (256, [])
            and cap_cpus(group) is None
            and all(cap_cpus(v) is None for v in group.glob("vcpu*"))
            and guest_size(live, "fx")[0] == 1
        )
    except (AssertionError, ValueError, OSError):  # no QEMU, two, or a guest that does not answer
        return False


@pytest.fixture
def fx(live):
    """The module's scalable guest `fx`, running at f1's size as booted; booted (again) when it is not."""
    if not fx_as_booted(live):
        live.cli("vm", "stop", "fx", "--force")
        live.cli("vm", "delete", "fx")
        run_json(live, "vm", "create", "fx", "--project", "p", "--offering", "f1", "--template", "scalable", "--start")
    return "fx"


def guest_size(live, vm):
    out = guest(live, vm, "nproc; grep MemTotal /proc/meminfo; cut -d' ' -f1 /proc/uptime").split()
    return int(out[0]), int(out[2]), float(out[4])


def scale(live, vm, *args):
    r = live.cli("vm", "scale", vm, *args, "--output", "json", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def domain_group(vm: str):
    [pid] = qemu_pids(f"vmplane-{vm}")
    return pid, cpu_cgroup(pid)


def test_a_fixed_offering_vm_scales_up_and_down_live_seen_in_the_guest(live, fx):
    vcpus, mem0, up0 = guest_size(live, fx)
    assert vcpus == 1
    out = scale(live, fx, "--offering", "f2")
    assert (out["vcpus"], out["memory_mib"], out["offering"]) == (2, 512, "f2") and "hotplug" in out["scale"]
    vcpus, mem1, up1 = guest_size(live, fx)
    assert vcpus == 2 and mem1 - mem0 == 256 * 1024 and up1 > up0  # grew, no reboot

    # down, live: 2 -> 1 vCPU, 512 -> 256 MiB; then a busy guest may use one CPU at most
    out = scale(live, fx, "--offering", "f1")
    assert (out["vcpus"], out["memory_mib"]) == (1, 256)
    # the method of each part, not a word that is always there ("memory dimm-unplug; vcpus soft")
    assert "memory dimm-unplug" in out["scale"] and ("vcpus soft" in out["scale"] or "vcpus unplug" in out["scale"])
    vcpus, mem2, up2 = guest_size(live, fx)
    assert vcpus == 1 and mem2 == mem0 and up2 > up1
    assert domain_memory(live, out["host"], fx) == (256, [])  # the DIMM really left
    record_agrees_with_host(live, fx)
    pid, group = domain_group(fx)
    if "vcpus soft" in out["scale"]:  # TCG: the offlined vCPU stays plugged, a whole-domain cap holds 1 CPU
        assert cap_cpus(group) == 1.0
    busy(live, fx, 2)
    assert cpu_use(pid) <= 1.15  # an upper bound holds under load

    out = scale(live, fx, "--offering", "f2")  # back up
    vcpus, mem3, up3 = guest_size(live, fx)
    assert vcpus == 2 and mem3 == mem1 and up3 > up2
    assert qemu_pids("vmplane-fx", live.home) == [pid]  # the same QEMU, alive
    assert cap_cpus(group) is None  # both busy vCPUs may run again
    before = throttled(group)
    record_agrees_with_host(live, fx)
    assert run_json(live, "audit")["ok"]  # while it runs, scaled
    assert throttled(group) == before  # not held back meanwhile

    calm(live, fx)
    out = scale(live, fx, "--offering", "f1")  # down again: fx as it started
    assert (out["vcpus"], out["memory_mib"]) == (1, 256) and guest_size(live, fx)[:2] == (1, mem0)
    record_agrees_with_host(live, fx)


def test_the_cpu_cap_is_applied_updated_and_removed_live(live, fx):
    mhz = run_json(live, "host", "show", run_json(live, "vm", "show", fx)["host"])["cpu_mhz"]
    for name, speed in (("quarter", mhz // 4), ("half", mhz // 2)):
        run_json(
            live,
            "offering",
            "create",
            name,
            "--kind",
            "fixed",
            "--vcpus",
            "1",
            "--memory",
            "256MiB",
            "--dynamic-scaling",
            "--cpu-speed",
            str(speed),
            "--cpu-cap",
        )
    busy(live, fx)
    pid, group = domain_group(fx)
    vcpu0 = group / "vcpu0"
    assert cap_cpus(vcpu0) is None  # uncapped
    assert throttled_during(vcpu0) == 0  # busy, never held back

    for offering, speed, step in (("quarter", mhz // 4, "applied"), ("half", mhz // 2, "updated")):
        scale(live, fx, "--offering", offering)
        cap = cpu_cap(speed, mhz)
        assert cfs(vcpu0) == (cap.quota_us, cap.period_us), step  # the cap, read back
        before = throttled(vcpu0)
        wait_until(lambda b=before: throttled(vcpu0) > b, THROTTLE_WAIT_S, f"the busy vCPU throttled ({offering})")
        share = cap.quota_us / cap.period_us
        used = vcpu_cpu_use(pid)
        assert used <= share + 0.05, f"{offering}: the vCPU used {used:.2f} CPU, above its cap {share}"

    scale(live, fx, "--cpu-cap", "off")  # removed
    assert cap_cpus(vcpu0) is None and throttled_during(vcpu0) == 0
    calm(live, fx)  # fx stays at 1 vCPU / 256 MiB uncapped (its offering: half)


def test_a_full_host_moves_the_vm_then_scales_it_and_without_auto_migrate_refuses(live, fx):
    # small host capacity so that one VM fills a host: about 1.2 GiB each, whatever share of the machine's
    # memory a local host reports (`vmplane up` splits it between its hosts)
    host_mib = min(run_json(live, "host", "show", h)["memory_mib"] for h in ("lv1", "lv2"))
    run_json(live, "setting", "set", "mem.overprovisioning.factor", f"{1200 / host_mib:.4f}", "--cluster", "cluster1")
    home = run_json(live, "vm", "show", fx)["host"]
    other = "lv2" if home == "lv1" else "lv1"
    run_json(live, "host", "maintenance", "enter", other)
    run_json(
        live, "vm", "create", "filler", "--project", "p", "--offering", "f1", "--template", "scalable", "--start"
    )  # lands on `home` too
    run_json(live, "host", "maintenance", "exit", other)
    run_json(
        live, "setting", "set", "auto.migrate.vm.on.live.scale.insufficient.capacity", "false", "--cluster", "cluster1"
    )
    r = live.cli("vm", "scale", fx, "--offering", "f2", "--output", "json")
    body = json.loads(r.stdout)
    assert r.returncode == 1 and body["error"] == "insufficient_capacity"
    assert (
        f"host {home}" in body["message"] and "auto.migrate.vm.on.live.scale.insufficient.capacity" in body["message"]
    )
    assert run_json(live, "vm", "show", fx)["vcpus"] == 1
    run_json(
        live, "setting", "set", "auto.migrate.vm.on.live.scale.insufficient.capacity", "true", "--cluster", "cluster1"
    )
    plan = run_json(live, "vm", "scale", fx, "--offering", "f2", "--dry-run")
    assert plan["path"] == "migrate-then-scale" and plan["migrate_to"] == other
    out = scale(live, fx, "--offering", "f2")
    assert out["host"] == other and out["vcpus"] == 2
    vcpus, _, _ = guest_size(live, fx)
    assert vcpus == 2 and domain_memory(live, other, fx) == (512, [256])
    record_agrees_with_host(live, fx)
    assert run_json(live, "audit")["ok"]
    out = scale(live, fx, "--offering", "f1")  # a moved guest scales down live
    assert (out["host"], out["vcpus"], out["memory_mib"]) == (other, 1, 256) and guest_size(live, fx)[0] == 1
    record_agrees_with_host(live, fx)


def charged(live) -> tuple:
    usage = run_json(live, "project", "usage", "p")
    return usage["vcpus"], usage["memory_mib"]


def online_dimm_memory_as_kernel(live, vm) -> str:
    """Inside the guest: re-online the hot-added memory blocks (above 4 GiB, where QEMU places DIMMs) as
    kernel memory, which the kernel can not migrate away: the guest can no longer release the DIMM."""
    return guest(
        live,
        vm,
        "bs=$((0x$(cat /sys/devices/system/memory/block_size_bytes))); "
        "for m in /sys/devices/system/memory/memory*; do n=${m##*memory}; "
        "[ $((n * bs)) -ge $((4 << 30)) ] || continue; echo offline > $m/state; "
        "echo online_kernel > $m/state; echo $n $(cat $m/state) $(cat $m/valid_zones); done",
    )


def test_the_walkthrough_scale_while_booting_cap_then_down_leaves_domain_guest_record_and_ledger_agreeing(live):
    """The issue's walkthrough: f1 -> f2 right after the start (the guest still boots), the CPU cap on,
    then back to f1. Whichever way the DIMM unplug ends, the domain, the guest, the record, the ledger
    and the host's claim say the same size afterwards."""
    run_json(live, "vm", "create", "app", "--project", "p", "--offering", "f1", "--template", "scalable", "--start")
    up = scale(live, "app", "--offering", "f2")  # while the guest boots
    assert (up["vcpus"], up["memory_mib"]) == (2, 512)
    assert domain_memory(live, up["host"], "app") == (512, [256])
    vcpus, mem_f2, _ = guest_size(live, "app")
    assert vcpus == 2
    record_agrees_with_host(live, "app")
    scale(live, "app", "--cpu-cap", "on")
    r = live.cli("vm", "scale", "app", "--offering", "f1", "--output", "json", timeout=600)
    show = record_agrees_with_host(live, "app")
    current, dimms = domain_memory(live, show["host"], "app")
    vcpus, mem, _ = guest_size(live, "app")
    if r.returncode == 0:  # the guest released it
        assert (show["vcpus"], show["memory_mib"], current, dimms) == (1, 256, 256, [])
        assert mem == mem_f2 - 256 * 1024 and vcpus == 1
    else:  # refused (the DIMM) or failed (the soft vCPU step): the cause named, the size kept
        said = r.stdout + r.stderr
        assert "still attached" in said or "vCPUs online" in said, said
        assert show["memory_mib"] == current and show["vcpus"] == vcpus, (show, current, vcpus)
        assert mem == (mem_f2 if current == 512 else mem_f2 - 256 * 1024)
    assert run_json(live, "audit")["ok"]


def test_a_guest_that_refuses_the_unplug_fails_the_scale_naming_it_and_keeps_the_larger_size(live, fx):
    """Breaks `fx` on purpose (its DIMM made unmovable): the `fx` fixture boots it again if a later test
    asks for it."""
    scale(live, fx, "--offering", "f2")
    _, mem_f2, _ = guest_size(live, fx)
    blocks = online_dimm_memory_as_kernel(live, fx)
    assert "online" in blocks and "Normal" in blocks, blocks
    before = charged(live)
    r = live.cli("vm", "scale", fx, "--offering", "f1", "--output", "json", timeout=600)
    assert r.returncode != 0, r.stdout
    message = r.stdout + r.stderr
    assert "DIMM" in message and "still attached after 3 unplug requests" in message, message
    assert "the guest did not release it" in message, message
    show = record_agrees_with_host(live, fx)
    assert (show["state"], show["vcpus"], show["memory_mib"], show["offering"]) == ("running", 2, 512, "f2")
    assert domain_memory(live, show["host"], fx) == (512, [256])
    assert charged(live) == before  # still charged the larger size
    vcpus, mem, _ = guest_size(live, fx)
    assert (vcpus, mem) == (2, mem_f2)
    assert run_json(live, "audit")["ok"]
