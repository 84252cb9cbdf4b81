"""High availability on sim hosts: a failed host is fenced, its HA VMs run again elsewhere (by priority,
exactly once, quota-neutral), its other VMs are stopped; a blip restarts nothing; fencing that fails
restarts nothing until it works or an operator confirms the host off; a restart that can not be placed
ends in `error` after its attempts; a whole cluster going dark at once fences nothing."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from vmplane.core.model import HostState, Offering, OfferingKind
from vmplane.core.names import domain_name
from vmplane.orchestrator import Orchestrator
from vmplane.store import ledger as L

from .conftest import add_sim_hosts, ledger_usage


def ha_plane(db) -> Orchestrator:
    """Three sim hosts (4 vCPUs, 8 GiB each) with a threaded executor: recovery waits and retries."""
    o = Orchestrator(db, ThreadPoolExecutor(8, thread_name_prefix="test-op"))
    o.load()
    o.catalog.create_zone("z1")
    o.catalog.create_cluster("c1", "z1")
    add_sim_hosts(o, 3, cores=4, memory_mib=8192)
    o.catalog.create_offering(Offering("one", OfferingKind.fixed, vcpus=1, memory_mib=1024))
    o.catalog.create_template("t", "tiny-linux")
    o.catalog.create_project("p", 12, 24576, 20)
    o.catalog.set_setting("vmplane.ha.grace", "0")
    return o


def close_ha_plane(o: Orchestrator) -> None:
    """Every host powered on and its fence agent working again, then the plane closed."""
    for name in ("h1", "h2", "h3"):
        o.drivers[name].fabric.recover_host(name)
        o.drivers[name].fabric.set_fence_broken(name, None)
    o.close()


@pytest.fixture
def ha(db):
    o = ha_plane(db)
    yield o
    close_ha_plane(o)


def on_h1(o, specs: list[tuple[str, str, int]]) -> None:
    """Start VMs (name, ha policy, priority) on h1: the other hosts are disabled meanwhile."""
    for other in ("h2", "h3"):
        o.set_host_state(other, HostState.disabled)
    for name, policy, priority in specs:
        o.create_vm(name, "p", "one", "t", start=True, ha_policy=policy, ha_priority=priority)
        wait_for(lambda name=name: o.vm(name).state == "running", 60, f"{name} to run")
        assert o.vm(name).host.name == "h1"
    for other in ("h2", "h3"):
        o.set_host_state(other, HostState.enabled)


def wait_for(predicate, timeout: float, what: str) -> None:
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


def recovery(o, host: str):
    with o.db.read() as s:
        return (
            s.connection()
            .execute(
                L.OPERATIONS.select()
                .where(L.OPERATIONS.c.kind == "recover", L.OPERATIONS.c.target == host)
                .order_by(L.OPERATIONS.c.created_at.desc())
            )
            .first()
        )


def restarts(o) -> list:
    with o.db.read() as s:
        return (
            s.connection()
            .execute(L.OPERATIONS.select().where(L.OPERATIONS.c.kind == "restart").order_by(L.OPERATIONS.c.created_at))
            .all()
        )


def copies(o, vm: str) -> list[str]:
    """Every host that runs the VM's domain, asked through the fabric (all hosts at once)."""
    return o.drivers["h1"].fabric.hosts_of(domain_name(vm))


def fail(o, host: str, mode: str) -> None:
    o.drivers[host].fabric.fail_host(host, mode)
    o.check_hosts()
    assert o.host(host).state == "down"


def partitioned_with_broken_fencing(o, host: str) -> None:
    o.drivers[host].fabric.set_fence_broken(host, "BMC busy")
    fail(o, host, "network")
    o.ha.check()
    wait_for(lambda: "fencing failed" in (o.host(host).state_reason or ""), 60, "a failed fencing attempt")


def test_power_failure_restarts_ha_vms_by_priority_once_and_stops_the_others(ha):
    o = ha
    o.catalog.set_setting("vmplane.ha.max.parallel", "1")
    on_h1(o, [("low", "restart", 1), ("mid", "restart", 2), ("top", "restart", 3), ("plain", "off", 0)])
    before, plain = ledger_usage(o, "p"), o.vm("plain")
    fail(o, "h1", "power")
    declared = o.ha.check()
    assert declared and "it looks dead" in declared[0], declared
    wait_for(lambda: recovery(o, "h1").state == "succeeded", 60, "the recovery")
    assert o.host("h1").state == "fenced" and "fenced by its sim agent" in o.host("h1").state_reason
    for vm in ("low", "mid", "top"):
        v = o.vm(vm)
        assert v.state == "running" and v.host.name in ("h2", "h3"), (vm, v.state)
        assert copies(o, vm) == [v.host.name]  # exactly one domain on the whole fabric
    assert o.vm("plain").state == "stopped" and copies(o, "plain") == []
    assert [op.target for op in restarts(o)] == ["top", "mid", "low"]  # highest priority first
    after = ledger_usage(o, "p")
    assert (after.vcpus, after.memory_mib) == (
        before.vcpus - plain.charged_vcpus,
        before.memory_mib - plain.charged_memory_mib,
    )  # only plain's went
    assert o.host("h1").used_vcpus == 0
    assert o.audit() == []


