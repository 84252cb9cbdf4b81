"""Live scaling of real QEMU guests (TCG): what the guest sees, what the QEMU process may use."""

import json

import pytest

from .realguest import (cpu_use, domain_memory, guest, qemu_pids, record_agrees_with_host, run_json,
                        scalable_cluster)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server = scalable_cluster(tmp_path_factory.mktemp("scale"), 4, 2048, {"f1": (1, "256MiB"), "f2": (2, "512MiB")})
    yield server
    server.stop()


def guest_size(live, vm):
    out = guest(live, vm, "nproc; grep MemTotal /proc/meminfo; cut -d' ' -f1 /proc/uptime").split()
    return int(out[0]), int(out[2]), float(out[4])


def scale(live, vm, *args):
    r = live.cli("vm", "scale", vm, *args, "--output", "json", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def test_a_fixed_offering_vm_scales_up_and_down_live_seen_in_the_guest(live):
    run_json(live, "vm", "create", "fx", "--project", "p", "--offering", "f1", "--template", "scalable", "--start")
    vcpus, mem0, up0 = guest_size(live, "fx")
    assert vcpus == 1
    out = scale(live, "fx", "--offering", "f2")
    assert (out["vcpus"], out["memory_mib"], out["offering"]) == (2, 512, "f2") and "hotplug" in out["scale"]
    vcpus, mem1, up1 = guest_size(live, "fx")
    assert vcpus == 2 and mem1 - mem0 == 256 * 1024 and up1 > up0                 # grew, no reboot

    # down, live: 2 -> 1 vCPU, 512 -> 256 MiB; then a busy guest may use one CPU at most
    out = scale(live, "fx", "--offering", "f1")
    assert (out["vcpus"], out["memory_mib"]) == (1, 256)
    # the method of each part, not a word that is always there ("memory dimm-unplug; vcpus soft")
    assert "memory dimm-unplug" in out["scale"] and ("vcpus soft" in out["scale"] or "vcpus unplug" in out["scale"])
    vcpus, mem2, up2 = guest_size(live, "fx")
    assert vcpus == 1 and mem2 == mem0 and up2 > up1
    assert domain_memory(live, out["host"], "fx") == (256, [])                     # the DIMM really left
    record_agrees_with_host(live, "fx")
    guest(live, "fx", "for i in 1 2; do (while :; do :; done) >/dev/null 2>&1 & done")
    [pid] = qemu_pids("vmplane-fx")
    assert cpu_use(pid) <= 1.15

    out = scale(live, "fx", "--offering", "f2")                                    # back up
    vcpus, mem3, up3 = guest_size(live, "fx")
    assert vcpus == 2 and mem3 == mem1 and up3 > up2
    assert qemu_pids("vmplane-fx") == [pid]                                        # the same QEMU, alive
    assert cpu_use(pid) > 1.4                                                      # both busy vCPUs run again
    record_agrees_with_host(live, "fx")
    assert run_json(live, "audit")["ok"]                                           # while it runs, scaled
    run_json(live, "vm", "stop", "fx", "--force")


def test_the_cpu_cap_is_applied_updated_and_removed_live(live):
    mhz = run_json(live, "host", "show", "lv1")["cpu_mhz"]
    run_json(live, "offering", "create", "quarter", "--kind", "fixed", "--vcpus", "1", "--memory", "256MiB",
             "--dynamic-scaling", "--cpu-speed", str(mhz // 4), "--cpu-cap")
    run_json(live, "offering", "create", "half", "--kind", "fixed", "--vcpus", "1", "--memory", "256MiB",
             "--dynamic-scaling", "--cpu-speed", str(mhz // 2), "--cpu-cap")
    run_json(live, "vm", "create", "cap", "--project", "p", "--offering", "f1", "--template", "scalable", "--start")
    guest(live, "cap", "(while :; do :; done) >/dev/null 2>&1 &")
    [pid] = qemu_pids("vmplane-cap")
    assert cpu_use(pid) > 0.8                                                      # uncapped
    scale(live, "cap", "--offering", "quarter")                                    # applied
    assert cpu_use(pid) <= 0.3
    scale(live, "cap", "--offering", "half")                                       # updated
    assert 0.35 <= cpu_use(pid) <= 0.6
    scale(live, "cap", "--cpu-cap", "off")                                         # removed
    assert cpu_use(pid) > 0.8
    run_json(live, "vm", "stop", "cap", "--force")


def test_a_full_host_moves_the_vm_then_scales_it_and_without_auto_migrate_refuses(live):
    # small host capacity so that one VM fills a host: about 1.2 GiB each, whatever share of the machine's
    # memory a local host reports (`vmplane up` splits it between its hosts)
    host_mib = min(run_json(live, "host", "show", h)["memory_mib"] for h in ("lv1", "lv2"))
    run_json(live, "setting", "set", "mem.overprovisioning.factor", f"{1200 / host_mib:.4f}", "--cluster", "cluster1")
    try:
        run_json(live, "vm", "create", "mover", "--project", "p", "--offering", "f1", "--template", "scalable",
                 "--start")
        home = run_json(live, "vm", "show", "mover")["host"]
        other = "lv2" if home == "lv1" else "lv1"
        run_json(live, "host", "maintenance", "enter", other)
        run_json(live, "vm", "create", "filler", "--project", "p", "--offering", "f1", "--template", "scalable",
                 "--start")                                                        # lands on `home` too
        run_json(live, "host", "maintenance", "exit", other)
        run_json(live, "setting", "set", "auto.migrate.vm.on.live.scale.insufficient.capacity", "false",
                 "--cluster", "cluster1")
        r = live.cli("vm", "scale", "mover", "--offering", "f2", "--output", "json")
        body = json.loads(r.stdout)
        assert r.returncode == 1 and body["error"] == "insufficient_capacity"
        assert f"host {home}" in body["message"] and "auto.migrate.vm.on.live.scale.insufficient.capacity" in body["message"]
        assert run_json(live, "vm", "show", "mover")["vcpus"] == 1
        run_json(live, "setting", "set", "auto.migrate.vm.on.live.scale.insufficient.capacity", "true",
                 "--cluster", "cluster1")
        plan = run_json(live, "vm", "scale", "mover", "--offering", "f2", "--dry-run")
        assert plan["path"] == "migrate-then-scale" and plan["migrate_to"] == other
        out = scale(live, "mover", "--offering", "f2")
        assert out["host"] == other and out["vcpus"] == 2
        vcpus, mem, _ = guest_size(live, "mover")
        assert vcpus == 2 and domain_memory(live, other, "mover") == (512, [256])
        record_agrees_with_host(live, "mover")
        assert run_json(live, "audit")["ok"]
    finally:
        run_json(live, "setting", "set", "mem.overprovisioning.factor", "1.0", "--cluster", "cluster1")


def charged(live) -> tuple:
    usage = run_json(live, "project", "usage", "p")
    return usage["vcpus"], usage["memory_mib"]


def online_dimm_memory_as_kernel(live, vm) -> str:
    """Inside the guest: re-online the hot-added memory blocks (above 4 GiB, where QEMU places DIMMs) as
    kernel memory, which the kernel can not migrate away: the guest can no longer release the DIMM."""
    return guest(live, vm, "bs=$((0x$(cat /sys/devices/system/memory/block_size_bytes))); "
                           "for m in /sys/devices/system/memory/memory*; do n=${m##*memory}; "
                           "[ $((n * bs)) -ge $((4 << 30)) ] || continue; echo offline > $m/state; "
                           "echo online_kernel > $m/state; echo $n $(cat $m/state) $(cat $m/valid_zones); done")


def test_the_walkthrough_scale_while_booting_cap_then_down_leaves_domain_guest_record_and_ledger_agreeing(live):
    """The issue's walkthrough: f1 -> f2 right after the start (the guest still boots), the CPU cap on,
    then back to f1. Whichever way the DIMM unplug ends, the domain, the guest, the record, the ledger
    and the host's claim say the same size afterwards."""
    run_json(live, "vm", "create", "app", "--project", "p", "--offering", "f1", "--template", "scalable", "--start")
    up = scale(live, "app", "--offering", "f2")                                    # while the guest boots
    assert (up["vcpus"], up["memory_mib"]) == (2, 512)
    assert domain_memory(live, up["host"], "app") == (512, [256])
    vcpus, mem_f2, _ = guest_size(live, "app")
    assert vcpus == 2
    record_agrees_with_host(live, "app")
    scale(live, "app", "--cpu-cap", "on")
    r = live.cli("vm", "scale", "app", "--offering", "f1", "--output", "json", timeout=300)
    show = record_agrees_with_host(live, "app")
    current, dimms = domain_memory(live, show["host"], "app")
    vcpus, mem, _ = guest_size(live, "app")
    if r.returncode == 0:                                                          # the guest released it
        assert (show["vcpus"], show["memory_mib"], current, dimms) == (1, 256, 256, [])
        assert mem == mem_f2 - 256 * 1024 and vcpus == 1
    else:            # refused (the DIMM) or failed (the soft vCPU step): the cause named, the size kept
        said = r.stdout + r.stderr
        assert "still attached" in said or "vCPUs online" in said, said
        assert show["memory_mib"] == current and show["vcpus"] == vcpus, (show, current, vcpus)
        assert mem == (mem_f2 if current == 512 else mem_f2 - 256 * 1024)
    assert run_json(live, "audit")["ok"]
    run_json(live, "vm", "stop", "app", "--force")


def test_a_guest_that_refuses_the_unplug_fails_the_scale_naming_it_and_keeps_the_larger_size(live):
    run_json(live, "vm", "create", "keep", "--project", "p", "--offering", "f1", "--template", "scalable",
             "--start")
    scale(live, "keep", "--offering", "f2")
    _, mem_f2, _ = guest_size(live, "keep")
    blocks = online_dimm_memory_as_kernel(live, "keep")
    assert "online" in blocks and "Normal" in blocks, blocks
    before = charged(live)
    r = live.cli("vm", "scale", "keep", "--offering", "f1", "--output", "json", timeout=300)
    assert r.returncode != 0, r.stdout
    message = r.stdout + r.stderr
    assert "DIMM" in message and "still attached after 3 unplug requests" in message, message
    assert "the guest did not release it" in message, message
    show = record_agrees_with_host(live, "keep")
    assert (show["state"], show["vcpus"], show["memory_mib"], show["offering"]) == ("running", 2, 512, "f2")
    assert domain_memory(live, show["host"], "keep") == (512, [256])
    assert charged(live) == before                                                 # still charged the larger size
    vcpus, mem, _ = guest_size(live, "keep")
    assert (vcpus, mem) == (2, mem_f2)
    assert run_json(live, "audit")["ok"]
    run_json(live, "vm", "stop", "keep", "--force")
