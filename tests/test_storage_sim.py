"""Storage end to end on sim hosts: pools, root disks, volumes, the storage quota, migrations with disks."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from vmplane.core.errors import Conflict, InsufficientCapacity, Invalid, NotFound, QuotaExceeded
from vmplane.core.model import HostState, Offering, OfferingKind
from vmplane.orchestrator import Orchestrator
from vmplane.store.schema import Pool

from .conftest import add_sim_hosts
from .conftest import ledger_usage as usage

GIB = 1024


def setup(o, hosts=2, storage=10 * GIB, shared=False):
    add_sim_hosts(o, hosts)
    o.catalog.create_offering(Offering("small", OfferingKind.fixed, vcpus=1, memory_mib=1024))
    o.catalog.create_offering(Offering("sized", OfferingKind.custom_unconstrained, max_root_disk_mib=8 * GIB))
    o.catalog.create_template("disk", "tiny-linux", disk="tiny-linux", dynamic_scaling=True)
    o.catalog.create_project("p", 64, 256 * GIB, 100, storage_mib=storage)
    for i in range(1, hosts + 1):
        o.pools.create(f"local-h{i}", "local", host=f"h{i}")
    if shared:
        o.pools.create("shared", "shared", cluster="c1")


def vol(o, name):
    return o.volumes.row(name)


def test_a_vm_gets_a_root_disk_charged_while_it_exists(orch):
    setup(orch)
    orch.create_vm("a", "p", "small", "disk", start=True, pool="local-h1")
    root = vol(orch, "a-root")
    assert (root.state, root.role, root.device, root.pool_name, root.size_mib) == (
        "attached",
        "root",
        "vda",
        "local-h1",
        256,
    )
    assert usage(orch, "p").storage_mib == 256
    assert orch.drivers["h1"].volume("local-h1", root.file_name) is not None
    assert orch.vm("a").host.name == "h1"  # it runs where its disk is
    orch.stop_vm("a")
    assert usage(orch, "p").storage_mib == 256  # stopped: still charged
    orch.delete_vm("a")
    assert usage(orch, "p").storage_mib == 0
    assert orch.drivers["h1"].volume("local-h1", root.file_name) is None
    assert orch.audit() == []


def test_keep_disk_leaves_the_root_disk_as_a_volume(orch):
    setup(orch)
    orch.create_vm("a", "p", "small", "disk")
    orch.delete_vm("a", keep_disk=True)
    kept = vol(orch, "a-root")
    assert (kept.state, kept.role, kept.vm_name) == ("available", "data", None)
    assert usage(orch, "p").storage_mib == 256


def test_storage_quota_refuses_naming_storage_and_changes_nothing(orch):
    setup(orch, storage=300)
    orch.create_vm("a", "p", "small", "disk")
    with pytest.raises(
        QuotaExceeded,
        match="storage_mib quota exceeded: 256 MiB of storage used \\+ 256 MiB of "
        "storage asked > quota 300 MiB of storage",
    ):
        orch.create_vm("b", "p", "small", "disk")
    with pytest.raises(QuotaExceeded, match="storage"):
        orch.volumes.create("v", "p", 100)
    assert [v.name for v in orch.vms()] == ["a"] and [v.name for v in orch.volumes.rows()] == ["a-root"]
    with pytest.raises(Conflict, match="256 MiB of storage in use"):
        orch.catalog.set_quota("p", storage_mib=200)
    assert usage(orch, "p").storage_mib == 256


def test_root_disk_size_from_the_request_within_the_offering(orch):
    setup(orch)
    orch.create_vm("a", "p", "sized", "disk", vcpus=1, memory_mib=512, root_disk_mib=2 * GIB)
    assert vol(orch, "a-root").size_mib == 2 * GIB
    assert orch.drivers["h1"].volumes("local-h1") or orch.drivers["h2"].volumes("local-h2")
    with pytest.raises(Invalid, match="above offering sized's maximum 8 GiB"):
        orch.create_vm("b", "p", "sized", "disk", vcpus=1, memory_mib=512, root_disk_mib=9 * GIB)
    with pytest.raises(Invalid, match=r"fixed at|no disk image|root_disk"):
        orch.create_vm("c", "p", "small", "disk", root_disk_mib=GIB)  # a fixed offering has the image's size


def test_volumes_attach_live_detach_confirmed_and_outlive_the_vm(orch):
    setup(orch, shared=True)
    orch.create_vm("a", "p", "small", "disk", start=True)
    orch.create_vm("b", "p", "small", "disk", start=True)
    orch.volumes.create("data", "p", 512)
    assert vol(orch, "data").pool_name == "shared"
    with pytest.raises(Conflict, match="only an attached volume can be detached"):
        orch.volumes.detach("data")
    v = orch.volumes.attach("data", "a")
    assert (v.state, v.vm_name, v.device) == ("attached", "a", "vdb")
    host = orch.vm("a").host.name
    assert any(p.endswith(vol(orch, "data").file_name) for p in orch.drivers[host].domain_disks("vmplane-a").values())
    with pytest.raises(Conflict, match="only an available"):
        orch.volumes.delete("data")
    with pytest.raises(Conflict, match="only an available volume can be attached"):
        orch.volumes.attach("data", "b")
    v = orch.volumes.detach("data")
    assert (v.state, v.vm_name) == ("available", None)
    assert not any(
        p.endswith(vol(orch, "data").file_name) for p in orch.drivers[host].domain_disks("vmplane-a").values()
    )
    orch.volumes.attach("data", "b")
    orch.stop_vm("b")
    orch.delete_vm("b")
    assert vol(orch, "data").state == "available"  # it outlives its VM
    assert usage(orch, "p").storage_mib == 256 + 512
    orch.volumes.delete("data")
    assert usage(orch, "p").storage_mib == 256
    assert orch.audit() == []


def test_a_detach_locks_its_vm_before_its_volume_as_a_vm_delete_does(pg_orch):
    """Lock order (PostgreSQL, row locks): a detach that waits for its VM's row holds no lock on the
    volume yet, so a writer that holds the VM and then wants the volume (a VM's delete) never deadlocks
    with it. Before, the detach locked the volume first; a run of the truth harness met that deadlock."""
    from .rowlocks import row_held

    o = pg_orch
    setup(o, shared=True)
    o.create_vm("a", "p", "small", "disk", start=True)
    o.volumes.create("data", "p", 512)
    o.volumes.attach("data", "a")
    with ThreadPoolExecutor(1) as pool, row_held(o.db.url, "SELECT id FROM vms WHERE name = 'a' FOR UPDATE") as probe:
        detached = pool.submit(o.volumes.detach, "data")  # waits behind a VM's writer, midway
        probe.wait_for_a_waiter()
        probe.lock_now("SELECT id FROM volumes WHERE name = 'data' FOR UPDATE")  # the VM's writer can go on
    assert (detached.result(timeout=30).state, vol(o, "data").vm_name) == ("available", None)
    assert o.audit() == []


def test_attaching_another_projects_volume_answers_404_without_waiting_for_its_lock(pg_orch):
    """A tenant who names another project's volume learns it does not exist at once: the project is checked
    before any lock, so it never queues behind that project's writers (nor holds its own VM meanwhile)."""
    from .rowlocks import row_held

    o = pg_orch
    setup(o, shared=True)
    o.catalog.create_project("q", 8, 8 * GIB, 10)
    o.create_vm("a", "p", "small", "disk", start=True)
    o.volumes.create("theirs", "q", 64)
    p_id = o.catalog.project("p").id
    with ThreadPoolExecutor(1) as pool, row_held(o.db.url, "SELECT id FROM volumes WHERE name = 'theirs' FOR UPDATE"):
        attached = pool.submit(o.volumes.attach, "theirs", "a", p_id)
        with pytest.raises(NotFound, match="volume 'theirs' does not exist"):
            attached.result(timeout=10)
    assert vol(o, "theirs").state == "available" and o.audit() == []


def test_a_root_disk_can_not_be_detached_nor_another_projects_volume_attached(orch):
    setup(orch, shared=True)
    orch.catalog.create_project("q", 8, 8 * GIB, 10)
    orch.create_vm("a", "p", "small", "disk", start=True)
    with pytest.raises(Conflict, match="root disk"):
        orch.volumes.detach("a-root")
    orch.volumes.create("theirs", "q", 64)
    with pytest.raises(Conflict, match="project q"):
        orch.volumes.attach("theirs", "a")


def test_a_stopped_vm_with_a_local_disk_starts_only_on_its_host(orch):
    setup(orch)
    orch.create_vm("a", "p", "small", "disk", pool="local-h2")
    orch.set_host_state("h2", HostState.maintenance)
    with pytest.raises(InsufficientCapacity, match="can not open the VM's disks"):
        orch.start_vm("a")


@pytest.fixture
def threaded(db):
    o = Orchestrator(db, ThreadPoolExecutor(8))
    o.load()
    o.catalog.create_zone("z1")
    o.catalog.create_cluster("c1", "z1")
    yield o
    o.close()


def wait_migration(o, vm, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = o.migrator.list(vm=vm)
        if rows and rows[0]["state"] in ("succeeded", "failed", "cancelled"):
            return rows[0]
        time.sleep(0.02)
    raise AssertionError(f"migration of {vm} still running")


def test_a_local_disk_is_copied_at_full_storage_quota_and_the_source_copy_deleted(threaded):
    o = threaded
    setup(o, storage=256)  # the project is at 100 % of its storage quota
    o.create_vm("a", "p", "small", "disk", start=True, pool="local-h1")
    o.executor.submit(lambda: None).result()
    deadline = time.monotonic() + 10
    while o.vm("a").state != "running" and time.monotonic() < deadline:
        time.sleep(0.02)
    before = usage(o, "p")
    o.migrator.migrate("a", to="h2")
    m = wait_migration(o, "a")
    assert m["state"] == "succeeded", m
    deadline = time.monotonic() + 10  # the source's copy goes right after the migration ends
    while vol(o, "a-root").copy_pool_name is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    root = vol(o, "a-root")
    assert (root.pool_name, root.copy_pool_name) == ("local-h2", None)
    assert usage(o, "p") == before  # never charged twice
    assert o.drivers["h2"].volume("local-h2", root.file_name) is not None
    assert o.drivers["h1"].volume("local-h1", root.file_name) is None  # deleted after the check
    assert o.pools.row("local-h1").used_mib == 0 and o.pools.row("local-h2").used_mib == 256
    assert o.audit() == []


def test_a_migration_is_refused_when_no_target_pool_has_room(orch):
    setup(orch)
    orch.create_vm("a", "p", "small", "disk", start=True, pool="local-h1")
    with orch.db.write() as s:  # the target's pool is full (as other volumes would make it)
        s.query(Pool).filter_by(name="local-h2").one().used_mib = (
            s.query(Pool).filter_by(name="local-h2").one().capacity_mib
        )
    with pytest.raises(InsufficientCapacity, match="its disks can not follow it here"):
        orch.migrator.migrate("a", to="h2")
    assert orch.vm("a").host.name == "h1" and orch.vm("a").state == "running"
    assert vol(orch, "a-root").copy_pool_name is None


def test_a_root_disk_grows_offline_and_live_charged_first(orch):
    setup(orch, storage=1024)
    orch.create_vm("a", "p", "small", "disk", pool="local-h1")
    assert orch.volumes.resize("a-root", 512).size_mib == 512  # stopped: the file grows
    assert orch.drivers["h1"].volume("local-h1", vol(orch, "a-root").file_name).capacity_mib == 512
    orch.start_vm("a")
    assert orch.volumes.resize("a-root", 768).size_mib == 768  # running: blockResize
    assert usage(orch, "p").storage_mib == 768
    with pytest.raises(QuotaExceeded, match="storage"):
        orch.volumes.resize("a-root", 2048)
    with pytest.raises(Invalid, match="can only grow"):
        orch.volumes.resize("a-root", 300)
    assert usage(orch, "p").storage_mib == 768 and orch.pools.row("local-h1").used_mib == 768
    assert orch.audit() == []


def test_a_drain_moves_local_disk_vms_with_their_disks_within_the_limits(threaded):
    o = threaded
    setup(o, hosts=3, shared=True)
    for i in range(3):
        o.create_vm(f"l{i}", "p", "small", "disk", start=True, pool="local-h1")
    o.create_vm("s0", "p", "small", "disk", start=True, pool="shared")
    deadline = time.monotonic() + 10
    while any(v.state != "running" for v in o.vms()) and time.monotonic() < deadline:
        time.sleep(0.02)
    on_h1 = [v.name for v in o.vms() if v.host.name == "h1"]
    o.maintenance.enter("h1")
    for vm in on_h1:
        assert wait_migration(o, vm)["state"] == "succeeded"
    assert all(v.host.name != "h1" for v in o.vms())
    deadline = time.monotonic() + 10
    while any(vol(o, f"l{i}-root").copy_pool_name for i in range(3)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for i in range(3):
        root = vol(o, f"l{i}-root")
        assert root.pool_name == f"local-{o.vm(f'l{i}').host.name}" and root.copy_pool_name is None
    assert vol(o, "s0-root").pool_name == "shared"
    assert o.pools.row("local-h1").used_mib == 0
    assert o.audit() == []
