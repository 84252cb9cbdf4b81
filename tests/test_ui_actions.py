"""The web console's actions through the ASGI app: every POST needs the session's CSRF token; migrate,
scale and maintenance show their dry-run plan first and change nothing until confirmed; the work then shows
under "Running now" until it ends; a refusal answers the API's status with the API's words in the action's
error slot (p.error), and changes nothing."""

from __future__ import annotations

import re

import pytest

from vmplane.core.errors import NotFound
from vmplane.core.model import Offering, OfferingKind

from .ui_serverkit import ADMIN, ALPHA, BETA, bars, build, csrf, error, text


@pytest.fixture
def con(db):
    console = build(db)
    yield console
    console.o.close()


@pytest.fixture
def admin(con):
    return con.client(ADMIN)


def snapshot(con) -> dict:
    """What an action could change: every VM's state, host and size, hosts' states and claims, projects'
    usage, migrations and the newest event."""
    o = con.o
    vms = {v.name: (v.state, v.host and v.host.name, v.vcpus, v.memory_mib, v.offering.name) for v in o.vms()}
    hosts = {h.name: (h.state, h.used_vcpus, h.used_memory_mib) for h in o.hosts()}
    projects = {p.name: (p.used_vcpus, p.used_memory_mib, p.used_vms) for p in o.catalog.projects()}
    migrations = [(m["vm_name"], m["state"]) for m in o.migrator.list(limit=100)]
    newest = con.client(ADMIN).get("/ui/f/events?pane=1").text
    return {
        "vms": vms,
        "hosts": hosts,
        "projects": projects,
        "migrations": migrations,
        "newest_event": re.search(r'data-event="(\d+)"', newest).group(1),
    }


def same_as_api(console_answer, api_answer) -> dict:
    """The console's refusal is the API's: same status, same words, same field."""
    assert api_answer.status_code >= 400
    body = api_answer.json()
    assert console_answer.status_code == api_answer.status_code, (console_answer.text, body)
    shown = error(console_answer.text)
    assert shown == {"error": body["error"], "field": body["field"], "message": body["message"]}
    assert "<html" not in console_answer.text  # the slot's fragment, not a page
    return shown


# -- CSRF ------------------------------------------------------------------------------------------
POSTS = [
    ("/ui/vms/a1/stop", {"force": "on"}),
    ("/ui/vms/a3/start", {}),
    ("/ui/vms/a3/delete", {}),
    ("/ui/vms/a1/migrate/plan", {"to": ""}),
    ("/ui/vms/a1/migrate", {"to": "h2"}),
    ("/ui/vms/a1/scale/plan", {"offering": "f2"}),
    ("/ui/vms/a1/scale", {"offering": "f2"}),
    ("/ui/hosts/h1/maintenance/enter", {}),
    ("/ui/hosts/h1/maintenance/plan", {}),
    ("/ui/logout", {}),
]


@pytest.mark.parametrize("url,form", POSTS, ids=[u for u, _ in POSTS])
def test_a_post_without_the_right_csrf_token_is_403_and_changes_nothing(con, admin, url, form):
    before = snapshot(con)
    mine = csrf(ADMIN)
    for token in (None, "", "0" * 64, csrf(ALPHA), mine[:-1] + ("1" if mine[-1] == "0" else "0")):  # another's too
        data = dict(form) if token is None else {**form, "csrf": token}
        r = admin.post(url, data=data)
        assert r.status_code == 403, (url, token, r.text[:200])
        assert error(r.text)["field"] == "csrf" and "CSRF token is missing or wrong" in error(r.text)["message"]
        r = admin.post(url, data=form, headers={"X-CSRF-Token": token or "x"})
        assert r.status_code == 403
    assert snapshot(con) == before
    assert admin.get("/ui").status_code == 200  # still logged in (logout refused too)


def test_the_csrf_token_works_as_htmx_sends_it_in_a_header_or_as_a_form_field(con, admin):
    r = admin.post("/ui/vms/a1/stop", data={"force": "on"}, headers={"X-CSRF-Token": csrf(ADMIN)})
    assert r.status_code == 200 and con.o.vm("a1").state == "stopped"
    r = admin.post("/ui/vms/a1/start", data={"csrf": csrf(ADMIN)})
    assert r.status_code == 200 and con.o.vm("a1").state == "running"


