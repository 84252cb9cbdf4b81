"""Drift between the record and the hosts: the pure rules, `vm sync` adopting what a host really runs
(sim hosts changed behind vmplane's back), and offline resize of stopped VMs."""

import pytest
from sqlalchemy import select

from vmplane.controllers import adopt
from vmplane.core.drift import host_size, vcpus_match
from vmplane.core.driver import CpuCap, DomainInfo, DomainSpec
from vmplane.core.errors import Conflict, Invalid, QuotaExceeded
from vmplane.core.model import Offering, OfferingKind, Size, Usage
from vmplane.core.quota import overhead_mib
from vmplane.hosts.drivers.simfabric import SimFabric
from vmplane.store.schema import Event

from .conftest import add_sim_hosts
from .conftest import ledger_usage as usage

GIB = 1024
D = "vmplane-v"


# -- pure rules ---------------------------------------------------------------------------------
def test_the_soft_vcpu_rule_and_what_the_host_gives():
    soft = DomainInfo(D, True, 4, 512, soft_vcpus=2)
    assert vcpus_match(2, soft) and not vcpus_match(4, soft) and not vcpus_match(3, soft)
    assert vcpus_match(4, DomainInfo(D, True, 4, 512)) and not vcpus_match(2, DomainInfo(D, True, 4, 512))
    assert (host_size(soft).vcpus, host_size(soft).memory_mib) == (2, 512)
    capped = DomainInfo(D, True, 2, 768, CpuCap(10_000, 5_000))
    assert (host_size(capped).vcpus, host_size(capped).memory_mib, host_size(capped).cpu_cap_percent) == (2, 768, 50.0)


# -- vm sync on sim hosts -------------------------------------------------------------------------
@pytest.fixture
def cluster(orch):
    add_sim_hosts(orch, 2, cores=8, memory_mib=8 * GIB)
    orch.catalog.set_setting("enable.dynamic.scale.vm", "true", "zone", "z1")
    orch.catalog.create_offering(Offering("f1", OfferingKind.fixed, vcpus=1, memory_mib=256, dynamic_scaling=True))
    orch.catalog.create_offering(
        Offering(
            "f2", OfferingKind.fixed, vcpus=2, memory_mib=512, dynamic_scaling=True, cpu_cap=True, cpu_speed_mhz=1200
        )
    )
    orch.catalog.create_offering(
        Offering(
            "flex",
            OfferingKind.custom_constrained,
            min_vcpus=1,
            max_vcpus=4,
            min_memory_mib=256,
            max_memory_mib=4 * GIB,
            dynamic_scaling=True,
        )
    )
    orch.catalog.create_template("t", "tiny-linux", dynamic_scaling=True)
    orch.catalog.create_project("p", 16, 32 * GIB, 10, count_overhead=True)
    return orch


def fabric(o):
    return SimFabric.for_store(o.db.url)


def footprint(vcpus, memory):
    return memory + overhead_mib(Size(vcpus, memory))


def host_used(o, name):
    h = o.host(name)
    return h.used_vcpus, h.used_memory_mib


def events_of(o, vm):
    with o.db.read() as s:
        return [e.message for e in s.scalars(select(Event).where(Event.vm == vm).order_by(Event.id))]


def test_a_vm_grown_behind_vmplanes_back_is_reported_then_adopted_with_its_charge_and_claim(cluster):
    o = cluster
    o.create_vm("v", "p", "f1", "t", start=True)
    host = o.vm("v").host.name
    assert fabric(o).update(host, D, vcpus=2, memory_mib=512)
    assert o.audit() == [
        f"vm v: memory_mib is 512 on {host}, the record says 256",
        f"vm v: vcpus is 2 on {host}, the record says 1",
    ]
    result = adopt.sync_vm(o.plane, "v")
    assert result["changes"] == [
        {"field": "vcpus", "record": "1", "host": "2"},
        {"field": "memory_mib", "record": "256", "host": "512"},
    ]
    assert not result["in_sync"] and result["over_quota"] is None and result["host"] == host
    vm = o.vm("v")
    assert (vm.vcpus, vm.memory_mib, vm.state) == (2, 512, "running")
    assert usage(o, "p") == Usage(2, footprint(2, 512), 1)
    assert host_used(o, host) == (2, footprint(2, 512)) and o.audit() == []
    assert any("sync: vcpus: 1 -> 2; memory_mib: 256 -> 512" in m for m in events_of(o, "v"))
    assert adopt.sync_vm(o.plane, "v") == {
        "vm": "v",
        "in_sync": True,
        "changes": [],
        "over_quota": None,
        "message": "in sync",
        "host": host,
    }


