"""The truth harness on sim hosts in fault mode (see tests/truthkit.py): random operations while the
hosts misbehave as libvirt does at its worst, then a quiet period; afterwards every VM's record must be
what its host runs (size, cap, state, host), the ledger == recomputed, claims == what runs, nothing in
flight. Each mutant (one rule of the code under test broken) must be caught. The long run is
bench/truth.py."""

import pytest

from vmplane.model import Offering, OfferingKind

from . import truthkit
from .conftest import add_sim_hosts, ledger_usage

REQUIRED = ("transient", "partial", "event_late", "event_twice", "event_lost")


def test_the_record_is_what_the_hosts_run_after_more_than_100_faults(tmp_path):
    report = truthkit.run(tmp_path, rounds=12, seed=20261130, log=print, migration_faults=True)
    print(report.counts)
    assert report.problems() == []
    assert report.faults >= 100
    for kind in REQUIRED:
        assert report.counts[kind] > 0, f"no {kind} fault was injected"
    assert report.counts["detach_late"] + report.counts["detach_never"] > 0, "no disk unplug fault was injected"
    assert report.counts["lost_connection"] + report.counts["postcopy_failed"] > 0, "no migration fault was injected"
    assert report.counts["unplug_late"] + report.counts["unplug_never"] > 0
    assert report.counts["guest_poweroff"] + report.counts["guest_crash"] + report.counts["guest_pause"] > 0
    assert max(r.vms for r in report.rounds) >= 10      # the cluster was busy, not empty


@pytest.mark.parametrize("mutant", ["no-unplug-wait", "unknown-is-absent", "copy-error-stays"])
def test_each_mutant_is_caught(tmp_path, mutant):
    report = truthkit.run(tmp_path, rounds=10, seed=7, mutant=mutant, log=print,       # (no storage: none of
                          migration_faults=mutant in truthkit.MUTANT_FAULTS,          # their rules is in it)
                          faults=truthkit.MUTANT_RATES.get(mutant), storage=False)
    assert report.problems(), f"mutant {mutant} survived {len(report.rounds)} rounds ({report.faults} faults)"


def test_the_sync_adopts_a_domain_that_shrank_and_only_reports_one_that_grew(orch):
    """A DIMM unplug the guest completed after the scale gave up (or a scale whose read-back failed)
    leaves the domain smaller than the record: the full sync adopts it, the charge and the claim go
    down. A domain with more than the record is not adopted by the sync (the audit reports it)."""
    add_sim_hosts(orch, 1, cores=8, memory_mib=16384)
    orch.catalog.create_offering(Offering("two", OfferingKind.fixed, vcpus=2, memory_mib=2048))
    orch.catalog.create_template("t", "tiny-linux")
    orch.catalog.create_project("p", 16, 65536, 20)
    for name in ("small", "big"):
        orch.create_vm(name, "p", "two", "t", start=True)
    host = orch.vm("small").host.name
    fabric = orch.drivers[host].fabric
    charged = ledger_usage(orch, "p").memory_mib
    fabric.update(host, orch.domain_name("small"), memory_mib=1024)        # the late unplug landed
    fabric.update(host, orch.domain_name("big"), memory_mib=3072)          # a DIMM attached behind our back
    orch.sync.sync()
    assert orch.vm("small").memory_mib == 1024
    assert ledger_usage(orch, "p").memory_mib < charged
    assert orch.vm("big").memory_mib == 2048
    assert [p for p in orch.audit() if "small" in p] == []
    assert any("vm big: memory_mib is 3072" in p for p in orch.audit())


def test_a_scale_that_adds_vcpus_and_gives_back_memory_keeps_the_capacity_index_with_the_store(orch):
    """Found by the truth harness: the admission took the vCPU growth on the host but mirrored it in the
    capacity index only when the memory footprint grew too (`host h4: index 3/6448 != store`)."""
    add_sim_hosts(orch, 1, cores=8, memory_mib=16384)
    orch.catalog.set_setting("enable.dynamic.scale.vm", "true", "zone", "z1")
    for name, vcpus, memory in (("a", 1, 1024), ("a2", 1, 2048), ("b", 2, 1024)):
        orch.catalog.create_offering(Offering(name, OfferingKind.fixed, vcpus=vcpus, memory_mib=memory,
                                              dynamic_scaling=True))
    orch.catalog.create_template("t", "tiny-linux", dynamic_scaling=True)
    orch.catalog.create_project("p", 16, 65536, 20)
    orch.create_vm("v", "p", "a", "t", start=True)
    orch.scaler.scale("v", offering="a2")
    orch.scaler.scale("v", offering="b")            # +1 vCPU, -1024 MiB
    vm = orch.vm("v")
    assert (vm.state, vm.vcpus, vm.memory_mib) == ("running", 2, 1024)
    assert orch.audit() == []
