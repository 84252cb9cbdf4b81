"""A host's libvirtd killed under running guests: the host goes down, its VMs become unknown (still charged,
never started twice), operations on them say why; when the daemon is back they are found again."""

import json
import os
import signal
import time

import pytest

from vmplane.hosts import localhosts

from .realguest import guest, host_of, libvirt_cluster, qemu_pids, run_json


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server = libvirt_cluster(tmp_path_factory.mktemp("faults"))
    run_json(server, "setting", "set", "vmplane.host.check.interval", "1")
    yield server
    server.stop()


def wait_for(predicate, timeout=60, what=""):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def test_a_killed_libvirtd_makes_its_host_down_and_its_vms_unknown_until_it_returns(live):
    run_json(live, "offering", "create", "one", "--kind", "fixed", "--vcpus", "1", "--memory", "512MiB")
    vm = run_json(
        live, "vm", "create", "survivor", "--project", "p", "--offering", "one", "--template", "tiny-linux", "--start"
    )
    guest(live, "survivor", "echo alive > /tmp/marker")
    host = host_of(live, vm["host"])
    [qemu] = qemu_pids("vmplane-survivor", live.home)
    usage_before = run_json(live, "project", "usage", "p")

    os.kill(host.pid(), signal.SIGKILL)  # the hypervisor's daemon dies; QEMU keeps running
    wait_for(lambda: run_json(live, "host", "show", vm["host"])["state"] == "down", what="host down")
    shown = run_json(live, "vm", "show", "survivor")
    assert shown["state"] == "unknown" and shown["host"] == vm["host"]
    assert run_json(live, "project", "usage", "p")["vcpus"] == usage_before["vcpus"]  # still charged
    r = live.cli("vm", "exec", "survivor", "--output", "json", "--", "true")
    assert r.returncode == 1 and "does not answer" in json.loads(r.stdout)["message"]
    r = live.cli("vm", "stop", "survivor", "--output", "json")
    assert r.returncode == 1 and "unknown" in json.loads(r.stdout)["message"]
    r = live.cli("vm", "migrate", "survivor", "--output", "json")
    assert r.returncode == 1 and "does not answer" in json.loads(r.stdout)["message"]
    # placement no longer uses the down host
    other = run_json(
        live, "vm", "create", "newcomer", "--project", "p", "--offering", "one", "--template", "tiny-linux", "--start"
    )
    assert other["host"] != vm["host"]
    assert qemu_pids("vmplane-survivor", live.home) == [qemu]  # nobody started it again

    localhosts.start(
        host.dir.parent,
        host.name,
        json.loads((host.dir / "host.json").read_text())["index"],
        netns=host.netns is not None,
    )  # the daemon comes back and finds its QEMU
    wait_for(lambda: run_json(live, "vm", "show", "survivor")["state"] == "running", what="vm running again")
    assert run_json(live, "host", "show", vm["host"])["state"] == "enabled"
    assert qemu_pids("vmplane-survivor", live.home) == [qemu]  # the same QEMU: not restarted
    assert guest(live, "survivor", "cat /tmp/marker").strip() == "alive"
    assert run_json(live, "audit")["ok"]
    # what was refused while the host was down is safe to retry now
    stopped = run_json(live, "vm", "stop", "survivor", "--force", "--wait")
    assert stopped["state"] == "stopped" and qemu_pids("vmplane-survivor", live.home) == []
    assert run_json(live, "audit")["ok"]


def test_local_hosts_libvirt_sockets_are_not_reachable_by_other_users(live):
    for name in ("lv1", "lv2"):
        host = host_of(live, name)
        assert host.socket.exists()
        assert os.stat(host.socket).st_mode & 0o002 == 0, f"{host.socket} is world-writable"
        assert os.stat(host.dir).st_mode & 0o077 == 0, f"{host.dir} lets other users reach the socket"
