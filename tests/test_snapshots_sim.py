"""Disk snapshots on simulated hosts (issue 32), through the API: the acceptance's marker scenario (write,
snapshot, overwrite, stop, revert, start: the marker is back), the charge of each overlay, live migration
with a snapshot (a shared pool) or its refusal (a local pool), bad input refused naming the field with nothing
half-made, and every file of a chain gone with its VM. The sim's guest reads a disk through its qcow2 chain."""

from __future__ import annotations

import pytest

from vmplane.controllers.volumes import disk_spec
from vmplane.core.model import Offering, OfferingKind
from vmplane.hosts.drivers.simstorage import SHARED
from vmplane.store import snapshots as S

from .conftest import add_sim_hosts
from .conftest import ledger_usage as usage

V = "/api/v1/vms"


@pytest.fixture
def cluster(orch, api):
    add_sim_hosts(orch, 2)
    orch.catalog.create_offering(Offering("small", OfferingKind.fixed, vcpus=1, memory_mib=512))
    orch.catalog.create_template("disk", "tiny-linux", disk="tiny-linux")
    orch.catalog.create_project("p", 8, 16384, 10, storage_mib=2048)
    orch.pools.create("shared", "shared", cluster="c1")
    orch.pools.create("local-h1", "local", host="h1")
    return orch


def vm(o, name: str, pool: str = "shared", start: bool = True) -> str:
    o.create_vm(name, "p", "small", "disk", start=start, pool=pool)
    return o.vm(name).host.name if start else ""


def marker(o, name: str) -> str | None:
    return o.drivers[o.vm(name).host.name].guest_read_marker(f"vmplane-{name}", "vda")


def write(o, name: str, text: str) -> None:
    o.drivers[o.vm(name).host.name].guest_write_marker(f"vmplane-{name}", "vda", text)


def pool_files(o, pool: str) -> set[str]:
    host = o.pools.hosts_of(o.pools.row(pool))[0]
    return {v.name for v in o.drivers[host].volumes(pool)}


def test_a_marker_written_before_a_snapshot_is_back_after_overwrite_stop_revert_start(cluster, api):
    o = cluster
    vm(o, "web")
    write(o, "web", "before")
    root = o.volumes.row("web-root")
    assert usage(o, "p").storage_mib == root.size_mib

    r = api.post(f"{V}/web/snapshots", json={"name": "s1"})
    assert r.status_code == 201, r.text
    snap = r.json()
    assert (snap["state"], snap["live"], snap["quiesced"]) == ("ready", True, False)
    assert snap["disks"] == {"web-root": disk_spec(root).volume} and snap["pause_ms"] is not None
    assert usage(o, "p").storage_mib == 2 * root.size_mib  # the overlay, at the disk's size
    assert o.audit() == []

    write(o, "web", "after")
    assert marker(o, "web") == "after"
    r = api.post(f"{V}/web/snapshots/s1/revert")
    assert (r.status_code, r.json()["field"]) == (409, "vm") and "stop it" in r.json()["message"]

    o.stop_vm("web", force=True)
    r = api.post(f"{V}/web/snapshots/s1/revert")
    assert r.status_code == 200, r.text
    o.start_vm("web")
    assert marker(o, "web") == "before"
    # the overlay that held "after" is gone; the base, the new overlay: charged at the disk's size each
    assert usage(o, "p").storage_mib == 2 * root.size_mib
    assert len(pool_files(o, "shared")) == 2 and o.audit() == []

    assert [s["name"] for s in api.get(f"{V}/web/snapshots").json()] == ["s1"]
    assert api.delete(f"{V}/web/snapshots/s1").status_code == 204
    assert api.get(f"{V}/web/snapshots").json() == []
    # the running VM's chain merged live: one file again, charged once, the data as it was
    assert len(pool_files(o, "shared")) == 1 and usage(o, "p").storage_mib == root.size_mib
    assert marker(o, "web") == "before" and o.audit() == []


