"""The long truth run on sim hosts in fault mode (tests/truthkit.py): random operations while the hosts
misbehave as libvirt does at its worst, a quiet period, then the record against what the hosts run.
Several clusters, one per seed; injected faults by kind, problems found. With --mutant NAME, one rule
of the code under test is broken (truthkit.MUTANTS) and the run says after how many rounds the
harness caught it. With --migration-faults, lost connections mid-copy and post-copy failures too.

Each run forces every kind of fault once (truthkit.ScheduledFaults), then goes on at the rates; --seed S
(default 1) is the first cluster's seed (the next: S+1, ...): the same seed replays the same schedule and
workload choices (threads still decide which call meets each fault). The suite's versions
(tests/test_truth_sim.py) are one bounded run each.

usage: .venv/bin/python bench/truth.py [rounds per cluster, default 40] [clusters, default 3] [--seed S]
       .venv/bin/python bench/truth.py --mutants [rounds, default 20]     (every mutant, 3 seeds each)
       .venv/bin/python bench/truth.py --mutant NAME [rounds] [--migration-faults]
       .venv/bin/python bench/truth.py --ha [rounds per cluster, default 20] [clusters]   (HA mode, issue 12)
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from common import table, write_section
from tests import truthkit
from vmplane.hosts.drivers.simfaults import KINDS

SHORT = {
    "transient": "transient",
    "transient_call": "in restart",
    "partial": "partial",
    "unplug_late": "unplug late",
    "unplug_never": "unplug never",
    "lost_connection": "conn lost",
    "postcopy_failed": "postcopy fail",
    "guest_poweroff": "poweroff",
    "guest_crash": "crash",
    "guest_pause": "pause",
    "event_late": "ev late",
    "event_twice": "ev twice",
    "event_lost": "ev lost",
}


def one(
    rounds: int,
    seed: int,
    migration_faults: bool,
    mutant: str | None = None,
    stop_at_problem: bool = False,
    ha: truthkit.HaMode | None = None,
) -> tuple[truthkit.Report, float]:
    ha = ha or truthkit.MUTANT_HA.get(mutant)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        report = truthkit.run(
            Path(tmp),
            rounds,
            seed=seed,
            migration_faults=migration_faults,
            mutant=mutant,
            stop_at_problem=stop_at_problem,
            ha=ha,
            storage=not (mutant and ha),
            scheduled=mutant not in truthkit.MUTANT_UNSCHEDULED,
            steer=truthkit.MUTANT_STEER.get(mutant, ()) if mutant else (),
        )
        return report, time.monotonic() - t0


def clean(rounds: int, clusters: int, first_seed: int = 1) -> None:
    rows, total = [], collections.Counter()
    findings = []
    for migration_faults in (False, True):
        for seed in range(first_seed, first_seed + clusters):
            report, seconds = one(rounds, seed, migration_faults)
            total.update(report.counts)
            rows.append(
                [
                    seed,
                    "on" if migration_faults else "off",
                    len(report.rounds),
                    *report.counts.values(),
                    report.faults,
                    len(report.problems()),
                    max(r.vms for r in report.rounds),
                    f"{seconds:.0f}",
                ]
            )
            for p in report.problems()[:8]:
                print("PROBLEM", p)
                findings.append(f"- seed {seed}, migration faults {'on' if migration_faults else 'off'}: {p}")
    body = table(
        [
            "seed",
            "migration faults",
            "rounds",
            *(SHORT.get(k, k) for k in KINDS),
            "faults",
            "problems",
            "max VMs",
            "seconds",
        ],
        rows,
    )
    body += (
        "\n\nFaults injected in all runs: "
        + ", ".join(f"{k} {total[k]}" for k in KINDS)
        + f" (total {sum(total.values())}).\n\n"
        "A round: 60 random operations (crashkit's workload: create/start, stop, delete, migrate, cancel, "
        "scale incl. past a full host, drain, quota changes; plus CPU-cap changes, scale-downs that unplug "
        "DIMMs, and small VMs that grow and give it back) while the sim hosts inject faults "
        "(drivers/simfaults.py, `SimFaults.nasty` x3), then a quiet period (faults off; late unplugs, copies, "
        "events and pauses land; the event loop drains; the monitor, the full sync and the migration settle "
        "loop run until nothing is in flight), then the check: record == what the hosts run (host, state, "
        "usable vCPUs, memory, cap), stopped VMs run nowhere, no unknown domains, ledger == recomputed and "
        "within quota, host usage == claims == the capacity index, nothing in flight (30 s at most). "
        '"in restart": calls refused because libvirtd was still restarting after a transient fault. '
        "Migration faults (connection lost mid-copy, post-copy failure) are settled by the migrator's settle "
        "step (issue 10).\n"
    )
    if findings:
        body += "\nProblems found (first of each run):\n" + "\n".join(findings[:20]) + "\n"
    write_section("Truth harness (bench/truth.py, sim hosts in fault mode)", body)


def mutants(rounds: int, seeds: int, first_seed: int = 1) -> None:
    rows = []
    for name in truthkit.MUTANTS:
        for seed in range(first_seed, first_seed + seeds):
            mf = name in truthkit.MUTANT_FAULTS
            report, seconds = one(rounds, seed, mf, mutant=name, stop_at_problem=True)
            caught = report.first_caught()
            first = report.problems()[0] if caught is not None else ""
            rows.append(
                [
                    name,
                    seed,
                    "on" if mf else "off",
                    "yes" if caught is not None else "NO",
                    "" if caught is None else caught + 1,
                    report.faults,
                    f"{seconds:.0f}",
                    first[:110],
                ]
            )
            print(rows[-1])
    body = table(
        ["mutant", "seed", "migration faults", "caught", "after rounds", "faults", "seconds", "first problem"], rows
    )
    body += (
        "\n\nMutants (tests/truthkit.py MUTANTS, the code under test rewritten at run time): "
        "`no-unplug-wait`: a DIMM unplug taken as done once asked (no wait for the DIMM to leave, the size "
        "asked for reported: the libvirt driver before issue 10); `no-unplug-wait-only`: only the wait removed, "
        "the driver still reads the domain back (the scale fails, records the larger size, the sync adopts the "
        "late unplug: the record stays true, so it is expected to survive); `unknown-is-absent`: a DriverError "
        'on a lookup taken as "gone" (settle.settle_vm and Orchestrator._domain_presence); `copy-error-stays`: '
        'a copy that raised taken as "the VM stayed on its source" (Migrator._run finishing `copy-failed`, '
        "the target claim given back unasked, instead of Migrator.settle asking both hosts: the migrator "
        "before issue 10). Caught: the first round with a problem (1-based); seeds of the fault sequence "
        "(threads make the interleaving vary). The suite (tests/test_truth_sim.py) runs each caught mutant "
        "with the fault it needs made likelier (truthkit.MUTANT_RATES).\n"
    )
    write_section("Truth harness mutants (bench/truth.py --mutants)", body)


def ha_runs(rounds: int, clusters: int, first_seed: int = 1) -> None:
    """HA mode: hosts failing during the random operations (truthkit.HaMode); per cluster the failures,
    fences, HA restarts, running-twice samples and problems."""
    rows, findings = [], []
    for seed in range(first_seed, first_seed + clusters):
        report, seconds = one(rounds, seed, False, ha=truthkit.HaMode())
        h = report.ha
        failures = sum(n for k, n in h.items() if k.startswith(("power ", "daemon ", "network ")))
        host_faults = sum(report.counts[k] for k in ("host_flap", "host_partition", "host_reboot"))
        twice = sum(1 for p in report.problems() if "running twice" in p)
        rows.append(
            [
                seed,
                len(report.rounds),
                failures,
                h.get("blips (< grace)", 0),
                host_faults,
                h.get("fence broken", 0),
                h.get("operator confirmed off", 0),
                h.get("repairs", 0),
                h["fences"],
                h["HA restarts"],
                h["running-twice samples"],
                twice,
                len(report.problems()),
                f"{seconds:.0f}",
            ]
        )
        print(rows[-1])
        findings += [f"- seed {seed}: {p}" for p in report.problems()[:8]]
    body = table(
        [
            "seed",
            "rounds",
            "host failures",
            "blips < grace",
            "flaps/partitions/reboots",
            "fence broken",
            "confirmed off",
            "repairs",
            "fences",
            "HA restarts",
            "twice samples",
            "running twice",
            "problems",
            "seconds",
        ],
        rows,
    )
    body += (
        "\n\nA round: 60 random operations at a slower pace (HA VMs among them) while hosts fail (power, "
        "daemon, network; for good or for 0.1-4 s; `vmplane.ha.grace` 0.7 s) and fault mode's flaps, "
        "partitions and reboots happen, fence agents broken for 1-4 s, an operator confirming a stuck host "
        "off; then the recoveries end, the HA checks (every HA restart after its host was fenced, no VM "
        "charged on a fenced host), every host repaired, the usual checks. The running-twice watch reads the "
        "fabric every 5 ms all along.\n"
    )
    if findings:
        body += "\nProblems found:\n" + "\n".join(findings[:20]) + "\n"
    write_section("Truth harness, HA mode (bench/truth.py --ha)", body)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("rounds", nargs="?", type=int)
    ap.add_argument("clusters", nargs="?", type=int, default=3)
    ap.add_argument("--mutant", choices=list(truthkit.MUTANTS))
    ap.add_argument("--mutants", action="store_true")
    ap.add_argument("--migration-faults", action="store_true")
    ap.add_argument("--ha", action="store_true")
    ap.add_argument("--seed", type=int, default=1, help="the first cluster's seed (the next: +1, ...)")
    a = ap.parse_args()
    if a.ha:
        ha_runs(a.rounds or 20, a.clusters, a.seed)
        sys.exit(0)
    if a.mutant:
        report, seconds = one(
            a.rounds or 20,
            a.seed,
            a.migration_faults or a.mutant in truthkit.MUTANT_FAULTS,
            mutant=a.mutant,
            stop_at_problem=True,
        )
        caught = report.first_caught()
        print(
            f"mutant {a.mutant}: "
            + (
                f"caught after {caught + 1} round(s)"
                if caught is not None
                else f"NOT caught in {len(report.rounds)} rounds"
            )
            + f", {report.faults} faults, "
            f"{seconds:.0f} s"
        )
        for p in report.problems()[:5]:
            print("  ", p)
        sys.exit(0 if caught is not None else 1)
    if a.mutants:
        mutants(a.rounds or 20, a.clusters, a.seed)
    else:
        clean(a.rounds or 40, a.clusters, a.seed)