def test_a_logged_out_post_is_sent_to_the_login_and_changes_nothing(con):
    before = snapshot(con)
    r = con.client(None).post("/ui/vms/a1/stop", data={"csrf": csrf(ADMIN)}, headers={"HX-Request": "true"})
    assert (r.status_code, r.headers.get("hx-redirect")) == (401, "/ui/login")
    r = con.client("not-a-token").post("/ui/vms/a1/stop", data={"csrf": csrf("not-a-token")})
    assert r.status_code == 303 and r.headers["location"].startswith("/ui/login")
    assert snapshot(con) == before


# -- migrate -------------------------------------------------------------------------------------
def test_migrate_plan_then_migrate_shows_under_running_now_until_it_ends(con, admin):
    o = con.o
    source = o.vm("a1").host.name
    before = snapshot(con)
    r = admin.post("/ui/vms/a1/migrate/plan", data={"to": "", "csrf": csrf(ADMIN)})
    assert r.status_code == 200 and 'data-plan="migrate"' in r.text
    target = re.search(r"<strong data-target>(\w+)</strong>", r.text).group(1)
    assert target != source and f"a1: {source} → {target}, claiming 1 vCPU(s) and 1.3 GiB there" in text(r.text)
    assert f"{target} has room for 1 vCPU(s)" in text(r.text)  # placement's reason
    assert f'hx-vals=\'{{"to": "{target}"}}\'' in r.text and 'hx-post="/ui/vms/a1/migrate"' in r.text
    assert snapshot(con) == before  # a plan changes nothing

    con.executor.hold = True
    r = admin.post("/ui/vms/a1/migrate", data={"to": target, "csrf": csrf(ADMIN)})
    assert r.status_code == 200
    migration = re.search(r'data-migration="([0-9a-f-]+)"', r.text).group(1)
    assert f"migration of a1 to {target}" in text(r.text) and o.migrator.get(migration)["state"] in (
        "queued",
        "copying",
    )
    tasks = admin.get("/ui/f/tasks").text
    assert (
        re.search(
            rf'<li data-task="migration" data-vm="a1">migrate <a href="/ui/vms/a1">a1</a> {source} → {target}', tasks
        )
        and "nothing runs now" not in tasks
    )
    assert re.search(r'<progress max="100" value="\d+">', tasks)
    assert 'data-vm="a1"' in admin.get("/ui/stream?once=true").text  # the live pane too
    assert f'data-migration="{migration}"' in admin.get("/ui/f/vms/a1").text  # and the VM's own page
    assert 'data-vm="a1"' in con.client(ALPHA).get("/ui/f/tasks").text  # its project sees it
    assert 'data-vm="a1"' not in con.client(BETA).get("/ui/f/tasks").text  # another does not

    assert con.executor.release() >= 1
    assert o.migrator.get(migration)["state"] == "succeeded" and o.vm("a1").host.name == target
    assert "nothing runs now" in admin.get("/ui/f/tasks").text
    detail = admin.get("/ui/f/vms/a1").text
    assert f'<a href="/ui/hosts/{target}">{target}</a>' in detail
    assert "succeeded" in text(re.search(rf'<tr data-migration="{migration}">(.*?)</tr>', detail, re.S).group(1))


def test_migrate_to_a_chosen_host_plans_that_host(con, admin):
    source = con.o.vm("a1").host.name
    target = next(h for h in ("h1", "h2", "h3") if h != source)
    r = admin.post("/ui/vms/a1/migrate/plan", data={"to": target, "csrf": csrf(ADMIN)})
    assert r.status_code == 200 and re.search(rf"<strong data-target>{target}</strong>", r.text)
    r = admin.post("/ui/vms/a1/migrate", data={"to": target, "csrf": csrf(ADMIN)})
    assert r.status_code == 200 and con.o.vm("a1").host.name == target


@pytest.mark.parametrize("vm,to", [("a1", "nope"), ("a1", "HOST"), ("a1", "same"), ("a3", ""), ("zz", "")])
def test_a_refused_migration_answers_as_the_api_and_changes_nothing(con, admin, vm, to):
    if to == "same":
        to = con.o.vm(vm).host.name
    before = snapshot(con)
    api = con.api(ADMIN)
    for path in ("/migrate/plan", "/migrate"):
        r = admin.post(f"/ui/vms/{vm}{path}", data={"to": to, "csrf": csrf(ADMIN)})
        body = {"to": to or None, "dry_run": path.endswith("plan")}
        same_as_api(r, api.post(f"/api/v1/vms/{vm}/migrate", json={k: v for k, v in body.items() if v is not None}))
    assert snapshot(con) == before


