"""Backups on simulated hosts (issue 32), through the API: a store every host sees, a full backup then
incremental ones that hold only what was written since (also across a stop/start and a live migration), a
snapshot in between making the next one full, restores that read what the VM held when it was backed up,
verify, the backup quota refused before anything is written, deletes that never leave a chain dangling, and
bad input refused naming the field with nothing half-made."""

from __future__ import annotations

import pytest

from vmplane.core.model import Offering, OfferingKind

from .conftest import add_sim_hosts

V, B = "/api/v1/vms", "/api/v1/backups"


@pytest.fixture
def cluster(orch, api):
    add_sim_hosts(orch, 2)
    orch.catalog.create_offering(Offering("small", OfferingKind.fixed, vcpus=1, memory_mib=512))
    orch.catalog.create_template("disk", "tiny-linux", disk="tiny-linux")
    orch.catalog.create_project("p", 8, 16384, 10, storage_mib=8192)
    orch.pools.create("shared", "shared", cluster="c1")
    r = api.post("/api/v1/backup-stores", json={"name": "bk", "cluster": "c1"})
    assert r.status_code == 201, r.text
    orch.create_vm("web", "p", "small", "disk", start=True, pool="shared")
    return orch


def host_of(o, vm: str) -> str:
    return o.vm(vm).host.name


def write(o, vm: str, mib: int, marker: str, disk: str = "vda") -> None:
    d = o.drivers[host_of(o, vm)]
    d.guest_write(f"vmplane-{vm}", disk, mib)
    d.guest_write_marker(f"vmplane-{vm}", disk, marker)


def marker(o, vm: str, disk: str = "vda") -> str | None:
    return o.drivers[host_of(o, vm)].guest_read_marker(f"vmplane-{vm}", disk)


