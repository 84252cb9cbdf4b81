"""Review N2 (S1): no tenant ever meets another's disk data. A copy a migration left on a pool (its host
failed before the cleanup) is never forgotten by a delete, never adopted by a later volume, VM or
migration of the same name, and the audit names any pool file that no volume owns. On sim hosts: the
fabric's files carry a generation (a new file is a new one) and the data a guest wrote (a marker)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from alembic import command
from sqlalchemy import select, update

from vmplane.controllers.volumes import disk_spec
from vmplane.core.driver import DriverError
from vmplane.core.errors import AlreadyExists, Conflict
from vmplane.core.model import HostState, Offering, OfferingKind
from vmplane.orchestrator import Orchestrator
from vmplane.store import ledger as L
from vmplane.store import storageledger as SL
from vmplane.store.events import EVENTS
from vmplane.store.migrate import alembic_config
from vmplane.store.schema import Volume

from . import storagetruth
from .conftest import add_sim_hosts
from .conftest import ledger_usage as usage

SECRET = "tenant A's data"


@pytest.fixture
def threaded(db):
    o = Orchestrator(db, ThreadPoolExecutor(8))
    o.load()
    o.catalog.create_zone("z1")
    o.catalog.create_cluster("c1", "z1")
    add_sim_hosts(o, 2)
    o.catalog.create_offering(Offering("small", OfferingKind.fixed, vcpus=1, memory_mib=1024))
    o.catalog.create_template("disk", "tiny-linux", disk="tiny-linux")
    o.catalog.create_project("a", 8, 16384, 10, storage_mib=4096)
    o.catalog.create_project("b", 8, 16384, 10, storage_mib=4096)
    for h in ("h1", "h2"):
        o.pools.create(f"local-{h}", "local", host=h)
    yield o
    for h in ("h1", "h2"):
        o.drivers[h].fabric.recover_host(h)
    o.close()


def wait(what, until, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.02)


def running(o, vm: str) -> str:
    wait(f"{vm} running", lambda: o.vm(vm).state == "running")
    return o.vm(vm).host.name


def file_facts(o, volume: str, host: str):
    """(generation, marker) of the volume's file as `host` sees it (None: no such file)."""
    return o.drivers[host].fabric.file_facts(host, disk_spec(o.volumes.row(volume)).path)


def migrate_and_leave_the_copy(o, vm: str, source: str, target: str) -> None:
    """Migrate `vm` from `source`, whose daemon fails when the cleanup asks it to delete the copy: the
    copy of each local disk stays on `source`'s pool (the trigger of review N2)."""
    fabric = o.drivers[source].fabric
    fabric.fail_at_delete(source, "daemon")
    o.migrator.migrate(vm, to=target)
    wait("the migration's end", lambda: o.migrator.list(vm=vm)[0]["state"] in ("succeeded", "failed", "cancelled"))
    assert o.migrator.list(vm=vm)[0]["state"] == "succeeded"
    wait(f"{source} failing at the cleanup", lambda: not fabric.host_answers(source))
    wait(f"{source} recorded down", lambda: o.check_hosts() is not None and o.host(source).state == "down")


def volume_events(o, volume: str) -> list[str]:
    with o.db.read() as s:
        return list(s.scalars(select(EVENTS.c.message).where(EVENTS.c.kind == "volume", EVENTS.c.subject == volume)))


def bring_back(o, host: str) -> None:
    o.drivers[host].fabric.recover_host(host)
    wait(f"{host} back", lambda: o.check_hosts() is not None and o.host(host).state == HostState.enabled.value)


def test_tenant_b_s_new_disk_of_the_same_name_reads_as_zeros(threaded):
    """The review's Test (sim): A's VM migrates h1 -> h2, h1 fails before the cleanup, A deletes the VM;
    B's VM of the same name on h1's pool gets a fresh file, never A's copy."""
    o = threaded
    o.create_vm("web1", "a", "small", "disk", start=True, pool="local-h1")
    assert running(o, "web1") == "h1"
    o.drivers["h1"].guest_write_marker("vmplane-web1", "vda", SECRET)
    a_generation, _ = file_facts(o, "web1-root", "h1")

    migrate_and_leave_the_copy(o, "web1", "h1", "h2")
    assert o.drivers["h2"].guest_read_marker("vmplane-web1", "vda") == SECRET  # the copy carried the data
    assert o.volumes.row("web1-root").copy_pool_name == "local-h1"
    o.stop_vm("web1", force=True)
    wait("web1 stopped", lambda: o.vm("web1").state == "stopped")
    o.delete_vm("web1")

    # A's copy on h1 is still remembered: the root disk's row stands for it, deleting, until h1 confirms
    root = o.volumes.row("web1-root")
    assert (root.state, root.pool_name, root.copy_pool_name, root.vm_name) == ("deleting", "local-h1", None, None)
    assert usage(o, "a").storage_mib == 256 and o.pools.row("local-h2").used_mib == 0
    with pytest.raises(AlreadyExists, match="still being deleted"):  # its name waits for the copy
        o.volumes.create("web1-root", "b", 256, pool="local-h2")
    assert usage(o, "b").storage_mib == 0 and o.pools.row("local-h2").used_mib == 0

    bring_back(o, "h1")
    o.storage_settle.run_once(min_age_s=0)
    assert [v.name for v in o.volumes.rows()] == [] and usage(o, "a").storage_mib == 0
    assert o.pools.row("local-h1").used_mib == 0

    o.create_vm("web1", "b", "small", "disk", start=True, pool="local-h1")
    assert running(o, "web1") == "h1"
    generation, marker = file_facts(o, "web1-root", "h1")
    assert marker is None and generation != a_generation  # a fresh file
    assert o.drivers["h1"].guest_read_marker("vmplane-web1", "vda") is None  # B reads zeros, not A's data
    assert o.audit() == []


