"""The fence agents against real peers: the local agent on a real local libvirtd host with a real
guest QEMU, the ipmi agent through ipmitool against OpenIPMI's ipmi_sim, the redfish agent through
sushy against sushy-emulator; each emulator's power-off is wired to the host's power cut
(tests/bmckit.py). Plus the configuration checks of fencing.validate / agent_for."""

from __future__ import annotations

import shutil
import time

import pytest

from vmplane.hosts import liveness, localhosts
from vmplane.hosts.fencing import FenceError, agent_for, validate

from .bmckit import IpmiSim, SushyEmulator
from .hakit import alive, one_guest_host

# how long an agent may take to confirm the power is off: generous (a loaded machine), never a speed check;
# the fencing time is measured by bench/ha.py (its "fence" phase)
CONFIRM_S = 60


@pytest.fixture(scope="module")
def shared_host(tmp_path_factory):
    """One host and guest for the module (~8 s to start): each test gets it healthy (guest_host)."""
    yield from one_guest_host(tmp_path_factory)


@pytest.fixture
def guest_host(shared_host):
    """The module's host with its guest running: the power the test before cut is brought back first."""
    shared_host.restore()
    return shared_host


def test_agent_configs_are_normalised_and_bad_fields_named():
    assert validate(
        [{"agent": "local"}, {"agent": "ipmi", "address": "10.0.0.5", "username": "u", "password": "p"}]
    ) == [
        {"agent": "local"},
        {"agent": "ipmi", "address": "10.0.0.5", "port": 623, "username": "u", "password": "p", "cipher": 3},
    ]
    bad = [
        ([{"agent": "ssh"}], "fence_agents[0].agent"),
        ([{"agent": "ipmi", "address": "a", "username": "u"}], "fence_agents[0].password"),
        (
            [{"agent": "local"}, {"agent": "ipmi", "address": "a", "username": "u", "password": "p", "port": True}],
            "fence_agents[1].port",
        ),
        ([{"agent": "redfish", "address": "bmc:8000", "username": "u", "password": "p"}], "fence_agents[0].address"),
        (
            [{"agent": "redfish", "address": "https://b", "username": "u", "password": "p", "passwd": "x"}],
            "fence_agents[0].passwd",
        ),
    ]
    for configs, field in bad:
        with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
            validate(configs)
    with pytest.raises(ValueError, match="not one"):
        agent_for({"agent": "local"}, "qemu+tls://remote/system", "r1")


def _assert_powered_off(h, before: dict[str, list[int]]) -> None:
    assert not any(h.processes().values()), h.processes()
    assert not any(alive(pid) for pids in before.values() for pid in pids)
    assert liveness.local_signal(h.host.uri).alive is False


def test_the_local_agent_cuts_daemon_guest_lockd_and_heartbeat(guest_host):
    h = guest_host
    before = h.processes()
    assert before["libvirtd"] and before["qemu"] == [h.qemu] and before["virtlockd"] and before["heartbeat"]
    assert liveness.local_signal(h.host.uri).alive is True
    agent = agent_for({"agent": "local"}, h.host.uri, "h1")
    assert agent.status("h1") == "on"
    fenced = agent.power_off("h1", timeout_s=CONFIRM_S)
    print(f"local agent: {fenced}")
    assert fenced.agent == "local"
    _assert_powered_off(h, before)
    assert agent.status("h1") == "off"
    assert localhosts.failed(h.host) == "power"


def _need(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        print(f"fence agent test skipped: {', '.join(missing)} not installed (scripts/setup.sh --test)")
        pytest.skip(f"{', '.join(missing)} not installed")


def test_the_ipmi_agent_powers_the_host_off_through_ipmi_sim(guest_host, tmp_path):
    _need("ipmi_sim", "ipmitool")
    h = guest_host
    sim = IpmiSim(tmp_path / "bmc", h.host, "admin", "s3cret").start()
    try:
        config = {"agent": "ipmi", "address": "127.0.0.1", "port": sim.port, "username": "admin"}
        wrong = agent_for({**config, "password": "wrong"}, None, "h1")
        with pytest.raises(FenceError, match="Unable to establish IPMI v2 / RMCP\\+ session"):
            wrong.power_off("h1", timeout_s=5)
        assert alive(h.qemu)  # a refused login powered nothing off
        agent = agent_for({**config, "password": "s3cret"}, None, "h1")
        assert agent.status("h1") == "on"
        before, t0 = h.processes(), time.monotonic()
        fenced = agent.power_off("h1", timeout_s=CONFIRM_S)
        print(f"ipmi agent: {fenced} ({time.monotonic() - t0:.1f} s)")
        _assert_powered_off(h, before)
        assert agent.status("h1") == "off"
    finally:
        sim.stop()


def test_the_redfish_agent_powers_the_host_off_through_sushy_emulator(guest_host, tmp_path):
    pytest.importorskip("sushy")
    pytest.importorskip("sushy_tools")
    h = guest_host
    bmc = SushyEmulator(tmp_path / "bmc", h.host, "admin", "s3cret").start()
    try:
        config = {"agent": "redfish", "address": bmc.url, "username": "admin", "verify": False}
        wrong = agent_for({**config, "password": "wrong"}, None, "h1")
        with pytest.raises(FenceError, match="401"):
            wrong.power_off("h1", timeout_s=5)
        assert alive(h.qemu)
        agent = agent_for({**config, "password": "s3cret"}, None, "h1")
        assert agent.status("h1") == "on"
        before, t0 = h.processes(), time.monotonic()
        fenced = agent.power_off("h1", timeout_s=CONFIRM_S)
        print(f"redfish agent: {fenced} ({time.monotonic() - t0:.1f} s)")
        _assert_powered_off(h, before)
        assert agent.status("h1") == "off"
    finally:
        bmc.stop()