def test_a_blip_shorter_than_the_grace_restarts_and_fences_nothing(ha):
    o = ha
    o.catalog.set_setting("vmplane.ha.grace", "30")
    on_h1(o, [("a", "restart", 0)])
    fail(o, "h1", "network")
    assert o.ha.check() == []
    assert o.vm("a").state == "unknown"
    o.drivers["h1"].fabric.recover_host("h1")
    o.check_hosts()
    assert o.host("h1").state == "enabled" and o.vm("a").state == "running" and copies(o, "a") == ["h1"]
    assert recovery(o, "h1") is None and restarts(o) == []
    assert o.audit() == []


def test_fencing_that_fails_restarts_nothing_until_an_operator_confirms_the_host_off(ha):
    o = ha
    on_h1(o, [("a", "restart", 0), ("b", "off", 0)])
    o.drivers["h1"].fabric.set_fence_broken("h1", "the BMC does not answer")
    fail(o, "h1", "daemon")  # its guests run on
    o.ha.check()
    wait_for(lambda: "fencing failed" in (o.host("h1").state_reason or ""), 60, "a failed fencing attempt")
    assert o.host("h1").state == "fencing" and "the BMC does not answer" in o.host("h1").state_reason
    wait_for(lambda: "fencing failed (attempt 2)" in (o.host("h1").state_reason or ""), 60, "a retried fencing")
    # retried meanwhile: still nothing restarted
    assert o.vm("a").state == "unknown" and copies(o, "a") == ["h1"] and restarts(o) == []
    o.drivers["h1"].fabric.fail_host("h1", "power")  # the operator pulled the plug
    o.ha.fence("h1", confirm_off=True)
    wait_for(lambda: recovery(o, "h1").state == "succeeded", 60, "the recovery")
    assert o.vm("a").state == "running" and copies(o, "a") == [o.vm("a").host.name] != ["h1"]
    assert o.vm("b").state == "stopped"
    assert o.audit() == []


def test_fencing_that_works_again_is_retried_and_then_restarts(ha):
    o = ha
    on_h1(o, [("a", "restart", 0)])
    partitioned_with_broken_fencing(o, "h1")
    o.drivers["h1"].fabric.set_fence_broken("h1", None)
    wait_for(lambda: recovery(o, "h1").state == "succeeded", 60, "the recovery")
    assert o.host("h1").state == "fenced" and o.vm("a").state == "running"
    assert copies(o, "a") == [o.vm("a").host.name]
    assert o.audit() == []


def test_a_host_that_answers_again_before_it_is_fenced_keeps_its_vms(ha):
    o = ha
    on_h1(o, [("a", "restart", 0)])
    partitioned_with_broken_fencing(o, "h1")
    o.drivers["h1"].fabric.recover_host("h1")
    wait_for(lambda: recovery(o, "h1").state == "failed", 60, "the recovery to end")
    o.check_hosts()
    assert o.host("h1").state == "enabled" and o.vm("a").state == "running" and copies(o, "a") == ["h1"]
    assert restarts(o) == [] and o.audit() == []


def test_an_ha_restart_is_never_refused_for_quota(ha):
    o = ha
    o.catalog.create_project("full", 2, 2048 + 2 * 64, 2)
    for other in ("h2", "h3"):
        o.set_host_state(other, HostState.disabled)
    for vm in ("f1", "f2"):
        o.create_vm(vm, "full", "one", "t", start=True, ha_policy="restart")
        wait_for(lambda vm=vm: o.vm(vm).state == "running", 60, f"{vm} to run")
    for other in ("h2", "h3"):
        o.set_host_state(other, HostState.enabled)
    before = ledger_usage(o, "full")
    fail(o, "h1", "power")
    o.ha.check()
    wait_for(lambda: recovery(o, "h1").state == "succeeded", 60, "the recovery")
    assert {o.vm(v).state for v in ("f1", "f2")} == {"running"}
    assert ledger_usage(o, "full") == before
    assert o.audit() == []


def test_a_restart_with_no_room_ends_in_error_after_its_attempts(ha):
    o = ha
    o.catalog.set_setting("vmplane.ha.max.restart", "2")
    on_h1(o, [("a", "restart", 0)])
    for other in ("h2", "h3"):
        o.set_host_state(other, HostState.disabled)
    fail(o, "h1", "power")
    o.ha.check()
    wait_for(lambda: recovery(o, "h1").state == "succeeded", 60, "the recovery")
    vm = o.vm("a")
    assert vm.state == "error" and vm.charged_vcpus == 0
    assert "not restarted after 2 attempt(s)" in recovery(o, "h1").message
    assert o.audit() == []


def test_every_host_of_a_cluster_dark_at_once_fences_nothing(ha):
    o = ha
    on_h1(o, [("a", "restart", 0)])
    for host in ("h1", "h2", "h3"):
        o.drivers[host].fabric.fail_host(host, "network")
    o.check_hosts()
    assert o.ha.check() == []
    assert o.host("h1").state == "down" and "control plane's own network" in o.host("h1").state_reason
    assert recovery(o, "h1") is None
