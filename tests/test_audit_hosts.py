"""The audit's comparison of the store with what the hosts run (a pure function)."""

from vmplane.audit import StoredVm, placement_problems
from vmplane.drivers.base import DomainInfo
from vmplane.model import VmState

P = "vmplane-"


def vm(name, state="running", host="h1", vcpus=1, memory=1024):
    return StoredVm(name, P + name, VmState(state), host, vcpus, memory)


def dom(name, vcpus=1, memory=1024):
    return DomainInfo(P + name, True, vcpus, memory)


def test_consistent_cluster_has_no_problem():
    vms = [vm("a"), vm("b", host="h2"), vm("c", "stopped", None)]
    assert placement_problems(vms, {"h1": [dom("a")], "h2": [dom("b")]}, P, frozenset({"h1", "h2"})) == []


def test_each_broken_invariant_is_named():
    vms = [vm("twice"), vm("gone"), vm("moved"), vm("stopped", "stopped", None), vm("big")]
    seen = {"h1": [dom("twice"), dom("big", 2, 2048), DomainInfo("other-guest", True, 1, 1)],
            "h2": [dom("twice"), dom("moved"), dom("stopped"), dom("stranger")]}
    problems = placement_problems(vms, seen, P, frozenset({"h1"}))
    assert problems == [
        "vm twice: runs 2 times, on h1, h2",
        "vm gone: running on h1 in the store, but no host runs it",
        "vm moved: the store says h1, but it runs on h2",
        "vm stopped: stopped in the store, but it runs on h2",
        "vm big: 1 vCPU(s) / 1024 MiB in the store, 2 / 2048 on h1",
        "domain vmplane-stranger: runs on h2 but the store has no such VM",
    ]


def test_unreachable_host_and_moving_vms_are_not_judged_but_duplicates_are():
    vms = [vm("on-down-host"), vm("starting", "starting"), vm("migrating", "migrating")]
    seen = {"h1": None, "h2": [dom("migrating")], "h3": [dom("migrating")]}
    assert placement_problems(vms, seen, P) == ["vm migrating: runs 2 times, on h2, h3"]


def test_size_is_only_compared_on_sized_hosts():
    assert placement_problems([vm("a")], {"h1": [dom("a", 4, 4096)]}, P) == []
