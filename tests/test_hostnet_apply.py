"""Applying a host's networks and guest filter (hosts/hostnet.py) for real, in a network namespace the test
makes and deletes by its name (nothing else on this machine is touched)."""

import os
import shutil
import subprocess

import pytest

from vmplane.core import hostnet as H
from vmplane.core import networks as N
from vmplane.core.driver import DriverError
from vmplane.core.netfilter import Port
from vmplane.hosts import hostnet

NETS = [H.NetworkView(1, "z1"), H.NetworkView(2, "z1")]
UNDERLAY = {"h1": "10.99.0.1", "h2": "10.99.0.2"}


@pytest.fixture
def netns():
    if not all(shutil.which(t) for t in ("ip", "bridge", "nft")):
        pytest.skip("ip, bridge or nft is missing here (apt-get install iproute2 nftables)")
    name = f"vmptest-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        for cmd in (["ip", "link", "set", "lo", "up"], ["ip", "addr", "add", "10.99.0.1/32", "dev", "lo"]):
            subprocess.run(["ip", "netns", "exec", name, *cmd], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def test_a_host_is_brought_to_its_plan_and_filter_then_to_a_smaller_one_and_read_back(netns):
    run = hostnet.netns_runner("h1", netns)
    web = Port(N.tap_of(1), N.bridge_of(1), N.mac_of(1), "10.0.0.2", ("g1",))
    rules = {"g1": [N.Rule("in", "any", group="g1"), N.Rule("out", "any", cidr="0.0.0.0/0")]}
    first = hostnet.apply("h1", run, H.plan("h1", "z1", UNDERLAY, NETS), [web], rules, {"g1": ["10.0.0.2"]})
    assert first.commands > 0 and first.filtered == 1
    links, fdb = hostnet.held(run)
    assert {"vmpn1", "vmpx1", "vmpn2", "vmpx2"} <= {link.name for link in links}
    assert fdb == {"vmpx1": ["10.99.0.2"], "vmpx2": ["10.99.0.2"]}
    assert "from_vmpt1" in run(["nft", "list", "table", "bridge", "vmplane"], None)
    again = hostnet.apply("h1", run, H.plan("h1", "z1", UNDERLAY, NETS), [web], rules, {"g1": ["10.0.0.2"]})
    assert again.commands == 0  # it held the plan: nothing was run but the filter's reload
    smaller = hostnet.apply("h1", run, H.plan("h1", "z1", UNDERLAY, NETS[:1]), [], {}, {})
    assert smaller.commands > 0 and smaller.filtered == 0
    assert {link.name for link in hostnet.held(run)[0] if link.name.startswith("vmp")} == {"vmpn1", "vmpx1"}
    assert "vmpt1" not in run(["nft", "list", "ruleset"], None)


def test_a_host_that_refuses_a_step_is_an_error_naming_the_host_and_the_command(netns):
    run = hostnet.netns_runner("h1", netns)
    with pytest.raises(DriverError, match=r"h1.*ip link del vmpn77"):
        run(["ip", "link", "del", "vmpn77"], None)
    with pytest.raises(DriverError, match="h1"):
        hostnet.netns_runner("h1", "vmptest-no-such-namespace")(["ip", "link", "show"], None)
