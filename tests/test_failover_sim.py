"""Failover capacity through the orchestrator and the API (sim hosts): the reserve refuses, placement
keeps it when a host can, `cluster show` reports it."""

import pytest

from vmplane.core.errors import InsufficientCapacity
from vmplane.core.model import Offering, OfferingKind

from .conftest import add_basics, add_sim_hosts


@pytest.fixture
def three(orch):
    """3 hosts of 4 vCPUs (memory plenty: vCPUs decide), k=1, HA VM ha-1 (2 vCPUs) on h1, big (4) on h2."""
    add_sim_hosts(orch, 3, cores=4, memory_mib=65536)
    add_basics(orch)
    orch.catalog.create_project("a", 64, 262144, 50)
    orch.catalog.set_setting("vmplane.ha.host.failures.tolerated", "1", "cluster", "c1")
    orch.create_vm("ha-1", "a", "ranged", "tiny", vcpus=2, memory_mib=512, start=True, ha_policy="restart")
    orch.create_vm("big", "a", "ranged", "tiny", vcpus=4, memory_mib=512, start=True)
    assert (orch.vm("ha-1").host.name, orch.vm("big").host.name) == ("h1", "h2")
    return orch


def test_the_start_that_would_break_the_reserve_is_refused_naming_it(three):
    # only h3 has room for 4 vCPUs: then h1's HA VM (2 vCPUs) would find 0 free if h1 failed
    three.create_vm("web-3", "a", "ranged", "tiny", vcpus=4, memory_mib=512)
    with pytest.raises(InsufficientCapacity) as exc:
        three.start_vm("web-3")
    assert (
        "h3: starting web-3 on h3 would leave room for the HA VMs of 0 of the 1 host failure(s) cluster c1 "
        "tolerates (vmplane.ha.host.failures.tolerated=1): the worst case, h1 failing, needs 2 vCPU more than "
        "the other hosts have free"
    ) in exc.value.message
    assert three.vm("web-3").state == "stopped"
    # with k=0 the reserve costs nothing
    three.catalog.set_setting("vmplane.ha.host.failures.tolerated", "0", "cluster", "c1")
    three.start_vm("web-3")
    assert three.vm("web-3").host.name == "h3"


def test_placement_picks_the_host_that_keeps_the_reserve(orch):
    add_basics(orch)
    for name, cores in (("h1", 4), ("h2", 4), ("h3", 8)):
        orch.add_host(name, "c1", "sim", cores, 2400, 65536)
    orch.catalog.create_project("a", 64, 262144, 50)
    orch.catalog.set_setting("vmplane.ha.host.failures.tolerated", "1", "cluster", "c1")
    orch.create_vm("ha-1", "a", "ranged", "tiny", vcpus=4, memory_mib=512, start=True, ha_policy="restart")
    orch.create_vm("big", "a", "ranged", "tiny", vcpus=4, memory_mib=512, start=True)
    assert (orch.vm("ha-1").host.name, orch.vm("big").host.name) == ("h3", "h1")
    # spread prefers h2 (3 of 4 vCPUs allocated after, vs 7 of 8 on h3), but on h2 the HA VM of h3 (4 vCPUs)
    # would find 1 free; on h3 the reserve holds (h3 failing: 4 HA + 1 free = 5, the others have 4 + 1 = 5)
    orch.create_vm("web", "a", "ranged", "tiny", vcpus=3, memory_mib=512, start=True)
    assert orch.vm("web").host.name == "h3"


def test_an_ha_vm_counts_its_own_restart(three):
    # a second HA VM of 2 vCPUs: on h3 the worst case is h3 (2 HA + 2 free) or h1: both fit in what is left
    three.create_vm("ha-2", "a", "ranged", "tiny", vcpus=2, memory_mib=512, start=True, ha_policy="restart")
    assert three.vm("ha-2").host.name == "h3"
    three.create_vm("ha-3", "a", "ranged", "tiny", vcpus=2, memory_mib=512, ha_policy="restart")
    with pytest.raises(InsufficientCapacity, match="would leave room for the HA VMs of 0 of the 1"):
        three.start_vm("ha-3")


def test_cluster_show_reports_the_reserve(three, api):
    r = api.get("/api/v1/clusters/c1")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["hosts"] == ["h1", "h2", "h3"] and body["zone"] == "z1"
    f = body["failover"]
    assert f["failures_tolerated"] == 1 and f["reserve_vcpus"] == 2 and f["survives"] is True
    assert f["free_vcpus"] == 6 and f["ha_vcpus"] == 2 and f["survivable_failures"] == 1
    assert api.get("/api/v1/clusters/nope").status_code == 404
    # a start refused through the API: 409 naming the reserve
    three.create_vm("web-3", "a", "ranged", "tiny", vcpus=4, memory_mib=512)
    r = api.post("/api/v1/vms/web-3/start")
    assert r.status_code == 409 and "vmplane.ha.host.failures.tolerated=1" in r.json()["message"]
    # the cluster loses a host's room (maintenance): it no longer survives one failure, and says which
    three.set_host_state("h3", __import__("vmplane.core.model", fromlist=["HostState"]).HostState.maintenance)
    f = api.get("/api/v1/clusters/c1").json()["failover"]
    assert f["survives"] is False and f["worst_case"] == ["h1"] and f["shortfall_vcpus"] == 2


def test_a_migration_that_would_break_the_reserve_is_refused(three):
    three.create_vm("web-2", "a", "ranged", "tiny", vcpus=2, memory_mib=512, start=True)
    three.create_vm("web-4", "a", "ranged", "tiny", vcpus=2, memory_mib=512, start=True)
    assert (three.vm("web-2").host.name, three.vm("web-4").host.name) == ("h3", "h1")  # h3 would break
    # web-4 (not HA) from h1 to h3: h1's HA VM (2 vCPUs) would find no free room elsewhere
    with pytest.raises(InsufficientCapacity) as exc:
        three.migrator.migrate("web-4", to="h3")
    assert "migrating web-4 to h3 would leave room for the HA VMs of 0 of the 1 host failure(s)" in exc.value.message
    assert "the worst case, h1 failing, needs 2 vCPU more" in exc.value.message
    with pytest.raises(InsufficientCapacity, match="migrating web-4 to h3 would leave"):
        three.migrator.migrate("web-4")


def test_a_scale_that_would_break_the_reserve_is_refused(three):
    three.catalog.set_setting("enable.dynamic.scale.vm", "true", "zone", "z1")
    three.catalog.create_offering(
        Offering(
            "dyn",
            OfferingKind.custom_constrained,
            min_vcpus=1,
            max_vcpus=4,
            min_memory_mib=256,
            max_memory_mib=8192,
            dynamic_scaling=True,
        )
    )
    three.catalog.create_template("dt", "tiny-linux", dynamic_scaling=True)
    three.create_vm("web-2", "a", "dyn", "dt", vcpus=2, memory_mib=512, start=True)
    assert three.vm("web-2").host.name == "h3"
    # growing it to 4 vCPUs in place leaves h1's HA VM (2 vCPUs) no room anywhere
    with pytest.raises(InsufficientCapacity) as exc:
        three.scaler.scale("web-2", vcpus=4, memory_mib=512, dry_run=True)
    assert "growing web-2 on h3 would leave room for the HA VMs of 0 of the 1 host failure(s)" in exc.value.message
    three.catalog.set_setting("vmplane.ha.host.failures.tolerated", "0", "cluster", "c1")
    assert three.scaler.scale("web-2", vcpus=4, memory_mib=512, dry_run=True)
