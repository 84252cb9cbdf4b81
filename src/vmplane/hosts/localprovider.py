"""Provider networks on local hosts (issue 29): the hosts' uplink is their switch (the bridge namespace that
joins their namespaces, localhosts.py), and this machine is the outside world.

For a provider network, each local host gets a veth `vmpu<id>` in its namespace whose other end is a port of
the switch (the network's bridge takes it as its uplink: core/hostnet.py), and this machine gets a veth of
its own onto the switch holding the network's gateway address: a guest on the network answers ping and TCP
from the machine that runs `vmplane up`, through the gateway its DHCP lease names. All provider networks
share the switch's layer 2 (there are no VLANs in these namespaces). A port no provider network needs is
removed (this machine's here; a host's by the host's own converge, which takes its switch end with it).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from ipaddress import ip_network

from vmplane.core import hostnet as H
from vmplane.hosts import localhosts as LH

_lock = threading.Lock()  # two hosts' applies make this machine's ports one at a time


def _exists(name: str, netns: str | None = None) -> bool:
    if netns is None:
        return os.path.exists(f"/sys/class/net/{name}")
    return LH._ip("-n", netns, "link", "show", name, check=False).returncode == 0


def ensure(host: LH.LocalHost, networks: Iterable[tuple[int, str]]) -> None:
    """Ports for the provider networks `networks` ((id, gateway/prefix)): the host's uplink veths, and this
    machine's gateway ports (each with only its gateway address); this machine's other gateway ports of the
    hosts' folder go."""
    assert host.netns is not None  # (only hosts with a namespace carry networks)
    base, networks = host.dir.parent, sorted(networks)
    tag, sw = LH._tag(base), LH.switch_ns(base)
    with _lock:
        LH._ensure_switch(base)
        wanted = {f"v{tag}g{nid:x}" for nid, _ in networks}
        prefix = f"v{tag}g"
        for name in sorted(os.listdir("/sys/class/net")):
            if name.startswith(prefix) and name not in wanted:
                LH._ip("link", "del", name, check=False)
        for nid, gateway in networks:
            here = f"v{tag}g{nid:x}"
            if not _exists(here):
                LH._ip("link", "add", here, "type", "veth", "peer", "name", f"v{tag}q{nid:x}")
                _into_switch(sw, f"v{tag}q{nid:x}")
            LH._ip("addr", "replace", gateway, "dev", here)
            LH._ip("link", "set", here, "up")
        index = int(host.address.rsplit(".", 1)[1]) - 1  # (its namespace's address is SUBNET.index+1)
        for nid, _ in networks:
            uplink = f"vmpu{nid:x}"
            if _exists(uplink, host.netns):
                continue
            there = f"v{tag}p{index}x{nid:x}"
            LH._ip("link", "del", there, check=False)  # a half-made pair of an earlier try
            LH._ip("link", "add", uplink, "type", "veth", "peer", "name", there)
            LH._ip("link", "set", uplink, "netns", host.netns)
            _into_switch(sw, there)


def _into_switch(sw: str, name: str) -> None:
    LH._ip("link", "set", name, "netns", sw)
    LH._ip("-n", sw, "link", "set", name, "master", LH.BRIDGE)
    LH._ip("-n", sw, "link", "set", name, "up")


def gateways(want: H.HostNetworks) -> list[tuple[int, str]]:
    """(id, gateway/prefix) of the provider networks of a host's plan."""
    routers = {d.bridge: (d.router, ip_network(d.cidr).prefixlen) for d in want.dhcp}
    out = []
    for n in want.plan.networks:
        router, prefix = routers.get(n.bridge, (None, 0))
        if n.uplink is not None and router is not None:
            out.append((int(n.uplink.removeprefix("vmpu"), 16), f"{router}/{prefix}"))
    return out
