"""Guest networks as pure rules: CIDRs and gateways, addresses and MACs, the names a host gives a network, and
security-group rules (docs/design/networks.md).

An address and a MAC belong to a NIC record, allocated once in the NIC's own transaction and never changed
while it exists (stop, start, migration, HA restart). The MAC is derived from the NIC's row id, so two NICs
that exist together never share one and no retry is needed; the address is the lowest free one of the
network (or the one asked for), checked here and made unique by the store's constraint on (network, address).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from vmplane.core.errors import Conflict, Invalid

IPv4 = ipaddress.IPv4Address
Net = ipaddress.IPv4Network

MIN_ADDRESSES = 8  # a network smaller than a /29 has too few addresses for a gateway and guests
MAC_PREFIX = (0x02, 0x76, 0x70)  # locally administered, unicast; "vp"
BRIDGE_MAC_PREFIX = (0x02, 0x76, 0x71)  # a network's bridge (not a NIC's prefix)
MAC_LIMIT = 1 << 24  # NIC row ids that map to a MAC under MAC_PREFIX
VNI_BASE = 10_000  # a network's VXLAN id is VNI_BASE + its row id (1..2**24 - 1)
VNI_LIMIT = (1 << 24) - 1
IFNAME_MAX = 15  # Linux's IFNAMSIZ - 1
DIRECTIONS = ("in", "out")
PROTOCOLS = ("tcp", "udp", "icmp", "any")


def parse_cidr(text: str, field: str = "cidr") -> Net:
    """An IPv4 network in CIDR form with no host bits set, at least MIN_ADDRESSES addresses large."""
    try:
        net = ipaddress.ip_network(str(text).strip(), strict=True)
    except ValueError as exc:
        raise Invalid(
            f"{field} {text!r} is not an IPv4 network in CIDR form like 10.10.0.0/24 ({exc})", field=field
        ) from None
    if not isinstance(net, Net):
        raise Invalid(f"{field} {text!r} is IPv6: networks are IPv4 for now", field=field)
    if net.num_addresses < MIN_ADDRESSES:
        raise Invalid(
            f"{field} {text} has {net.num_addresses} addresses: a network needs at least "
            f"{MIN_ADDRESSES} (a /{32 - (MIN_ADDRESSES - 1).bit_length()} or larger)",
            field=field,
        )
    return net


def parse_address(text: str, field: str = "ip") -> IPv4:
    try:
        address = ipaddress.ip_address(str(text).strip())
    except ValueError:
        raise Invalid(f"{field} {text!r} is not an IPv4 address", field=field) from None
    if not isinstance(address, IPv4):
        raise Invalid(f"{field} {text!r} is IPv6: networks are IPv4 for now", field=field)
    return address


def usable(net: Net) -> tuple[IPv4, IPv4]:
    """The first and last address a host may hold (the network and broadcast addresses excluded)."""
    return net.network_address + 1, net.broadcast_address - 1


def gateway_for(net: Net, gateway: str | None = None) -> IPv4:
    """The network's gateway: the one given (inside it, a host address), else its first usable address."""
    if gateway is None:
        return usable(net)[0]
    address = parse_address(gateway, "gateway")
    first, last = usable(net)
    if not first <= address <= last:
        raise Invalid(f"gateway {address} is not a host address of {net} ({first} to {last})", field="gateway")
    return address


def dhcp_server(net: Net, gateway: IPv4) -> IPv4:
    """The address every host's DHCP server of the network answers from (the same on each host: the hosts
    never hear one another's, docs/design/networks.md): the last host address, or the one before it when the
    gateway took it. Never given to a NIC."""
    last = usable(net)[1]
    return last if last != gateway else last - 1


def overlapping(net: Net, others: Iterable[tuple[str, Net]]) -> str | None:
    """The name of the first network of `others` that shares an address with `net` (a project's own networks
    never overlap: a VM on two of them could not tell where to send); None when none does."""
    for name, other in others:
        if net.overlaps(other):
            return name
    return None


def check_address(net: Net, gateway: IPv4, taken: Iterable[IPv4], address: IPv4, network_name: str) -> IPv4:
    """An address asked for a NIC: inside the network, a host address, not its gateway, not taken."""
    first, last = usable(net)
    if address not in net:
        raise Invalid(f"ip {address} is outside network {network_name} ({net})", field="ip")
    if address == net.network_address:
        raise Invalid(f"ip {address} is the network address of {network_name} ({net})", field="ip")
    if address == net.broadcast_address:
        raise Invalid(f"ip {address} is the broadcast address of {network_name} ({net})", field="ip")
    if address == gateway:
        raise Invalid(f"ip {address} is the gateway of {network_name}", field="ip")
    if address == dhcp_server(net, gateway):
        raise Invalid(f"ip {address} is kept for the DHCP server of {network_name}", field="ip")
    if address in set(taken):
        raise Conflict(f"ip {address} is taken on network {network_name}", field="ip")
    assert first <= address <= last
    return address


