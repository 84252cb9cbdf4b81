"""Sim hosts that fail as local hosts do (drivers/simhosts.py): power, daemon and network failures seen
through SimDriver calls of another fabric instance on the same file (another process's view), their
recovery, migrations that meet a failed end, fault-mode flaps, partitions and reboots, and the sim fence
agent (fencing/sim.py) with its broken modes and the sim liveness signal.

No test waits on the machine's speed: a copy "still under way" is held by the test (`held_copy`), a fault
that ends by itself ends on a fake clock (tests/fakeclock.py) the test moves."""

import subprocess
import sys
import threading
import time

import pytest

from vmplane.core.driver import DomainSpec, DriverError, HostInfo, MigrationParams
from vmplane.hosts.drivers import simhosts
from vmplane.hosts.drivers.sim import SimDriver
from vmplane.hosts.drivers.simevents import STOPPED
from vmplane.hosts.drivers.simfabric import SimFabric
from vmplane.hosts.drivers.simfaults import KINDS, SimFaults
from vmplane.hosts.drivers.simstorage import SimStorageError
from vmplane.hosts.fencing import sim as sim_fencing
from vmplane.hosts.fencing.base import FenceError
from vmplane.hosts.fencing.sim import SimAgent, sim_signal

from . import fakeclock

INFO = HostInfo(16, 2400, 65536)


def spec(name: str, memory: int = 1024) -> DomainSpec:
    return DomainSpec(name, 1, 2, memory, memory, "tiny")


@pytest.fixture
def path(tmp_path):
    return tmp_path / "store.db.sim-hosts"


@pytest.fixture
def fabrics(path):
    """Two fabrics on one file: this process's and (another connection) another control plane's."""
    a, b = SimFabric(path), SimFabric(path)
    # a target's incoming domain goes at once when its source dies (the keepalive's linger, after a power loss,
    # is tested in test_review_migration.py)
    a.incoming_linger_s = b.incoming_linger_s = 0.0
    yield a, b
    a.close()
    b.close()


def drivers(fabric, *hosts):
    return [SimDriver(h, INFO, fabric) for h in hosts]


