"""Guest network rules (core/networks.py): CIDRs, gateways, addresses, MACs, interface names, security-group rules."""

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vmplane.core import networks as N
from vmplane.core.errors import Conflict, Invalid


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("10.10.0.1/24", "host bits"),
        ("10.10.0.0/30", "4 addresses"),
        ("10.10.0.0/32", "1 addresses"),
        ("nonsense", "CIDR form"),
        ("fd00::/64", "IPv6"),
        ("10.10.0.0/33", "CIDR form"),
    ],
)
def test_a_bad_cidr_is_refused_naming_the_field_and_why(text, why):
    with pytest.raises(Invalid, match=why) as err:
        N.parse_cidr(text)
    assert err.value.field == "cidr"


def test_the_smallest_network_is_a_29_its_gateway_the_first_host_and_its_dhcp_server_the_last():
    net = N.parse_cidr("192.0.2.8/29")
    assert N.gateway_for(net) == ipaddress.IPv4Address("192.0.2.9")
    assert N.dhcp_server(net, N.gateway_for(net)) == ipaddress.IPv4Address("192.0.2.14")
    assert N.dhcp_server(net, ipaddress.IPv4Address("192.0.2.14")) == ipaddress.IPv4Address("192.0.2.13")
    assert N.usable(net) == (ipaddress.IPv4Address("192.0.2.9"), ipaddress.IPv4Address("192.0.2.14"))


@pytest.mark.parametrize("gateway", ["10.10.1.1", "10.10.0.0", "10.10.0.255", "x"])
def test_a_gateway_outside_the_hosts_of_the_network_is_refused(gateway):
    with pytest.raises(Invalid) as err:
        N.gateway_for(N.parse_cidr("10.10.0.0/24"), gateway)
    assert err.value.field == "gateway"


def test_overlap_names_the_network_it_meets():
    mine = [("a", N.parse_cidr("10.0.0.0/24")), ("b", N.parse_cidr("10.1.0.0/16"))]
    assert N.overlapping(N.parse_cidr("10.1.2.0/24"), mine) == "b"
    assert N.overlapping(N.parse_cidr("10.0.0.0/16"), mine) == "a"
    assert N.overlapping(N.parse_cidr("10.2.0.0/24"), mine) is None


def test_an_address_is_refused_outside_the_cidr_on_the_network_broadcast_or_gateway_or_when_taken():
    net = N.parse_cidr("10.10.0.0/24")
    gw = N.gateway_for(net)
    taken = {ipaddress.IPv4Address("10.10.0.5")}
    for text, kind, words in [
        ("10.10.1.5", Invalid, "outside"),
        ("10.10.0.0", Invalid, "network address"),
        ("10.10.0.255", Invalid, "broadcast"),
        ("10.10.0.1", Invalid, "gateway"),
        ("10.10.0.5", Conflict, "taken"),
        ("10.10.0.254", Invalid, "DHCP server"),
    ]:
        with pytest.raises(kind, match=words) as err:
            N.check_address(net, gw, taken, ipaddress.IPv4Address(text), "n1")
        assert err.value.field == "ip"
    assert str(N.check_address(net, gw, taken, ipaddress.IPv4Address("10.10.0.6"), "n1")) == "10.10.0.6"


@given(st.integers(min_value=24, max_value=29), st.data())
def test_next_address_is_the_lowest_free_host_address_and_exhaustion_is_a_409(prefix, data):
    net = N.parse_cidr(f"10.20.0.0/{prefix}")
    first, last = N.usable(net)
    hosts = [ipaddress.IPv4Address(v) for v in range(int(first), int(last) + 1)]
    gw = data.draw(st.sampled_from(hosts))
    taken = set(data.draw(st.lists(st.sampled_from(hosts), max_size=len(hosts))))
    free = sorted(set(hosts) - taken - {gw, N.dhcp_server(net, gw)})
    if free:
        got = N.next_address(net, gw, taken, "n")
        assert got == free[0] and got in net and got not in (net.network_address, net.broadcast_address)
    else:
        with pytest.raises(Conflict, match="no free address"):
            N.next_address(net, gw, taken, "n")


def test_allocating_every_address_one_by_one_gives_each_once():
    net = N.parse_cidr("10.30.0.0/26")
    gw, taken = N.gateway_for(net), []
    while True:
        try:
            taken.append(N.next_address(net, gw, taken, "n"))
        except Conflict:
            break
    # the network, broadcast, gateway and DHCP server addresses are never handed out
    assert len(taken) == len(set(taken)) == 64 - 4 and N.dhcp_server(net, gw) not in taken


@given(st.integers(min_value=1, max_value=N.MAC_LIMIT - 1), st.integers(min_value=1, max_value=N.MAC_LIMIT - 1))
def test_macs_are_unicast_locally_administered_and_one_per_nic_id(a, b):
    mac_a, mac_b = N.mac_of(a), N.mac_of(b)
    first = int(mac_a.split(":")[0], 16)
    assert first & 0b10 and not first & 0b01  # locally administered, unicast
    assert (mac_a == mac_b) == (a == b)


def test_mac_vni_and_names_refuse_ids_past_their_space():
    for fn, bad in ((N.mac_of, 0), (N.mac_of, N.MAC_LIMIT), (N.vni_of, N.VNI_LIMIT)):
        with pytest.raises(Conflict):
            fn(bad)
    assert N.bridge_of(1) == "vmpn1" and N.vxlan_of(255) == "vmpxff" and N.tap_of(16) == "vmpt10"
    assert len(N.tap_of(N.MAC_LIMIT - 1)) <= N.IFNAME_MAX and len(N.bridge_of(N.VNI_LIMIT)) <= N.IFNAME_MAX


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("sideways", "tcp", "22", "0.0.0.0/0"), "direction"),
        (("in", "sctp", "22", "0.0.0.0/0"), "proto"),
        (("in", "tcp", "22", None, None), "from"),
        (("in", "tcp", "22", "0.0.0.0/0", "web"), "from"),
        (("in", "icmp", "22", "0.0.0.0/0"), "port"),
        (("in", "tcp", "23-22", "0.0.0.0/0"), "port"),
        (("in", "tcp", "0", "0.0.0.0/0"), "port"),
        (("in", "tcp", "ssh", "0.0.0.0/0"), "port"),
        (("in", "tcp", "22", "300.0.0.0/8"), "from"),
    ],
)
def test_a_bad_rule_is_refused_naming_the_field(args, field):
    with pytest.raises(Invalid) as err:
        N.parse_rule(*args)
    assert err.value.field == field


def test_a_rule_keeps_its_range_and_a_normal_cidr():
    rule = N.parse_rule("in", "tcp", "8000-8080", "192.0.2.7/24")
    assert (rule.port_min, rule.port_max, rule.cidr, rule.group) == (8000, 8080, "192.0.2.0/24", None)
    assert N.parse_rule("out", "any", None, None, "default") == N.Rule("out", "any", None, None, None, "default")
