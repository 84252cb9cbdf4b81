"""A VM's snapshots in the web console (issue 32): listed on its page, taken from the form, reverted (a
stopped VM) and deleted behind a confirmation; a refusal shows the API's status and words in the slot,
and a member never reaches another project's VM's snapshots."""

from __future__ import annotations

import pytest

from .ui_serverkit import ADMIN, ALPHA, BETA, build, csrf, error, row, text


@pytest.fixture
def con(db):
    console = build(db)
    o = console.o
    o.catalog.create_template("disk", "tiny-linux", disk="tiny-linux")
    o.pools.create("shared", "shared", cluster="c1")
    o.create_vm("d1", "alpha", "f1", "disk", start=True, pool="shared")
    yield console
    o.close()


def post(client, token: str, url: str, **form):
    return client.post(url, data={**form, "csrf": csrf(token)})


def test_a_snapshot_is_taken_listed_refused_a_revert_while_running_then_reverted_and_deleted(con):
    admin = con.client(ADMIN)
    page = admin.get("/ui/vms/d1").text
    assert "no snapshot" in text(page) and 'data-section="snapshots"' in page

    r = post(admin, ADMIN, "/ui/vms/d1/snapshots", name="before")
    assert r.status_code == 200 and "snapshot before of d1 taken" in text(r.text), r.text
    page = admin.get("/ui/vms/d1").text
    assert "before ready live" in text(row(page, "before", "data-snapshot"))

    api = con.api(ADMIN).post("/api/v1/vms/d1/snapshots/before/revert")
    r = post(admin, ADMIN, "/ui/vms/d1/snapshots/before/revert")
    assert r.status_code == api.status_code == 409
    assert error(r.text) == {"error": "conflict", "field": "vm", "message": api.json()["message"]}

    con.o.stop_vm("d1", force=True)
    r = post(admin, ADMIN, "/ui/vms/d1/snapshots/before/revert")
    assert r.status_code == 200 and "d1 reverted to snapshot before" in text(r.text), r.text
    r = post(admin, ADMIN, "/ui/vms/d1/snapshots/before/delete")
    assert r.status_code == 200 and "deleted" in text(r.text)
    assert "no snapshot" in text(admin.get("/ui/f/vms/d1").text)

    r = post(admin, ADMIN, "/ui/vms/d1/snapshots", name="Bad Name")
    assert r.status_code == 422 and error(r.text)["field"] == "name"


def test_a_member_takes_its_own_vms_snapshot_and_never_reaches_another_projects(con):
    alpha = con.client(ALPHA)
    assert post(alpha, ALPHA, "/ui/vms/d1/snapshots", name="mine").status_code == 200
    beta = con.client(BETA)
    r = post(beta, BETA, "/ui/vms/d1/snapshots", name="theirs")
    assert r.status_code == 404 and error(r.text)["field"] == "vm"
    assert [s["name"] for s in con.o.snapshots.listing("d1")] == ["mine"]


def test_a_backup_is_taken_from_the_vms_page_restored_to_a_new_vm_and_deleted(con):
    o = con.o
    o.backups.create_store("bk", "c1")
    admin = con.client(ADMIN)
    assert "no backup" in text(admin.get("/ui/vms/d1").text)
    r = post(admin, ADMIN, "/ui/vms/d1/backups")
    assert r.status_code == 200 and "backup 1 of d1 taken: full" in text(r.text), r.text
    page = admin.get("/ui/vms/d1").text
    assert "1 full - ready bk" in text(row(page, "1", "data-backup"))
    r = post(admin, ADMIN, "/ui/backups/1/restore", name="d1-back")
    assert r.status_code == 200 and "restored to a new VM d1-back" in text(r.text), r.text
    assert o.vm("d1-back").state == "stopped"
    r = post(admin, ADMIN, "/ui/backups/1/restore", name="d1-back")  # the name is taken: the API's words
    assert (r.status_code, error(r.text)["field"]) == (409, "name")
    beta = con.client(BETA)
    assert post(beta, BETA, "/ui/backups/1/delete").status_code == 404
    assert post(admin, ADMIN, "/ui/backups/1/delete").status_code == 200
    assert o.backups.listing() == [] and o.audit() == []


def test_a_backup_being_written_shows_under_running_now_with_its_progress_then_leaves(con):
    import threading

    o = con.o
    o.backups.create_store("bk", "c1")
    driver = o.drivers[o.vm("d1").host.name]
    halfway, go_on = threading.Event(), threading.Event()
    real = driver.backup_disks

    def slow_job(*args, on_progress=None, **kwargs):  # the job reports half its bytes done, then waits
        on_progress(512 << 20, 1024 << 20)
        halfway.set()
        go_on.wait(30)
        return real(*args, **kwargs)

    driver.backup_disks = slow_job
    taker = threading.Thread(target=o.backups.create, args=("d1",))
    taker.start()
    try:
        assert halfway.wait(30)
        admin, beta = con.client(ADMIN), con.client(BETA)
        tasks = admin.get("/ui/f/tasks").text
        assert "back up d1 (full, backup 1) running 50%" in text(tasks)
        assert '<progress max="100" value="50">' in tasks
        assert "back up d1" not in text(beta.get("/ui/f/tasks").text)  # another project's backup: not shown
    finally:
        go_on.set()
        taker.join(30)
    assert "nothing runs now" in text(con.client(ADMIN).get("/ui/f/tasks").text)
    assert o.backups.show(1)["progress"] == 100