def wait_until(predicate, what: str, timeout_s: float = 60.0) -> None:
    """A bounded wait on a condition (generous: a loaded machine is slow, never wrong)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"still waiting after {timeout_s:g} s for {what}"
        time.sleep(0.02)


def copy_ended(h1) -> None:
    wait_until(lambda: not h1._copies, "the copy going on without the client to end")


def held_copy(fabric: SimFabric, monkeypatch) -> threading.Event:
    """The next copy that goes on without its client (SimFaults.lost_connection) waits before it lands
    until the returned event is set: what the test does meanwhile happens while that copy is under way."""
    release = threading.Event()

    def copied(plan, mib):
        assert release.wait(60), "the test never let the copy land"
        return SimFabric.copied(fabric, plan, mib)

    monkeypatch.setattr(fabric, "copied", copied)
    return release


def alive(signal) -> bool:
    return signal[0] if isinstance(signal, tuple) else signal.alive


def test_a_power_failure_empties_the_host_at_once_with_no_event_and_another_view_sees_it(fabrics):
    a, b = fabrics
    h1, h2 = drivers(a, "h1", "h2")
    h1.start(spec("d1"))
    h1.start(spec("d2"))
    h2.start(spec("d3"))
    a.set_state("h1", "d2", "shutoff", "crashed")  # defined, shut off: gone too after a power cut
    events = []
    a.faults = SimFaults(seed=1)  # fault mode with no fault: events are sent
    h1.watch(lambda *e: events.append(e))

    a.fail_host("h1", "power")

    other = SimDriver("h1", INFO, b)
    for call in (
        other.domains,
        lambda: other.domain("d1"),
        lambda: other.start(spec("d4")),
        other.host_info,
        lambda: other.stop("d1"),
        lambda: other.migration_active("d1"),
    ):
        with pytest.raises(DriverError, match=r"cannot connect to the hypervisor.*retry"):
            call()
    state = b.host_state("h1")
    assert (state.power, state.reachable, state.mode) == ("off", False, "power")
    assert b.domains("h1") == [] and b.hosts_of("d1") == []
    assert [d.name for d in SimDriver("h2", INFO, b).domains()] == ["d3"]  # the others run on
    assert events == []
    with pytest.raises(SimStorageError, match="down"):  # nothing starts on it, even behind the driver
        b.put("h1", spec("d5"))

    b.recover_host("h1")
    assert a.host_state("h1").power == "on" and h1.domains() == []
    h1.start(spec("d1"))  # it runs what it is asked again
    assert a.hosts_of("d1") == ["h1"]


@pytest.mark.parametrize("mode", ["daemon", "network"])
def test_a_daemon_or_network_failure_keeps_the_guests_running_but_the_host_does_not_answer(fabrics, mode):
    a, b = fabrics
    (h1,) = drivers(a, "h1")
    h1.start(spec("d1"))
    events = []
    a.faults = SimFaults(seed=2)
    h1.watch(lambda *e: events.append(e))

    b.fail_host("h1", mode)

    with pytest.raises(DriverError, match="cannot connect"):
        h1.domains()
    with pytest.raises(DriverError, match="cannot connect"):
        SimDriver("h1", INFO, b).domain("d1")
    state = a.host_state("h1")
    assert (state.power, state.reachable, state.mode) == ("on", False, mode)
    assert [(d.name, d.running) for d in a.domains("h1")] == [("d1", True)]  # what the host runs
    a.emit("h1", "d1", STOPPED, 0)
    assert events == []  # nothing comes from a host not reached

    a.recover_host("h1")
    assert [d.name for d in SimDriver("h1", INFO, b).domains()] == ["d1"]
    a.emit("h1", "d1", STOPPED, 0)
    assert events == [("h1", "d1", STOPPED, 0)]


def test_another_process_fails_and_recovers_a_host(path):
    fabric = SimFabric(path)
    (h1,) = drivers(fabric, "h1")
    h1.start(spec("d1"))
    script = (
        "import sys; from pathlib import Path; from vmplane.hosts.drivers.simfabric import SimFabric; "
        "f = SimFabric(Path(sys.argv[1])); f.fail_host('h1', sys.argv[2]); print(len(f.domains('h1')))"
    )

    out = subprocess.run(
        [sys.executable, "-c", script, str(path), "network"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "1"
    with pytest.raises(DriverError, match="Connection reset"):
        h1.domains()
    subprocess.run([sys.executable, "-c", script, str(path), "power"], check=True, capture_output=True)
    assert fabric.host_state("h1").power == "off" and fabric.domains("h1") == []
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from vmplane.hosts.drivers.simfabric "
            "import SimFabric; SimFabric(Path(sys.argv[1])).recover_host('h1')",
            str(path),
        ],
        check=True,
    )
    assert h1.domains() == []
    fabric.close()


@pytest.mark.parametrize("failed,mode", [("h1", "daemon"), ("h2", "network"), ("h2", "power")])
def test_a_migration_to_or_from_a_failed_host_is_refused_and_the_domain_stays(fabrics, failed, mode):
    a, b = fabrics
    h1, h2 = drivers(a, "h1", "h2")
    h1.start(spec("d1"))
    b.fail_host(failed, mode)
    with pytest.raises(DriverError):
        h1.migrate("d1", h2, MigrationParams())
    assert a.hosts_of("d1") == ["h1"]
    assert a.domains("h2") == []


@pytest.mark.parametrize(
    "dies,mode,left",
    [
        ("h1", "power", []),
        ("h1", "daemon", ["h1"]),
        ("h1", "network", ["h1"]),
        ("h2", "power", ["h1"]),
        ("h2", "network", ["h1"]),
    ],
)
def test_an_end_failing_mid_copy_fails_the_migration_and_the_target_keeps_nothing(fabrics, dies, mode, left):
    a, b = fabrics
    h1, h2 = drivers(a, "h1", "h2")
    h1.copy_rate_mib_s = 8.0  # 1 GiB: a two-minute copy, failed long before it ends
    h1.start(spec("d1"))
    errors = []

    def migrate():
        try:
            h1.migrate("d1", h2, MigrationParams())
        except DriverError as e:
            errors.append(str(e))

    t = threading.Thread(target=migrate, daemon=True)
    t.start()
    wait_until(lambda: b.domain("h2", "d1") is not None, "the copy to begin (its incoming domain on h2)")
    b.fail_host(dies, mode)
    t.join(60)
    assert not t.is_alive() and errors and "does not answer" in errors[0], errors
    assert a.hosts_of("d1") == left
    assert a.domains("h2") == [] or dies == "h2"


def test_a_copy_going_on_without_the_client_dies_with_its_source_or_completes_through_a_partition(fabrics, monkeypatch):
    a, b = fabrics
    a.faults = SimFaults(seed=3, lost_connection=1.0, copy_delay_s=(0.01, 0.01))
    h1, h2 = drivers(a, "h1", "h2")
    h1.start(spec("d1"))
    h1.start(spec("d2"))
    release = held_copy(a, monkeypatch)
    with pytest.raises(DriverError, match="lost mid-copy"):
        h1.migrate("d1", h2, MigrationParams())
    b.fail_host("h1", "power")  # the source dies during the copy: the guest is lost
    release.set()
    copy_ended(h1)
    assert a.hosts_of("d1") == [] and a.domains("h2") == []

    a.recover_host("h1")
    h1.start(spec("d1"))
    release = held_copy(a, monkeypatch)
    with pytest.raises(DriverError, match="lost mid-copy"):
        h1.migrate("d1", h2, MigrationParams())
    b.fail_host("h1", "network")  # the control plane loses the source: the hosts copy on
    release.set()
    copy_ended(h1)
    assert a.hosts_of("d1") == ["h2"]


def test_a_copy_going_on_without_the_client_lands_nowhere_if_its_target_was_power_cycled_meanwhile(
    fabrics, monkeypatch
):
    """The incoming domain lives in the target's QEMU, under its libvirtd: a target whose power (or daemon)
    failed during the copy lost it, even if it answers again before the copy would have ended. The guest
    stays on its source, as with libvirt."""
    a, b = fabrics
    a.faults = SimFaults(seed=3, lost_connection=1.0, copy_delay_s=(0.01, 0.01))
    h1, h2 = drivers(a, "h1", "h2")
    for mode in ("power", "daemon"):
        release = held_copy(a, monkeypatch)
        h1.start(spec("d1"))
        with pytest.raises(DriverError, match="lost mid-copy"):
            h1.migrate("d1", h2, MigrationParams())
        b.fail_host("h2", mode)
        b.recover_host("h2")  # back (empty after a power cut) before the copy ends
        release.set()
        copy_ended(h1)
        assert a.hosts_of("d1") == ["h1"] and a.domains("h2") == [], mode
        h1.stop("d1", timeout_s=0)


def test_the_sim_agent_powers_a_host_off_and_reads_it_back_from_another_view(fabrics, monkeypatch):
    a, b = fabrics
    clock = fakeclock.install(monkeypatch, sim_fencing)  # the agent's polls, counted
    (h1,) = drivers(a, "h1")
    h1.start(spec("d1"))
    agent, other = SimAgent(a), SimAgent(b)
    assert agent.status("h1") == "on"
    a.fail_host("h1", "daemon")  # the daemon is dead: the BMC works all the same
    assert other.status("h1") == "on"

    fenced = agent.power_off("h1")
    assert (fenced.agent, fenced.host) == ("sim", "h1") and "off" in fenced.detail
    assert clock.slept == [] and fenced.seconds == 0  # confirmed by its first read-back: no poll
    assert other.status("h1") == "off" and b.domains("h1") == []
    assert agent.power_off("h1").host == "h1"  # off already: confirmed again
    b.recover_host("h1")
    assert agent.status("h1") == "on"


def test_broken_fencing_fails_and_changes_nothing(fabrics, monkeypatch):
    a, b = fabrics
    clock = fakeclock.install(monkeypatch, sim_fencing)  # the agent's wait for its read-back
    (h1,) = drivers(a, "h1")
    h1.start(spec("d1"))
    a.fail_host("h1", "network")
    b.set_fence_broken("h1", "BMC unreachable: no route to host")
    agent = SimAgent(a)
    with pytest.raises(FenceError, match="BMC unreachable") as e:
        agent.power_off("h1", timeout_s=1)
    assert e.value.agent == "sim" and e.value.host == "h1"
    with pytest.raises(FenceError, match="BMC unreachable"):
        agent.status("h1")
    assert [d.name for d in b.domains("h1")] == ["d1"] and b.host_state("h1").power == "on"

    b.set_fence_broken("h1", "the BMC ignores power-off", mode="ignores")
    t0 = clock.monotonic()
    with pytest.raises(FenceError, match=r"still on after 0.2 s.*ignores"):
        agent.power_off("h1", timeout_s=0.2)
    assert clock.monotonic() - t0 >= 0.2 and len(clock.slept) >= 0.2 / sim_fencing.POLL_S - 1  # read back till then
    assert agent.status("h1") == "on" and [d.name for d in b.domains("h1")] == ["d1"]

    b.set_fence_broken("h1", None)
    agent.power_off("h1")
    assert b.domains("h1") == [] and a.host_state("h1").fence_broken is None


def test_the_sim_liveness_signal_is_alive_unless_the_host_is_powered_off(fabrics):
    a, b = fabrics
    assert alive(sim_signal(b, "h1"))
    for mode in ("daemon", "network"):
        a.fail_host("h1", mode)
        assert alive(sim_signal(b, "h1")), mode
    a.fail_host("h1", "power")
    assert not alive(sim_signal(b, "h1"))
    a.recover_host("h1")
    assert alive(sim_signal(b, "h1"))


def test_host_faults_are_off_by_default_even_when_nasty():
    f = SimFaults.nasty(1)
    assert (f.host_flap, f.host_partition, f.host_reboot) == (0.0, 0.0, 0.0)
    assert {"host_flap", "host_partition", "host_reboot", "host_call"} <= set(KINDS)


def test_a_flap_is_a_short_blip_counted_seen_by_every_view_and_ends_by_itself(fabrics, monkeypatch):
    a, b = fabrics
    clock = fakeclock.install(monkeypatch, simhosts)  # when the flap ends: moved by the test
    (h1,) = drivers(a, "h1")
    h1.start(spec("d1"))
    faults = a.faults = SimFaults(seed=4, host_flap=1.0, flap_s=(0.3, 0.3))
    with pytest.raises(DriverError, match="Connection reset"):
        h1.domains()
    faults.enabled = False  # no new flap; the one under way still ends
    assert faults.counts["host_flap"] == 1
    assert not b.host_state("h1").reachable and not a.settled()
    with pytest.raises(DriverError):
        SimDriver("h1", INFO, b).domains()
    with pytest.raises(DriverError):
        h1.domains()
    assert faults.counts["host_call"] == 2  # the two refused calls of this process's fault mode
    assert not a.settled()
    clock.advance(0.3)  # the flap's length
    assert a.settled() and b.host_state("h1").reachable
    assert [d.name for d in h1.domains()] == ["d1"]  # its guests ran on


def test_partitions_and_reboots_are_counted_and_end_by_themselves(fabrics, monkeypatch):
    a, b = fabrics
    clock = fakeclock.install(monkeypatch, simhosts)  # when they end: moved by the test
    h1, h2 = drivers(a, "h1", "h2")
    h1.start(spec("d1"))
    h2.start(spec("d2"))
    faults = a.faults = SimFaults(seed=5, host_partition=1.0, partition_s=(0.3, 0.3))
    with pytest.raises(DriverError):
        h1.domains()
    faults.host_partition, faults.host_reboot, faults.reboot_s = 0.0, 1.0, (0.3, 0.3)
    with pytest.raises(DriverError):
        h2.domains()
    assert (faults.counts["host_partition"], faults.counts["host_reboot"]) == (1, 1)
    assert b.host_state("h1").mode == "network" and b.domains("h1") != []
    assert b.host_state("h2").power == "off" and b.domains("h2") == []
    assert set(b.failed_hosts()) == {"h1", "h2"}
    faults.enabled = False
    assert set(b.failed_hosts()) == {"h1", "h2"} and not a.settled()
    clock.advance(0.3)  # their length
    assert b.failed_hosts() == {} and a.settled()
    assert [d.name for d in h1.domains()] == ["d1"] and h2.domains() == []  # a rebooted host is back empty


def test_flaps_at_a_rate_on_many_hosts_leave_every_guest_where_it_was():
    fabric = SimFabric()
    faults = fabric.faults = SimFaults(seed=6, host_flap=0.05, flap_s=(0.01, 0.05))
    hosts = drivers(fabric, *(f"h{i}" for i in range(50)))
    placed = 0
    for i in range(200):
        d = hosts[i % 50]
        try:
            d.start(spec(f"vm{i}"))
            placed += 1
        except DriverError:
            pass
    refused = 0
    for _ in range(5):
        for d in hosts:
            try:
                d.domains()
            except DriverError:
                refused += 1
    assert faults.counts["host_flap"] > 5 and faults.counts["host_call"] >= refused > 0
    assert sum(len(fabric.domains(d.host)) for d in hosts) == placed
