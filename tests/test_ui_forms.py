"""The console creates and edits (issue 33): a VM (planned first by the API's dry run), a project and its
quota, volumes, tokens, placement groups and settings. Each form calls the API's own route with the
session's caller: the API's rules and words, a member only in its own project, nothing half-made on a
refusal, and every change recorded as caused by the session's token."""

from __future__ import annotations

import re

import pytest

from vmplane.core.errors import NotFound
from vmplane.store import events
from vmplane.store.listing import Page

from .ui_serverkit import ADMIN, ALPHA, build, csrf, error, text


@pytest.fixture
def con(db):
    console = build(db)
    console.o.pools.create("shared", "shared", cluster="c1")
    yield console
    console.o.close()


def post(client, token: str, url: str, **form):
    return client.post(url, data={**form, "csrf": csrf(token)})


def newest_cause(o, subject: str) -> str:
    rows, _ = events.page(o.db, Page(limit=1), vm=subject)
    return rows[0]["cause"]


VM = {"name": "web", "project": "alpha", "offering": "f1", "template": "t", "start": "on"}


def test_a_vm_is_planned_then_created_from_the_console_as_its_plan_said(con):
    admin, o = con.client(ADMIN), con.o
    page = admin.get("/ui/new/vm").text
    assert 'name="offering"' in page and ">alpha<" in page and ">beta<" in page
    plan = post(admin, ADMIN, "/ui/new/vm/plan", **VM)
    assert plan.status_code == 200, plan.text
    words = text(plan.text)
    host = re.search(r"(h\d) has room for 1 vCPU", words).group(1)
    assert "its project is charged 1 VM, 1 vCPU(s)" in words and "Create and start" in words
    with pytest.raises(NotFound):
        o.vm("web")  # planned only
    asked = re.search(r"hx-vals='([^']*)'", plan.text).group(1)
    assert '"name": "web"' in asked and '"start": "on"' in asked
    made = post(admin, ADMIN, "/ui/new/vm", **VM)
    assert made.status_code == 200 and made.headers["hx-redirect"] == "/ui/vms/web"
    assert o.vm("web").state == "running" and o.vm("web").host.name == host
    assert newest_cause(o, "web") == "user admin"


@pytest.mark.parametrize(
    "form,status,field",
    [
        ({**VM, "name": "Bad Name"}, 422, "name"),
        ({**VM, "memory": "lots"}, 422, "memory_mib"),
        ({**VM, "offering": "big", "project": "beta"}, 409, "vcpus"),  # over beta's vCPU quota
        ({**VM, "name": "a1"}, 409, "name"),
        ({**VM, "zone": "nowhere"}, 422, "zone"),
    ],
)
def test_a_refused_create_shows_the_apis_refusal_and_makes_nothing(con, form, status, field):
    admin, o = con.client(ADMIN), con.o
    before = sorted(v.name for v in o.vms())
    for url in ("/ui/new/vm/plan", "/ui/new/vm"):
        r = post(admin, ADMIN, url, **form)
        assert r.status_code == status and error(r.text)["field"] == field, (url, r.text)
    assert sorted(v.name for v in o.vms()) == before


def test_a_member_creates_in_its_own_project_only(con):
    member, o = con.client(ALPHA), con.o
    page = member.get("/ui/new/vm").text
    assert ">alpha<" in page and "beta" not in page  # the only project it sees
    r = post(member, ALPHA, "/ui/new/vm", **{**VM, "project": "beta", "name": "sneaky"})
    assert r.status_code == 404 and error(r.text) == {
        "error": "not_found",
        "field": "project",
        "message": "project 'beta' does not exist",
    }
    r = post(member, ALPHA, "/ui/new/vm/plan", **{**VM, "project": "beta", "name": "sneaky"})
    assert r.status_code == 404
    with pytest.raises(NotFound):
        o.vm("sneaky")
    assert post(member, ALPHA, "/ui/new/vm", **{**VM, "name": "mine"}).status_code == 200
    assert o.vm("mine").project.name == "alpha" and newest_cause(o, "mine") == "user alpha-user"
    for url, form in (
        ("/ui/new/project", {"name": "p2", "vcpus": "1", "memory": "1GiB"}),
        ("/ui/projects/alpha/quota", {"vcpus": "99"}),
        ("/ui/tokens", {"name": "t2"}),
        ("/ui/settings", {"key": "cpu.overprovisioning.factor", "value": "4"}),
    ):
        r = post(member, ALPHA, url, **form)
        assert r.status_code == 403, url
    assert member.get("/ui/new/project").status_code == 403 and member.get("/ui/settings").status_code == 403
    assert o.catalog.project("alpha").quota_vcpus == 8


