"""A host's packet filter for its guests' NICs, as a pure function of the store's view (issue 29): two nftables
tables replaced whole and atomically by one `nft -f` (core.networks names the bridges and taps).

- `bridge vmplane` (stateless, per tap: the bridge family sees the port a frame came from): a guest sends
  only from its recorded MAC, its IPv4 packets and ARP only from its recorded address (a DHCP request from
  0.0.0.0 excepted), and nothing but IPv4 and ARP.
- `inet vmplane` (stateful: this kernel has no conntrack in the bridge family, so bridged IPv4 is filtered
  where br_netfilter hands it to the IP forward hook, which sees the bridge, not the port): a NIC is its
  network's bridge plus its address, unique on a host even where two projects use one CIDR. Replies to what
  was allowed pass; a packet leaving a guest must pass its `out` rules (`from_<tap>`, which returns when one
  allows), then one reaching a guest its `in` rules (`to_<tap>`); a rule naming a group matches a set of
  that group's members' addresses, so the rule count grows with members plus rules, not their product.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from vmplane.core.networks import Rule

TABLE = "vmplane"
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


def ruleset(ports: Iterable[Port], rules: Mapping[str, Iterable[Rule]], members: Mapping[str, Iterable[str]]) -> str:
    """Both tables for `ports`: `rules` by group key (a rule's `group` is a group key too), `members` the
    addresses of each group key's NICs on every host. Deterministic: the same view gives the same text."""
    ports = sorted(ports, key=lambda p: p.tap)
    for p in ports:
        _checked(_NAME, p.tap, "tap"), _checked(_NAME, p.bridge, "bridge")
        _checked(_MAC, p.mac, "MAC"), _checked(_IPV4, p.ip, "address")
    keys = {g for p in ports for g in p.groups}
    keys |= {r.group for g in keys for r in rules.get(g, ()) if r.group is not None}
    out = [f"table bridge {TABLE}", f"delete table bridge {TABLE}", f"table bridge {TABLE} {{"]
    out += ["  chain forward {", "    type filter hook forward priority 0; policy accept;"]
    out += [f'    iifname "{p.tap}" jump spoof_{p.tap}' for p in ports]
    out.append("  }")
    for p in ports:
        out += [
            f"  chain spoof_{p.tap} {{",
            f"    ether saddr != {p.mac} drop",
            f"    arp saddr ip != {p.ip} drop",
            "    ip saddr 0.0.0.0 udp sport 68 udp dport 67 return",
            f"    ip saddr != {p.ip} drop",
            "    meta protocol { ip, arp } return",
            "    drop",
            "  }",
        ]
    out += ["}", f"table inet {TABLE}", f"delete table inet {TABLE}", f"table inet {TABLE} {{"]
    for key in sorted(keys):
        addresses = sorted(_checked(_IPV4, a, "address") for a in members.get(key, ()))
        elements = f" elements = {{ {', '.join(addresses)} }};" if addresses else ""
        out.append(f"  set m_{_checked(_NAME, key, 'group key')} {{ type ipv4_addr;{elements} }}")
    out += ["  chain forward {", "    type filter hook forward priority 0; policy accept;"]
    out += ["    ct state established,related accept", "    udp sport { 67, 68 } udp dport { 67, 68 } accept"]
    out += [f'    iifname "{p.bridge}" ip saddr {p.ip} jump from_{p.tap}' for p in ports]
    out += [f'    oifname "{p.bridge}" ip daddr {p.ip} jump to_{p.tap}' for p in ports]
    out.append("  }")
    for p in ports:
        mine = [r for g in p.groups for r in rules.get(g, ())]
        out.append(f"  chain from_{p.tap} {{")
        out += [f"    {_match(r, 'daddr')} return" for r in mine if r.direction == "out"]
        out += ["    drop", "  }", f"  chain to_{p.tap} {{"]
        out += [f"    {_match(r, 'saddr')} accept" for r in mine if r.direction == "in"]
        out += ["    drop", "  }"]
    out.append("}")
    return "\n".join(out) + "\n"
