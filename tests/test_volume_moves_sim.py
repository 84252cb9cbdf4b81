"""`volume move` and cold migration on simulated hosts (issue 32), through the API: a running VM's volume moved
live (its guest still reads what it wrote), a detached one copied by a host that sees both pools, refusals that
change nothing, a block job that fails midway or a host that stops answering (nothing half-moved, no claim
left), a control plane killed mid-move and settled by the next one, and a stopped VM migrated cold with its
local disks. Each ends with the audit clean: pools' space, the project's charge and the files agree."""

from __future__ import annotations

import pytest

from vmplane.controllers import volumemoves
from vmplane.core.model import Offering, OfferingKind
from vmplane.hosts.drivers.simblockcopy import fail_block_copy
from vmplane.orchestrator import InlineExecutor, Orchestrator

from .conftest import add_sim_hosts
from .conftest import ledger_usage as usage

V, VOL = "/api/v1/vms", "/api/v1/volumes"


@pytest.fixture
def cluster(orch, api):
    add_sim_hosts(orch, 2)
    orch.catalog.create_offering(Offering("small", OfferingKind.fixed, vcpus=1, memory_mib=512))
    orch.catalog.create_template("disk", "tiny-linux", disk="tiny-linux")
    orch.catalog.create_project("p", 8, 16384, 10, storage_mib=8192)
    orch.pools.create("shared", "shared", cluster="c1")
    orch.pools.create("shared2", "shared", cluster="c1")
    orch.pools.create("local-h1", "local", host="h1")
    orch.pools.create("local2-h1", "local", host="h1", path="/var/lib/vmplane/pool2")
    orch.pools.create("local-h2", "local", host="h2")
    return orch


def fabric(o):
    return next(iter(o.drivers.values())).fabric


def running_vm_with_volume(o, api, pool: str = "shared", vm_pool: str = "shared") -> str:
    o.create_vm("web", "p", "small", "disk", start=True, pool=vm_pool)
    assert api.post(VOL, json={"name": "data", "project": "p", "size_mib": 256, "pool": pool}).status_code == 201
    assert api.post(f"{VOL}/data/attach", json={"vm": "web"}).status_code == 200
    host = o.vm("web").host.name
    o.drivers[host].guest_write_marker("vmplane-web", "vdb", "kept")
    return host


def reads(o, vm: str = "web", dev: str = "vdb") -> str | None:
    return o.drivers[o.vm(vm).host.name].guest_read_marker(f"vmplane-{vm}", dev)


def files(o, pool: str) -> set[str]:
    host = o.pools.hosts_of(o.pools.row(pool))[0]
    return {v.name for v in o.drivers[host].volumes(pool)}


def used(o) -> dict[str, int]:
    return {p.name: p.used_mib for p in o.pools.rows()}


def test_a_running_vms_volume_moves_live_and_its_guest_still_reads_what_it_wrote(cluster, api):
    o = cluster
    host = running_vm_with_volume(o, api)
    before, charge = o.volumes.row("data"), usage(o, "p").storage_mib
    pools = used(o)

    r = api.post(f"{VOL}/data/move", json={"pool": "shared2"})
    assert r.status_code == 200, r.text
    moved = r.json()
    assert (moved["pool"], moved["state"], moved["vm"], moved["device"]) == ("shared2", "attached", "web", "vdb")
    assert moved["file"] != before.file_name and moved["file"] in files(o, "shared2")
    assert before.file_name not in files(o, "shared")  # the old file deleted, confirmed
    assert reads(o) == "kept" and o.vm("web").host.name == host
    assert o.drivers[host].domain_disks("vmplane-web")["vdb"].endswith(moved["file"])
    assert usage(o, "p").storage_mib == charge  # the project's charge does not change
    after = used(o)
    assert (after["shared"], after["shared2"]) == (pools["shared"] - 256, pools["shared2"] + 256)
    assert o.audit() == []

    # a root disk moves live too, to a local pool of the VM's host
    local = f"local-{host}"
    r = api.post(f"{VOL}/web-root/move", json={"pool": local})
    assert r.status_code == 200, r.text
    assert r.json()["pool"] == local and r.json()["template"] is None  # a full copy: no backing image any more
    assert o.vm("web").state == "running" and o.audit() == []
    o.stop_vm("web", force=True)
    o.start_vm("web")
    assert o.vm("web").host.name == host and reads(o) == "kept" and o.audit() == []