def test_a_project_is_created_and_its_quota_edited_showing_what_is_used(con):
    admin, o = con.client(ADMIN), con.o
    r = post(admin, ADMIN, "/ui/new/project", name="gamma", vcpus="4", memory="8GiB", vms="3", count_overhead="on")
    assert r.status_code == 200 and r.headers["hx-redirect"] == "/ui/projects/gamma"
    p = o.catalog.project("gamma")
    assert (p.quota_vcpus, p.quota_memory_mib, p.quota_vms, p.count_overhead) == (4, 8192, 3, True)

    page = admin.get("/ui/projects/alpha").text
    form = re.search(r'<form class="form" id="quota-edit".*?</form>', page, re.S).group(0)
    assert 'name="memory" size="9" value="16GiB"' in form and "3 used" in text(form)  # a1, a2, a3
    r = post(admin, ADMIN, "/ui/projects/alpha/quota", vcpus="12", memory="24GiB", vms="10", storage="1TiB")
    assert r.status_code == 200 and "quota saved" in r.text
    p = o.catalog.project("alpha")
    assert (p.quota_vcpus, p.quota_memory_mib, p.quota_storage_mib) == (12, 24 * 1024, 1024 * 1024)
    bad = post(admin, ADMIN, "/ui/projects/alpha/quota", vcpus="12", memory="16GB")
    assert bad.status_code == 422 and error(bad.text)["field"] == "memory_mib"
    assert bad.headers["hx-retarget"] == "#quota-error"  # the card stays; the refusal shows in it
    assert o.catalog.project("alpha").quota_memory_mib == 24 * 1024
    below = post(admin, ADMIN, "/ui/projects/alpha/quota", vcpus="1", memory="1GiB")  # alpha uses 3 vCPUs
    assert below.status_code == 409 and error(below.text)["field"] == "vcpus", below.text
    p = o.catalog.project("alpha")
    assert (p.quota_vcpus, p.quota_memory_mib) == (12, 24 * 1024)  # nothing half-changed


def test_volumes_are_created_attached_grown_detached_and_deleted(con):
    member, o = con.client(ALPHA), con.o
    assert "Volumes" in member.get("/ui/volumes").text
    r = post(member, ALPHA, "/ui/volumes", name="data", project="alpha", size="1GiB")
    assert r.status_code == 200 and "volume data created" in r.text, r.text
    assert o.volumes.row("data").size_mib == 1024
    r = post(member, ALPHA, "/ui/volumes/data/attach", vm="a1")
    assert r.status_code == 200 and "attached to a1" in r.text and o.volumes.row("data").vm_name == "a1"
    r = post(member, ALPHA, "/ui/volumes/data/resize", size="2GiB")
    assert r.status_code == 200 and o.volumes.row("data").size_mib == 2048
    refused = post(member, ALPHA, "/ui/volumes/data/delete")
    assert refused.status_code == 409 and refused.headers["hx-retarget"] == "#manage-error"
    assert post(member, ALPHA, "/ui/volumes/data/detach").status_code == 200
    assert o.volumes.row("data").vm_name is None
    r = post(member, ALPHA, "/ui/volumes/data/delete")
    assert r.status_code == 200 and "volume data deleted" in r.text
    theirs = post(member, ALPHA, "/ui/volumes", name="x", project="beta", size="1GiB")
    assert theirs.status_code == 404 and error(theirs.text)["field"] == "project"


