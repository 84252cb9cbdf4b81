"""A scale that migrates first has a deadline (review finding 6): after twice `vmplane.migration.timeout`
plus a slack, a migration still active is cancelled and the scale fails naming why; the VM stays where it
runs at its old size, its charge and claims as before the scale."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from vmplane.controllers import scaler as scaler_module
from vmplane.core import settings as settings_rules
from vmplane.core.model import Offering, OfferingKind
from vmplane.orchestrator import Orchestrator

from .conftest import add_sim_hosts, ledger_usage

GIB = 1024


@pytest.fixture
def threaded(db):
    o = Orchestrator(db, ThreadPoolExecutor(4))
    o.load()
    o.catalog.create_zone("z1")
    o.catalog.create_cluster("c1", "z1")
    add_sim_hosts(o, 2, cores=8, memory_mib=8 * GIB)
    o.catalog.set_setting("enable.dynamic.scale.vm", "true", "zone", "z1")
    o.catalog.create_offering(Offering("f1", OfferingKind.fixed, vcpus=1, memory_mib=256, dynamic_scaling=True))
    o.catalog.create_offering(Offering("big", OfferingKind.fixed, vcpus=4, memory_mib=6 * GIB, dynamic_scaling=True))
    o.catalog.create_offering(
        Offering(
            "flex",
            OfferingKind.custom_constrained,
            min_vcpus=1,
            max_vcpus=8,
            min_memory_mib=256,
            max_memory_mib=8 * GIB,
            dynamic_scaling=True,
        )
    )
    o.catalog.create_template("t", "tiny-linux", dynamic_scaling=True)
    o.catalog.create_project("p", 16, 32 * GIB, 10, count_overhead=True)
    yield o
    o.close()


def wait_op(o, op_id: str, timeout: float = 60.0):
    t0 = time.monotonic()
    while (op := o.operation(op_id)).state in ("pending", "running"):
        assert time.monotonic() - t0 < timeout, f"operation still {op.state}: {op.message}"
        time.sleep(0.05)
    return op


def started(o, name: str, *args, **kwargs) -> None:
    admitted = o.create_vm(name, "p", *args, start=True, **kwargs)
    wait_op(o, admitted.operation_id)


def test_a_migration_that_does_not_end_is_cancelled_and_the_scale_fails_naming_why(threaded, monkeypatch):
    o = threaded
    started(o, "filler", "flex", "t", vcpus=1, memory_mib=5 * GIB)  # h1
    started(o, "v", "f1", "t")  # spread: h2
    started(o, "filler2", "flex", "t", vcpus=1, memory_mib=5 * GIB)  # fills h2
    wait_op(o, o.stop_vm("filler").operation_id)
    host = o.vm("v").host.name
    o.drivers[host].copy_rate_mib_s = 0.01  # 256 MiB at 0.01 MiB/s: the copy would take 7 hours
    monkeypatch.setattr(scaler_module.Scaler, "_migration_timeout", lambda self, host: 1)
    monkeypatch.setattr(scaler_module, "MIGRATE_FIRST_SLACK_S", 0)
    before = ledger_usage(o, "p")
    used_before = o.host(host).used_vcpus, o.host(host).used_memory_mib
    result = o.scaler.scale("v", offering="big")
    op = wait_op(o, result["operation_id"], timeout=120)  # ended by its deadline: the copy would take hours
    assert op.state == "failed", op.message
    assert "still copying after 2 s" in op.message and "vmplane.migration.timeout" in op.message
    assert "cancelled" in op.message
    [mig] = o.migrator.list(vm="v", limit=1)
    assert mig["state"] in ("cancelled", "failed")
    vm = o.vm("v")
    assert vm.state == "running" and vm.host.name == host and (vm.vcpus, vm.memory_mib) == (1, 256)
    assert ledger_usage(o, "p") == before  # the increase given back
    assert (o.host(host).used_vcpus, o.host(host).used_memory_mib) == used_before
    assert o.audit() == []


def test_the_deadline_reads_the_migration_timeout_setting_when_it_exists_else_600(threaded, monkeypatch):
    o = threaded
    started(o, "v", "f1", "t")
    host = o.vm("v").host.name
    key = scaler_module.MIGRATION_TIMEOUT_KEY
    if key in settings_rules.KEYS:
        spec = settings_rules.KEYS[key]
        value = max(int(spec.low or 1), 1) + 7
        o.catalog.set_setting(key, str(value))
        assert o.scaler._migration_timeout(host) == value
        o.catalog.set_setting(key, str(spec.default))
    monkeypatch.delitem(settings_rules.KEYS, key, raising=False)
    assert o.scaler._migration_timeout(host) == 600
