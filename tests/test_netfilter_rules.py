"""A host's guest filter (core/netfilter.py): the table text from the store's view, and the kernel's own
check of it (`nft` in a network namespace made for the test: nothing on this machine is changed)."""

import shutil
import subprocess

import pytest

from vmplane.core import networks as N
from vmplane.core.netfilter import Port, ruleset

WEB = Port(N.tap_of(1), N.bridge_of(1), N.mac_of(1), "10.0.0.2", ("g1",))
DB = Port(N.tap_of(2), N.bridge_of(1), N.mac_of(2), "10.0.0.3", ("g1", "g2"))
RULES = {
    "g1": [N.Rule("in", "any", group="g1"), N.Rule("out", "any", cidr="0.0.0.0/0")],
    "g2": [N.parse_rule("in", "tcp", "5432", group="g3"), N.parse_rule("in", "udp", "53-54", "192.0.2.0/24")],
}
MEMBERS = {"g1": ["10.0.0.3", "10.0.0.2"], "g3": ["10.0.9.9"]}


def test_each_nic_sends_only_from_its_mac_and_address_and_gets_what_its_groups_allow():
    text = ruleset([DB, WEB], RULES, MEMBERS)
    assert text.splitlines()[:5] == [
        "table bridge vmplane {}",
        "delete table bridge vmplane",
        "table inet vmplane {}",
        "delete table inet vmplane",
        "table bridge vmplane {",
    ]
    spoof = text[text.index("chain from_vmpt1") :]
    spoof = spoof[: spoof.index("\n  }")]
    assert "ether saddr != 02:76:70:00:00:01 drop" in spoof and "ip saddr 10.0.0.2 accept" in spoof
    assert "arp saddr ether 02:76:70:00:00:01 arp saddr ip 10.0.0.2 accept" in spoof
    assert spoof.rstrip().endswith("drop")
    assert '"vmpt1" : jump from_vmpt1' in text and 'iifname "vmpt*" drop' in text  # an unknown tap sends nothing
    assert 'oifname "vmpx*" udp dport { 67, 68 } drop' in text  # each host's DHCP answers its own guests only
    # the bridge and the address make one NIC, its network's connections a conntrack zone of their own
    assert '"vmpn1" . 10.0.0.2 : jump from_vmpt1' in text and '"vmpn1" . 10.0.0.3 : jump to_vmpt2' in text
    assert 'ct zone set iifname map { "vmpn1" : 1 }' in text
    inet = text[text.index("table inet vmplane {\n") :]
    assert "ip daddr 0.0.0.0/0 return" in inet[inet.index("chain from_vmpt1") :]
    assert "set m_g1 { type ipv4_addr; elements = { 10.0.0.2, 10.0.0.3 }; }" in text  # sorted
    assert "set m_g3 { type ipv4_addr; elements = { 10.0.9.9 }; }" in text  # named by a rule of g2
    db_in = inet[inet.index("chain to_vmpt2") :]
    assert "ip saddr @m_g3 meta l4proto tcp th dport 5432 accept" in db_in
    assert "ip saddr 192.0.2.0/24 meta l4proto udp th dport 53-54 accept" in db_in
    assert ruleset([WEB, DB], RULES, MEMBERS) == text  # deterministic


@pytest.mark.parametrize(
    "port",
    [
        Port("vmpt1; drop", "vmpn1", N.mac_of(1), "10.0.0.2", ()),
        Port("vmpt1", "vmpn1", "x", "10.0.0.2", ()),
        Port("vmpt1", "vmpn1", N.mac_of(1), "10.0.0.2 }", ()),
        Port("vmpt1", "vmpn1 ", N.mac_of(1), "10.0.0.2", ()),
    ],
)
def test_values_that_could_break_out_of_the_table_are_refused(port):
    with pytest.raises(ValueError, match="not a valid"):
        ruleset([port], {}, {})


def test_the_kernel_accepts_the_tables_and_replaces_them_whole(tmp_path):
    if shutil.which("nft") is None or shutil.which("unshare") is None:
        pytest.skip("nft or unshare is missing here (apt-get install nftables util-linux)")
    (tmp_path / "both.nft").write_text(ruleset([DB, WEB], RULES, MEMBERS))
    (tmp_path / "one.nft").write_text(ruleset([WEB], RULES, MEMBERS))
    # a network namespace of its own, gone with the process: the tables are loaded there, never here; loaded
    # twice (the second replaces the first in one transaction), then the smaller view replaces both
    both, one = tmp_path / "both.nft", tmp_path / "one.nft"
    shell = f"nft -f {both} && nft -f {both} && nft list ruleset > {tmp_path / 'a'} && nft -f {one} && nft list ruleset"
    done = subprocess.run(["unshare", "--net", "sh", "-c", shell], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    first, listed = (tmp_path / "a").read_text(), done.stdout
    assert "chain from_vmpt2" in first and "ip saddr @m_g3 tcp dport 5432 accept" in first  # as nft shows it
    assert "chain from_vmpt1" in listed and "ct state established,related accept" in listed
    assert "ether saddr != 02:76:70:00:00:01 drop" in listed
    assert "vmpt2" not in listed  # the NIC that left is gone from both tables