def test_a_detached_volume_is_copied_by_a_host_that_sees_both_pools(cluster, api):
    o = cluster
    running_vm_with_volume(o, api)
    assert api.post(f"{VOL}/data/detach").status_code == 200
    charge = usage(o, "p").storage_mib
    r = api.post(f"{VOL}/data/move", json={"pool": "local-h2"})
    assert r.status_code == 200, r.text
    assert (r.json()["pool"], r.json()["state"], r.json()["host"]) == ("local-h2", "available", "h2")
    assert usage(o, "p").storage_mib == charge and o.audit() == []
    # what the guest wrote came along: attached to a VM on h2 it reads it
    o.create_vm("other", "p", "small", "disk", start=True, pool="local-h2")
    assert api.post(f"{VOL}/data/attach", json={"vm": "other"}).status_code == 200
    assert reads(o, "other") == "kept"
    # no host sees both a local pool of h2 and one of h1: refused, naming the way
    assert api.post(f"{VOL}/data/detach").status_code == 200
    r = api.post(f"{VOL}/data/move", json={"pool": "local-h1"})
    assert (r.status_code, r.json()["field"]) == (409, "pool") and "no host sees both" in r.json()["message"]
    assert o.volumes.row("data").pool_name == "local-h2" and o.audit() == []


def test_refusals_name_the_field_and_change_nothing(cluster, api):
    o = cluster
    host = running_vm_with_volume(o, api)
    other = "h2" if host == "h1" else "h1"
    fabric(o).set_capacity(other, 100_000)
    o.pools.create("tiny", "local", host=other, path="/var/lib/vmplane/tiny")
    o.pools.refresh("tiny")
    state = (o.volumes.rows(), used(o), usage(o, "p"), files(o, "shared"))
    for body, status, field, words in (
        ({"pool": "nowhere"}, 404, "pool", "does not exist"),
        ({"pool": "shared"}, 422, "pool", "already"),
        ({"pool": f"local-{other}"}, 409, "pool", f"runs on {host}"),
        ({"pool": "snap"}, 409, "volume", "snapshot"),  # its VM's snapshot made its disk a chain
    ):
        if body["pool"] == "snap":
            assert api.post(f"{V}/web/snapshots", json={"name": "s1"}).status_code == 201
            state, body = (o.volumes.rows(), used(o), usage(o, "p"), files(o, "shared")), {"pool": "shared2"}
        r = api.post(f"{VOL}/data/move", json=body)
        assert (r.status_code, r.json()["field"]) == (status, field), (body, r.text)
        assert words in r.json()["message"], r.text
        assert (o.volumes.rows(), used(o), usage(o, "p"), files(o, "shared")) == state
    assert api.delete(f"{V}/web/snapshots/s1").status_code == 204
    state = (o.volumes.rows(), used(o), usage(o, "p"), files(o, "shared"))
    o.catalog.set_quota("p", storage_mib=1 << 20)
    assert api.post(VOL, json={"name": "big", "project": "p", "size_mib": 900_000, "pool": "shared"}).status_code == 201
    r = api.post(f"{VOL}/big/move", json={"pool": "tiny"})
    assert (r.status_code, r.json()["field"]) == (409, "pool") and "free of" in r.json()["message"], r.text
    assert api.delete(f"{VOL}/big").status_code == 204
    assert (o.volumes.rows(), used(o), usage(o, "p"), files(o, "shared")) == state
    assert o.audit() == []


def test_a_block_job_that_fails_midway_leaves_the_volume_where_it_was_and_no_claim(cluster, api):
    o = cluster
    host = running_vm_with_volume(o, api)
    before, pools = o.volumes.row("data"), used(o)
    fail_block_copy(fabric(o), host, "job")
    r = api.post(f"{VOL}/data/move", json={"pool": "shared2"})
    assert (r.status_code, r.json()["field"]) == (409, "pool") and "failed midway" in r.json()["message"], r.text
    now = o.volumes.row("data")
    assert (now.pool_name, now.file_name, now.state, now.move_pool_id) == ("shared", before.file_name, "attached", None)
    assert files(o, "shared2") == set() and used(o) == pools  # the partial copy deleted, its claim given back
    assert reads(o) == "kept" and o.audit() == []
    # then it moves
    assert api.post(f"{VOL}/data/move", json={"pool": "shared2"}).status_code == 200
    assert reads(o) == "kept" and o.audit() == []


