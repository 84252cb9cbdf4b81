"""The QEMU guest agent of the test guest on a real local libvirtd host (no orchestrator), through
LibvirtDriver's agent calls (drivers/libvirtagent.py): the agent answers a ping soon after boot (the time it
took is printed, never asserted), reports the guest's interfaces, runs a command with its output and exit
code and leaves a command that outlives its timeout running with a clear error, a hung agent is a False ping
within its timeout, it powers the guest off, and it answers on the target of a live migration. Without
vmplane's orchestrator: `vm exec`, `vm show` and scaling are wired to the agent elsewhere."""

from __future__ import annotations

import time

import pytest

from vmplane.core.driver import DomainSpec, DriverError, MigrationParams
from vmplane.hosts import localhosts
from vmplane.hosts.guest import build as guest

from .realguest import require_libvirt

BOOT_S = 180.0  # generous bounds: TCG on a shared 2-core machine
NAME = "agent-a"


@pytest.fixture(scope="module")
def drivers(tmp_path_factory):
    """Two local hosts (the second one takes a live migration)."""
    require_libvirt()
    from vmplane.hosts.drivers.libvirt import LibvirtDriver

    base = tmp_path_factory.mktemp("agent") / "hosts"
    netns = localhosts.netns_available()
    hosts, made = [], []
    try:
        for i in range(2):
            hosts.append(localhosts.start(base, f"ag{i + 1}", i, netns=netns))
            made.append(LibvirtDriver(hosts[-1].name, hosts[-1].uri))
            made[-1].migration_address = hosts[-1].address
        guest.cached_image() or guest.build()
        yield made
    finally:
        for d in made:
            d.close()
        for h in hosts:
            localhosts.stop(h)
        localhosts.stop_switch(base)


@pytest.fixture(scope="module")
def driver(drivers):
    return drivers[0]


@pytest.fixture(scope="module")
def booted(driver):
    """A guest started, and how long its agent took to answer: (seconds after start(), the guest's uptime
    then, the longest a ping that found no agent took)."""
    t0 = time.monotonic()
    driver.start(DomainSpec(NAME, 1, 1, 256, 256, guest.IMAGE_NAME))
    started = time.monotonic()
    longest_miss = 0.0
    while True:
        asked = time.monotonic()
        if driver.agent_ping(NAME, timeout_s=2):
            answered = time.monotonic()
            break
        longest_miss = max(longest_miss, time.monotonic() - asked)
        assert time.monotonic() - started < BOOT_S, f"the guest agent did not answer within {BOOT_S:.0f} s"
        time.sleep(0.2)
    out, _code = driver.agent_exec(NAME, "cut -d' ' -f1 /proc/uptime; pidof qemu-ga", 30)
    uptime, pid = out.split()
    # the agent process's start, in the guest's clock: /proc/PID/stat field 22, in ticks (100 a second)
    stat, _ = driver.agent_exec(NAME, f"cat /proc/{pid}/stat", 30)
    agent_started = int(stat.rsplit(")", 1)[1].split()[19]) / 100
    guest_uptime = float(uptime) - (time.monotonic() - answered)  # less the time the uptime took to come
    print(
        f"\nagent answered {answered - started:.2f} s after start() returned ({started - t0:.2f} s in start); "
        f"guest uptime then ~{guest_uptime:.2f} s, qemu-ga started at uptime {agent_started:.2f} s; "
        f"longest ping that found no agent: {longest_miss:.2f} s"
    )
    yield driver
    driver.stop(NAME)


def test_the_agent_answers_a_ping_soon_after_boot(booted):
    assert booted.agent_ping(NAME) is True


def test_the_agent_reports_the_guests_interfaces(booted):
    interfaces = {i.name: i for i in booted.agent_interfaces(NAME)}
    assert "lo" in interfaces, interfaces
    assert "127.0.0.1/8" in interfaces["lo"].addresses


def test_a_command_runs_through_the_agent_with_its_output_and_exit_code(booted):
    assert booted.agent_exec(NAME, "echo hi; exit 3", 30) == ("hi\n", 3)
    out, code = booted.agent_exec(NAME, "echo out; echo err >&2; false", 30)
    assert (out, code) == ("out\nerr\n", 1)  # standard error merged in, in order