def test_a_cap_set_behind_vmplanes_back_is_adopted(cluster):
    o = cluster
    o.create_vm("v", "p", "f1", "t", start=True)
    host = o.vm("v").host.name
    fabric(o).update(host, D, cpu_cap=CpuCap(10_000, 2_500))
    assert o.audit() == [f"vm v: cpu_cap is 0.25 CPU per vCPU on {host}, the record says off"]
    assert adopt.sync_vm(o.plane, "v")["message"] == "cpu_cap: off -> 0.25 CPU per vCPU"
    assert o.vm("v").cpu_cap_percent == 25.0 and o.audit() == []


def test_a_grown_vm_over_its_quota_is_adopted_and_reported_never_stopped(cluster):
    o = cluster
    o.catalog.create_project("small", 2, 2 * GIB, 2, count_overhead=False)
    o.create_vm("v", "small", "f1", "t", start=True)
    host = o.vm("v").host.name
    fabric(o).update(host, D, vcpus=3, memory_mib=2304)
    result = adopt.sync_vm(o.plane, "v")
    assert result["over_quota"] == "over quota by 1 vCPU and 256 MiB"
    assert result["message"].endswith("; over quota by 1 vCPU and 256 MiB")
    assert o.vm("v").state == "running" and usage(o, "small") == Usage(3, 2304, 1)
    assert fabric(o).domain(host, D) is not None  # still runs
    assert any("over quota by 1 vCPU and 256 MiB" in m for m in events_of(o, "v"))
    assert o.audit() == ["project small: vcpus 3 above quota", "project small: memory_mib 2304 above quota"]


def test_gone_is_recorded_stopped_and_running_elsewhere_moves_the_claim(cluster):
    o = cluster
    o.create_vm("v", "p", "f1", "t", start=True)
    o.create_vm("w", "p", "f1", "t", start=True)
    host = o.vm("v").host.name
    other = ({"h1", "h2"} - {host}).pop()
    fabric(o).remove(host, D)
    assert adopt.sync_vm(o.plane, "v")["changes"] == [
        {"field": "state", "record": "running", "host": "stopped (no host runs it)"}
    ]
    assert o.vm("v").state == "stopped" and o.vm("v").host is None
    w_host = o.vm("w").host.name
    w_other = ({"h1", "h2"} - {w_host}).pop()
    assert fabric(o).move("vmplane-w", w_host, w_other)
    assert o.audit() == [f"vm w: the store says {w_host}, but it runs on {w_other}"]
    assert adopt.sync_vm(o.plane, "w")["changes"] == [{"field": "host", "record": w_host, "host": w_other}]
    assert o.vm("w").host.name == w_other and host_used(o, w_host) == (0, 0)
    assert host_used(o, w_other) == (1, footprint(1, 256))
    assert usage(o, "p") == Usage(1, footprint(1, 256), 2) and o.audit() == []
    # a stopped VM found running (started by hand on a host): adopted running there, charged and claimed
    fabric(o).put(other, DomainSpec(D, 1, 1, 256, 256, "tiny-linux"))
    assert [c["field"] for c in adopt.sync_vm(o.plane, "v")["changes"]] == ["host", "state"]
    assert o.vm("v").state == "running" and usage(o, "p") == Usage(2, 2 * footprint(1, 256), 2)
    assert o.audit() == []


def test_sync_is_refused_while_an_operation_owns_the_vm(cluster):
    from .test_scaling_sim import Deferred

    o = cluster
    o.create_vm("v", "p", "f1", "t", start=True)
    o.plane.executor = deferred = Deferred()
    o.scaler.scale("v", offering="f2")
    with pytest.raises(Conflict, match=r"vm v is owned by operation .* \(scale\)"):
        adopt.sync_vm(o.plane, "v")
    deferred.run()
    assert adopt.sync_vm(o.plane, "v")["in_sync"]