def test_a_token_is_created_with_its_secret_shown_once_and_revoked(con):
    admin = con.client(ADMIN)
    r = post(admin, ADMIN, "/ui/tokens", name="ci", role="member", project="alpha")
    assert r.status_code == 200, r.text
    secret = re.search(r"<code data-token-secret>([^<]+)</code>", r.text).group(1)
    assert con.api(secret).get("/api/v1/vms").status_code == 200  # it works
    assert secret not in admin.get("/ui/tokens").text  # shown once
    r = post(admin, ADMIN, "/ui/tokens/ci/revoke")
    assert r.status_code == 200 and "token ci revoked" in r.text
    assert con.api(secret).get("/api/v1/vms").status_code == 401
    member = con.client(ALPHA)
    assert "beta-user" not in member.get("/ui/tokens").text  # its project's tokens only
    assert post(member, ALPHA, "/ui/tokens/beta-user/revoke").status_code == 404


def test_placement_groups_and_settings_from_the_console(con):
    member, admin, o = con.client(ALPHA), con.client(ADMIN), con.o
    r = post(member, ALPHA, "/ui/projects/alpha/groups", name="web-tier", policy="anti-affinity", hard="on")
    assert r.status_code == 200 and 'data-group="web-tier"' in r.text
    assert post(member, ALPHA, "/ui/projects/beta/groups", name="x", policy="affinity").status_code == 404
    assert post(member, ALPHA, "/ui/projects/alpha/groups/web-tier/delete").status_code == 200
    assert 'data-group="web-tier"' not in member.get("/ui/projects/alpha").text

    page = admin.get("/ui/settings", params={"scope": "cluster", "scope_name": "c1"}).text
    row = re.search(r'<tr data-setting="cpu.overprovisioning.factor">(.*?)</tr>', page, re.S).group(1)
    assert "default" in text(row)
    r = post(admin, ADMIN, "/ui/settings", key="cpu.overprovisioning.factor", value="3", scope="zone",
             scope_name="z1", view_scope="cluster", view_scope_name="c1")  # fmt: skip
    assert r.status_code == 200, r.text
    row = re.search(r'<tr data-setting="cpu.overprovisioning.factor">(.*?)</tr>', r.text, re.S).group(1)
    assert "3.0 zone z1" in text(row) or "3 zone z1" in text(row), text(row)
    assert o.catalog.effective("cpu.overprovisioning.factor", "z1", "c1") == 3
    bad = post(admin, ADMIN, "/ui/settings", key="cpu.overprovisioning.factor", value="-1")
    assert bad.status_code == 422 and bad.headers["hx-retarget"] == "#manage-error"
    r = post(admin, ADMIN, "/ui/settings", key="cpu.overprovisioning.factor", scope="zone", scope_name="z1",
             unset="on")  # fmt: skip
    assert r.status_code == 200 and o.catalog.effective("cpu.overprovisioning.factor", "z1", "c1") == 1


def test_bulk_actions_on_ticked_vms_show_their_plan_first_then_act_one_by_one(con):
    admin, o = con.client(ADMIN), con.o
    page = admin.get("/ui/vms").text
    assert 'form="bulk" aria-label="tick a1"' in page
    before = {v.name: (v.state, v.host and v.host.name) for v in o.vms()}
    plan = admin.post("/ui/vms/bulk/plan", data={"action": "stop", "vm": ["a1", "a2", "a3"], "csrf": csrf(ADMIN)})
    assert plan.status_code == 200, plan.text
    lines = dict(re.findall(r'data-bulk-vm="([^"]+)" class="(\w+)"', plan.text))
    assert lines == {"a1": "ok", "a2": "ok", "a3": "skipped"} and "Stop 2 VM(s) now" in plan.text
    assert {v.name: (v.state, v.host and v.host.name) for v in o.vms()} == before  # planned only
    done = admin.post("/ui/vms/bulk", data={"action": "stop", "vm": ["a1", "a2"], "csrf": csrf(ADMIN)})
    assert done.status_code == 200 and o.vm("a1").state == o.vm("a2").state == "stopped"

    source = o.vm("b1").host.name
    plan = admin.post("/ui/vms/bulk/plan", data={"action": "migrate", "vm": ["b1", "a1"], "csrf": csrf(ADMIN)})
    said = dict(re.findall(r'data-bulk-vm="([^"]+)" class="\w+"><strong>[^<]+</strong>: ([^<]+)</li>', plan.text))
    assert said["b1"].startswith(f"{source} → ") and said["a1"] == "skipped: stopped, it runs on no host", said
    admin.post("/ui/vms/bulk", data={"action": "migrate", "vm": ["b1"], "csrf": csrf(ADMIN)})
    assert o.vm("b1").host.name != source

    member = con.client(ALPHA)  # another project's VM is refused as not existing, its own acts
    r = member.post("/ui/vms/bulk", data={"action": "start", "vm": ["a1", "b1"], "csrf": csrf(ALPHA)})
    said = dict(re.findall(r'data-bulk-vm="([^"]+)" class="(\w+)"', r.text))
    assert said == {"a1": "ok", "b1": "skipped"} and "vm &#39;b1&#39; does not exist" in r.text
    assert o.vm("a1").state == "running" and o.vm("b1").state == "running"
    bad = admin.post("/ui/vms/bulk/plan", data={"action": "delete", "vm": ["a1"], "csrf": csrf(ADMIN)})
    assert bad.status_code == 422 and error(bad.text)["field"] == "action"


