"""The guest agent's rules (issue 30), pure: how often a VM's agent is asked, what of its answer is shown, and
what in it differs from the record (drift).

- An agent that answers and gave the guest's addresses is asked again every CONNECTED_EVERY_S (a guest's
  addresses rarely move; a change through vmplane, a NIC plugged, asks at once); one that does
  not answer (a guest still booting, one without an agent, a hung agent) or that has no address yet on a
  NIC of the record is asked every second for its first FAST_CHECKS, then less and less often (up to
  NONE_EVERY_MAX_S): a VM's addresses are shown within seconds of its boot, and a guest without an agent
  costs its host one fast failure (libvirt knows the channel is closed) every half minute.
- Drift: on the interface with a NIC's MAC, the guest must hold the NIC's recorded IPv4 address and no other
  IPv4 address (a guest that set another one by hand sends nothing from it: the host's filter drops it).
  IPv6 link-local addresses and interfaces of no NIC (lo, a bridge in the guest) are the guest's own.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Mapping, Sequence

from vmplane.core.driver import GuestInterface

CONNECTED_EVERY_S = 30.0
FAST_CHECKS = 10
NONE_EVERY_MAX_S = 30.0
STATES = ("connected", "none")


def next_check_s(state: str, misses: int, complete: bool) -> float:
    """Seconds until a VM's agent is asked again, after its `misses`-th answer in a row that was not
    `connected` with every NIC's address (`complete`)."""
    if state == "connected" and complete:
        return CONNECTED_EVERY_S
    if misses <= FAST_CHECKS:
        return 1.0
    return min(NONE_EVERY_MAX_S, 2.0 ** min(misses - FAST_CHECKS, 5))


def ipv4s(addresses: Sequence[str]) -> list[str]:
    """The IPv4 addresses (without their prefix) of an interface's `ADDR/PREFIX` list."""
    out = []
    for a in addresses:
        try:
            ip = ipaddress.ip_interface(a).ip
        except ValueError:
            continue
        if ip.version == 4:
            out.append(str(ip))
    return out


def complete(recorded: Mapping[str, str], reported: Sequence[GuestInterface]) -> bool:
    """Whether the guest reports every recorded NIC (MAC -> IP) with an address."""
    by_mac = {i.mac.lower(): i for i in reported}
    return all(mac.lower() in by_mac and ipv4s(by_mac[mac.lower()].addresses) for mac in recorded)


def drift(recorded: Mapping[str, str], reported: Sequence[GuestInterface]) -> list[str]:
    """What the guest holds that differs from the record, in words: for each recorded NIC (MAC -> IP), its
    address missing, or another IPv4 address on its interface. Empty when they agree."""
    by_mac = {i.mac.lower(): i for i in reported}
    out = []
    for mac, ip in sorted(recorded.items()):
        iface = by_mac.get(mac.lower())
        if iface is None:
            out.append(f"NIC {mac} ({ip}) is not among the guest's interfaces")
            continue
        held = ipv4s(iface.addresses)
        if ip not in held:
            out.append(
                f"NIC {mac}: the guest's {iface.name} lacks {ip}" + (f" (it holds {', '.join(held)})" if held else "")
            )
        others = [a for a in held if a != ip]
        if others and ip in held:
            out.append(f"NIC {mac}: the guest's {iface.name} also holds {', '.join(others)}, not recorded")
    return out


def to_json(reported: Sequence[GuestInterface]) -> str:
    return json.dumps([{"name": i.name, "mac": i.mac, "addresses": list(i.addresses)} for i in reported])


def from_json(text: str) -> list[GuestInterface]:
    try:
        return [GuestInterface(d["name"], d["mac"], list(d["addresses"])) for d in json.loads(text or "[]")]
    except (ValueError, KeyError, TypeError):
        return []


def shown(reported: Sequence[GuestInterface]) -> list[str]:
    """The guest's addresses as `vm show` lists them: `eth0 10.0.0.5/24`, loopback and IPv6 link-local left out."""
    out = []
    for i in reported:
        if i.name == "lo":
            continue
        for a in i.addresses:
            try:
                if ipaddress.ip_interface(a).ip.is_link_local:
                    continue
            except ValueError:
                continue
            out.append(f"{i.name} {a}")
    return out