def test_a_command_past_its_timeout_is_stopped_in_the_guest_with_a_clear_error(booted):
    with pytest.raises(DriverError, match=r"'echo started; sleep 600' did not end in time.*started"):
        booted.agent_exec(NAME, "echo started; sleep 600", 2)
    out, _ = booted.agent_exec(NAME, "ps | grep '[s]leep 600'; true", 30)  # (busybox here has no pgrep)
    assert not out.strip(), f"the command was left running: {out}"


def test_a_command_that_leaves_a_process_in_the_background_returns_at_its_own_end(booted):
    # the background process keeps the runner's output file, not the agent's pipe: exec returns now
    out, code = booted.agent_exec(NAME, "sleep 300 & echo started", 20)
    assert (out, code) == ("started\n", 0)
    booted.agent_exec(NAME, "kill $(ps | awk '/[s]leep 300/ {print $1}'); true", 20)


def test_a_person_on_the_serial_console_is_never_kicked_off(booted):
    """`vm exec` goes through the agent while a person holds the console; the console itself is not taken
    from them: a command for the console waits, then fails saying why."""
    conn = booted._console_conn()
    held = conn.newStream(0)
    conn.lookupByName(NAME).openConsole(None, held, 0)  # the person (`virsh console`)
    try:
        assert booted.guest_run(NAME, "echo through-the-agent", 30) == ("through-the-agent\n", 0)
        with pytest.raises(DriverError, match=r"serial console of agent-a is held by someone else"):
            booted.console_run(NAME, "true", 8)
        held.send(b"echo still-mine\n")  # still theirs: their stream works
    finally:
        held.abort()
        booted._let_go(conn)
    assert booted.console_run(NAME, "echo free", 60) == ("free\n", 0)  # once they let go


def test_a_domain_without_an_answering_agent_is_no_error_but_false(booted):
    # hung (stopped through the serial console, not through itself): the channel stays open
    out, code = booted.console_run(NAME, "kill -STOP $(pidof qemu-ga)", 60)
    assert code == 0, out
    try:
        for _ in range(2):  # the second after libvirt knows the agent is out of sync
            t0 = time.monotonic()
            assert booted.agent_ping(NAME, timeout_s=2) is False
            print(f"\na ping of a hung agent returned False after {time.monotonic() - t0:.2f} s (timeout 2 s)")
        with pytest.raises(DriverError, match="guest agent of agent-a"):
            booted.agent_interfaces(NAME, timeout_s=2)
    finally:
        out, code = booted.console_run(NAME, "kill -CONT $(pidof qemu-ga)", 60)
        assert code == 0, out
    deadline = time.monotonic() + 60
    while not booted.agent_ping(NAME):  # back (libvirt syncs with it again)
        assert time.monotonic() < deadline, "the agent did not answer again after SIGCONT"
        time.sleep(0.2)


def test_a_shutdown_through_the_agent_stops_the_domain(booted):
    t0 = time.monotonic()
    booted.agent_shutdown(NAME)
    while (info := booted.domain(NAME)) is not None and info.active:
        assert time.monotonic() - t0 < 60, f"{NAME} still {info.state} 60 s after the agent's shutdown"
        time.sleep(0.1)
    print(f"\nshut off {time.monotonic() - t0:.2f} s after agent_shutdown was called ({info})")
    assert info is None or info.state == "shutoff"
    assert booted.agent_ping(NAME) is False


def wait_for_agent(driver, name: str) -> float:
    """Seconds until the guest agent of `name` answers on `driver`'s host (bounded)."""
    t0 = time.monotonic()
    while not driver.agent_ping(name):
        assert time.monotonic() - t0 < BOOT_S, f"the guest agent of {name} did not answer within {BOOT_S:.0f} s"
        time.sleep(0.2)
    return time.monotonic() - t0


def test_the_agent_answers_on_the_target_after_a_live_migration(drivers):
    a, b = drivers
    name = "agent-m"
    a.start(DomainSpec(name, 1, 1, 256, 256, guest.IMAGE_NAME))
    try:
        wait_for_agent(a, name)
        a.agent_exec(name, "echo before > /tmp/mark", 30)
        a.migrate(name, b, MigrationParams())
        assert a.domain(name) is None and b.domain(name).running
        took = wait_for_agent(b, name)
        print(f"\nthe agent answered on the target {took:.2f} s after the migration returned")
        assert b.agent_exec(name, "cat /tmp/mark", 30) == ("before\n", 0)  # the same guest, on b
    finally:
        a.stop(name)
        b.stop(name)
