"""The audit's comparison of the store with what the hosts run (a pure function)."""

from vmplane.controllers.audit import placement_problems
from vmplane.core.drift import StoredVm
from vmplane.core.driver import DomainInfo
from vmplane.core.model import VmState
from vmplane.core.scaling import cap_for_share

P = "vmplane-"


def vm(name, state="running", host="h1", vcpus=1, memory=1024, cap=None, busy=False, migration=None):
    return StoredVm(name, P + name, VmState(state), host, vcpus, memory, cap, busy, migration)


def dom(name, vcpus=1, memory=1024, cap=None, state="running", reason="", soft=None):
    return DomainInfo(
        P + name, state in ("running", "blocked"), vcpus, memory, cap, state=state, reason=reason, soft_vcpus=soft
    )


def test_consistent_cluster_has_no_problem():
    vms = [vm("a"), vm("b", host="h2"), vm("c", "stopped", None)]
    assert placement_problems(vms, {"h1": [dom("a")], "h2": [dom("b")]}, P) == []


def test_each_broken_invariant_is_named():
    vms = [vm("twice"), vm("gone"), vm("moved"), vm("stopped", "stopped", None), vm("big")]
    seen = {
        "h1": [dom("twice"), dom("big", 2, 2048), DomainInfo("other-guest", True, 1, 1)],
        "h2": [dom("twice"), dom("moved"), dom("stopped"), dom("stranger")],
    }
    problems = placement_problems(vms, seen, P)
    assert problems == [
        "vm twice: runs 2 times, on h1, h2",
        "vm gone: running on h1 in the store, but no host runs it",
        "vm moved: the store says h1, but it runs on h2",
        "vm stopped: stopped in the store, but it runs on h2",
        "vm big: memory_mib is 2048 on h1, the record says 1024",
        "vm big: vcpus is 2 on h1, the record says 1",
        "domain vmplane-stranger: runs on h2 but the store has no such VM",
    ]


def test_unreachable_host_and_busy_moving_vms_are_not_judged_but_duplicates_are():
    """A VM seen on two hosts with no migration copying it between them runs twice, whatever its state."""
    vms = [vm("on-down-host"), vm("starting", "starting", busy=True), vm("migrating", "migrating", busy=True)]
    seen = {"h1": None, "h2": [dom("migrating")], "h3": [dom("migrating")]}
    assert placement_problems(vms, seen, P) == ["vm migrating: runs 2 times, on h2, h3"]


# -- drift on every host (review finding 8) ------------------------------------------------------------
def test_sizes_are_compared_on_every_host_naming_the_field_the_record_and_the_host():
    """A DIMM attached behind vmplane's back (libvirt counts it in the domain's current memory)."""
    problems = placement_problems([vm("app", host="lv1", memory=256)], {"lv1": [dom("app", memory=512)]}, P)
    assert problems == ["vm app: memory_mib is 512 on lv1, the record says 256"]


def test_soft_scaled_vcpus_are_in_sync_when_the_domain_cap_holds_the_recorded_count():
    """TCG soft scale-down: 4 plugged, the whole-domain cap holds it to 2 CPUs: the record's 2 is right."""
    assert placement_problems([vm("a", vcpus=2)], {"h1": [dom("a", vcpus=4, soft=2)]}, P) == []
    assert placement_problems([vm("a", vcpus=2)], {"h1": [dom("a", vcpus=4)]}, P) == [
        "vm a: vcpus is 4 on h1, the record says 2"
    ]
    assert placement_problems([vm("a", vcpus=2)], {"h1": [dom("a", vcpus=4, soft=3)]}, P) == [
        "vm a: vcpus is 4 plugged, capped to 3 CPUs on h1, the record says 2"
    ]
    assert placement_problems([vm("a", vcpus=4)], {"h1": [dom("a", vcpus=2)]}, P) == [
        "vm a: vcpus is 2 on h1, the record says 4"
    ]
    # a leftover soft cap holds the domain below the record: the project pays for CPUs the guest can't use
    assert placement_problems([vm("a", vcpus=4)], {"h1": [dom("a", vcpus=4, soft=2)]}, P) == [
        "vm a: vcpus is 4 plugged, capped to 2 CPUs on h1, the record says 4"
    ]


def test_the_cpu_cap_is_compared_with_the_record():
    half = cap_for_share(0.5)
    assert placement_problems([vm("a", cap=50.0)], {"h1": [dom("a", cap=half)]}, P) == []
    assert placement_problems([vm("a", cap=50.0)], {"h1": [dom("a")]}, P) == [
        "vm a: cpu_cap is off on h1, the record says 0.50 CPU per vCPU"
    ]
    assert placement_problems([vm("a")], {"h1": [dom("a", cap=half)]}, P) == [
        "vm a: cpu_cap is 0.50 CPU per vCPU on h1, the record says off"
    ]
    # tiny shares stretch the period (quota 1000 us): still the same cap
    assert placement_problems([vm("a", cap=7.0)], {"h1": [dom("a", cap=cap_for_share(0.07))]}, P) == []


def test_a_paused_domain_is_not_a_running_vm():
    problems = placement_problems([vm("a")], {"h1": [dom("a", state="paused", reason="postcopy-failed")]}, P)
    assert problems == ["vm a: state is paused (postcopy-failed) on h1, the record says running"]


def test_the_two_copies_of_a_migration_in_flight_are_not_a_vm_running_twice():
    """libvirt's incoming domain is paused on the target during the copy; in post-copy the source is paused."""
    copying = vm("m", "migrating", busy=True, migration=("h1", "h2"))
    incoming = {"h1": [dom("m")], "h2": [dom("m", state="paused", reason="migration")]}
    postcopy = {"h1": [dom("m", state="paused", reason="postcopy")], "h2": [dom("m")]}
    assert placement_problems([copying], incoming, P) == []
    assert placement_problems([copying], postcopy, P) == []
    # both executing, or a third host, or no migration copying: it runs twice
    assert placement_problems([copying], {"h1": [dom("m")], "h2": [dom("m")]}, P) == ["vm m: runs 2 times, on h1, h2"]
    assert placement_problems([vm("m", "migrating", busy=True, migration=("h1", "h3"))], incoming, P) == [
        "vm m: runs 2 times, on h1, h2"
    ]
    assert placement_problems([vm("m", busy=True)], incoming, P) == ["vm m: runs 2 times, on h1, h2"]


def test_a_vm_stuck_in_a_moving_state_with_nothing_in_flight_is_reported():
    vms = [vm("mig", "migrating"), vm("sc", "scaling"), vm("ok", "scaling", busy=True)]
    assert placement_problems(vms, {"h1": [dom("mig"), dom("sc"), dom("ok", 4, 4096)]}, P) == [
        "vm mig: migrating in the store, but no operation or migration of it is in flight",
        "vm sc: scaling in the store, but no operation or migration of it is in flight",
    ]
