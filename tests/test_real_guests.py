"""Real QEMU guests (TCG) on local libvirtd hosts, driven through `vmplane up --driver libvirt` and the CLI."""

import json
import time

import pytest

from .realguest import (
    cpu_use,
    domains_on,
    guest,
    host_of,
    libvirt_cluster,
    qemu_pids,
    run_json,
)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server = libvirt_cluster(tmp_path_factory.mktemp("libvirt"))
    yield server
    server.stop()
    # `vmplane up` stops what it started: no libvirtd of this cluster is left
    for name in ("lv1", "lv2"):
        assert host_of(server, name).pid() is None


def test_a_started_vm_boots_and_the_guest_sees_its_offering(live):
    run_json(live, "offering", "create", "one", "--kind", "fixed", "--vcpus", "1", "--memory", "512MiB")
    run_json(live, "offering", "create", "two", "--kind", "fixed", "--vcpus", "2", "--memory", "768MiB")
    for vm, offering, vcpus, memory in (("g1", "one", 1, 512), ("g2", "two", 2, 768)):
        out = run_json(live, "vm", "create", vm, "--project", "p", "--offering", offering, "--template",
                       "tiny-linux", "--start")
        assert out["state"] == "running" and out["host"] in ("lv1", "lv2")
        assert guest(live, vm, "nproc").strip() == str(vcpus)
        memtotal_kib = int(guest(live, vm, "grep MemTotal /proc/meminfo").split()[1])
        # the kernel keeps ~100 MiB for itself: MemTotal is a little under the offering, never over
        assert (memory - 128) * 1024 <= memtotal_kib <= memory * 1024, memtotal_kib
    assert run_json(live, "audit") == {"ok": True, "problems": []}


def test_stop_start_and_delete_leave_no_domain_no_qemu_and_no_claim(live):
    vm = run_json(live, "vm", "create", "cycle", "--project", "p", "--offering", "one", "--template", "tiny-linux",
                  "--start")
    host, domain = vm["host"], "vmplane-cycle"
    assert domain in domains_on(live, host) and len(qemu_pids(domain)) == 1
    assert guest(live, "cycle", "echo hello").strip() == "hello"

    assert run_json(live, "vm", "stop", "cycle", "--force")["state"] == "stopped"
    assert domain not in domains_on(live, "lv1") + domains_on(live, "lv2")
    assert qemu_pids(domain) == []
    claimed = {h["name"]: h["used_vcpus"] for h in run_json(live, "host", "list")}
    assert run_json(live, "audit")["ok"] and sum(claimed.values()) == 3      # g1 + g2 only

    vm = run_json(live, "vm", "start", "cycle")
    assert vm["state"] == "running" and len(qemu_pids(domain)) == 1
    assert guest(live, "cycle", "echo again").strip() == "again"
    run_json(live, "vm", "stop", "cycle", "--force")
    assert run_json(live, "vm", "delete", "cycle") == {"deleted": "cycle"}
    assert domain not in domains_on(live, "lv1") + domains_on(live, "lv2") and qemu_pids(domain) == []
    assert run_json(live, "audit")["ok"]


def test_a_cpu_cap_of_a_quarter_cpu_holds_a_busy_guest_and_lifting_it_frees_it(live):
    mhz = run_json(live, "host", "show", "lv1")["cpu_mhz"]
    run_json(live, "offering", "create", "quarter", "--kind", "fixed", "--vcpus", "1", "--memory", "512MiB",
             "--cpu-speed", str(mhz // 4), "--cpu-cap")
    vm = run_json(live, "vm", "create", "capped", "--project", "p", "--offering", "quarter", "--template",
                  "tiny-linux", "--start")
    guest(live, "capped", "(while :; do :; done) > /dev/null 2>&1 &", timeout=240)   # capped guests boot slowly
    [pid] = qemu_pids("vmplane-capped")
    capped = cpu_use(pid)
    assert capped <= 0.3, f"capped guest used {capped:.2f} CPU"

    from vmplane.drivers.libvirt import LibvirtDriver
    driver = LibvirtDriver(vm["host"], host_of(live, vm["host"]).uri)
    assert driver.domain("vmplane-capped").cpu_cap.quota_us == driver.domain("vmplane-capped").cpu_cap.period_us // 4
    driver.set_cpu_cap("vmplane-capped", None)
    time.sleep(0.5)
    free = cpu_use(pid)
    driver.close()
    assert free > 0.6, f"uncapped busy guest used only {free:.2f} CPU"
    run_json(live, "vm", "stop", "capped", "--force")


def test_exec_errors_are_clear(live):
    r = live.cli("vm", "exec", "g1", "--output", "json", "--", "exit 3")
    assert r.returncode == 3 and json.loads(r.stdout)["exit_code"] == 3
    run_json(live, "vm", "create", "off", "--project", "p", "--offering", "one", "--template", "tiny-linux")
    r = live.cli("vm", "exec", "off", "--output", "json", "--", "true")
    assert r.returncode == 1 and "only" not in r.stdout and "running VM" in json.loads(r.stdout)["message"]


def test_restarting_vmplane_up_finds_running_vms_again(live):
    before = {v["name"]: v for v in run_json(live, "vm", "list") if v["state"] == "running"}
    uptime = float(guest(live, "g1", "cut -d' ' -f1 /proc/uptime"))
    live.stop("kill")                 # the control plane dies; hosts and guests keep running
    live.start()
    after = {v["name"]: v for v in run_json(live, "vm", "list") if v["state"] == "running"}
    assert after.keys() == before.keys() and all(after[n]["host"] == before[n]["host"] for n in after)
    for name, vm in after.items():
        everywhere = domains_on(live, "lv1") + domains_on(live, "lv2")
        assert everywhere.count(f"vmplane-{name}") == 1 and len(qemu_pids(f"vmplane-{name}")) == 1
    assert float(guest(live, "g1", "cut -d' ' -f1 /proc/uptime")) > uptime       # no reboot
    assert run_json(live, "audit") == {"ok": True, "problems": []}