def test_a_host_that_stops_answering_midway_leaves_it_moving_until_it_answers_then_settled(cluster, api):
    o = cluster
    host = running_vm_with_volume(o, api)
    pools = used(o)
    fail_block_copy(fabric(o), host, "daemon")
    r = api.post(f"{VOL}/data/move", json={"pool": "shared2"})
    assert (r.status_code, r.json()["field"]) == (409, "pool"), r.text
    assert o.volumes.row("data").state == "moving"  # can not tell: kept claimed on both pools
    assert used(o)["shared2"] == pools["shared2"] + 256
    r = api.post(f"{VOL}/data/move", json={"pool": "shared2"})
    assert (r.status_code, r.json()["field"]) == (409, "volume") and "being moved already" in r.json()["message"]
    r = api.post(f"{V}/web/stop", json={"force": True})  # which file holds its last writes would not be known
    assert (r.status_code, r.json()["field"]) == (409, "state") and "being moved live" in r.json()["message"]
    assert o.volume_moves.settle(force=True) == []  # the host still does not answer: nothing changes
    fabric(o).recover_host(host)
    assert o.volume_moves.settle(force=True) == ["data"]
    now = o.volumes.row("data")
    assert (now.pool_name, now.state) == ("shared", "attached") and used(o) == pools
    assert files(o, "shared2") == set() and reads(o) == "kept" and o.audit() == []


class Killed(BaseException):
    """The control plane killed at a step (nothing after it runs)."""


@pytest.mark.parametrize("point,where", [("volume.move-admitted", "shared"), ("volume.move-copied", "shared2")])
def test_a_control_plane_killed_mid_move_is_settled_by_the_next_one(cluster, api, monkeypatch, point, where):
    o = cluster
    running_vm_with_volume(o, api)
    pools = used(o)

    def hit(name: str) -> None:
        if name == point:
            raise Killed(name)

    monkeypatch.setattr(volumemoves.failpoints, "hit", hit)
    with pytest.raises(Killed):
        o.volume_moves.move("data", "shared2")
    monkeypatch.undo()
    assert o.volumes.row("data").state == "moving"
    o.volume_moves._busy.clear()  # (the killed process's memory is gone with it)
    o.plane.membership.stop()  # ... and its lease: the next process settles its hosts

    nxt = Orchestrator(o.db, InlineExecutor(), name="next")
    nxt.load()
    try:
        nxt.volume_moves.settle(force=True)
        now = nxt.volumes.row("data")
        assert (now.pool_name, now.state, now.move_pool_id) == (where, "attached", None)
        other = "shared" if where == "shared2" else "shared2"
        assert reads(nxt) == "kept" and not {f for f in files(nxt, other) if f.startswith("vmp-data.")}
        after = used(nxt)
        assert after["shared"] + after["shared2"] == pools["shared"] + pools["shared2"]  # one file, claimed once
        assert nxt.audit() == []
    finally:
        nxt.close()


