"""The local-host nemesis (localhosts.fail / recover) and the second liveness signal, on a real local
libvirtd host with a real guest QEMU, through vmplane's libvirt driver."""

from __future__ import annotations

import time

import pytest

from vmplane.core.driver import DriverError
from vmplane.hosts import liveness, localhosts

from .hakit import alive, one_guest_host

# A call on a broken host must fail, not hang: the bound is that behaviour, far above the normal (under
# 1 s for a dead daemon, ~15 s of keepalive for a partitioned one), never a speed check on a loaded machine
HANG_S = 60


@pytest.fixture(scope="module")
def shared_host(tmp_path_factory):
    """One host and guest for the module (~8 s to start): each test gets it healthy (guest_host)."""
    yield from one_guest_host(tmp_path_factory)


@pytest.fixture
def guest_host(shared_host):
    """The module's host with its guest g1 running: whatever the test before broke is recovered first."""
    shared_host.restore()
    return shared_host


def _fails_within(driver, seconds: float = HANG_S) -> float:
    """The call fails with a DriverError, and does not hang (seconds: the generous bound)."""
    t0 = time.monotonic()
    with pytest.raises(DriverError):
        driver.domains()
    took = time.monotonic() - t0
    assert took < seconds, f"the call hung {took:.0f} s on a broken host"
    return took


def _until(condition, what: str, timeout_s: float = HANG_S):
    """The condition's first true value, waited for with a generous bound."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.1)
    return value


def test_a_bad_mode_is_refused(guest_host):
    with pytest.raises(ValueError, match="power, daemon, network"):
        localhosts.fail(guest_host.host, "disk")
    assert localhosts.failed(guest_host.host) is None


def test_a_stale_pid_file_naming_another_process_is_no_daemon_and_is_never_signalled(guest_host):
    """A pid file left by a daemon that died may name a process that took its pid since: it is not the
    daemon, and the nemesis must not stop or kill it (it could be the control plane itself)."""
    import os
    import subprocess

    h = guest_host
    real = h.host.pid_file.read_text()
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        h.host.pid_file.write_text(str(bystander.pid))
        assert h.host.pid() is None and localhosts.processes(h.host)["libvirtd"] == []
        localhosts.fail(h.host, "network")
        assert localhosts._state(bystander.pid) not in ("T", "t") and bystander.poll() is None
    finally:
        h.host.pid_file.write_text(real)
        localhosts.recover(h.host)
        bystander.kill()
        bystander.wait()
    assert h.host.pid() == int(real) and os.path.exists(f"/proc/{real.strip()}")
    assert [(d.name, d.running) for d in h.driver.domains()] == [("g1", True)]


def test_daemon_failure_leaves_the_guest_running_and_recover_finds_it(guest_host):
    h = guest_host
    localhosts.fail(h.host, "daemon")
    procs = h.processes()
    assert not procs["libvirtd"] and procs["qemu"] == [h.qemu] and procs["virtlockd"] and procs["heartbeat"]
    assert liveness.local_signal(h.host.uri).alive is True
    print(f"daemon mode: driver failed in {_fails_within(h.driver):.1f} s")
    localhosts.recover(h.host)
    assert localhosts.failed(h.host) is None
    assert [(d.name, d.running) for d in h.driver.domains()] == [("g1", True)]
    assert h.driver.qemu_pid("g1") == h.qemu and alive(h.qemu)


def test_network_failure_makes_calls_fail_in_bounded_time_and_recover_answers(guest_host):
    h = guest_host
    assert h.driver.domains()  # the connection is open before the partition
    localhosts.fail(h.host, "network")
    assert localhosts.failed(h.host) == "network"
    # keepalive (5 s x 3) ends the call on the open connection; opening a new one fails too, without hanging
    print(
        f"network mode: driver failed in {_fails_within(h.driver):.1f} s, "
        f"reconnect failed in {_fails_within(h.driver):.1f} s"
    )
    assert alive(h.qemu) and liveness.local_signal(h.host.uri).alive is True
    localhosts.recover(h.host)
    assert [(d.name, d.running) for d in h.driver.domains()] == [("g1", True)]
    assert h.driver.qemu_pid("g1") == h.qemu


def test_power_failure_then_recover_brings_the_daemon_back_without_the_guest(guest_host):
    h = guest_host
    localhosts.fail(h.host, "power")
    assert not any(h.processes().values()) and not alive(h.qemu)
    _fails_within(h.driver)
    localhosts.recover(h.host)
    procs = h.processes()
    assert procs["libvirtd"] and procs["virtlockd"] and procs["heartbeat"] and not procs["qemu"], procs
    assert not [d.name for d in h.driver.domains() if d.running]


def test_stop_cleans_up_a_partitioned_host(guest_host):
    h = guest_host
    localhosts.fail(h.host, "network")
    localhosts.stop(h.host)
    assert not any(h.processes().values()), h.processes()


def test_the_heartbeat_is_fresh_while_the_host_runs_and_stale_after_a_power_cut(guest_host, tmp_path):
    h = guest_host
    path = localhosts.heartbeat_path(h.base, "h1")
    deadline = time.monotonic() + 10
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    first = liveness.heartbeat_signal(path, 3)
    assert first.alive is True, first
    _until(lambda: liveness.heartbeat_signal(path, 3).detail != first.detail, "the heartbeat's counter moves on")
    localhosts.fail(h.host, "power")
    # no writer is left: the beat ages past its 3 s limit (waited for, not slept: a loaded machine is slow)
    stale = _until(lambda: (s := liveness.heartbeat_signal(path, 3)).alive is False and s, "the heartbeat goes stale")
    assert "old" in stale.detail, stale
    assert liveness.heartbeat_signal(tmp_path / "never", 3).alive is None
    assert liveness.local_signal("qemu+tls://remote/system") is None
