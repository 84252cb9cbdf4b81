"""The domain XML of a VM with NICs (pure): virtio interfaces on their network's host bridge, in slot order."""

from xml.etree import ElementTree

import pytest

from vmplane.core import networks as N
from vmplane.core.driver import DomainSpec, NicSpec
from vmplane.hosts.drivers.domainxml import domain_xml, interface_xml

FIRST = NicSpec(N.mac_of(1), N.bridge_of(7), N.tap_of(1))
SECOND = NicSpec(N.mac_of(2), N.bridge_of(9), N.tap_of(2), mtu=1450)


def spec(nics=()):
    return DomainSpec("vm1", 1, 1, 256, 256, "tiny-linux", nics=nics)


def test_a_nic_is_a_virtio_interface_on_its_networks_bridge_with_its_mac_and_tap():
    nic = ElementTree.fromstring(interface_xml(SECOND))
    assert nic.get("type") == "bridge"
    assert nic.find("mac").get("address") == "02:76:70:00:00:02"
    assert nic.find("source").get("bridge") == "vmpn9"
    assert nic.find("target").get("dev") == "vmpt2"
    assert nic.find("model").get("type") == "virtio"
    assert nic.find("mtu").get("size") == "1450"
    assert ElementTree.fromstring(interface_xml(FIRST)).find("mtu") is None


def test_a_domain_carries_its_nics_in_order_and_none_without_them():
    devices = ElementTree.fromstring(domain_xml(spec((FIRST, SECOND)), "/k", "/i", "console=ttyS0")).find("devices")
    assert [i.find("mac").get("address") for i in devices.findall("interface")] == [FIRST.mac, SECOND.mac]
    plain = ElementTree.fromstring(domain_xml(spec(), "/k", "/i", "console=ttyS0"))
    assert plain.find("devices").findall("interface") == []


@pytest.mark.parametrize(
    ("nic", "words"),
    [
        (NicSpec("02:76:70:00:00:0G", "vmpn1", "vmpt1"), "MAC"),
        (NicSpec("02:76:70:00:00:01", "br'0", "vmpt1"), "bridge"),
        (NicSpec("02:76:70:00:00:01", "vmpn1", "a-very-long-tap-name"), "tap"),
    ],
)
def test_nic_values_are_checked(nic, words):
    with pytest.raises(ValueError, match=words):
        interface_xml(nic)


def test_two_nics_with_one_mac_are_refused():
    with pytest.raises(ValueError, match="same MAC"):
        domain_xml(spec((FIRST, FIRST)), "/k", "/i", "")
