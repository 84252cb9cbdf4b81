"""A host's packet filter for its guests' NICs, as a pure function of the store's view (issue 29): two nftables
tables replaced whole and atomically by one `nft -f` (core.networks names the bridges and taps; the design
and its measurements: docs/design/networks.md and networks-probe.md).

- `bridge vmplane`, stateless, where the bridge family sees the port a frame came from. In prerouting, before
  anything else: a guest sends only from its recorded MAC, its IPv4 only from its recorded address and its
  ARP only for it (a DHCP request from 0.0.0.0 excepted); a tap this host does not know sends nothing. The
  host answers its guests only for DHCP and ARP, and nothing of the host crosses a VXLAN port (each host's
  DHCP server answers its own guests only).
- `inet vmplane`, stateful. This kernel has no connection tracking in the bridge family, so bridged IPv4 is
  filtered where br_netfilter hands it to the IP hooks, which see the bridge, not the port: there a NIC is
  its network's bridge plus its address (unique on a host even where two projects use one CIDR), and each
  network's connections are tracked in a zone of their own. Replies to what was allowed pass; a packet
  leaving a guest must pass its `out` rules, then one reaching a guest its `in` rules; a rule naming a group
  matches a set of that group's members' addresses, so the rule count grows with members plus rules, not
  their product; NICs are found by a map, not a list.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from vmplane.core.networks import Rule

TABLE = "vmplane"
BETWEEN_HOSTS = ("vmpx*", "vmpu*")  # the ports a network's bridge reaches other hosts by: VXLAN, provider uplink
_NAME = re.compile(r"[a-z0-9_]{1,31}")
_MAC = re.compile(r"([0-9a-f]{2}:){5}[0-9a-f]{2}")
_IPV4 = re.compile(r"\d{1,3}(\.\d{1,3}){3}(/\d{1,2})?")


@dataclass(frozen=True)
class Port:
    """A NIC on this host: its tap, its network's bridge, its MAC, address and its security groups' keys."""

    tap: str
    bridge: str
    mac: str
    ip: str
    groups: tuple[str, ...]


def _checked(pattern: re.Pattern[str], value: str, what: str) -> str:
    if not pattern.fullmatch(value):
        raise ValueError(f"not a valid {what} for the host's filter: {value!r}")
    return value


def _match(rule: Rule, peer: str) -> str:
    """The nft match of one rule; `peer` is `saddr` (in) or `daddr` (out)."""
    parts = []
    if rule.cidr is not None:
        parts.append(f"ip {peer} {_checked(_IPV4, rule.cidr, 'CIDR')}")
    if rule.group is not None:
        parts.append(f"ip {peer} @m_{_checked(_NAME, rule.group, 'group key')}")
    if rule.proto != "any":  # `ip saddr/daddr` above already means IPv4 (a rule names a CIDR or a group)
        parts.append(f"meta l4proto {rule.proto}")
    if rule.port_min is not None:
        ports = f"{rule.port_min}" if rule.port_min == rule.port_max else f"{rule.port_min}-{rule.port_max}"
        parts.append(f"th dport {ports}")
    return " ".join(parts)


def ruleset(
    ports: Iterable[Port],
    rules: Mapping[str, Iterable[Rule]],
    members: Mapping[str, Iterable[str]],
    zones: Mapping[str, int] | None = None,
) -> str:
    """Both tables for `ports`: `rules` by group key (a rule's `group` is a group key too), `members` the
    addresses of each group key's NICs on every host, `zones` each bridge's conntrack zone (by default its
    order). Deterministic: the same view gives the same text."""
    ports = sorted(ports, key=lambda p: p.tap)
    for p in ports:
        _checked(_NAME, p.tap, "tap"), _checked(_NAME, p.bridge, "bridge")
        _checked(_MAC, p.mac, "MAC"), _checked(_IPV4, p.ip, "address")
    bridges = sorted({p.bridge for p in ports})
    zones = dict(zones) if zones is not None else {b: n for n, b in enumerate(bridges, start=1)}
    keys = {g for p in ports for g in p.groups}
    keys |= {r.group for g in keys for r in rules.get(g, ()) if r.group is not None}
    out = [f"table bridge {TABLE} {{}}", f"delete table bridge {TABLE}"]
    out += [f"table inet {TABLE} {{}}", f"delete table inet {TABLE}", f"table bridge {TABLE} {{"]
    for p in ports:
        out += [
            f"  chain from_{p.tap} {{",
            f"    ether saddr != {p.mac} drop",
            f"    arp saddr ether {p.mac} arp saddr ip {p.ip} accept",
            "    ip saddr 0.0.0.0 ip daddr 255.255.255.255 udp sport 68 udp dport 67 accept",
            f"    ip saddr {p.ip} accept",
            "    drop",
            "  }",
        ]
    out += ["  chain prerouting {", "    type filter hook prerouting priority -300; policy accept;"]
    if ports:
        taps = ", ".join(f'"{p.tap}" : jump from_{p.tap}' for p in ports)
        out.append(f"    iifname vmap {{ {taps} }}")
    out += ['    iifname "vmpt*" drop', "  }"]
    out += ["  chain forward {", "    type filter hook forward priority -300; policy accept;"]
    for between in BETWEEN_HOSTS:
        out += [
            f'    oifname "{between}" udp dport {{ 67, 68 }} drop',
            f'    iifname "{between}" udp dport {{ 67, 68 }} drop',
        ]
    out += ["  }", "  chain input {", "    type filter hook input priority -300; policy accept;"]
    out += [f'    iifname "{between}" drop' for between in BETWEEN_HOSTS]
    out += ['    iifname "vmpt*" udp dport 67 accept', '    iifname "vmpt*" ether type arp accept']
    out += ['    iifname "vmpt*" drop', "  }"]
    out += ["  chain output {", "    type filter hook output priority -300; policy accept;"]
    out += [f'    oifname "{between}" drop' for between in BETWEEN_HOSTS]
    out += ["  }", "}", f"table inet {TABLE} {{"]
    for key in sorted(keys):
        addresses = sorted(_checked(_IPV4, a, "address") for a in members.get(key, ()))
        elements = f" elements = {{ {', '.join(addresses)} }};" if addresses else ""
        out.append(f"  set m_{_checked(_NAME, key, 'group key')} {{ type ipv4_addr;{elements} }}")
    for p in ports:
        mine = [r for g in p.groups for r in rules.get(g, ())]
        out += [f"  chain from_{p.tap} {{", "    ct state established,related return"]
        out += [f"    {_match(r, 'daddr')} return" for r in mine if r.direction == "out"]
        out += ["    drop", "  }", f"  chain to_{p.tap} {{", "    ct state established,related accept"]
        out += [f"    {_match(r, 'saddr')} accept" for r in mine if r.direction == "in"]
        out += ["    drop", "  }"]
    if bridges:
        zone_map = ", ".join(f'"{_checked(_NAME, b, "bridge")}" : {int(zones[b])}' for b in bridges)
        out += ["  chain zone_in {", "    type filter hook prerouting priority -310; policy accept;"]
        out += [f"    ct zone set iifname map {{ {zone_map} }}", "  }"]
        out += ["  chain zone_out {", "    type filter hook output priority -310; policy accept;"]
        out += [f"    ct zone set oifname map {{ {zone_map} }}", "  }"]
    out += ["  chain forward {", "    type filter hook forward priority 0; policy accept;"]
    if ports:
        leaving = ", ".join(f'"{p.bridge}" . {p.ip} : jump from_{p.tap}' for p in ports)
        reaching = ", ".join(f'"{p.bridge}" . {p.ip} : jump to_{p.tap}' for p in ports)
        out += [f"    iifname . ip saddr vmap {{ {leaving} }}", f"    oifname . ip daddr vmap {{ {reaching} }}"]
    out += ["  }", "}"]
    return "\n".join(out) + "\n"