def test_deleting_a_middle_snapshot_merges_its_file_and_every_other_snapshot_still_reads_its_data(cluster, api):
    o = cluster
    o.catalog.set_quota("p", storage_mib=8192)
    vm(o, "web")
    for i, name in enumerate(("a", "b", "c")):
        write(o, "web", f"m{i}")
        assert api.post(f"{V}/web/snapshots", json={"name": name}).status_code == 201
    write(o, "web", "m3")
    assert len(pool_files(o, "shared")) == 4
    assert api.delete(f"{V}/web/snapshots/b").status_code == 204
    assert len(pool_files(o, "shared")) == 3 and marker(o, "web") == "m3"  # b's file took c's: c keeps it
    size = o.volumes.row("web-root").size_mib
    assert usage(o, "p").storage_mib == 3 * size and o.audit() == []
    o.stop_vm("web", force=True)
    for name, want in (("c", "m2"), ("a", "m0")):
        assert api.post(f"{V}/web/snapshots/{name}/revert").status_code == 200
        o.start_vm("web")
        assert marker(o, "web") == want
        o.stop_vm("web", force=True)
    assert api.delete(f"{V}/web/snapshots/c").status_code == 204  # stopped: merged once it runs
    assert api.delete(f"{V}/web/snapshots/a").status_code == 204
    o.start_vm("web")
    o.snapshots.settle()
    assert len(pool_files(o, "shared")) == 1 and usage(o, "p").storage_mib == size
    assert marker(o, "web") == "m0" and o.audit() == []


def test_a_vm_with_a_snapshot_live_migrates_on_a_shared_pool_and_is_refused_on_a_local_one(cluster, api):
    o = cluster
    src = vm(o, "web")
    write(o, "web", "kept")
    assert api.post(f"{V}/web/snapshots", json={"name": "s1"}).status_code == 201
    write(o, "web", "newer")
    o.migrator.migrate("web")
    assert o.migrator.list(vm="web")[0]["state"] == "succeeded"
    assert o.vm("web").host.name != src and marker(o, "web") == "newer"
    o.stop_vm("web", force=True)
    assert api.post(f"{V}/web/snapshots/s1/revert").status_code == 200
    o.start_vm("web")
    assert marker(o, "web") == "kept"

    vm(o, "loc", pool="local-h1")
    assert api.post(f"{V}/loc/snapshots", json={"name": "s1"}).status_code == 201
    r = api.post(f"{V}/loc/migrate", json={})
    assert r.status_code == 409 and "chains of snapshot overlays" in r.json()["message"], r.text
    assert o.audit() == []


