"""What a host holds for its zone's networks (core/hostnet.py): the plan, the commands that converge a host to
it, and those commands run for real in a network namespace of the test's own (nothing here is changed)."""

import json
import shutil
import subprocess
import sys
import textwrap

import pytest

from vmplane.core import hostnet as H

UNDERLAY = {"h1": "10.99.0.1", "h2": "10.99.0.2", "h3": "10.99.0.3"}
NETS = [H.NetworkView(2, "z1"), H.NetworkView(1, "z1"), H.NetworkView(3, "z2")]


def test_a_host_carries_every_network_of_its_zone_joined_to_every_other_host():
    p = H.plan("h1", "z1", UNDERLAY, NETS)
    assert [n.bridge for n in p.networks] == ["vmpn1", "vmpn2"]  # z2's network is not here
    assert all(n.peers == ("10.99.0.2", "10.99.0.3") and n.mtu == 1450 for n in p.networks)
    assert (p.networks[0].vxlan, p.networks[0].vni, p.local) == ("vmpx1", 10001, "10.99.0.1")
    with pytest.raises(ValueError, match="underlay"):
        H.plan("h9", "z1", UNDERLAY, NETS)


def test_converging_an_empty_host_builds_everything_and_a_converged_one_needs_nothing():
    p = H.plan("h1", "z1", UNDERLAY, NETS[:1])
    first = H.converge(p, [], {})
    assert first[0] == ["ip", "link", "add", "vmpn2", "address", "02:76:71:00:00:02", "type", "bridge"]
    assert ["bridge", "fdb", "append", H.ALL_ZEROS, "dev", "vmpx2", "dst", "10.99.0.3"] in first
    bridge = H.Link("vmpn2", "bridge", mac="02:76:71:00:00:02")
    held = [bridge, H.Link("vmpx2", "vxlan", "vmpn2", 10002, 1450), H.Link("eth0", "veth")]
    assert H.converge(p, held, {"vmpx2": ["10.99.0.2", "10.99.0.3"]}) == []


def test_the_bridge_holds_the_dhcp_servers_address_the_same_on_every_host_and_nothing_else():
    nets = [H.NetworkView(2, "z1", "10.10.0.0/24")]
    plans = [H.plan(h, "z1", UNDERLAY, nets) for h in ("h1", "h2")]
    assert {p.networks[0].address for p in plans} == {"10.10.0.254/24"}  # the last host address
    assert {p.networks[0].mac for p in plans} == {"02:76:71:00:00:02"}
    stale = H.Link("vmpn2", "bridge", mac="02:aa:00:00:00:01", addresses=("10.10.0.9/24",))
    cmds = H.converge(plans[0], [stale], {})
    assert ["ip", "link", "set", "dev", "vmpn2", "address", "02:76:71:00:00:02"] in cmds
    assert ["ip", "addr", "del", "10.10.0.9/24", "dev", "vmpn2"] in cmds
    assert ["ip", "addr", "replace", "10.10.0.254/24", "dev", "vmpn2"] in cmds


def test_stale_devices_peers_and_a_wrong_vni_are_repaired():
    p = H.plan("h1", "z1", {"h1": "10.99.0.1", "h2": "10.99.0.2"}, NETS[:1])
    held = [H.Link("vmpn9", "bridge"), H.Link("vmpn2", "bridge"), H.Link("vmpx2", "vxlan", "vmpn2", 77, 1450)]
    cmds = H.converge(p, held, {"vmpx2": ["10.99.0.7"]})
    assert cmds[0] == ["ip", "link", "del", "vmpn9"]  # an orphan of a deleted network
    assert ["ip", "link", "del", "vmpx2"] in cmds and ["ip", "link", "set", "vmpx2", "master", "vmpn2"] in cmds
    assert ["bridge", "fdb", "append", H.ALL_ZEROS, "dev", "vmpx2", "dst", "10.99.0.2"] in cmds


RUNNER = textwrap.dedent(
    """
    import json, subprocess, sys
    from vmplane.core import hostnet as H

    def held():
        links = H.parse_links(json.loads(subprocess.run(["ip", "-j", "-d", "addr", "show"], check=True,
                              capture_output=True, text=True).stdout))
        fdb = H.parse_fdb(json.loads(subprocess.run(["bridge", "-j", "fdb", "show"], check=True,
                          capture_output=True, text=True).stdout or "[]"))
        return links, fdb

    def converge(plan):
        cmds = H.converge(plan, *held())
        for cmd in cmds:
            subprocess.run(cmd, check=True, capture_output=True, text=True)
        return len(cmds)

    subprocess.run(["ip", "addr", "add", "10.99.0.1/32", "dev", "lo"], check=True)
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    nets = [H.NetworkView(1, "z1"), H.NetworkView(2, "z1")]
    big = H.plan("h1", "z1", {"h1": "10.99.0.1", "h2": "10.99.0.2", "h3": "10.99.0.3"}, nets)
    small = H.plan("h1", "z1", {"h1": "10.99.0.1", "h2": "10.99.0.2"}, nets[:1])
    out = {"first": converge(big), "again": converge(big), "shrunk": converge(small), "after": converge(small)}
    links, fdb = held()
    out["links"] = sorted(l.name for l in links if l.name.startswith("vmp"))
    out["fdb"] = fdb
    out["master"] = {l.name: l.master for l in links if l.name.startswith("vmpx")}
    print(json.dumps(out))
    """
)


def test_the_commands_converge_a_real_host_and_remove_what_no_network_needs():
    if not all(shutil.which(t) for t in ("unshare", "ip", "bridge")):
        pytest.skip("unshare, ip or bridge is missing here (apt-get install util-linux iproute2)")
    done = subprocess.run(
        ["unshare", "--net", sys.executable, "-c", RUNNER], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["first"] > 0 and got["again"] == 0 and got["shrunk"] > 0 and got["after"] == 0
    assert got["links"] == ["vmpn1", "vmpx1"]  # network 2's devices are gone
    assert got["fdb"] == {"vmpx1": ["10.99.0.2"]} and got["master"] == {"vmpx1": "vmpn1"}


def test_a_provider_network_is_bridged_to_its_uplink_port_with_no_vxlan_device():
    nets = [H.NetworkView(4, "z1", "10.20.0.0/24", None, provider=True)]
    p = H.plan("h1", "z1", UNDERLAY, nets)
    (n,) = p.networks
    assert (n.uplink, n.mtu) == ("vmpu4", 1500)  # one L2 already: no VXLAN, no overhead
    cmds = H.converge(p, [H.Link("vmpu4", "veth"), H.Link("vmpx4", "vxlan", "vmpn4", 10004, 1450)], {})
    assert ["ip", "link", "del", "vmpx4"] in cmds  # a VXLAN link as well would loop broadcasts
    assert ["ip", "link", "set", "vmpu4", "master", "vmpn4"] in cmds
    assert not any("vxlan" in c for c in cmds)
    held = [
        H.Link("vmpn4", "bridge", mac="02:76:71:00:00:04", addresses=("10.20.0.254/24",)),
        H.Link("vmpu4", "veth", "vmpn4"),
    ]
    assert H.converge(p, held, {}) == []
