"""What a host must hold for its zone's guest networks, and the `ip`/`bridge` commands that bring what it
holds to that, as pure functions (issue 29; core/networks.py names the devices).

Every network of a zone is on every host of the zone (as Proxmox's VNets are on every node): a live
migration or an HA restart finds its network ready on any target. On each host a network is one Linux
bridge, joined to the same network on the zone's other hosts by a VXLAN device (its VNI, one all-zeros FDB
entry per peer: head-end replication over the hosts' underlay addresses, for broadcasts and unknown
destinations). The device learns where each guest MAC is: without learning every unicast went to every
peer (a third host received 100 of 100 pings between two others; with learning 0), and after a live
migration QEMU's announcements move the entry by themselves. What a host holds is
read back (`ip -j -d link show`, `bridge -j fdb show`) and only the difference is applied; devices named
like vmplane's that no network needs are removed (no orphan after a crash).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from vmplane.core import networks as N
from vmplane.core.netfilter import Port
from vmplane.core.networks import Rule

VXLAN_OVERHEAD = 50  # outer Ethernet + IPv4 + UDP + VXLAN headers
VXLAN_PORT = 4789
ALL_ZEROS = "00:00:00:00:00:00"


@dataclass(frozen=True)
class NetworkView:
    """A network as the store has it (id, zone; its CIDR and gateway give its DHCP server's address)."""

    id: int
    zone: str
    cidr: str | None = None
    gateway: str | None = None
    provider: bool = False  # bridged to the hosts' uplink (its port `vmpu<id>`), not joined by VXLAN


@dataclass(frozen=True)
class NetworkOnHost:
    bridge: str
    vxlan: str
    vni: int
    peers: tuple[str, ...]  # the other hosts' underlay addresses
    mtu: int  # the VXLAN device's and its guests' (the underlay's less the overhead)
    address: str | None = None  # the bridge's: the network's DHCP server, ADDRESS/PREFIX, the same on every host
    uplink: str | None = None  # a provider network's port to the uplink (then no VXLAN device: one L2 already)
    mac: str | None = None  # the bridge's, the same on every host: a migrated guest's ARP entry stays right


@dataclass(frozen=True)
class Dhcp:
    """A network's DHCP server on one host: reservations only (MAC -> address), bound to its bridge, at the
    same address on every host; `router`: the gateway it tells (a provider network's), or none."""

    bridge: str
    cidr: str
    router: str | None
    reservations: tuple[tuple[str, str], ...]  # (MAC, address), sorted


@dataclass(frozen=True)
class HostPlan:
    host: str
    local: str  # this host's underlay address
    networks: tuple[NetworkOnHost, ...]


@dataclass(frozen=True)
class Link:
    """A link as the host reports it: its kind (bridge, vxlan, ...), master, VNI and MTU when it has them."""

    name: str
    kind: str
    master: str | None = None
    vni: int | None = None
    mtu: int | None = None
    up: bool = True
    addresses: tuple[str, ...] = ()  # IPv4 ADDRESS/PREFIX
    mac: str | None = None


def plan(
    host: str, zone: str, underlay: Mapping[str, str], networks: Iterable[NetworkView], underlay_mtu: int = 1500
) -> HostPlan:
    """The networks `host` (of `zone`) must carry; `underlay` maps each host of the zone to its address."""
    if host not in underlay:
        raise ValueError(f"host {host} has no underlay address")
    peers = tuple(sorted(addr for name, addr in underlay.items() if name != host))
    mtu = underlay_mtu - VXLAN_OVERHEAD
    mine = sorted((n for n in networks if n.zone == zone), key=lambda n: n.id)
    return HostPlan(
        host,
        underlay[host],
        tuple(
            NetworkOnHost(
                N.bridge_of(n.id),
                N.vxlan_of(n.id),
                N.vni_of(n.id),
                peers,
                underlay_mtu if n.provider else mtu,
                address=_server(n),
                mac=N.bridge_mac_of(n.id),
                uplink=N.uplink_of(n.id) if n.provider else None,
            )
            for n in mine
        ),
    )


def _server(n: NetworkView) -> str | None:
    if n.cidr is None:
        return None
    net = N.parse_cidr(n.cidr)
    gateway = N.gateway_for(net, n.gateway)
    return f"{N.dhcp_server(net, gateway)}/{net.prefixlen}"


def _ours(name: str) -> bool:
    return name.startswith(("vmpn", "vmpx", "vmpu"))


def converge(target: HostPlan, links: Iterable[Link], fdb: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The commands that turn what the host holds (`links`; `fdb`: each VXLAN device's all-zeros
    destinations) into `target`, in order: stale devices removed first, then bridges, VXLAN devices, their
    ports and FDB entries (a provider network: its uplink port, which must exist). Nothing when the host
    already holds the plan."""
    have = {link.name: link for link in links}
    out: list[list[str]] = []
    wanted = {n.bridge for n in target.networks} | {n.uplink or n.vxlan for n in target.networks}
    for name in sorted(have):
        if _ours(name) and name not in wanted:
            out.append(["ip", "link", "del", name])
    for n in target.networks:
        bridge, vxlan = have.get(n.bridge), have.get(n.vxlan)
        if bridge is not None and bridge.kind != "bridge":
            out.append(["ip", "link", "del", n.bridge])
            bridge = None
        if bridge is None:
            out.append(["ip", "link", "add", n.bridge, *(["address", n.mac] if n.mac else []), "type", "bridge"])
        elif n.mac and bridge.mac != n.mac:
            out.append(["ip", "link", "set", "dev", n.bridge, "address", n.mac])
        held_addresses = bridge.addresses if bridge is not None else ()
        for address in sorted(a for a in held_addresses if a != n.address):
            out.append(["ip", "addr", "del", address, "dev", n.bridge])
        if n.address and n.address not in held_addresses:
            out.append(["ip", "addr", "replace", n.address, "dev", n.bridge])
        if n.uplink is not None:  # a provider network: its port to the uplink, made beforehand, is enslaved
            port = have.get(n.uplink)
            if port is None or port.master != n.bridge:
                out.append(["ip", "link", "set", n.uplink, "master", n.bridge])
            for name, link in ((n.bridge, bridge), (n.uplink, port)):
                if link is None or not link.up:
                    out.append(["ip", "link", "set", name, "up"])
            continue
        if vxlan is not None and (vxlan.kind != "vxlan" or vxlan.vni != n.vni):
            out.append(["ip", "link", "del", n.vxlan])
            vxlan = None
        if vxlan is None:
            out.append(
                ["ip", "link", "add", n.vxlan, "type", "vxlan", "id", str(n.vni), "local", target.local,
                 "dstport", str(VXLAN_PORT)]
            )  # fmt: skip
        if vxlan is None or vxlan.mtu != n.mtu:
            out.append(["ip", "link", "set", n.vxlan, "mtu", str(n.mtu)])
        if vxlan is None or vxlan.master != n.bridge:
            out.append(["ip", "link", "set", n.vxlan, "master", n.bridge])
        for name, link in ((n.bridge, bridge), (n.vxlan, vxlan)):
            if link is None or not link.up:
                out.append(["ip", "link", "set", name, "up"])
        present = set(fdb.get(n.vxlan, ())) if vxlan is not None else set()
        for peer in sorted(present - set(n.peers)):
            out.append(["bridge", "fdb", "del", ALL_ZEROS, "dev", n.vxlan, "dst", peer])
        for peer in sorted(set(n.peers) - present):
            out.append(["bridge", "fdb", "append", ALL_ZEROS, "dev", n.vxlan, "dst", peer])
    return out


def parse_links(report: Iterable[Mapping[str, object]]) -> list[Link]:
    """`ip -j -d addr show` (or `link show`) as Links (only vmplane's devices matter; the others are kept for
    their names)."""
    out = []
    for item in report:
        name = str(item.get("ifname", ""))
        info = item.get("linkinfo")
        kind = str(info.get("info_kind", "")) if isinstance(info, Mapping) else ""
        data = info.get("info_data") if isinstance(info, Mapping) else None
        vni = data.get("id") if isinstance(data, Mapping) else None
        master = item.get("master")
        flags = item.get("flags")
        mtu = item.get("mtu")
        mac = item.get("address")
        addr_info = item.get("addr_info")
        addresses = tuple(
            f"{a.get('local')}/{a.get('prefixlen')}"
            for a in (addr_info if isinstance(addr_info, list) else [])
            if isinstance(a, Mapping) and a.get("family") == "inet"
        )
        out.append(
            Link(
                name,
                kind,
                str(master) if master is not None else None,
                int(vni) if isinstance(vni, int) else None,
                int(mtu) if isinstance(mtu, int) else None,
                isinstance(flags, list) and "UP" in flags,
                addresses,
                str(mac) if isinstance(mac, str) else None,
            )
        )
    return out


def parse_fdb(report: Iterable[Mapping[str, object]]) -> dict[str, list[str]]:
    """`bridge -j fdb show` as each device's all-zeros destinations."""
    out: dict[str, list[str]] = {}
    for item in report:
        if item.get("mac") == ALL_ZEROS and item.get("dst") is not None:
            out.setdefault(str(item.get("ifname")), []).append(str(item["dst"]))
    return out


@dataclass(frozen=True)
class HostNetworks:
    """Everything a host must hold for its guests' networks: its plan (bridges, VXLAN), the filter's view
    (its ports, the rules and members by group key) and its DHCP servers."""

    plan: HostPlan
    ports: tuple[Port, ...] = ()
    rules: Mapping[str, tuple[Rule, ...]] = field(default_factory=dict)
    members: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    dhcp: tuple[Dhcp, ...] = ()


@dataclass(frozen=True)
class Applied:
    """What applying a host's networks took."""

    commands: int  # link and FDB commands run to reach the plan (0: the host held it already)
    filtered: int  # NICs in the filter loaded
