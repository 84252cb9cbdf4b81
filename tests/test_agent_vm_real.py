"""The guest agent wired into vmplane, on real guests (issue 30): `vm show` says the agent is connected and
lists the guest's address beside the recorded one; a vCPU hot-plug is online in the guest while a person
holds the serial console (no console round trip: a console command would fail then); `vm stop` of a
guest that ignores ACPI (the test guest's init does) goes through the agent, not the forced power-off;
`vm exec` runs through the agent. Timings are printed, never asserted (bench/scale.py measures them)."""

import json
import re
import signal
import subprocess
import sys
import time

import httpx
import libvirt
import pytest

from vmplane.core.driver import DriverError

from . import stores
from .conftest import ADMIN_TOKEN
from .realguest import busy, calm, guest, run_json, scalable_cluster

DOMAIN = "vmplane-ag"
BOUND_S = 180.0  # generous: TCG on a shared 2-core machine
STATS_S = 2.0  # the usage sampler's interval in this module's server (60 s by default)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with stores.env("VMPLANE_STATS_INTERVAL_S", STATS_S):  # the server reads it at its start
        server = scalable_cluster(
            tmp_path_factory.mktemp("agentvm"), 2, 1024, {"f1": (1, "256MiB"), "f2": (2, "256MiB")}
        )
    run_json(server, "network", "create", "a-net", "--project", "p", "--cidr", "10.30.0.0/24")
    # a root disk (ext4, /data in the test guest): what a freeze freezes
    run_json(server, "template", "create", "scalable-disk", "--image", "tiny-linux", "--disk", "tiny-linux",
             "--dynamic-scaling")  # fmt: skip
    yield server
    server.stop()


@pytest.fixture(scope="module")
def vm(live):
    t0 = time.monotonic()
    run_json(live, "vm", "create", "ag", "--project", "p", "--offering", "f1", "--template", "scalable-disk",
             "--network", "a-net", "--pool", "local-lv1", "--start")  # fmt: skip
    running = time.monotonic()
    while not (show := run_json(live, "vm", "show", "ag"))["guest_addresses"]:
        assert time.monotonic() - running < BOUND_S, f"no guest address shown: {show}"
        time.sleep(0.2)
    print(f"\nthe guest's address was shown {time.monotonic() - running:.2f} s after `vm create --start` "
          f"returned ({running - t0:.2f} s in it)")  # fmt: skip
    return "ag"


def test_vm_show_says_the_agent_answers_and_lists_the_guests_address_beside_the_recorded_one(live, vm):
    show = run_json(live, "vm", "show", vm)
    assert show["agent"] == "connected"
    assert show["guest_addresses"] == [f"eth0 {show['nics'][0]['ip']}/24"]
    listed = {v["name"]: v for v in run_json(live, "vm", "list")}
    assert listed[vm]["guest_addresses"] == show["guest_addresses"]
    assert not [p for p in json.loads(live.cli("audit", "--output", "json").stdout or "[]") if "guest" in str(p)]


def test_vm_exec_runs_through_the_agent_with_output_and_exit_code(live, vm):
    r = live.cli("vm", "exec", vm, "--output", "json", "--", "echo out; echo err >&2; exit 4")
    assert r.returncode == 4 and json.loads(r.stdout) == {"output": "out\nerr\n", "exit_code": 4}, r.stdout


def test_a_hot_plugged_vcpu_is_online_with_a_person_on_the_console(live, vm):
    host = run_json(live, "vm", "show", vm)["host"]
    uri = next(h["uri"] for h in run_json(live, "host", "list") if h["name"] == host)
    conn = libvirt.open(uri)
    held = conn.newStream(0)
    conn.lookupByName(f"vmplane-{vm}").openConsole(None, held, 0)  # a person's `virsh console`
    try:
        t0 = time.monotonic()
        out = json.loads(live.cli("vm", "scale", vm, "--offering", "f2", "--output", "json", timeout=600).stdout)
        print(f"\nscaled to 2 vCPUs in {time.monotonic() - t0:.2f} s ({out.get('scale')})")
        assert out["vcpus"] == 2, out
        assert guest(live, vm, "cat /sys/devices/system/cpu/online").strip() == "0-1"
    finally:
        held.abort()
        conn.close()