def test_a_vm_seen_on_two_hosts_is_not_adopted(cluster):
    o = cluster
    o.create_vm("v", "p", "f1", "t", start=True)
    other = ({"h1", "h2"} - {o.vm("v").host.name}).pop()
    fabric(o).put(other, DomainSpec(D, 1, 1, 256, 256, "tiny-linux"))
    with pytest.raises(Conflict, match="runs on h1 and h2"):
        adopt.sync_vm(o.plane, "v")


def test_sync_over_the_api(cluster, api):
    o = cluster
    o.create_vm("v", "p", "f1", "t", start=True)
    fabric(o).update(o.vm("v").host.name, D, memory_mib=384)
    r = api.post("/api/v1/vms/v/sync")
    assert r.status_code == 200 and r.json()["changes"] == [{"field": "memory_mib", "record": "256", "host": "384"}]
    assert api.get("/api/v1/projects/p/usage").json()["consistent"] is True
    assert api.get("/api/v1/audit").json()["ok"] is True
    assert api.post("/api/v1/vms/nope/sync").status_code == 404


# -- offline resize ---------------------------------------------------------------------------------
def test_a_stopped_vm_is_resized_offline_and_charged_when_it_next_starts(cluster, api):
    o = cluster
    o.create_vm("v", "p", "f1", "t")
    before = usage(o, "p")
    plan = api.post("/api/v1/vms/v/scale", json={"offering": "flex", "vcpus": 2, "memory_mib": 768, "dry_run": True})
    assert plan.status_code == 200 and plan.json()["path"] == "offline resize"
    assert plan.json()["summary"].startswith("offline resize: 1 -> 2 vCPU(s), 256 -> 768 MiB")
    assert o.vm("v").memory_mib == 256
    r = api.post("/api/v1/vms/v/scale", json={"offering": "flex", "vcpus": 2, "memory_mib": 768})
    assert r.status_code == 200, r.text
    assert r.json()["vm"]["vcpus"] == 2 and r.json()["vm"]["memory_mib"] == 768
    assert r.json()["operation"]["state"] == "succeeded" and "offline resize" in r.json()["operation"]["message"]
    assert usage(o, "p") == before == Usage(0, 0, 1)  # nothing charged while stopped
    # ranges as at create
    refused = api.post("/api/v1/vms/v/scale", json={"vcpus": 9})
    assert refused.status_code == 422 and "outside offering flex's range 1..4" in refused.json()["message"]
    assert api.post("/api/v1/vms/v/scale", json={"offering": "f1", "vcpus": 2}).status_code == 422
    assert api.post("/api/v1/vms/v/scale", json={"cpu_cap": True}).json()["field"] == "cpu_cap"
    o.start_vm("v")
    vm = o.vm("v")
    assert (vm.vcpus, vm.memory_mib, vm.state) == (2, 768, "running")
    assert usage(o, "p") == Usage(2, footprint(2, 768), 1) and o.audit() == []
    # a fixed offering with a CPU cap: the cap follows the offering at start
    o.stop_vm("v")
    assert api.post("/api/v1/vms/v/scale", json={"offering": "f2"}).status_code == 200
    o.start_vm("v")
    assert (o.vm("v").vcpus, o.vm("v").memory_mib, o.vm("v").cpu_cap_percent) == (2, 512, 50.0)
    assert o.audit() == []


def test_an_offline_resize_beyond_the_quota_is_taken_but_its_start_is_refused(cluster):
    o = cluster
    o.catalog.create_project("small", 2, GIB, 2, count_overhead=False)
    o.create_vm("v", "small", "flex", "t", vcpus=1, memory_mib=512)
    result = o.scaler.scale("v", vcpus=3)
    assert "no room for it now (vcpus quota)" in o.operation(result["operation_id"]).message
    with pytest.raises(QuotaExceeded, match="vcpus quota exceeded"):
        o.start_vm("v")
    assert o.vm("v").state == "stopped" and usage(o, "small") == Usage(0, 0, 1)
    with pytest.raises(Invalid):
        o.scaler.scale("v", offering="f1", memory_mib=512)  # fixed: no custom values
    o.scaler.scale("v", vcpus=2)
    o.start_vm("v")
    assert usage(o, "small") == Usage(2, 512, 1) and o.audit() == []