def next_address(net: Net, gateway: IPv4, taken: Iterable[IPv4], network_name: str) -> IPv4:
    """The lowest free host address of the network (the gateway and the DHCP server's are never free); 409
    when none is left."""
    used = set(taken) | {gateway, dhcp_server(net, gateway)}
    first, last = usable(net)
    for value in range(int(first), int(last) + 1):
        candidate = IPv4(value)
        if candidate not in used:
            return candidate
    raise Conflict(
        f"network {network_name} ({net}) has no free address: its {int(last) - int(first) + 1} host "
        f"addresses are all in use (the gateway's and the DHCP server's among them)",
        field="network",
    )


def mac_of(nic_id: int) -> str:
    """The MAC of NIC row `nic_id`: MAC_PREFIX then the id's 24 bits (unique among existing NICs by the id)."""
    if not 0 < nic_id < MAC_LIMIT:
        raise Conflict(
            f"NIC id {nic_id} is past the {MAC_LIMIT - 1} MACs of prefix {':'.join(f'{b:02x}' for b in MAC_PREFIX)}",
            field="network",
        )
    octets = [*MAC_PREFIX, (nic_id >> 16) & 0xFF, (nic_id >> 8) & 0xFF, nic_id & 0xFF]
    return ":".join(f"{b:02x}" for b in octets)


def bridge_mac_of(network_id: int) -> str:
    """The MAC of a network's bridge on every host: BRIDGE_MAC_PREFIX then the id's 24 bits (the hosts'
    frames never cross between hosts, so one MAC everywhere is safe, and a migrated guest's ARP entry for
    its DHCP server stays right)."""
    octets = [*BRIDGE_MAC_PREFIX, (network_id >> 16) & 0xFF, (network_id >> 8) & 0xFF, network_id & 0xFF]
    return ":".join(f"{b:02x}" for b in octets)


def vni_of(network_id: int) -> int:
    vni = VNI_BASE + network_id
    if not 0 < vni <= VNI_LIMIT:
        raise Conflict(f"network id {network_id} has no VXLAN id left (at most {VNI_LIMIT})", field="network")
    return vni


def bridge_of(network_id: int) -> str:
    """The Linux bridge of a network, the same name on every host (a migrated VM finds it)."""
    return _ifname("vmpn", network_id)


def uplink_of(network_id: int) -> str:
    """A provider network's port to the hosts' uplink on each host, enslaved to its bridge (a local host's is
    a veth into the hosts' switch; a remote host's, a device of this name the operator makes)."""
    return _ifname("vmpu", network_id)


def vxlan_of(network_id: int) -> str:
    return _ifname("vmpx", network_id)


def tap_of(nic_id: int) -> str:
    return _ifname("vmpt", nic_id)


def _ifname(prefix: str, number: int) -> str:
    name = f"{prefix}{number:x}"
    if len(name) > IFNAME_MAX:
        raise Conflict(f"id {number} makes an interface name longer than {IFNAME_MAX} characters", field="network")
    return name


@dataclass(frozen=True)
class Rule:
    """One security-group rule: traffic in or out, by protocol and port range, from (or to) a CIDR or the
    members of a group. `port_min`/`port_max` only for tcp and udp."""

    direction: str
    proto: str
    port_min: int | None = None
    port_max: int | None = None
    cidr: str | None = None
    group: str | None = None


def parse_ports(text: str | None, proto: str) -> tuple[int | None, int | None]:
    """`22` or `22-23` for tcp and udp; nothing for icmp and any."""
    if text is None or str(text).strip() == "":
        return None, None
    if proto not in ("tcp", "udp"):
        raise Invalid(f"port is for tcp and udp rules, not {proto}", field="port")
    low, _, high = str(text).strip().partition("-")
    try:
        port_min, port_max = int(low), int(high or low)
    except ValueError:
        raise Invalid(f"port {text!r} is not a port (22) or a range (22-23)", field="port") from None
    if not 1 <= port_min <= port_max <= 65535:
        raise Invalid(f"port {text!r} must be within 1..65535, the lower end first", field="port")
    return port_min, port_max


def parse_rule(
    direction: str, proto: str, port: str | None = None, cidr: str | None = None, group: str | None = None
) -> Rule:
    if direction not in DIRECTIONS:
        raise Invalid(f"direction must be one of {', '.join(DIRECTIONS)}, not {direction!r}", field="direction")
    if proto not in PROTOCOLS:
        raise Invalid(f"proto must be one of {', '.join(PROTOCOLS)}, not {proto!r}", field="proto")
    if (cidr is None) == (group is None):
        raise Invalid(
            "a rule names either a CIDR (--from 0.0.0.0/0) or a group (--from-group G), one of them", field="from"
        )
    port_min, port_max = parse_ports(port, proto)
    if cidr is not None:
        try:
            net = ipaddress.ip_network(str(cidr).strip(), strict=False)
        except ValueError:
            raise Invalid(f"from {cidr!r} is not an IPv4 network like 192.0.2.0/24", field="from") from None
        if not isinstance(net, Net):
            raise Invalid(f"from {cidr!r} is IPv6: rules are IPv4 for now", field="from")
        cidr = str(net)
    return Rule(direction, proto, port_min, port_max, cidr, group)
