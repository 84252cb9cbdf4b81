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


def write(o, vm: str, mib: int, marker: str) -> None:
    d = o.drivers[host_of(o, vm)]
    d.guest_write(f"vmplane-{vm}", "vda", mib)
    d.guest_write_marker(f"vmplane-{vm}", "vda", marker)


def marker(o, vm: str) -> str | None:
    return o.drivers[host_of(o, vm)].guest_read_marker(f"vmplane-{vm}", "vda")


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
    assert (full["kind"], full["parent"], full["state"]) == ("full", None, "ready") and full["sha256"]
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
    ):
        r = api.post("/api/v1/backup-stores", json=body)
        assert (r.status_code, r.json()["field"]) == (status, field), r.text
    r = api.post(f"{V}/web/backups", json={"store": "nope"})
    assert (r.status_code, r.json()["field"]) == (404, "store")
    o.stop_vm("web", force=True)
    r = api.post(f"{V}/web/backups", json={})
    assert (r.status_code, r.json()["field"]) == (409, "vm") and "running VM" in r.text
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