FORM_POSTS = [
    ("/ui/new/vm", VM),
    ("/ui/new/vm/plan", VM),
    ("/ui/new/project", {"name": "p2", "vcpus": "1", "memory": "1GiB"}),
    ("/ui/projects/alpha/quota", {"vcpus": "99"}),
    ("/ui/volumes", {"name": "v", "project": "alpha", "size": "1GiB"}),
    ("/ui/tokens", {"name": "t2"}),
    ("/ui/tokens/beta-user/revoke", {}),
    ("/ui/projects/alpha/groups", {"name": "g", "policy": "affinity"}),
    ("/ui/settings", {"key": "cpu.overprovisioning.factor", "value": "4"}),
    ("/ui/vms/bulk", {"action": "stop", "vm": "a1"}),
]


def _changeable(o) -> tuple:
    """What the forms could change: VMs, tokens, a quota, a setting."""
    vms, tokens = [v.name for v in o.vms()], [t["name"] for t in o.catalog.tokens()]
    return vms, tokens, o.catalog.project("alpha").quota_vcpus, o.catalog.effective("cpu.overprovisioning.factor")


@pytest.fixture(scope="module")
def refusing(tmp_path_factory):
    """One console for the CSRF refusals (each is refused and changes nothing, which each test checks)."""
    from vmplane.store import Database

    from .stores import store_url

    database = Database(store_url(tmp_path_factory.mktemp("forms-csrf"), migrated=True))
    database.migrate()
    console = build(database)
    yield console
    console.o.close()
    database.dispose()


@pytest.mark.parametrize("url,form", FORM_POSTS, ids=[u for u, _ in FORM_POSTS])
def test_a_form_post_without_the_sessions_csrf_token_is_403_and_changes_nothing(refusing, url, form):
    con = refusing
    admin, o = con.client(ADMIN), con.o
    before = _changeable(o)
    for token in (None, csrf(ALPHA)):
        r = admin.post(url, data=form if token is None else {**form, "csrf": token})
        assert r.status_code == 403, (url, r.text)
    after = _changeable(o)
    assert after == before and o.vm("a1").state == "running"


def test_an_admin_makes_and_deletes_pools_and_a_member_sees_none(con):
    admin, member, o = con.client(ADMIN), con.client(ALPHA), con.o
    page = admin.get("/ui/volumes").text
    assert 'data-pool="shared"' in page and 'id="pool-create"' in page
    r = post(admin, ADMIN, "/ui/pools", name="fast-h1", kind="local", host="h1", cluster="c1")
    assert r.status_code == 200 and "pool fast-h1 created" in r.text, r.text
    assert o.pools.row("fast-h1").host_name == "h1"
    again = post(admin, ADMIN, "/ui/pools", name="fast-h1", kind="local", host="h1")
    assert again.status_code == 409 and again.headers["hx-retarget"] == "#pool-error"
    assert post(admin, ADMIN, "/ui/pools/fast-h1/delete").status_code == 200
    with pytest.raises(NotFound):
        o.pools.row("fast-h1")
    assert 'id="pool-create"' not in member.get("/ui/volumes").text
    assert post(member, ALPHA, "/ui/pools", name="mine", kind="local", host="h1").status_code == 403
