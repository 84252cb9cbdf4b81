"""Real QEMU guests (TCG) on local libvirtd hosts, driven through `vmplane up --driver libvirt` and the CLI.

`g1` and `g2`, booted by the first test, stay running for the module (the `g1` fixture boots g1 again if
that test failed); every other VM a test starts is stopped after it, even when it fails."""

import json

import pytest

from vmplane.core.scaling import cpu_cap

from .realguest import (
    busy,
    cap_cpus,
    cfs,
    cpu_cgroup,
    domains_on,
    guest,
    host_of,
    libvirt_cluster,
    qemu_pids,
    run_json,
    throttled,
    throttled_during,
    vcpu_cpu_use,
    wait_until,
)

KEPT = ("g1", "g2")


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server = libvirt_cluster(tmp_path_factory.mktemp("libvirt"))
    run_json(server, "offering", "create", "one", "--kind", "fixed", "--vcpus", "1", "--memory", "512MiB")
    run_json(server, "offering", "create", "two", "--kind", "fixed", "--vcpus", "2", "--memory", "768MiB")
    yield server
    server.stop()
    # `vmplane up` stops what it started: no libvirtd of this cluster is left
    for name in ("lv1", "lv2"):
        assert host_of(server, name).pid() is None


@pytest.fixture(autouse=True)
def tidy(live):
    """After each test, whatever it left when it failed: no VM but g1 and g2 runs (a busy guest would load
    the machine for the tests after)."""
    yield
    for v in run_json(live, "vm", "list", "--limit", "200"):
        if v["state"] == "running" and v["name"] not in KEPT:
            live.cli("vm", "stop", v["name"], "--force")


@pytest.fixture
def g1(live):
    """`g1` running, as the first test leaves it; created or started again when it is not."""
    show = live.cli("vm", "show", "g1", "--output", "json")
    if show.returncode != 0:
        run_json(
            live, "vm", "create", "g1", "--project", "p", "--offering", "one", "--template", "tiny-linux", "--start"
        )
    elif json.loads(show.stdout)["state"] != "running":
        run_json(live, "vm", "start", "g1")
    return "g1"


def test_a_started_vm_boots_and_the_guest_sees_its_offering(live):
    for vm, offering, vcpus, memory in (("g1", "one", 1, 512), ("g2", "two", 2, 768)):
        out = run_json(
            live, "vm", "create", vm, "--project", "p", "--offering", offering, "--template", "tiny-linux", "--start"
        )
        assert out["state"] == "running" and out["host"] in ("lv1", "lv2")
        assert guest(live, vm, "nproc").strip() == str(vcpus)
        memtotal_kib = int(guest(live, vm, "grep MemTotal /proc/meminfo").split()[1])
        # the kernel keeps ~100 MiB for itself: MemTotal is a little under the offering, never over
        assert (memory - 128) * 1024 <= memtotal_kib <= memory * 1024, memtotal_kib
    assert run_json(live, "audit") == {"ok": True, "problems": []}


def test_stop_start_and_delete_leave_no_domain_no_qemu_and_no_claim(live):
    vm = run_json(
        live, "vm", "create", "cycle", "--project", "p", "--offering", "one", "--template", "tiny-linux", "--start"
    )
    host, domain = vm["host"], "vmplane-cycle"
    assert domain in domains_on(live, host) and len(qemu_pids(domain, live.home)) == 1
    assert guest(live, "cycle", "echo hello").strip() == "hello"

    assert run_json(live, "vm", "stop", "cycle", "--force")["state"] == "stopped"
    assert domain not in domains_on(live, "lv1") + domains_on(live, "lv2")
    assert qemu_pids(domain, live.home) == []
    claimed = {h["name"]: h["used_vcpus"] for h in run_json(live, "host", "list")}
    running = [v for v in run_json(live, "vm", "list") if v["state"] == "running"]
    assert run_json(live, "audit")["ok"] and sum(claimed.values()) == sum(v["vcpus"] for v in running)

    vm = run_json(live, "vm", "start", "cycle")
    assert vm["state"] == "running" and len(qemu_pids(domain, live.home)) == 1
    assert guest(live, "cycle", "echo again").strip() == "again"
    run_json(live, "vm", "stop", "cycle", "--force")
    assert run_json(live, "vm", "delete", "cycle") == {"deleted": "cycle"}
    assert domain not in domains_on(live, "lv1") + domains_on(live, "lv2") and qemu_pids(domain, live.home) == []
    assert run_json(live, "audit")["ok"]


