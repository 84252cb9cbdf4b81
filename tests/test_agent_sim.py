"""The sim guests' QEMU guest agent (drivers/simagent.py): every running sim guest's agent answers, unless the
fabric silenced it (seen by another process's fabric on the same file); it reports lo and one ethN per NIC
with the address the host's filter holds for it; a shutdown through it leaves the domain shut off. A driver
without an agent says so. The real agent: test_agent_real.py."""

from __future__ import annotations

import pytest

from vmplane.core import hostnet as H
from vmplane.core import networks as N
from vmplane.core.driver import DomainSpec, Driver, DriverError, GuestInterface, HostInfo, NicSpec
from vmplane.core.netfilter import Port
from vmplane.hosts.drivers.sim import SimDriver
from vmplane.hosts.drivers.simfabric import SimFabric

INFO = HostInfo(16, 2400, 65536)
NIC = NicSpec(N.mac_of(1), N.bridge_of(7), N.tap_of(1))


@pytest.fixture
def fabrics(tmp_path):
    """Two fabrics on one file: this process's and another control plane's."""
    a, b = SimFabric(tmp_path / "sim-hosts"), SimFabric(tmp_path / "sim-hosts")
    yield a, b
    a.close()
    b.close()


def started(fabric: SimFabric, name: str = "vm1", nics: tuple[NicSpec, ...] = ()) -> SimDriver:
    driver = SimDriver("h1", INFO, fabric)
    if nics:  # the host must hold the NIC's bridge (as libvirt needs it), at the network's prefix
        net = H.NetworkView(7, "z1", cidr="10.7.0.0/24", gateway=None)
        port = Port(NIC.tap, NIC.bridge, NIC.mac, "10.7.0.5", ())
        driver.apply_networks(H.HostNetworks(H.plan("h1", "z1", {"h1": "10.99.0.1"}, [net]), (port,)))
    driver.start(DomainSpec(name, 1, 1, 256, 256, "tiny", nics=nics))
    return driver


def test_a_sim_guests_agent_answers_until_silenced_in_any_process(fabrics):
    a, b = fabrics
    driver = started(a)
    assert driver.agent_ping("vm1") is True
    b.silence_agent("vm1")
    assert driver.agent_ping("vm1") is False
    with pytest.raises(DriverError, match=r"guest agent of vm1.*not connected"):
        driver.agent_interfaces("vm1")
    with pytest.raises(DriverError, match="not connected"):
        driver.agent_shutdown("vm1")
    assert driver.domain("vm1").running  # a silent agent stopped nothing
    b.silence_agent("vm1", False)
    assert driver.agent_ping("vm1") is True


def test_a_sim_guest_reports_lo_and_its_nics_with_their_leases(fabrics):
    driver = started(fabrics[0], nics=(NIC,))
    lo, eth0 = driver.agent_interfaces("vm1")
    assert lo == GuestInterface("lo", "00:00:00:00:00:00", ["127.0.0.1/8", "::1/128"])
    assert eth0 == GuestInterface("eth0", NIC.mac, ["10.7.0.5/24"])
    assert [i.name for i in started(fabrics[0], "vm2").agent_interfaces("vm2")] == ["lo"]


def test_a_shutdown_through_the_sim_agent_leaves_the_domain_shut_off(fabrics):
    driver = started(fabrics[0])
    driver.agent_shutdown("vm1")
    info = driver.domain("vm1")
    assert (info.state, info.reason, info.running) == ("shutoff", "shutdown", False)
    assert driver.agent_ping("vm1") is False  # nothing answers in a guest that is off
    with pytest.raises(DriverError, match="not running here"):
        driver.agent_exec("vm1", "true")


def test_sim_guests_run_no_commands_and_a_missing_domain_is_an_error(fabrics):
    driver = started(fabrics[0])
    with pytest.raises(DriverError, match="run no commands"):
        driver.agent_exec("vm1", "echo hi")
    with pytest.raises(DriverError, match="not running here"):
        driver.agent_interfaces("ghost")
    with pytest.raises(DriverError, match="ghost does not exist here"):
        driver.agent_ping("ghost")


def test_a_driver_without_an_agent_says_so():
    class Bare(SimDriver):  # the base class's answer, as a driver that never learned the agent
        agent_ping = Driver.agent_ping
        agent_exec = Driver.agent_exec

    bare = Bare("h9", INFO)
    with pytest.raises(DriverError, match="h9: no guest agent on this host's driver"):
        bare.agent_ping("vm1")
    with pytest.raises(DriverError, match="no guest agent"):
        bare.agent_exec("vm1", "true")


def test_a_sim_freeze_holds_until_thawed_or_its_deadline_in_any_process(fabrics):
    a, b = fabrics
    driver = started(a)
    assert driver.fs_freeze("vm1") == 1
    other = SimDriver("h1", INFO, b)  # another control plane's view of the same host
    assert other.fs_frozen("vm1") is True
    assert driver.fs_thaw("vm1") == 1 and other.fs_frozen("vm1") is False
    driver.fs_freeze("vm1", thaw_after_s=0)  # nobody thaws it: its deadline does
    assert driver.fs_frozen("vm1") is False
    b.silence_agent("vm1")
    with pytest.raises(DriverError, match="not connected"):
        driver.fs_freeze("vm1")
