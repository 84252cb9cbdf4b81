"""How soon the control plane's timed behaviours happen, on sim hosts in this process: what the tests assert
without the clock (issue 28: no test depends on the machine's speed) is measured here, N trials each.

- lease takeover: a control plane paused (its renewals stopped) with a start admitted; the other finishes
  that start (tests/test_controllers.py, lease 2 s; the promise: about two lease periods);
- sync loop: a domain removed behind vmplane's back, recorded stopped by the full sync at a 1-s interval
  (tests/test_host_loops_sim.py);
- migration deadline: a copy past `vmplane.migration.timeout` = 1 s aborted and the migration failed
  (tests/test_migration_settle.py);
- scale deadline: a scale whose migration never ends, failed after twice its 1-s migration timeout
  (tests/test_scale_deadline.py);
- sim fabric: 2000 hosts, each with a local pool, a volume and a running domain
  (tests/test_storage_sim_driver.py).

usage: .venv/bin/python bench/timing.py [--trials 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from common import table, write_section
from tests.conftest import add_basics, add_sim_hosts
from vmplane.controllers import scaler as scaler_module
from vmplane.core.driver import DiskSpec, DomainSpec, HostInfo, PoolSpec
from vmplane.core.model import Offering, OfferingKind
from vmplane.hosts.drivers.sim import SimDriver
from vmplane.hosts.drivers.simfabric import SimFabric
from vmplane.orchestrator import InlineExecutor, Orchestrator
from vmplane.store import Database

LEASE_S = 2.0
POLL_S = 0.01
LIMIT_S = 120.0


def until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + LIMIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} after {LIMIT_S:g} s")
        time.sleep(POLL_S)


def plane(url: str, executor=None, **kwargs) -> Orchestrator:
    """A control plane on the store at `url` (kwargs: its name and lease, as `vmplane serve`)."""
    db = Database(url)
    db.migrate()
    o = Orchestrator(db, executor or InlineExecutor(), **kwargs)
    o.load()
    return o


def close(*planes: Orchestrator) -> None:
    for o in planes:
        o.close()
        o.db.dispose()


def cluster(o: Orchestrator, hosts: int = 2) -> None:
    o.catalog.create_zone("z1")
    o.catalog.create_cluster("c1", "z1")
    add_sim_hosts(o, hosts)
    add_basics(o)
    o.catalog.create_project("p", 8, 10**6, 10)


# -- the measures: each one trial, in seconds ------------------------------------------------------------
class Held:
    """An executor that never runs what it is given: the process paused right after it admitted it."""

    def submit(self, fn, /, *args, **kwargs):
        return None

    def shutdown(self, wait=True, **kwargs):
        return None


def lease_takeover(folder: Path) -> float:
    url = f"sqlite:///{folder / 'takeover.db'}"
    a = plane(url, Held(), name="a", lease_s=LEASE_S)
    cluster(a, 6)
    b = plane(url, name="b", lease_s=LEASE_S)
    try:
        for o in (a, b, a):
            o.controllers.balance()
        a.create_vm("v1", "p", "small", "tiny", start=True)
        a.controllers._stop.set()  # paused: no renewal from here
        t0 = time.monotonic()
        until(lambda: b.vm("v1").state == "running", "takeover")
        return time.monotonic() - t0
    finally:
        close(b, a)


def sync_loop(folder: Path) -> float:
    o = plane(f"sqlite:///{folder / 'sync.db'}")
    try:
        cluster(o)
        o.create_vm("gone", "p", "small", "tiny", start=True)
        o.catalog.set_setting("vmplane.host.sync.interval", 1)
        o.sync.start()
        SimFabric.for_store(o.db.url).remove(o.vm("gone").host.name, "vmplane-gone")
        t0 = time.monotonic()
        until(lambda: o.vm("gone").state == "stopped", "sync")
        return time.monotonic() - t0
    finally:
        close(o)


def migration_deadline(folder: Path) -> float:
    o = plane(f"sqlite:///{folder / 'migration.db'}")
    try:
        cluster(o)
        o.create_vm("v", "p", "small", "tiny", start=True)
        o.catalog.set_setting("vmplane.migration.timeout", "1", "cluster", "c1")
        for d in o.drivers.values():
            d.copy_rate_mib_s = 4  # 1 GiB: minutes, unless aborted
        t0 = time.monotonic()
        row = o.migrator.get(o.migrator.migrate("v")["id"])
        took = time.monotonic() - t0
        if row["state"] != "failed":
            raise RuntimeError(f"the migration was not aborted: {row}")
        return took
    finally:
        close(o)


def scale_deadline(folder: Path) -> float:
    o = plane(f"sqlite:///{folder / 'scale.db'}", executor=ThreadPoolExecutor(4))
    saved = scaler_module.Scaler._migration_timeout, scaler_module.MIGRATE_FIRST_SLACK_S
    try:
        o.catalog.create_zone("z1")
        o.catalog.create_cluster("c1", "z1")
        add_sim_hosts(o, 2, cores=8, memory_mib=8 * 1024)
        o.catalog.set_setting("enable.dynamic.scale.vm", "true", "zone", "z1")
        o.catalog.create_offering(Offering("f1", OfferingKind.fixed, vcpus=1, memory_mib=256, dynamic_scaling=True))
        o.catalog.create_offering(
            Offering("big", OfferingKind.fixed, vcpus=4, memory_mib=6 * 1024, dynamic_scaling=True)
        )
        o.catalog.create_offering(
            Offering(
                "flex",
                OfferingKind.custom_constrained,
                min_vcpus=1,
                max_vcpus=8,
                min_memory_mib=256,
                max_memory_mib=8 * 1024,
                dynamic_scaling=True,
            )
        )
        o.catalog.create_template("t", "tiny-linux", dynamic_scaling=True)
        o.catalog.create_project("p", 16, 32 * 1024, 10, count_overhead=True)

        def started(name, *args, **kwargs):
            op = o.create_vm(name, "p", *args, start=True, **kwargs).operation_id
            until(lambda: o.operation(op).state not in ("pending", "running"), f"{name} started")

        started("filler", "flex", "t", vcpus=1, memory_mib=5 * 1024)
        started("v", "f1", "t")
        started("filler2", "flex", "t", vcpus=1, memory_mib=5 * 1024)
        stop = o.stop_vm("filler").operation_id
        until(lambda: o.operation(stop).state not in ("pending", "running"), "filler stopped")
        o.drivers[o.vm("v").host.name].copy_rate_mib_s = 0.01  # the copy would take hours
        scaler_module.Scaler._migration_timeout = lambda self, host: 1
        scaler_module.MIGRATE_FIRST_SLACK_S = 0
        t0 = time.monotonic()
        op_id = o.scaler.scale("v", offering="big")["operation_id"]
        until(lambda: o.operation(op_id).state not in ("pending", "running"), "scale ended")
        took = time.monotonic() - t0
        if o.operation(op_id).state != "failed":
            raise RuntimeError(f"the scale did not fail: {o.operation(op_id).message}")
        return took
    finally:
        scaler_module.Scaler._migration_timeout, scaler_module.MIGRATE_FIRST_SLACK_S = saved
        close(o)


def sim_fabric(folder: Path) -> float:
    local = PoolSpec("local", "/var/lib/vmplane/pools/local")
    fabric = SimFabric()
    fabric.disk_copy_rate_mib_s = None
    try:
        t0 = time.monotonic()
        for i in range(2000):
            d = SimDriver(f"h{i}", HostInfo(16, 2400, 65536), fabric)
            d.define_pool(local)
            d.create_volume("local", "root", 8192)
            d.start(
                DomainSpec(
                    f"v{i}",
                    1,
                    1,
                    1024,
                    1024,
                    "",
                    disks=(DiskSpec("local", "root", f"{local.path}/root", "vda", "qcow2", False),),
                )
            )
        return time.monotonic() - t0
    finally:
        fabric.close()


MEASURES = [
    (
        "lease takeover: pause -> start finished by the other",
        lease_takeover,
        f"at most {2 * LEASE_S:g} (2 leases of {LEASE_S:g} s)",
    ),
    ("sync loop: domain gone -> VM stopped (interval 1 s)", sync_loop, "1 to 2 (an interval and a pass)"),
    ("migration deadline: migrate -> aborted, failed (timeout 1 s)", migration_deadline, "about 1 (its timeout)"),
    ("scale deadline: scale -> failed (2 x 1-s migration timeout)", scale_deadline, "about 2 (twice the timeout)"),
    ("sim fabric: 2000 hosts with a pool, a volume, a domain", sim_fabric, "-"),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--dry", action="store_true", help="print the table, do not write RESULTS.md")
    args = ap.parse_args()
    rows = []
    for label, measure, promise in MEASURES:
        runs = []
        for _ in range(args.trials):
            with tempfile.TemporaryDirectory(prefix="vmplane-timing-") as folder:
                runs.append(measure(Path(folder)))
        rows.append([label, args.trials, f"{statistics.median(runs):.2f}", f"{max(runs):.2f}", promise])
        print(rows[-1], flush=True)
    body = table(["measure (seconds)", "trials", "median", "max", "promised"], rows)
    body += (
        "\n\nEach trial in a fresh store (SQLite) with sim hosts, in this process; the tests named in "
        "bench/timing.py assert these behaviours without the clock. 'promised': what the settings make of it; "
        "a median far above it on an idle machine is a regression."
    )
    if args.dry:
        print(body)
    else:
        write_section("Timed behaviours on sim hosts (bench/timing.py)", body)


if __name__ == "__main__":
    main()