def test_a_member_migrates_its_vm_where_placement_picks_but_may_not_choose_the_host(con):
    member = con.client(ALPHA)
    before = snapshot(con)
    r = member.post("/ui/vms/a1/migrate/plan", data={"to": "h2", "csrf": csrf(ALPHA)})
    same_as_api(r, con.api(ALPHA).post("/api/v1/vms/a1/migrate", json={"to": "h2", "dry_run": True}))
    assert r.status_code == 403 and "choosing the target host needs an admin token" in error(r.text)["message"]
    r = member.post("/ui/vms/a1/migrate/plan", data={"csrf": csrf(ALPHA)})
    assert r.status_code == 200 and """hx-vals='{"to": ""}'""" in r.text  # the confirm sends no host
    assert snapshot(con) == before
    source = con.o.vm("a1").host.name
    r = member.post("/ui/vms/a1/migrate", data={"to": "", "csrf": csrf(ALPHA)})
    assert r.status_code == 200 and con.o.vm("a1").host.name != source


# -- scale ---------------------------------------------------------------------------------------
def test_scale_plan_then_scale_shows_the_path_then_the_new_size(con, admin):
    o = con.o
    before = snapshot(con)
    host = o.vm("a1").host.name
    r = admin.post("/ui/vms/a1/scale/plan", data={"offering": "f2", "csrf": csrf(ADMIN)})
    assert r.status_code == 200 and 'data-plan="scale"' in r.text
    assert f"a1: 1 -> 2 vCPU(s), 1024 -> 2048 MiB; in place on {host} (in-place)" in text(r.text)
    assert "the project's charge changes by 1 vCPUs and" in text(r.text)
    assert re.search(r"hx-vals='\{[^']*\"offering\": \"f2\"", r.text)  # the confirm asks the same
    assert snapshot(con) == before

    con.executor.hold = True
    r = admin.post(
        "/ui/vms/a1/scale", data={"offering": "f2", "vcpus": "", "memory_mib": "", "cpu_cap": "", "csrf": csrf(ADMIN)}
    )
    assert r.status_code == 200 and re.search(r"scaling a1: operation <code>[0-9a-f]{8}</code>", r.text)
    tasks = admin.get("/ui/f/tasks").text
    assert re.search(r'<li data-task="scale">scale <a href="/ui/vms/a1">a1</a>', tasks)
    assert con.executor.release() >= 1
    assert "nothing runs now" in admin.get("/ui/f/tasks").text
    vm = o.vm("a1")
    assert (vm.vcpus, vm.memory_mib, vm.offering.name, vm.state) == (2, 2048, "f2", "running")
    detail = admin.get("/ui/vms/a1").text
    assert re.search(r"<span data-vcpus>2</span> vCPUs, <span data-memory>2 GiB</span>", detail)
    assert "offering f2" in text(detail) and "scale succeeded" in text(detail)
    alpha = bars(admin.get("/ui/projects/alpha").text)
    assert alpha["vCPUs"]["used"] == before["projects"]["alpha"][0] + 1 == 4


def test_scale_by_size_and_the_cpu_cap(con, admin):
    o = con.o
    o.catalog.create_offering(
        Offering(
            "flex",
            OfferingKind.custom_constrained,
            min_vcpus=1,
            max_vcpus=4,
            min_memory_mib=512,
            max_memory_mib=4096,
            dynamic_scaling=True,
        )
    )
    o.create_vm("a4", "alpha", "flex", "t", vcpus=1, memory_mib=1024, start=True)
    r = admin.post("/ui/vms/a4/scale/plan", data={"vcpus": "3", "memory_mib": "1536", "csrf": csrf(ADMIN)})
    assert r.status_code == 200 and "1 -> 3 vCPU(s), 1024 -> 1536 MiB" in text(r.text)
    assert o.vm("a4").vcpus == 1
    r = admin.post("/ui/vms/a4/scale", data={"vcpus": "3", "memory_mib": "1536", "csrf": csrf(ADMIN)})
    assert r.status_code == 200 and (o.vm("a4").vcpus, o.vm("a4").memory_mib) == (3, 1536)
    api_cap = con.api(ADMIN).post("/api/v1/vms/a4/scale", json={"cpu_cap": True, "dry_run": True})
    r = admin.post("/ui/vms/a4/scale", data={"cpu_cap": "on", "csrf": csrf(ADMIN)})
    if api_cap.status_code == 200:  # an offering without a speed: the API may refuse the cap
        assert r.status_code == 200 and o.vm("a4").cpu_cap_percent is not None
    else:
        same_as_api(r, api_cap)