def test_bad_input_is_refused_naming_the_field_and_nothing_is_half_made(cluster, api):
    o = cluster
    vm(o, "web")
    before = usage(o, "p").storage_mib
    for body, status, field in (
        ({"name": "Bad Name"}, 422, "name"),
        ({"name": "s1", "extra": 1}, 422, "extra"),
    ):
        r = api.post(f"{V}/web/snapshots", json=body)
        assert (r.status_code, r.json()["field"]) == (status, field), r.text
    assert api.post(f"{V}/nope/snapshots", json={"name": "s1"}).status_code == 404
    assert api.post(f"{V}/web/snapshots", json={"name": "s1"}).status_code == 201
    r = api.post(f"{V}/web/snapshots", json={"name": "s1"})
    assert (r.status_code, r.json()["field"]) == (409, "name") and "already has a snapshot named s1" in r.text
    assert api.post(f"{V}/web/snapshots/none/revert").json()["field"] == "snapshot"
    # the quota: 2048 MiB; the disk and one overlay take 2 x its size; one more overlay does not fit
    root = o.volumes.row("web-root").size_mib
    o.catalog.set_quota("p", storage_mib=2 * root + root // 2)
    files = pool_files(o, "shared")
    r = api.post(f"{V}/web/snapshots", json={"name": "s2"})
    assert (r.status_code, r.json()["field"]) == (409, "storage_mib"), r.text
    assert pool_files(o, "shared") == files and usage(o, "p").storage_mib == before + root
    assert [s["name"] for s in api.get(f"{V}/web/snapshots").json()] == ["s1"]
    o.stop_vm("web", force=True)
    r = api.post(f"{V}/web/snapshots", json={"name": "s3", "quiesce": True})
    assert (r.status_code, r.json()["field"]) == (422, "quiesce")


def test_a_host_that_fails_during_a_take_leaves_nothing_and_a_stopped_vm_snapshots_through_its_pool(cluster, api):
    o = cluster
    vm(o, "web", start=False)
    o.start_vm("web")
    host = o.vm("web").host.name
    fabric = o.drivers[host].fabric
    files = pool_files(o, "shared")
    fabric.fail_host(host, "daemon")
    r = api.post(f"{V}/web/snapshots", json={"name": "s1"})
    assert r.status_code == 409, r.text
    fabric.recover_host(host)
    o.snapshots.settle(force=True)
    assert api.get(f"{V}/web/snapshots").json() == [] and pool_files(o, "shared") == files
    assert usage(o, "p").storage_mib == o.volumes.row("web-root").size_mib

    o.stop_vm("web", force=True)
    write_offline = o.volumes.row("web-root")
    r = api.post(f"{V}/web/snapshots", json={"name": "cold"})
    assert r.status_code == 201 and r.json()["live"] is False, r.text
    assert o.volumes.row("web-root").file_name != write_offline.file_name  # the VM opens the overlay now
    o.start_vm("web")
    assert o.vm("web").state == "running" and o.audit() == []


def test_a_deleted_vm_takes_every_file_of_its_chains_and_their_charge_with_it(cluster, api):
    o = cluster
    vm(o, "web")
    for name in ("a", "b", "c"):
        assert api.post(f"{V}/web/snapshots", json={"name": name}).status_code == 201
    assert len(pool_files(o, "shared")) == 4
    o.stop_vm("web", force=True)
    o.delete_vm("web")
    assert pool_files(o, "shared") == set() and usage(o, "p").storage_mib == 0
    assert o.pools.row("shared").used_mib == 0 and o.audit() == []
    with o.db.read() as s:
        assert S.chain_files(s.connection()) == []


def test_a_clone_of_a_stopped_vm_or_of_a_snapshot_reads_the_sources_data_and_outlives_it(cluster, api):
    o = cluster
    o.catalog.set_quota("p", storage_mib=8192)
    vm(o, "web")
    write(o, "web", "at-snapshot")
    assert api.post(f"{V}/web/snapshots", json={"name": "s1"}).status_code == 201
    write(o, "web", "later")

    r = api.post(f"{V}/web/clone", json={"name": "c1"})
    assert (r.status_code, r.json()["field"]) == (409, "vm") and "--snapshot" in r.json()["message"]
    r = api.post(f"{V}/web/clone", json={"name": "c1", "snapshot": "s1", "start": True, "full": True})
    assert r.status_code == 201, r.text
    assert r.json()["vm"]["offering"] == "small" and r.json()["copied"] == o.volumes.row("c1-root").file_name
    assert r.json()["linked"] is False
    assert marker(o, "c1") == "at-snapshot"  # what the snapshot kept, not what the source wrote since

    o.stop_vm("web", force=True)
    assert api.post(f"{V}/web/clone", json={"name": "c2", "start": True}).status_code == 201
    assert marker(o, "c2") == "later"
    host = o.pools.hosts_of(o.pools.row("shared"))[0]
    assert o.drivers[host].volume("shared", o.volumes.row("c2-root").file_name).backing is None  # stands alone

    o.delete_vm("web")  # the clones outlive their source and its snapshots
    assert marker(o, "c1") == "at-snapshot" and marker(o, "c2") == "later"
    size = o.volumes.row("c1-root").size_mib
    assert usage(o, "p").storage_mib == 2 * size and o.audit() == []


def test_a_linked_clone_reads_the_snapshots_base_which_its_source_keeps_unmerged_until_the_clone_goes(cluster, api):
    o = cluster
    o.catalog.set_quota("p", storage_mib=8192)
    vm(o, "web")
    write(o, "web", "at-snapshot")
    assert api.post(f"{V}/web/snapshots", json={"name": "s1"}).status_code == 201
    write(o, "web", "later")
    r = api.post(f"{V}/web/clone", json={"name": "c1", "snapshot": "s1", "start": True})
    assert r.status_code == 201 and r.json()["linked"] is True, r.text
    host = o.pools.hosts_of(o.pools.row("shared"))[0]
    (base,) = o.snapshots.listing("web")[0]["disks"].values()
    made = o.drivers[host].volume("shared", o.volumes.row("c1-root").file_name)
    assert made.backing == f"{o.pools.row('shared').path}/{base}", made  # an empty overlay on s1's base
    assert marker(o, "c1") == "at-snapshot"
    size = o.volumes.row("c1-root").size_mib
    assert usage(o, "p").storage_mib == 3 * size  # web's base and overlay, and the clone's overlay

    # the snapshot deleted: its base stays (the clone reads it), never merged into while the source runs
    assert api.delete(f"{V}/web/snapshots/s1").status_code == 204
    o.snapshots.settle(force=True)
    write(o, "web", "after-delete")
    assert marker(o, "c1") == "at-snapshot" and marker(o, "web") == "after-delete"
    assert usage(o, "p").storage_mib == 3 * size and o.audit() == []
    o.stop_vm("web", force=True)
    r = api.delete(f"{V}/web")
    assert (r.status_code, r.json()["field"]) == (409, "vm") and "linked clones (c1-root" in r.text, r.text
    # the clone on a local pool could not live-migrate; on the shared pool it does, reading the same base
    o.migrator.migrate("c1")
    assert marker(o, "c1") == "at-snapshot"

    o.stop_vm("c1", force=True)
    o.delete_vm("c1")
    o.start_vm("web")
    o.snapshots.settle(force=True)  # nothing reads the base any more: merged, one file again
    assert marker(o, "web") == "after-delete"
    assert usage(o, "p").storage_mib == size and o.audit() == []
    o.stop_vm("web", force=True)
    o.delete_vm("web")
    assert pool_files(o, "shared") == set() and o.audit() == []


def test_a_clone_refused_leaves_no_vm_and_no_file(cluster, api):
    o = cluster
    vm(o, "web", start=False)
    files, before = pool_files(o, "shared"), usage(o, "p").storage_mib
    for body, status, field in (
        ({"name": "web"}, 409, "name"),
        ({"name": "c1", "snapshot": "none"}, 404, "snapshot"),
        ({"name": "Bad Name"}, 422, "name"),
    ):
        r = api.post(f"{V}/web/clone", json=body)
        assert (r.status_code, r.json()["field"]) == (status, field), r.text
    host = o.pools.hosts_of(o.pools.row("shared"))[0]
    used = o.drivers[host].pool_info("shared").allocation_mib  # room for the new root disk, not for the copy
    o.drivers[host].fabric.set_capacity(SHARED, used + 1)
    r = api.post(f"{V}/web/clone", json={"name": "c1"})
    assert r.status_code == 409 and "c1 was not kept" in r.json()["message"], r.text
    assert [v.name for v in o.vms()] == ["web"] and pool_files(o, "shared") == files
    assert usage(o, "p").storage_mib == before and o.audit() == []


def test_a_volume_whose_disk_is_a_chain_is_not_resized_and_nothing_changes(cluster, api):
    """Each file of a chain is charged at the volume's size: a resize would change every file's charge (the
    truth harness caught the ledger one overlay short)."""
    o = cluster
    vm(o, "web")
    assert api.post(f"{V}/web/snapshots", json={"name": "s1"}).status_code == 201
    before = usage(o, "p").storage_mib
    r = api.post("/api/v1/volumes/web-root/resize", json={"size_mib": 2048})
    assert (r.status_code, r.json()["field"]) == (409, "volume") and "delete its snapshots" in r.text
    assert usage(o, "p").storage_mib == before and o.audit() == []
