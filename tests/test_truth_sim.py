"""The truth harness on sim hosts in fault mode (see tests/truthkit.py): random operations while the
hosts misbehave as libvirt does at its worst, then a quiet period; afterwards every VM's record must be
what its host runs (size, cap, state, host), the ledger == recomputed, claims == what runs, nothing in
flight. Each mutant (one rule of the code under test broken) must be caught. The long run is
bench/truth.py."""

import collections

import pytest

from vmplane.model import Offering, OfferingKind

from . import truthkit
from .conftest import add_sim_hosts, ledger_usage

REQUIRED = ("transient", "partial", "event_late", "event_twice", "event_lost")
# each group must have been injected at least once (any of its kinds)
GROUPS = {**{kind: (kind,) for kind in REQUIRED}, "disk unplug": ("detach_late", "detach_never"),
          "migration": ("lost_connection", "postcopy_failed"), "memory unplug": ("unplug_late", "unplug_never"),
          "guest": ("guest_poweroff", "guest_crash", "guest_pause")}
SEEDS = (20261130, 20261201, 20261202)


def _missing(counts) -> list[str]:
    return [group for group, kinds in GROUPS.items() if not sum(counts[k] for k in kinds)]


def test_the_record_is_what_the_hosts_run_after_more_than_100_faults(tmp_path):
    """Which faults a run meets depends on how its threads interleave: a live volume detach, for one, may
    not come up in 12 rounds on a loaded machine. Another run (another seed) follows until every kind of
    fault has been met, at most three in all; every run must end with the record equal to the hosts
    (a further run can only find more: stop 28's second seed met a volume left `detaching` once, not
    seen again in 25 runs of seeds 20261201-10 and 20261301-10; a volume finding now names its VM's
    state and host and the volume's last events)."""
    counts: collections.Counter = collections.Counter()
    faults, busiest = 0, 0
    for seed in SEEDS:
        home = tmp_path / str(seed)
        home.mkdir()
        report = truthkit.run(home, rounds=12, seed=seed, log=print, migration_faults=True,
                              weights=truthkit.MORE_DETACHES)
        print(report.counts)
        assert report.problems() == []
        counts.update(report.counts)
        faults += report.faults
        busiest = max(busiest, *(r.vms for r in report.rounds))
        if faults >= 100 and not _missing(counts):
            break
    assert faults >= 100
    assert not _missing(counts), f"no fault of these kinds was injected in {len(SEEDS)} runs: {_missing(counts)}"
    assert busiest >= 10      # the cluster was busy, not empty


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


def test_ha_mode_hosts_failing_during_random_operations_run_no_vm_twice_and_keep_the_ledger_exact(tmp_path):
    """Issue 12 on sim hosts: HA VMs among the random operations while hosts fail (power, daemon, network;
    for good or for a while, blips shorter than the grace among them; fault mode's flaps, partitions and
    reboots), fence agents broken for a while, an operator confirming a host off. A watch reads the fabric
    all along: no domain ever runs on two hosts; every HA restart came while its host was fenced; no VM
    left charged on a fenced host; then every host repaired, the usual checks (ledger exact, audit clean).
    How many hosts fail in 4 rounds depends on timing (CI once met two): another seed follows until enough
    did, at most three runs; every run must end clean (a further run can only find more)."""
    failures = fences = restarts = flaps = samples = 0
    for seed in (20261201, 20261202, 20261203):
        home = tmp_path / str(seed)
        home.mkdir()
        report = truthkit.run(home, rounds=4, seed=seed, log=print, ha=truthkit.HaMode())
        print(report.counts, report.ha)
        assert report.problems() == []
        failures += sum(n for k, n in report.ha.items() if k.startswith(("power ", "daemon ", "network ")))
        fences += report.ha["fences"]
        restarts += report.ha["HA restarts"]
        flaps += report.counts["host_flap"] + report.counts["host_partition"] + report.counts["host_reboot"]
        samples += report.ha["running-twice samples"]
        if failures >= 3 and fences >= 2 and restarts >= 1 and flaps > 0 and samples > 1000:
            break
    assert failures >= 3 and fences >= 2 and restarts >= 1, (failures, fences, restarts)
    assert flaps > 0
    assert samples > 1000


def test_the_ha_mutant_that_restarts_before_fencing_is_caught_by_the_running_twice_watch(tmp_path):
    """A failed host taken as fenced without its agent (truthkit.MUTANTS["ha-no-fence"]): a host whose
    daemon died, or that is cut off, still runs its guests when they restart elsewhere. Whether a run of
    4 rounds restarts a VM whose host still runs it depends on timing (CI once met a single HA restart,
    caught by the other checks instead): another seed follows until one is, at most three runs."""
    seen = []
    for seed in (7, 8, 9):
        home = tmp_path / str(seed)
        home.mkdir()
        report = truthkit.run(home, rounds=4, seed=seed, mutant="ha-no-fence", log=print, storage=False,
                              ha=truthkit.MUTANT_HA["ha-no-fence"],
                              stop_at_problem=lambda problems: any("running twice" in p for p in problems))
        seen += report.problems()
        if any("running twice" in p for p in report.problems()):
            break
    assert any("running twice" in p for p in seen), seen