@pytest.mark.parametrize(
    "form,field,words",
    [
        ({"vcpus": "abc"}, "vcpus", "vcpus: Input should be a valid integer"),
        ({"vcpus": "0"}, "vcpus", "vcpus: Input should be greater than 0"),
        ({"memory_mib": "-5"}, "memory_mib", "memory_mib:"),
        ({"cpu_cap": ""}, "offering", "give an offering, vcpus / memory_mib, or cpu_cap"),
    ],
)
def test_a_bad_scale_form_is_422_naming_the_field(con, admin, form, field, words):
    before = snapshot(con)
    for path in ("/scale/plan", "/scale"):
        r = admin.post(f"/ui/vms/a1{path}", data={**form, "csrf": csrf(ADMIN)})
        assert r.status_code == 422 and error(r.text)["field"] == field and error(r.text)["message"].startswith(words)
    assert snapshot(con) == before


def test_a_scale_refused_by_the_quota_shows_the_apis_message_and_changes_nothing(con, admin):
    before = snapshot(con)
    api = con.api(ADMIN)
    for path, dry in (("/scale/plan", True), ("/scale", False)):
        r = admin.post(f"/ui/vms/b1{path}", data={"offering": "big", "csrf": csrf(ADMIN)})
        shown = same_as_api(r, api.post("/api/v1/vms/b1/scale", json={"offering": "big", "dry_run": dry}))
        assert shown["error"] == "quota_exceeded" and "project beta: vcpus quota exceeded" in shown["message"]
    r = admin.post("/ui/vms/a2/scale", data={"offering": "f1", "csrf": csrf(ADMIN)})  # memory can not shrink live
    same_as_api(r, api.post("/api/v1/vms/a2/scale", json={"offering": "f1"}))
    assert snapshot(con) == before and "nothing runs now" in admin.get("/ui/f/tasks").text


# -- maintenance ---------------------------------------------------------------------------------
def test_maintenance_plan_then_enter_then_exit(con, admin):
    o = con.o
    host = o.vm("a2").host.name
    before = snapshot(con)
    r = admin.post(f"/ui/hosts/{host}/maintenance/plan", data={"csrf": csrf(ADMIN)})
    assert r.status_code == 200 and 'data-plan="maintenance"' in r.text
    planned = re.findall(r"<li>(\w+) → (\w+)</li>", r.text)
    assert [vm for vm, _ in planned] == ["a2"] and planned[0][1] != host
    assert "Entering maintenance would move 1 VM(s)" in text(r.text)
    assert f'hx-post="/ui/hosts/{host}/maintenance/enter"' in r.text and "Enter maintenance" in r.text
    assert snapshot(con) == before

    r = admin.post(f"/ui/hosts/{host}/maintenance/enter", data={"csrf": csrf(ADMIN)})
    assert r.status_code == 200 and "In maintenance" in r.text and "Leave maintenance" in r.text
    assert o.host(host).state == "maintenance" and o.vm("a2").host.name != host and o.vm("a2").state == "running"
    page = admin.get(f"/ui/hosts/{host}")
    assert "Leave maintenance" in page.text and "VMs here (0)" in text(page.text)
    assert re.findall(rf'<tr data-host="{host}">.*?state-(\w+)', admin.get("/ui/hosts").text, re.S) == ["maintenance"]

    r = admin.post(f"/ui/hosts/{host}/maintenance/exit", data={"csrf": csrf(ADMIN)})
    assert r.status_code == 200 and "Plan maintenance" in r.text and o.host(host).state == "enabled"
    cancel = admin.get(f"/ui/hosts/{host}/maintenance")
    assert cancel.status_code == 200 and "Plan maintenance" in cancel.text


def test_a_refused_maintenance_step_shows_the_apis_message_by_its_controls(con, admin):
    api = con.api(ADMIN)
    before = snapshot(con)
    r = admin.post("/ui/hosts/h1/maintenance/exit", data={"csrf": csrf(ADMIN)})
    shown = error(r.text)
    body = api.post("/api/v1/hosts/h1/maintenance", json={"action": "exit"})
    assert r.status_code == body.status_code == 409 and shown["message"] == body.json()["message"]
    assert "Plan maintenance" in r.text  # the controls stay, the error beside them
    r = admin.post("/ui/hosts/h1/maintenance/bogus", data={"csrf": csrf(ADMIN)})
    assert r.status_code == 422 and error(r.text)["field"] == "step"
    r = admin.post("/ui/hosts/nope/maintenance/plan", data={"csrf": csrf(ADMIN)})
    same_as_api(r, api.post("/api/v1/hosts/nope/maintenance", json={"action": "enter", "dry_run": True}))
    assert snapshot(con) == before