def test_a_volume_deleted_while_its_copy_waits_for_its_host_deletes_the_copy_once_it_answers(threaded):
    o = threaded
    o.create_vm("vm1", "a", "small", "disk", start=True, pool="local-h1")
    assert running(o, "vm1") == "h1"
    o.volumes.create("d", "a", 512, pool="local-h1")
    o.volumes.attach("d", "vm1")
    o.drivers["h1"].guest_write_marker("vmplane-vm1", "vdb", SECRET)
    migrate_and_leave_the_copy(o, "vm1", "h1", "h2")
    assert o.volumes.row("d").copy_pool_name == "local-h1"
    d_path = disk_spec(o.volumes.row("d")).path

    o.volumes.detach("d")
    assert o.volumes.row("d").copy_pool_name == "local-h1"  # the detach keeps tracking it
    with pytest.raises(Conflict, match=r"pool local-h1 did not confirm the delete.*stays deleting"):
        o.volumes.delete("d")  # h2's file goes; h1 does not answer
    d = o.volumes.row("d")
    assert (d.state, d.pool_name, d.copy_pool_name) == ("deleting", "local-h1", None)
    assert o.pools.row("local-h2").used_mib == 256  # only vm1's root disk there now
    assert usage(o, "a").storage_mib == 256 + 512  # charged until the copy is gone
    assert o.drivers["h1"].fabric.file_facts("h1", d_path)[1] == SECRET  # the copy, on h1

    bring_back(o, "h1")
    o.storage_settle.run_once(min_age_s=0)
    assert [v.name for v in o.volumes.rows()] == ["vm1-root"]
    assert o.drivers["h1"].fabric.file_facts("h1", d_path) is None
    assert o.volumes.row("vm1-root").copy_pool_name is None  # and the root disk's copy was cleaned
    assert usage(o, "a").storage_mib == 256
    assert o.pools.row("local-h1").used_mib == 0 and o.pools.row("local-h2").used_mib == 256
    assert o.audit() == []


def test_the_audit_names_a_pool_file_that_no_volume_owns(orch, api):
    add_sim_hosts(orch, 1)
    orch.pools.create("local-h1", "local", host="h1")
    assert api.get("/api/v1/audit").json() == {"ok": True, "problems": []}
    orch.drivers["h1"].create_volume("local-h1", "vmp-web1-root.qcow2", 64)  # left by a volume deleted long ago
    body = api.get("/api/v1/audit").json()
    assert body["ok"] is False  # `vmplane audit` exits 1
    assert body["problems"] == [
        "pool local-h1 on h1 holds vmp-web1-root.qcow2, a vmplane volume file that no "
        "volume owns (once its data is not needed: `virsh vol-delete --pool local-h1 "
        "vmp-web1-root.qcow2` on h1)"
    ]


def test_a_new_volume_never_takes_a_file_an_older_volume_of_its_name_left(orch):
    """A file `vmp-NAME.qcow2` of a volume made before file names were unique, left on the pool: a new
    VM (or volume) of that name gets its own file."""
    add_sim_hosts(orch, 1)
    orch.catalog.create_offering(Offering("small", OfferingKind.fixed, vcpus=1, memory_mib=1024))
    orch.catalog.create_template("disk", "tiny-linux", disk="tiny-linux")
    orch.catalog.create_project("b", 8, 16384, 10, storage_mib=4096)
    orch.pools.create("local-h1", "local", host="h1")
    fabric = orch.drivers["h1"].fabric
    old = orch.drivers["h1"].create_volume("local-h1", "vmp-web1-root.qcow2", 256)
    old_generation, _ = fabric.file_facts("h1", old.path)
    orch.create_vm("web1", "b", "small", "disk", start=True, pool="local-h1")
    root = orch.volumes.row("web1-root")
    assert disk_spec(root).path != old.path
    assert fabric.file_facts("h1", disk_spec(root).path)[0] != old_generation
    assert orch.drivers["h1"].domain_disks("vmplane-web1")["vda"] == disk_spec(root).path
    assert any("holds vmp-web1-root.qcow2" in p for p in orch.audit())  # the old file is still reported