def backup(api, vm: str = "web", **body) -> dict:
    r = api.post(f"{V}/{vm}/backups", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def backup_used(o) -> int:
    return o.catalog.project("p").used_backup_mib


def test_full_then_incremental_backups_hold_what_changed_and_restore_what_the_vm_held(cluster, api):
    o = cluster
    write(o, "web", 100, "v1")
    full = backup(api)
    assert (full["kind"], full["parent"], full["state"]) == ("full", None, "ready") and full["disks"][0]["sha256"]
    assert full["written"] >= 100 << 20
    write(o, "web", 16, "v2")
    inc = backup(api)
    assert (inc["kind"], inc["parent"]) == ("incremental", full["id"]) and inc["written"] == 16 << 20
    assert backup_used(o) == full["charged_mib"] + inc["charged_mib"] and o.audit() == []

    # incremental across a stop/start and a live migration: the bitmaps live in the disk's file
    o.stop_vm("web", force=True)
    o.start_vm("web")
    write(o, "web", 8, "v3")
    assert backup(api)["written"] == 8 << 20
    o.migrator.migrate("web")
    write(o, "web", 4, "v4")
    after_move = backup(api)
    assert (after_move["kind"], after_move["written"]) == ("incremental", 4 << 20)

    # a snapshot puts a new file on the disk: the next backup is full, and says why
    assert api.post(f"{V}/web/snapshots", json={"name": "s1"}).status_code == 201
    again = backup(api)
    assert again["kind"] == "full" and "snapshot" in again["why"]

    r = api.post(f"{B}/{inc['id']}/restore", json={"name": "back", "start": True})
    assert r.status_code == 201, r.text
    assert marker(o, "back") == "v2"  # what the VM held at that backup, through the chain
    assert api.post(f"{B}/{inc['id']}/verify").json()["ok"] is True
    assert o.audit() == []


def test_the_backup_quota_is_refused_before_anything_is_written_and_deletes_keep_chains_whole(cluster, api):
    o = cluster
    disk = o.volumes.row("web-root").size_mib
    o.catalog.set_quota("p", backups_mib=disk - 1)
    r = api.post(f"{V}/web/backups", json={})
    assert (r.status_code, r.json()["field"]) == (409, "backups_mib") and "backups_mib quota" in r.text
    assert api.get(B).json() == [] and backup_used(o) == 0
    o.catalog.set_quota("p", backups_mib=4 * disk)

    full, inc = backup(api), backup(api)
    r = api.delete(f"{B}/{full['id']}")
    assert (r.status_code, r.json()["field"]) == (409, "backup") and f"delete {inc['id']} first" in r.text
    assert api.delete(f"{B}/{inc['id']}").status_code == 204
    assert api.delete(f"{B}/{full['id']}").status_code == 204
    assert api.get(B).json() == [] and backup_used(o) == 0 and o.audit() == []


def test_bad_input_is_refused_naming_the_field(cluster, api):
    o = cluster
    for body, status, field in (
        ({"name": "bk", "cluster": "c1"}, 409, "name"),
        ({"name": "b2", "cluster": "nope"}, 404, "cluster"),
        ({"name": "b2", "cluster": "c1", "path": "relative"}, 422, "path"),
        ({"name": "b2", "cluster": "c1", "path": "/srv/backups"}, 409, "path"),  # each host's own disk there
    ):
        r = api.post("/api/v1/backup-stores", json=body)
        assert (r.status_code, r.json()["field"]) == (status, field), r.text
    assert "not seen by every host" in r.text
    assert [st["name"] for st in api.get("/api/v1/backup-stores").json()] == ["bk"]
    assert all(d.pool_info("backup-b2") is None for d in o.drivers.values())  # no pool left defined
    r = api.post(f"{V}/web/backups", json={"store": "nope"})
    assert (r.status_code, r.json()["field"]) == (404, "store")
    o.catalog.create_template("bare", "tiny-linux")  # a kernel and initrd, no disk
    o.create_vm("nodisk", "p", "small", "bare", start=True)
    r = api.post(f"{V}/nodisk/backups", json={})
    assert (r.status_code, r.json()["field"]) == (409, "vm") and "nothing to back up" in r.text
    assert api.post(f"{B}/99/restore", json={"name": "x"}).status_code == 404
    assert api.get(B).json() == [] and backup_used(o) == 0


def test_twenty_rounds_of_writes_backups_and_restores_each_restore_reads_what_its_backup_saw(cluster, api):
    o = cluster
    o.catalog.set_quota("p", vms=30, storage_mib=64 * 1024)
    seen = {}
    for i in range(20):
        write(o, "web", 1 + i % 5, f"round-{i}")
        b = backup(api, full=i % 7 == 0)
        seen[b["id"]] = f"round-{i}"
        assert b["kind"] == ("full" if i % 7 == 0 else "incremental"), b
    for n, (backup_id, want) in enumerate(sorted(seen.items())):
        r = api.post(f"{B}/{backup_id}/restore", json={"name": f"r{n}", "start": True})
        assert r.status_code == 201, r.text
        assert marker(o, f"r{n}") == want
        o.stop_vm(f"r{n}", force=True)
        o.delete_vm(f"r{n}")
    assert all(api.post(f"{B}/{i}/verify").json()["ok"] for i in seen)
    assert o.audit() == []


def test_retention_deletes_what_it_does_not_keep_and_every_backup_left_restores(cluster, api):
    o = cluster
    ids = []
    for i in range(6):
        write(o, "web", 2, f"m{i}")
        ids.append(backup(api, full=i == 0)["id"])  # one full, then five incrementals on it, each on the last
    r = api.post(f"{V}/web/backups/prune", json={"keep_last": 2})
    assert r.status_code == 200, r.text
    assert (r.json()["kept"], r.json()["deleted"]) == (ids[-2:], ids[:-2])
    assert r.json()["made_whole"] == [ids[-2]]  # it was built on a deleted one: made whole first
    assert [b["id"] for b in api.get(B, params={"vm": "web"}).json()] == ids[-2:]
    for n, backup_id in enumerate(ids[-2:]):
        assert api.post(f"{B}/{backup_id}/verify").json()["ok"]
        assert api.post(f"{B}/{backup_id}/restore", json={"name": f"k{n}", "start": True}).status_code == 201
        assert marker(o, f"k{n}") == f"m{4 + n}"
    write(o, "web", 2, "m6")
    assert backup(api)["kind"] == "incremental"  # the checkpoint chain goes on
    r = api.post(f"{V}/web/backups/prune", json={"keep_last": 0})
    assert (r.status_code, r.json()["field"]) == (422, "keep_last")
    assert o.audit() == []


def test_a_schedule_runs_once_per_due_time_whoever_asks_and_applies_its_retention(cluster, api):
    import datetime as dt
    from concurrent.futures import ThreadPoolExecutor

    from vmplane.controllers.backupschedules import BackupSchedules

    o = cluster
    r = api.put(f"{V}/web/backup-schedule", json={"cron": "*/5 * * * *", "keep_last": 2})
    assert r.status_code == 200, r.text
    first = dt.datetime.fromisoformat(r.json()["next_run_at"].removesuffix("Z"))
    assert first.minute % 5 == 0
    other = BackupSchedules(o.plane, o.backups)  # a second process's controller, on the same store
    for n in range(3):
        due = first + dt.timedelta(minutes=5 * n)
        write(o, "web", 1, f"s{n}")
        with ThreadPoolExecutor(2) as pool:
            ran = list(pool.map(lambda c, at=due: c.run_due(at), (o.backup_schedules, other)))
        assert sorted(ran) == [0, 1]  # exactly one of them took the run
    backups = api.get(B, params={"vm": "web"}).json()
    assert len(backups) == 2 and all(b["state"] == "ready" for b in backups)  # three runs, the retention kept 2
    (sched,) = api.get("/api/v1/backup-schedules").json()
    assert sched["last_result"].startswith("web: backup") and sched["keep_last"] == 2

    for body, field in (({"cron": "every day"}, "cron"), ({"cron": "* * * * *", "keep_last": 0}, "keep_last")):
        r = api.put(f"{V}/web/backup-schedule", json=body)
        assert (r.status_code, r.json()["field"]) == (422, field), r.text
    assert api.delete(f"{V}/web/backup-schedule").status_code == 204
    assert api.delete(f"{V}/web/backup-schedule").status_code == 404

    o.create_vm("api2", "p", "small", "disk", start=True, pool="shared")
    assert api.put("/api/v1/projects/p/backup-schedule", json={"cron": "0 3 * * *"}).status_code == 200
    at = dt.datetime.fromisoformat(api.get("/api/v1/backup-schedules").json()[0]["next_run_at"].removesuffix("Z"))
    assert o.backup_schedules.run_due(at) == 1  # the project's run: each of its running VMs
    assert sorted(b["vm"] for b in api.get(B).json()) == ["api2", "web", "web", "web"]
    assert o.audit() == []


def test_a_stopped_vm_is_restored_in_place_and_its_next_backup_is_full(cluster, api):
    o = cluster
    write(o, "web", 4, "kept")
    b = backup(api)
    write(o, "web", 4, "lost")
    r = api.post(f"{B}/{b['id']}/restore", json={"in_place": True})
    assert (r.status_code, r.json()["field"]) == (409, "vm") and "stop it" in r.text
    r = api.post(f"{B}/{b['id']}/restore", json={})
    assert (r.status_code, r.json()["field"]) == (422, "name")
    o.stop_vm("web", force=True)
    files = len(o.drivers["h1"].volumes("shared"))
    r = api.post(f"{B}/{b['id']}/restore", json={"in_place": True})
    assert r.status_code == 201, r.text
    assert len(o.drivers["h1"].volumes("shared")) == files  # the former file went, the copy came
    o.start_vm("web")
    assert marker(o, "web") == "kept"
    assert backup(api)["kind"] == "full" and o.audit() == []


def test_a_deleted_vms_backups_stay_restorable_and_a_new_vm_of_its_name_starts_with_a_full_one(cluster, api):
    o = cluster
    write(o, "web", 2, "old")
    b = backup(api)
    assert api.put(f"{V}/web/backup-schedule", json={"cron": "0 3 * * *"}).status_code == 200
    o.stop_vm("web", force=True)
    o.delete_vm("web")
    assert api.get("/api/v1/backup-schedules").json() == []  # its schedule went with it
    assert api.post(f"{B}/{b['id']}/restore", json={"in_place": True}).json()["field"] == "vm"  # it is gone
    o.create_vm("web", "p", "small", "disk", start=True, pool="shared")
    assert backup(api)["kind"] == "full"  # never incremental on the old VM's backup
    assert api.post(f"{B}/{b['id']}/restore", json={"name": "old-web", "start": True}).status_code == 201
    assert marker(o, "old-web") == "old" and o.audit() == []


def test_a_backup_holds_every_disk_each_incremental_on_its_own_and_restores_them_all(cluster, api):
    o = cluster
    for name in ("data", "logs"):
        assert api.post("/api/v1/volumes", json={"name": name, "project": "p", "size_mib": 1024}).status_code == 201
    assert api.post("/api/v1/volumes/data/attach", json={"vm": "web"}).status_code == 200
    write(o, "web", 2, "root-1")
    write(o, "web", 64, "data-1", "vdb")
    full = backup(api)
    assert [(d["device"], d["volume"], d["mode"]) for d in full["disks"]] == [
        ("vda", "web-root", "full"), ("vdb", "data", "full"),
    ]  # fmt: skip
    assert full["charged_mib"] == sum(-(-d["bytes"] // (1 << 20)) for d in full["disks"])

    write(o, "web", 16, "data-2", "vdb")  # only the data volume changes
    inc = backup(api)
    assert (inc["kind"], inc["written"]) == ("incremental", 16 << 20)
    assert {d["device"]: d["mode"] for d in inc["disks"]} == {"vda": "incremental", "vdb": "incremental"}

    assert api.post("/api/v1/volumes/logs/attach", json={"vm": "web"}).status_code == 200
    write(o, "web", 3, "logs-1", "vdc")
    mixed = backup(api)  # a disk new since: copied whole, in the same backup as the others' changes
    assert {d["device"]: d["mode"] for d in mixed["disks"]} == {"vda": "incremental", "vdb": "incremental",
                                                               "vdc": "full"}  # fmt: skip
    assert mixed["kind"] == "incremental" and "logs whole" in mixed["why"]

    r = api.post(f"{B}/{inc['id']}/restore", json={"name": "twin", "start": True})
    assert r.status_code == 201, r.text
    assert (marker(o, "twin"), marker(o, "twin", "vdb")) == ("root-1", "data-2")
    assert [v["name"] for v in api.get("/api/v1/volumes", params={"vm": "twin"}).json()] == ["twin-root", "twin-vdb"]
    assert api.post(f"{B}/{mixed['id']}/verify").json()["ok"] and o.audit() == []

    # in place: every disk back as the backup saw it; refused while one of them is no longer the VM's
    write(o, "web", 1, "data-lost", "vdb")
    o.stop_vm("web", force=True)
    assert api.post("/api/v1/volumes/logs/detach").status_code == 200
    r = api.post(f"{B}/{mixed['id']}/restore", json={"in_place": True})
    assert (r.status_code, r.json()["field"]) == (409, "vm") and "logs" in r.text
    r = api.post(f"{B}/{inc['id']}/restore", json={"in_place": True})
    assert r.status_code == 201, r.text
    o.start_vm("web")
    assert (marker(o, "web"), marker(o, "web", "vdb")) == ("root-1", "data-2")
    assert o.audit() == []


def test_a_restore_whose_data_disk_does_not_fit_leaves_nothing(cluster, api):
    o = cluster
    assert api.post("/api/v1/volumes", json={"name": "data", "project": "p", "size_mib": 1024}).status_code == 201
    assert api.post("/api/v1/volumes/data/attach", json={"vm": "web"}).status_code == 200
    b = backup(api)
    used = o.catalog.project("p").used_storage_mib
    o.catalog.set_quota("p", storage_mib=o.volumes.row("web-root").size_mib * 2 + 1024 + 10)
    r = api.post(f"{B}/{b['id']}/restore", json={"name": "twin"})
    assert r.status_code == 409 and "twin" in r.text, r.text
    assert api.get(f"{V}/twin").status_code == 404
    assert [v["name"] for v in api.get("/api/v1/volumes").json()] == ["data", "web-root"]
    assert o.catalog.project("p").used_storage_mib == used  # the new VM's charge and its volume's given back
    assert o.audit() == []


def test_a_stopped_vms_backup_copies_every_disk_whole_and_the_next_running_one_builds_on_the_last_checkpoint(
    cluster, api
):
    o = cluster
    assert api.post("/api/v1/volumes", json={"name": "data", "project": "p", "size_mib": 512}).status_code == 201
    assert api.post("/api/v1/volumes/data/attach", json={"vm": "web"}).status_code == 200
    write(o, "web", 8, "root-1")
    write(o, "web", 8, "data-1", "vdb")
    first = backup(api)
    o.stop_vm("web", force=True)
    cold = backup(api)
    assert (cold["kind"], cold["state"]) == ("full", "ready") and "stopped" in cold["why"]
    assert [d["mode"] for d in cold["disks"]] == ["full", "full"]
    o.start_vm("web")
    write(o, "web", 4, "data-2", "vdb")
    warm = backup(api)
    assert (warm["kind"], warm["parent"]) == ("incremental", first["id"])  # the stopped VM's copy has no bitmap
    assert warm["written"] == 4 << 20
    r = api.post(f"{B}/{cold['id']}/restore", json={"name": "cold", "start": True})
    assert r.status_code == 201, r.text
    assert (marker(o, "cold"), marker(o, "cold", "vdb")) == ("root-1", "data-1")
    assert api.post(f"{B}/{cold['id']}/verify").json()["ok"] and o.audit() == []