def test_a_cpu_cap_of_a_quarter_cpu_holds_a_busy_guest_and_lifting_it_frees_it(live):
    mhz = run_json(live, "host", "show", "lv1")["cpu_mhz"]
    run_json(
        live,
        "offering",
        "create",
        "quarter",
        "--kind",
        "fixed",
        "--vcpus",
        "1",
        "--memory",
        "512MiB",
        "--cpu-speed",
        str(mhz // 4),
        "--cpu-cap",
    )
    vm = run_json(
        live, "vm", "create", "capped", "--project", "p", "--offering", "quarter", "--template", "tiny-linux", "--start"
    )
    [pid] = qemu_pids("vmplane-capped", live.home)
    vcpu0 = cpu_cgroup(pid) / "vcpu0"
    cap = cpu_cap(mhz // 4, mhz)
    # capped from its first instant: its boot (busy: TCG runs the kernel's start on this one vCPU) is held
    # back at the quota; no need to wait for a boot at a quarter CPU
    assert cfs(vcpu0) == (cap.quota_us, cap.period_us)
    wait_until(lambda: throttled(vcpu0) > 0, 120, "the capped booting vCPU held back at its quota")
    used = vcpu_cpu_use(pid)
    assert used <= cap.quota_us / cap.period_us + 0.05, f"the capped vCPU used {used:.2f} CPU"  # holds under load

    from vmplane.hosts.drivers.libvirt import LibvirtDriver

    driver = LibvirtDriver(vm["host"], host_of(live, vm["host"]).uri)
    try:
        assert driver.domain("vmplane-capped").cpu_cap == cap  # libvirt reports the same
        driver.set_cpu_cap("vmplane-capped", None)
    finally:
        driver.close()
    assert cap_cpus(vcpu0) is None  # lifted in the kernel
    busy(live, "capped")  # booted, now uncapped
    assert throttled_during(vcpu0) == 0  # busy, never held back again
    run_json(live, "vm", "stop", "capped", "--force")


def test_exec_errors_are_clear(live, g1):
    r = live.cli("vm", "exec", g1, "--output", "json", "--", "exit 3")
    assert r.returncode == 3 and json.loads(r.stdout)["exit_code"] == 3
    run_json(live, "vm", "create", "off", "--project", "p", "--offering", "one", "--template", "tiny-linux")
    r = live.cli("vm", "exec", "off", "--output", "json", "--", "true")
    assert r.returncode == 1 and "only" not in r.stdout and "running VM" in json.loads(r.stdout)["message"]


def test_restarting_vmplane_up_finds_running_vms_again(live, g1):
    before = {v["name"]: v for v in run_json(live, "vm", "list") if v["state"] == "running"}
    uptime = float(guest(live, "g1", "cut -d' ' -f1 /proc/uptime"))
    live.stop("kill")  # the control plane dies; hosts and guests keep running
    live.start()
    after = {v["name"]: v for v in run_json(live, "vm", "list") if v["state"] == "running"}
    assert after.keys() == before.keys() and all(after[n]["host"] == before[n]["host"] for n in after)
    for name in after:
        everywhere = domains_on(live, "lv1") + domains_on(live, "lv2")
        assert everywhere.count(f"vmplane-{name}") == 1 and len(qemu_pids(f"vmplane-{name}", live.home)) == 1
    assert float(guest(live, "g1", "cut -d' ' -f1 /proc/uptime")) > uptime  # no reboot
    assert run_json(live, "audit") == {"ok": True, "problems": []}


def test_a_reboot_inside_the_guest_and_vm_reboot_keep_the_vm_running_on_its_host(live, g1):
    """Issue 33 (audit): a reboot from inside the guest kept nothing running (on_reboot destroy); every domain
    restarts in place now, and `vm reboot` asks the guest (its agent, else ACPI) or resets it (--force)."""
    host = run_json(live, "vm", "show", g1)["host"]

    def uptime() -> float:
        return float(guest(live, g1, "cut -d' ' -f1 /proc/uptime"))

    def rebooted(since: float) -> bool:
        try:
            return uptime() < since
        except AssertionError:  # not answering while it boots again
            return False

    wait_until(lambda: uptime() > 8, 60, "g1 up for a while")  # so that a reboot shows as a smaller uptime
    up = uptime()
    guest(live, g1, "(sleep 1; reboot -f) >/dev/null 2>&1 &")  # from inside the guest
    wait_until(lambda: rebooted(up + 30), 120, "g1 answering again after its own reboot")
    shown = run_json(live, "vm", "show", g1)
    assert (shown["state"], shown["host"]) == ("running", host), shown
    assert domains_on(live, host).count(f"vmplane-{g1}") == 1

    wait_until(lambda: uptime() > 8, 60, "g1 up for a while")
    up = uptime()
    r = run_json(live, "vm", "reboot", g1, "--force")
    assert (r["host"], r["how"]) == (host, "reset (forced)"), r
    wait_until(lambda: rebooted(up), 120, "g1 answering again after vm reboot --force")
    assert run_json(live, "vm", "show", g1)["state"] == "running"
    events = run_json(live, "events", "--vm", g1, "--limit", "5")
    assert any("reboot: reset (forced)" in e["message"] for e in events), events
    run_json(live, "vm", "create", "down", "--project", "p", "--offering", "one", "--template", "tiny-linux")
    r = live.cli("vm", "reboot", "down", "--output", "json")
    assert r.returncode == 1 and "only a running VM is rebooted" in r.stdout, r.stdout
    assert run_json(live, "audit") == {"ok": True, "problems": []}
    live.cli("vm", "delete", "down")