def test_a_migration_target_never_adopts_a_file_already_there(threaded):
    """A file at the copy's place on the target (planted there, as an earlier attempt or an older volume
    would leave it) is removed first, recorded, and a fresh overlay takes its place."""
    o = threaded
    o.create_vm("vm1", "a", "small", "disk", start=True, pool="local-h1")
    assert running(o, "vm1") == "h1"
    o.drivers["h1"].guest_write_marker("vmplane-vm1", "vda", "vm1's own data")
    root = o.volumes.row("vm1-root")
    planted = o.drivers["h2"].create_volume("local-h2", disk_spec(root).volume, 256)
    stale_generation, _ = o.drivers["h2"].fabric.file_facts("h2", planted.path)
    o.migrator.migrate("vm1", to="h2")
    wait("the migration", lambda: o.migrator.list(vm="vm1")[0]["state"] in ("succeeded", "failed", "cancelled"))
    assert o.migrator.list(vm="vm1")[0]["state"] == "succeeded"
    generation, marker = o.drivers["h2"].fabric.file_facts("h2", planted.path)
    assert generation != stale_generation and marker == "vm1's own data"
    assert any("removed before the copy" in m for m in volume_events(o, "vm1-root"))


def test_sim_files_have_generations_never_reused_and_a_copy_carries_the_marker(orch):
    add_sim_hosts(orch, 1)
    orch.pools.create("local-h1", "local", host="h1")
    d, fabric = orch.drivers["h1"], orch.drivers["h1"].fabric
    first = d.create_volume("local-h1", "vmp-x.qcow2", 64)
    g1 = fabric.file_facts("h1", first.path)
    d.delete_volume("local-h1", "vmp-x.qcow2")
    again = d.create_volume("local-h1", "vmp-x.qcow2", 64)
    g2 = fabric.file_facts("h1", again.path)
    assert g1[0] is not None and g2[0] is not None and g2[0] > g1[0] and g2[1] is None
    with pytest.raises(DriverError, match="not the volume asked for"):  # another format: not returned as it is
        d.create_volume("local-h1", "vmp-x.qcow2", 64, format="raw")


def test_the_truth_harness_counts_a_pool_file_no_volume_owns_even_on_a_failed_host(orch):
    add_sim_hosts(orch, 2)
    orch.pools.create("local-h1", "local", host="h1")
    orch.pools.create("local-h2", "local", host="h2")
    assert storagetruth.unowned_pool_files(orch) == []
    orch.drivers["h1"].create_volume("local-h1", "vmp-left.abc.qcow2", 64)
    orch.drivers["h1"].fabric.fail_host("h1", "power")  # its disk keeps the file; the audit can not ask
    assert storagetruth.unowned_pool_files(orch) == [
        "truth: pool local-h1 on h1 holds vmp-left.abc.qcow2, a vmplane volume file that no volume owns (once its "
        "data is not needed: `virsh vol-delete --pool local-h1 vmp-left.abc.qcow2` on h1)"
    ]


def test_a_volume_left_creating_never_adopts_a_file_it_did_not_make(orch):
    """A row left `creating` (a crash) is made again by resolve(): a file at its place that is not the one
    it asked for (here: raw, not a qcow2; a row of before 0010 has its name's file) is refused, the row
    and its charge go, and the file is left alone for the operator (the audit names it)."""
    add_sim_hosts(orch, 1)
    orch.catalog.create_project("b", 8, 16384, 10, storage_mib=4096)
    orch.pools.create("local-h1", "local", host="h1")
    with orch.db.transaction() as conn:
        pool = SL.pool_row(conn, "local-h1")
        assert SL.take_on_pool(conn, pool.id, 256)
        SL.insert_volume(
            conn,
            name="old",
            project_id=L.lock_project(conn, None, name="b").id,
            pool_id=pool.id,
            size_mib=256,
            format="qcow2",
            role="data",
            file_name="vmp-old.qcow2",
        )
    orch.drivers["h1"].create_volume("local-h1", "vmp-old.qcow2", 256, format="raw")  # someone else's
    assert orch.volumes.resolve(0) == []
    assert orch.volumes.rows() == [] and usage(orch, "b").storage_mib == 0 and orch.pools.row("local-h1").used_mib == 0
    assert orch.drivers["h1"].volume("local-h1", "vmp-old.qcow2").format == "raw"
    assert any("holds vmp-old.qcow2" in p for p in orch.audit())
    assert any("a file this volume did not make" in m for m in volume_events(orch, "old"))


def test_volumes_made_before_0010_keep_their_files(orch):
    """The migration records each existing volume's file (its name's, as it was made): nothing moves."""
    add_sim_hosts(orch, 1)
    orch.catalog.create_project("b", 8, 16384, 10, storage_mib=4096)
    orch.pools.create("local-h1", "local", host="h1")
    orch.volumes.create("d", "b", 64)
    with orch.db.transaction() as conn:
        conn.execute(update(Volume.__table__).values(file_name=None))
    assert disk_spec(orch.volumes.row("d")).volume == "vmp-d.qcow2"  # a row without one: its name's file
    cfg = alembic_config(orch.db.url)
    command.downgrade(cfg, "0009")
    command.upgrade(cfg, "head")  # (0010 records the files; the rows are read with today's columns: 0019's too)
    assert orch.volumes.row("d").file_name == "vmp-d.qcow2"