def test_a_member_can_not_plan_or_enter_maintenance(con):
    member = con.client(ALPHA)
    before = snapshot(con)
    for step in ("plan", "enter", "exit"):
        r = member.post(f"/ui/hosts/h1/maintenance/{step}", data={"csrf": csrf(ALPHA)})
        assert r.status_code == 403 and error(r.text) == {
            "error": "forbidden",
            "field": None,
            "message": "this needs an admin token",
        }
        assert 'data-plan="maintenance"' not in r.text
    assert member.get("/ui/hosts/h1/maintenance").status_code == 403
    assert snapshot(con) == before


# -- start, stop, delete -------------------------------------------------------------------------
def test_stop_start_and_delete_from_the_vm_page(con, admin):
    o = con.o
    r = admin.post("/ui/vms/a1/stop", data={"force": "on", "csrf": csrf(ADMIN)})
    assert r.status_code == 200 and re.search(r"stopping a1: operation <code>[0-9a-f]{8}</code> succeeded", r.text)
    assert o.vm("a1").state == "stopped" and o.vm("a1").host is None
    page = admin.get("/ui/vms/a1").text
    assert not re.search(r'<button hx-post="/ui/vms/a1/start"[^>]*disabled', page)
    assert re.search(r'<button class="secondary" hx-post="/ui/vms/a1/stop"[^>]*disabled', page)
    r = admin.post("/ui/vms/a1/start", data={"csrf": csrf(ADMIN)})
    assert r.status_code == 200 and "starting a1" in r.text and o.vm("a1").state == "running"
    r = admin.post("/ui/vms/a2/stop", data={"csrf": csrf(ADMIN)})  # asks the guest first
    assert r.status_code == 200 and o.vm("a2").state == "stopped"

    used_vms = o.catalog.project("alpha").used_vms
    r = admin.post("/ui/vms/a3/delete", data={"csrf": csrf(ADMIN)})
    assert r.status_code == 200 and r.headers["hx-redirect"] == "/ui/vms" and "a3 deleted" in r.text
    with pytest.raises(NotFound):
        o.vm("a3")
    assert o.catalog.project("alpha").used_vms == used_vms - 1
    assert "a3" not in admin.get("/ui/vms").text.split("<tbody>")[1]
    gone = admin.post("/ui/vms/a3/delete", data={"csrf": csrf(ADMIN)})
    assert gone.status_code == 404 and error(gone.text)["message"] == "vm 'a3' does not exist"


@pytest.mark.parametrize(
    "vm,action,api_call",
    [
        ("a2", "start", ("post", "/api/v1/vms/a2/start")),
        ("a3", "stop", ("post", "/api/v1/vms/a3/stop")),
        ("a2", "delete", ("delete", "/api/v1/vms/a2")),
        ("b2", "start", ("post", "/api/v1/vms/b2/start")),  # beyond beta's vCPU quota
        ("zz", "start", ("post", "/api/v1/vms/zz/start")),
    ],
)
def test_a_refused_power_action_answers_the_apis_status_and_words_and_changes_nothing(con, admin, vm, action, api_call):
    con.o.create_vm("b2", "beta", "big", "t")
    before = snapshot(con)
    r = admin.post(f"/ui/vms/{vm}/{action}", data={"csrf": csrf(ADMIN)})
    method, url = api_call
    shown = same_as_api(r, getattr(con.api(ADMIN), method)(url))
    if vm == "b2":
        assert shown["error"] == "quota_exceeded" and "quota 4 vCPUs" in shown["message"]
    assert snapshot(con) == before


def test_a_member_acts_on_its_own_vms_and_another_projects_do_not_exist(con):
    member = con.client(ALPHA)
    before = snapshot(con)
    for path, form in (
        ("stop", {"force": "on"}),
        ("start", {}),
        ("delete", {}),
        ("migrate/plan", {}),
        ("migrate", {}),
        ("scale/plan", {"offering": "f2"}),
        ("scale", {"offering": "f2"}),
    ):
        r = member.post(f"/ui/vms/b1/{path}", data={**form, "csrf": csrf(ALPHA)})
        assert r.status_code == 404 and error(r.text) == {
            "error": "not_found",
            "field": "vm",
            "message": "vm 'b1' does not exist",
        }, path
    assert snapshot(con) == before
    r = member.post("/ui/vms/a1/stop", data={"force": "on", "csrf": csrf(ALPHA)})
    assert r.status_code == 200 and con.o.vm("a1").state == "stopped"