def test_a_busy_guest_shows_in_its_cpu_graph_within_two_sampling_intervals(live, vm):
    """A CPU loop on each vCPU inside the guest: the VM page's CPU chart (its latest value, as a screen reader
    reads it) climbs from the idle guest's. Waited on with BOUND_S; the time taken is printed in intervals."""
    seen: list[tuple[float, float | None]] = []  # (when, the chart's value): printed
    with httpx.Client(base_url=live.url, timeout=30) as page:
        assert page.post("/ui/login", data={"token": ADMIN_TOKEN}).status_code == 303  # (the session cookie)

        def chart_cpu() -> float | None:
            r = page.get(f"/ui/vms/{vm}")
            r.raise_for_status()
            m = re.search(r'<figure [^>]*data-graph="CPU">.*?<b data-latest="cpu_pct">([\d.]+) %</b>', r.text, re.S)
            value = float(m.group(1)) if m else None
            if not seen or seen[-1][1] != value:
                seen.append((time.monotonic(), value))
            return value

        wait_for(chart_cpu, lambda v: v is not None, "a CPU point for the idle guest")
        calm_until = time.monotonic() + 60  # a guest that just booted is busy a while (TCG): its quietest value
        while (idle := min(v for _at, v in seen if v is not None)) > 25.0 and time.monotonic() < calm_until:
            chart_cpu()
            time.sleep(0.5)
        vcpus = run_json(live, "vm", "show", vm)["vcpus"]
        busy(live, vm, loops=vcpus)
        t0 = time.monotonic()
        goal = min(max(50.0, idle + 25.0), 90.0)
        try:
            shown = wait_for(chart_cpu, lambda v: v is not None and v >= goal, "the busy CPU")
            took = time.monotonic() - t0
            api = run_json(live, "vm", "show", vm)  # (the API's series agrees: GET /vms/{name}/stats)
            with live.client() as c:
                latest = c.get(f"/vms/{vm}/stats").json()["latest"]["cpu_pct"]
                host = c.get(f"/hosts/{api['host']}/stats").json()["latest"]  # its own CPU and memory (getCPUStats)
        finally:
            calm(live, vm)
    print(f"\nidle {idle:.1f} %, busy {shown:.1f} % on the chart {took:.1f} s ({took / STATS_S:.1f} sampling "
          f"intervals) after the loops started; API latest {latest:.1f} % ({api['vcpus']} vCPUs); the chart: "
          + ", ".join(f"{v} at {at - t0:+.1f} s" for at, v in seen))  # fmt: skip
    assert latest >= 40.0  # the API's series agrees with the chart
    assert host["cpu_pct"] is not None and host["mem_used_mib"] > 0 and host["mem_total_mib"] > 0, host


def wait_for(read, done, what: str):
    deadline = time.monotonic() + BOUND_S
    while not done(value := read()):
        assert time.monotonic() < deadline, f"{what}: not shown within {BOUND_S:g} s (last: {value})"
        time.sleep(0.2)
    return value


@pytest.fixture(scope="module")
def frozen_driver(live, vm):
    """A driver on the VM's host, as the snapshots' controller will use it: the VM's root disk (ext4, at
    /data in the test guest) is what a freeze freezes."""
    from vmplane.hosts.drivers.libvirt import LibvirtDriver

    host = run_json(live, "vm", "show", vm)["host"]
    uri = next(h["uri"] for h in run_json(live, "host", "list") if h["name"] == host)
    driver = LibvirtDriver(host, uri)
    yield driver
    driver.close()


def wait_thawed(driver, bound_s: float) -> float:
    t0 = time.monotonic()
    while driver.fs_frozen(DOMAIN):
        assert time.monotonic() - t0 < bound_s, f"still frozen {bound_s:g} s later"
        time.sleep(0.2)
    return time.monotonic() - t0


def test_a_freeze_holds_until_thawed(frozen_driver):
    assert frozen_driver.fs_freeze(DOMAIN) == 1  # the root disk, ext4 at /data
    try:
        assert frozen_driver.fs_frozen(DOMAIN) is True
        with pytest.raises(DriverError):  # a frozen guest's agent runs nothing but the thaw
            frozen_driver.agent_exec(DOMAIN, "true", 5)
    finally:
        frozen_driver.fs_thaw(DOMAIN)
    assert frozen_driver.fs_frozen(DOMAIN) is False
    assert frozen_driver.agent_exec(DOMAIN, "echo after", 30) == ("after\n", 0)


def test_a_freeze_nobody_thaws_is_thawed_by_its_guard(frozen_driver):
    frozen_driver.fs_freeze(DOMAIN, thaw_after_s=2)
    took = wait_thawed(frozen_driver, 2 + 20)
    print(f"\nthawed by its guard {took:.2f} s after the freeze returned (guard: 2 s)")


def test_a_freeze_whose_control_plane_is_killed_is_thawed(frozen_driver, tmp_path):
    """The process that froze the guest is killed at once (SIGKILL, its guard left behind)."""
    script = (
        "import os, signal\n"
        "from vmplane.hosts.drivers.libvirt import LibvirtDriver\n"
        f"d = LibvirtDriver('x', {frozen_driver.uri!r})\n"
        f"print(d.fs_freeze({DOMAIN!r}, thaw_after_s=5), d.fs_frozen({DOMAIN!r}), flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    # (its standard error to a file: the guard it leaves behind keeps it open, and a pipe would be waited for)
    with open(tmp_path / "stderr", "w+") as err:
        r = subprocess.run([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=err, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, (tmp_path / "stderr").read_text()
    assert r.stdout.split() == ["1", "True"]  # it froze the root disk
    assert frozen_driver.fs_frozen(DOMAIN) is True  # frozen, and its freezer is gone
    took = wait_thawed(frozen_driver, 5 + 20)
    print(f"\nthawed {took:.2f} s after its control plane was killed (guard: 5 s)")
    assert frozen_driver.agent_exec(DOMAIN, "echo alive", 30) == ("alive\n", 0)


def test_a_guest_that_ignores_acpi_stops_through_its_agent(live, vm):
    run_json(live, "setting", "set", "vmplane.vm.shutdown.timeout", "120", "--cluster", "cluster1")
    t0 = time.monotonic()
    out = run_json(live, "vm", "stop", vm)
    print(f"\n`vm stop` took {time.monotonic() - t0:.2f} s: {out}")
    assert out["state"] == "stopped", out
    ops = [o for o in run_json(live, "operation", "list") if o["vm"] == vm and o["kind"] == "stop"]
    assert "the guest powered off (asked through its guest agent)" in ops[0]["message"], ops