def test_a_stopped_vm_migrates_cold_with_its_local_disks_and_starts_on_the_target(cluster, api):
    o = cluster
    o.create_vm("web", "p", "small", "disk", start=True, pool="local-h1")
    assert api.post(VOL, json={"name": "data", "project": "p", "size_mib": 256, "pool": "local-h1"}).status_code == 201
    assert api.post(VOL, json={"name": "logs", "project": "p", "size_mib": 128, "pool": "shared"}).status_code == 201
    for v in ("data", "logs"):
        assert api.post(f"{VOL}/{v}/attach", json={"vm": "web"}).status_code == 200
    o.drivers["h1"].guest_write_marker("vmplane-web", "vdb", "kept")
    o.drivers["h1"].guest_write_marker("vmplane-web", "vda", "root")
    r = api.post(f"{V}/web/migrate", json={"to": "h2"})
    assert r.status_code == 202  # a running VM: live, as before
    assert o.vm("web").host.name == "h2"
    o.stop_vm("web", force=True)
    charge, old = usage(o, "p").storage_mib, {v: o.volumes.row(v).file_name for v in ("web-root", "data")}

    r = api.post(f"{V}/web/migrate", json={"to": "h1", "dry_run": True})
    assert r.status_code == 200 and r.json()["state"] == "planned" and r.json()["copied"] == ["data", "web-root"]
    assert o.volumes.row("data").pool_name == "local-h2"
    r = api.post(f"{V}/web/migrate", json={"to": "h1"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["source"], body["target"], body["state"]) == ("h2", "h1", "succeeded")
    assert body["disks"] == {"web-root": "local-h1", "data": "local-h1", "logs": "shared"}
    assert o.vm("web").state == "stopped" and usage(o, "p").storage_mib == charge
    assert not ({old["web-root"], old["data"]} & files(o, "local-h2"))  # the old files deleted, confirmed
    assert o.audit() == []
    o.start_vm("web")
    assert o.vm("web").host.name == "h1"
    assert (reads(o, "web", "vdb"), reads(o, "web", "vda")) == ("kept", "root") and o.audit() == []


def test_a_cold_migration_refused_or_failed_leaves_the_vm_and_its_disks_where_they_were(cluster, api):
    o = cluster
    o.create_vm("web", "p", "small", "disk", start=True, pool="local-h1")
    o.drivers["h1"].guest_write_marker("vmplane-web", "vda", "root")
    o.stop_vm("web", force=True)
    root, pools = o.volumes.row("web-root"), used(o)
    r = api.post(f"{V}/web/migrate", json={"to": "h3"})
    assert (r.status_code, r.json()["field"]) == (404, "to")
    o.pools.delete("local-h2")
    r = api.post(f"{V}/web/migrate", json={"to": "h2"})
    assert (r.status_code, r.json()["field"]) == (409, "to") and "no local pool" in r.json()["message"], r.text
    o.pools.create("local-h2", "local", host="h2")
    pools = used(o)
    fail_block_copy(fabric(o), "h2", "job")  # the copy into h2's pool stops midway
    r = api.post(f"{V}/web/migrate", json={"to": "h2"})
    assert (r.status_code, r.json()["field"]) == (409, "to") and "stays where it was" in r.json()["message"], r.text
    now = o.volumes.row("web-root")
    assert (now.pool_name, now.file_name, now.state) == ("local-h1", root.file_name, "attached")
    assert used(o) == pools and files(o, "local-h2") == set() and o.audit() == []
    o.start_vm("web")
    assert o.vm("web").host.name == "h1" and reads(o, "web", "vda") == "root"


def test_concurrent_moves_never_overfill_a_pool_the_space_is_claimed_at_admission(cluster, api, monkeypatch):
    o = cluster
    fabric(o).set_capacity("h2", 400)
    o.pools.create("tiny", "local", host="h2", path="/var/lib/vmplane/tiny")
    for v in ("a", "b"):
        assert api.post(VOL, json={"name": v, "project": "p", "size_mib": 256, "pool": "shared"}).status_code == 201

    def hit(name: str) -> None:  # the first move's process dies right after its admission: its claim stays
        if name == "volume.move-admitted":
            raise Killed(name)

    monkeypatch.setattr(volumemoves.failpoints, "hit", hit)
    with pytest.raises(Killed):
        o.volume_moves.move("a", "tiny")
    monkeypatch.undo()
    assert (o.volumes.row("a").state, used(o)["tiny"]) == ("moving", 256)
    r = api.post(f"{VOL}/b/move", json={"pool": "tiny"})
    assert (r.status_code, r.json()["field"]) == (409, "pool") and "144 MiB free" in r.json()["message"], r.text
    assert o.volumes.row("b").pool_name == "shared"
    o.volume_moves._busy.clear()
    assert o.volume_moves.settle(force=True) == ["a"]  # rolled back: its copy was never made
    assert (o.volumes.row("a").pool_name, used(o)["tiny"]) == ("shared", 0)
    assert api.post(f"{VOL}/b/move", json={"pool": "tiny"}).json()["pool"] == "tiny"
    assert api.post(f"{VOL}/a/move", json={"pool": "tiny"}).status_code == 409 and o.audit() == []
