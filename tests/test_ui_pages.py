"""The web console's pages and htmx fragments through the ASGI app: status, what they show (sizes, hosts,
bars, quota numbers and their overhead part), server-side paging, sorting and filtering, bad input answered
422 naming the field, login and logout, and a member seeing its project only (pages, fragments, stream).
The actions (CSRF, plans, migrate, scale, maintenance, power) are in test_ui_actions.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vmplane.core.model import HostState
from vmplane.core.quota import overhead_mib
from vmplane.ui.render import PAGE_SIZE, mib
from vmplane.ui.session import COOKIE

from .conftest import add_sim_hosts
from .stores import store_url
from .ui_serverkit import ADMIN, ALPHA, BETA, bars, block, build, csrf, error, pager, row, rows, text


def _console(tmp_path_factory, name):
    from vmplane.store import Database

    db = Database(store_url(tmp_path_factory.mktemp(name)))
    db.migrate()
    return build(db)


@pytest.fixture(scope="module")
def con(tmp_path_factory):
    """One console for the tests that only read (they change nothing; those that do take `fresh`)."""
    console = _console(tmp_path_factory, "ui-read")
    yield console
    console.o.close()
    console.o.db.dispose()


@pytest.fixture
def fresh(db):
    console = build(db)
    yield console
    console.o.close()


@pytest.fixture
def admin(con):
    return con.client(ADMIN)


@pytest.fixture
def alpha(con):
    return con.client(ALPHA)


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """More than a page of everything: 120 VMs in alpha (every third running), 60 hosts, 52 projects."""
    console = _console(tmp_path_factory, "ui-big")
    for i in range(50):
        console.o.catalog.create_project(f"q{i:02d}", 4, 4096, 4)
    add_sim_hosts(console.o, 57, cores=16, memory_mib=64 * 1024, prefix="x")
    console.o.catalog.set_quota("alpha", vms=200, vcpus=200, memory_mib=400 * 1024)
    for i in range(120):
        console.o.create_vm(f"v{i:03d}", "alpha", "f1", "t", start=i % 3 == 0)
    yield console
    console.o.close()
    console.o.db.dispose()


# -- login and logout ----------------------------------------------------------------------------
def test_logged_out_pages_redirect_to_the_login_form_keeping_the_page_and_fragments_answer_401(con):
    c = con.client(None)
    r = c.get("/ui")
    assert (r.status_code, r.headers["location"]) == (303, "/ui/login")
    r = c.get("/ui/vms?state=running")
    assert (r.status_code, r.headers["location"]) == (303, "/ui/login?next=/ui/vms?state=running")
    for url in ("/ui/f/vms", "/ui/f/tasks", "/ui/f/events?pane=1"):
        r = c.get(url, headers={"HX-Request": "true"})
        assert (r.status_code, r.headers.get("hx-redirect")) == (401, "/ui/login"), url
    r = c.get("/ui/stream?once=true")
    assert (r.status_code, r.headers.get("hx-redirect")) == (401, "/ui/login")
    assert "b1" not in r.text and "a1" not in r.text
    form = c.get("/ui/login?next=/ui/vms")
    assert form.status_code == 200 and 'name="token"' in form.text and 'name="next" value="/ui/vms"' in form.text


def test_a_bad_token_is_refused_401_with_the_message_and_no_cookie(con):
    c = con.client(None)
    r = c.post("/ui/login", data={"token": "not-a-token", "next": "/ui/vms"})
    assert r.status_code == 401 and COOKIE not in r.headers.get("set-cookie", "")
    assert error(r.text)["message"] == "the bearer token is not valid" and 'name="next" value="/ui/vms"' in r.text
    r = c.post("/ui/login", data={"token": "  "})
    assert r.status_code == 401 and error(r.text) == {
        "error": None,
        "field": "token",
        "message": "token: give an API token",
    }
    assert c.get("/ui").status_code == 303  # still logged out


def test_login_sets_an_httponly_strict_cookie_on_ui_and_goes_to_the_page_asked_for(con):
    c = con.client(None)
    r = c.post("/ui/login", data={"token": ALPHA, "next": "/ui/vms?state=running"})
    assert (r.status_code, r.headers["location"]) == (303, "/ui/vms?state=running")
    cookie = r.headers["set-cookie"]
    flags = {f.strip().lower() for f in cookie.split(";")[1:]}
    assert cookie.startswith(f"{COOKIE}=") and ALPHA not in cookie  # a session id, not the token
    assert {"httponly", "samesite=strict", "path=/ui"} <= flags and "secure" not in flags  # loopback http: no Secure
    assert any(f.startswith("max-age=") for f in flags)
    page = c.get("/ui/vms?state=running")  # the cookie jar sends it back
    assert page.status_code == 200 and "alpha-user · member" in text(page.text)
    assert rows(page.text) == ["a1", "a2"]


@pytest.mark.parametrize("next_url", ["https://evil.example/ui", "//evil.example/ui", "/elsewhere", "javascript:x"])
def test_login_never_redirects_off_the_console(con, next_url):
    c = con.client(None)
    r = c.post("/ui/login", data={"token": ADMIN, "next": next_url})
    assert (r.status_code, r.headers["location"]) == (303, "/ui")
    form = c.get("/ui/login", params={"next": next_url})
    assert 'name="next" value="/ui"' in form.text


def test_logout_needs_the_csrf_token_then_clears_the_cookie(con):
    c = con.client(None)
    c.post("/ui/login", data={"token": ADMIN})
    r = c.post("/ui/logout", data={})
    assert r.status_code == 403 and error(r.text)["field"] == "csrf" and c.get("/ui").status_code == 200
    r = c.post("/ui/logout", data={"csrf": csrf(ADMIN)})
    assert (r.status_code, r.headers["location"]) == (303, "/ui/login")
    cookie = r.headers["set-cookie"].lower()
    assert cookie.startswith(f'{COOKIE}=""') or cookie.startswith(f"{COOKIE}=;")
    assert "max-age=0" in cookie and "path=/ui" in cookie
    assert c.get("/ui").status_code == 303


def test_a_revoked_token_logs_its_session_out_at_the_next_request(fresh):
    alpha = fresh.client(ALPHA)
    assert alpha.get("/ui").status_code == 200
    fresh.o.catalog.revoke_token("alpha-user")
    r = alpha.get("/ui/vms")
    assert (r.status_code, r.headers["location"]) == (303, "/ui/login?next=/ui/vms")
    assert alpha.get("/ui/f/vms", headers={"HX-Request": "true"}).status_code == 401


# -- overview --------------------------------------------------------------------------------------
def test_overview_shows_counts_host_bars_with_the_overhead_apart_and_project_quota_bars(con, admin):
    o = con.o
    r = admin.get("/ui")
    assert r.status_code == 200
    counts = {
        label: int(n)
        for n, label in re.findall(
            r'<div class="count"><b>(\d+)</b>(?:<span[^>]*>)?'
            r"([\w ]+)",
            r.text,
        )
    }
    assert counts == {"VMs": 4, "running": 3, "stopped": 1, "hosts": 3, "enabled": 3}
    for h in o.hosts():
        cap = o.host_capacity(h.name)
        on_host = [v for v in o.vms() if v.host and v.host.name == h.name and v.state != "stopped"]
        got = bars(block(r.text, "data-host", h.name))
        assert got["vCPUs"] == {
            "used": h.used_vcpus,
            "total": cap.vcpus_capacity,
            "overhead": 0,
            "pct": round(100 * h.used_vcpus / cap.vcpus_capacity, 1),
        }
        assert got["memory (MiB)"]["used"] == h.used_memory_mib == sum(v.memory_mib + v.overhead_mib for v in on_host)
        assert got["memory (MiB)"]["total"] == cap.memory_capacity_mib == 65536
        assert got["memory (MiB)"]["overhead"] == sum(v.overhead_mib for v in on_host) > 0
    a1_host = o.vm("a1").host.name
    assert bars(block(r.text, "data-host", a1_host))["memory (MiB)"]["used"] == 1024 + overhead_mib_of(o, "a1")
    alpha_bars = bars(block(r.text, "data-project", "alpha"))
    over = overhead_mib_of(o, "a1") + overhead_mib_of(o, "a2")
    assert alpha_bars["vCPUs"] == {"used": 3, "total": 8, "pct": 37.5, "overhead": 0}
    assert alpha_bars["memory (MiB)"] == {
        "used": 1024 + 2048 + over,
        "total": 16384,
        "overhead": over,
        "pct": round(100 * (3072 + over) / 16384, 1),
    }
    assert alpha_bars["VMs"] == {"used": 3, "total": 10, "pct": 30.0, "overhead": 0}
    beta_bars = bars(block(r.text, "data-project", "beta"))  # beta does not count overhead
    assert beta_bars["memory (MiB)"] == {"used": 1024, "total": 8192, "overhead": 0, "pct": 12.5}
    assert "overhead counted" in block(r.text, "data-project", "alpha")
    assert "overhead counted" not in block(r.text, "data-project", "beta")


def overhead_mib_of(o, vm: str) -> int:
    v = o.vm(vm)
    from vmplane.core.model import Size

    assert v.overhead_mib == overhead_mib(Size(v.vcpus, v.memory_mib))
    return v.overhead_mib


def test_an_over_allocated_host_bar_says_so_and_stays_inside_its_track(fresh):
    o, admin = fresh.o, fresh.client(ADMIN)
    o.catalog.set_setting("cpu.overprovisioning.factor", "0.1", "cluster", "c1")  # 16 cores -> 1.6 vCPUs
    h2 = o.vm("a2").host.name
    html_ = admin.get("/ui").text
    got = bars(block(html_, "data-host", h2))["vCPUs"]
    assert got["used"] == 2 and got["total"] == o.host_capacity(h2).vcpus_capacity < 2 and got["pct"] > 100
    assert re.search(
        r'<div class="track over">\s*<span class="fill" style="width: 100.0%"', block(html_, "data-host", h2)
    )


def test_a_members_overview_counts_its_project_only_and_has_no_hosts(alpha):
    r = alpha.get("/ui")
    assert r.status_code == 200
    page = text(r.text)
    assert "hosts" not in re.findall(r'<div class="count"><b>\d+</b>([\w ]+)', r.text)
    assert 'data-host="' not in r.text and 'href="/ui/hosts"' not in r.text
    assert re.findall(r'data-project="(\w+)"', r.text) == ["alpha"] and "beta" not in page
    assert re.search(r"<b>3</b>VMs", r.text)  # a1 a2 a3, not b1


def test_overview_host_bars_are_paged(big):
    admin = big.client(ADMIN)
    first = admin.get("/ui")
    assert len(re.findall(r'<div class="host" data-host=', first.text)) == PAGE_SIZE
    p = pager(first.text.split('<div id="host-bars">')[1])
    assert (p["first"], p["last"], p["total"], p["prev"], p["next"]) == (1, PAGE_SIZE, 60, None, PAGE_SIZE)
    assert p["next_url"].startswith("/ui/f/overview/hosts?")
    rest = admin.get(p["next_url"], headers={"HX-Request": "true"})
    assert rest.status_code == 200 and "<html" not in rest.text
    names = re.findall(r'<div class="host" data-host="(\w+)"', first.text) + re.findall(
        r'<div class="host" data-host="(\w+)"', rest.text
    )
    assert len(names) == len(set(names)) == 60  # every host once
    assert pager(rest.text)["first"] == PAGE_SIZE + 1 and pager(rest.text)["next"] is None
    by_name = {h.name: h.used_memory_mib for h in big.o.hosts()}
    assert [by_name[n] for n in names] == sorted(by_name.values(), reverse=True)  # the most allocated first
    assert big.client(ALPHA).get("/ui/f/overview/hosts").status_code == 403


# -- hosts -----------------------------------------------------------------------------------------
def test_hosts_list_shows_allocation_against_capacity_with_filters_and_sorting(fresh):
    o, admin = fresh.o, fresh.client(ADMIN)
    r = admin.get("/ui/hosts")
    assert r.status_code == 200 and rows(r.text, "data-host") == ["h1", "h2", "h3"]
    h2 = o.vm("a2").host.name
    cap = o.host_capacity(h2)
    assert row(r.text, h2, "data-host") == (
        f"{h2} c1 enabled 2 / {cap.vcpus_capacity} "
        f"{mib(o.host(h2).used_memory_mib)} / {mib(cap.memory_capacity_mib)} "
        f"{mib(overhead_mib_of(o, 'a2'))}"
    )
    by_vcpus = admin.get("/ui/f/hosts?sort=-used_vcpus")
    assert by_vcpus.status_code == 200 and rows(by_vcpus.text, "data-host")[0] == h2 and "<html" not in by_vcpus.text
    assert '?sort=used_vcpus"' in by_vcpus.text  # its header flips the order
    o.maintenance.enter("h3")
    maint = admin.get("/ui/f/hosts?state=maintenance")
    assert rows(maint.text, "data-host") == ["h3"] and pager(maint.text)["total"] == 1
    assert rows(admin.get("/ui/hosts?cluster=c1").text, "data-host") == ["h1", "h2", "h3"]
    none = admin.get("/ui/f/hosts?cluster=nope")
    assert none.status_code == 200 and rows(none.text, "data-host") == [] and "no host matches" in none.text


@pytest.mark.parametrize(
    "url,field",
    [
        ("/ui/hosts?sort=bogus", "sort"),
        ("/ui/f/hosts?sort=-cores2", "sort"),
        ("/ui/hosts?offset=-1", "offset"),
        ("/ui/f/hosts?cluster=" + "c" * 64, "cluster"),
        ("/ui/hosts?colour=red", "colour"),
    ],
)
def test_hosts_list_refuses_bad_input_naming_the_field(admin, url, field):
    r = admin.get(url)
    assert r.status_code == 422 and error(r.text)["field"] == field and error(r.text)["error"] == "invalid"


def test_host_detail_shows_its_vms_bars_maintenance_controls_and_events(con, admin):
    o = con.o
    h = o.vm("a2").host.name
    r = admin.get(f"/ui/hosts/{h}")
    assert r.status_code == 200
    here, claims = r.text.split("<table data-claims>")
    assert re.findall(r'<td><a href="/ui/vms/(\w+)">', here) == ["a2"]
    a2 = o.vm("a2")
    claimed = [text(m) for m in re.findall(r"<tr><td>(.*?)</tr>", claims.split("</table>")[0], re.S)]
    assert len(claimed) == 1 and claimed[0].startswith("a2 ")  # its one claim: the VM with its overhead
    assert claimed[0].endswith(f" 2 {mib(a2.memory_mib + a2.overhead_mib)}")
    got = bars(r.text)
    assert got["vCPUs"]["used"] == 2 and got["memory (MiB)"]["overhead"] == overhead_mib_of(o, "a2")
    assert "Plan maintenance" in r.text and f'hx-post="/ui/hosts/{h}/maintenance/plan"' in r.text
    assert "VMs here (1)" in text(r.text)
    events = re.findall(r'<tr data-event="\d+">(.*?)</tr>', r.text, re.S)
    assert events and all(h in text(e) or "a2" in text(e) for e in events)
    controls = admin.get(f"/ui/hosts/{h}/maintenance")
    assert controls.status_code == 200 and "Plan maintenance" in controls.text and "<html" not in controls.text
    missing = admin.get("/ui/hosts/nope")
    assert missing.status_code == 404 and error(missing.text) == {
        "error": "not_found",
        "field": "host",
        "message": "host 'nope' does not exist",
    }


def test_host_detail_lists_a_page_of_its_vms_and_says_how_many(big):
    o = big.o
    host = max(o.hosts(), key=lambda h: h.used_vcpus)
    on_host = sorted(v.name for v in o.vms() if v.host and v.host.name == host.name)
    r = big.client(ADMIN).get(f"/ui/hosts/{host.name}")
    here = r.text.split("<table data-claims>")[0]
    assert re.findall(r'<td><a href="/ui/vms/(\w+)">', here) == on_host[:PAGE_SIZE]
    assert f"VMs here ({len(on_host)}" in text(r.text)


# -- VMs -----------------------------------------------------------------------------------------
def test_vm_list_rows_show_project_state_host_and_size(con, admin):
    o = con.o
    r = admin.get("/ui/vms")
    assert r.status_code == 200 and rows(r.text) == ["a1", "a2", "a3", "b1"]
    assert re.search(r'<table class="list" data-total="4">', r.text)
    a2 = o.vm("a2")
    assert row(r.text, "a2") == f"a2 alpha running {a2.host.name} 2 2 GiB {a2.created_at:%Y-%m-%d %H:%M:%S} UTC"
    assert row(r.text, "a3").startswith("a3 alpha stopped - 1 1 GiB")
    p = pager(r.text)
    assert (p["first"], p["last"], p["total"], p["prev"], p["next"]) == (1, 4, 4, None, None)
    fragment = admin.get("/ui/f/vms", headers={"HX-Request": "true"})
    assert fragment.status_code == 200 and "<html" not in fragment.text and rows(fragment.text) == rows(r.text)


def test_vm_list_filters_by_project_host_state_and_name_prefix(con, admin):
    o = con.o
    h2 = o.vm("a2").host.name

    def names(query):
        page, frag = admin.get(f"/ui/vms?{query}"), admin.get(f"/ui/f/vms?{query}")
        assert page.status_code == frag.status_code == 200 and rows(page.text) == rows(frag.text)
        assert pager(frag.text)["total"] == len(rows(frag.text))
        return rows(frag.text)

    assert names("project=alpha") == ["a1", "a2", "a3"]
    assert names("project=beta") == ["b1"]
    assert names(f"host={h2}") == ["a2"]
    assert names("state=stopped") == ["a3"]
    assert names("state=running&project=alpha") == ["a1", "a2"]
    assert names("name=a") == ["a1", "a2", "a3"] and names("name=b1") == ["b1"] and names("name=a1x") == []
    assert names("name=a&state=running&project=alpha") == ["a1", "a2"]
    assert names("project=nope") == [] and names("host=nope") == [] and names("name=%25") == []
    assert "no VM matches" in admin.get("/ui/f/vms?project=nope").text
    page = admin.get("/ui/vms?state=running&name=a")
    assert re.search(r"<option selected>running</option>", page.text) and 'name="name" value="a"' in page.text


def test_vm_list_sorts_and_its_headers_flip_the_order(con, admin):
    def names(sort):
        r = admin.get(f"/ui/f/vms?sort={sort}")
        assert r.status_code == 200
        return rows(r.text), r.text

    assert names("-name")[0] == ["b1", "a3", "a2", "a1"]
    assert names("-vcpus")[0][0] == "a2"
    assert names("state")[0][-1] == "a3"  # running < stopped
    assert names("project")[0] == ["a1", "a2", "a3", "b1"] and names("-project")[0][0] == "b1"
    _listed, markup = names("name")
    assert 'hx-get="/ui/f/vms?sort=-name"' in markup and "VM ▲" in markup
    _, markup = names("-memory_mib")
    assert "Memory ▼" in markup and 'hx-get="/ui/f/vms?sort=memory_mib"' in markup
    filtered = admin.get("/ui/f/vms?state=running&sort=-name").text
    assert 'hx-get="/ui/f/vms?state=running&amp;sort=name"' in filtered  # filters kept by the headers


@pytest.mark.parametrize(
    "query,field",
    [
        ("sort=bogus", "sort"),
        ("sort=-password", "sort"),
        ("state=bogus", "state"),
        ("offset=-1", "offset"),
        ("offset=x", "offset"),
        ("name=" + "n" * 64, "name"),
        ("colour=red", "colour"),
    ],
)
def test_vm_list_refuses_bad_input_422_naming_the_field_as_page_and_as_fragment(admin, query, field):
    for url in (f"/ui/vms?{query}", f"/ui/f/vms?{query}"):
        for headers in ({}, {"HX-Request": "true"}):
            r = admin.get(url, headers=headers)
            assert r.status_code == 422, (url, headers, r.status_code)
            assert error(r.text)["field"] == field and error(r.text)["error"] == "invalid"
            if headers or (url.startswith("/ui/f/") and field in ("sort", "state")):
                assert "<html" not in r.text  # an htmx swap gets the error slot alone
            else:
                assert "<html" in r.text


def test_vm_list_pages_on_the_server(big):
    admin = big.client(ADMIN)
    everything = sorted(v.name for v in big.o.vms())
    assert len(everything) == 124 > 2 * PAGE_SIZE
    first = admin.get("/ui/vms")
    assert len(rows(first.text)) == PAGE_SIZE and rows(first.text) == everything[:PAGE_SIZE]
    p = pager(first.text)
    assert (p["first"], p["last"], p["total"], p["prev"], p["next"]) == (1, PAGE_SIZE, 124, None, PAGE_SIZE)
    second = admin.get(p["next_url"], headers={"HX-Request": "true"})
    assert rows(second.text) == everything[PAGE_SIZE : 2 * PAGE_SIZE]
    p2 = pager(second.text)
    assert (p2["first"], p2["last"], p2["prev"], p2["next"]) == (PAGE_SIZE + 1, 2 * PAGE_SIZE, 0, 2 * PAGE_SIZE)
    last = admin.get(p2["next_url"])
    assert rows(last.text) == everything[2 * PAGE_SIZE :] and len(rows(last.text)) == 124 - 2 * PAGE_SIZE
    p3 = pager(last.text)
    assert (p3["first"], p3["last"], p3["total"], p3["prev"], p3["next"]) == (
        2 * PAGE_SIZE + 1,
        124,
        124,
        PAGE_SIZE,
        None,
    )
    beyond = admin.get("/ui/f/vms?offset=500")
    assert rows(beyond.text) == [] and pager(beyond.text)["total"] == 124


def test_vm_list_paging_keeps_the_filter_and_the_sort(big):
    admin = big.client(ADMIN)
    stopped = sorted((v.name for v in big.o.vms() if v.state == "stopped"), reverse=True)
    assert len(stopped) > PAGE_SIZE
    first = admin.get("/ui/f/vms?state=stopped&sort=-name")
    p = pager(first.text)
    assert rows(first.text) == stopped[:PAGE_SIZE] and p["total"] == len(stopped)
    assert "state=stopped" in p["next_url"] and "sort=-name" in p["next_url"]
    second = admin.get(p["next_url"])
    assert rows(second.text) == stopped[PAGE_SIZE : 2 * PAGE_SIZE]


def test_vm_detail_shows_size_offering_host_operations_and_its_events(con, admin):
    o = con.o
    a2 = o.vm("a2")
    r = admin.get("/ui/vms/a2")
    assert r.status_code == 200
    page = text(r.text)
    assert "VM a2 running" in page and "project alpha" in page
    assert re.search(r"<span data-vcpus>2</span> vCPUs, <span data-memory>2 GiB</span>", r.text)
    assert f"overhead {a2.overhead_mib} MiB" in page and "offering f2" in page
    assert re.search(rf'<dd data-host><a href="/ui/hosts/{a2.host.name}">{a2.host.name}</a></dd>', r.text)
    assert "start succeeded done" in page
    events = re.findall(r'<tr data-event="\d+">(.*?)</tr>', r.text, re.S)
    assert events and all(" a2 " in f" {text(e)} " or "start a2" in text(e) for e in events)
    # no other VM's events (as words: an operation's hex id may hold "a1" or "b1": CI met one)
    assert not any(re.search(r"\b(a1|b1)\b", text(e)) for e in events)
    assert 'hx-post="/ui/vms/a2/migrate/plan"' in r.text and 'hx-get="/ui/f/vms/a2"' in r.text
    assert re.search(r'<button hx-post="/ui/vms/a2/start"[^>]*disabled', r.text)  # running: no start
    fragment = admin.get("/ui/f/vms/a2", headers={"HX-Request": "true"})
    assert fragment.status_code == 200 and "<html" not in fragment.text and "<span data-vcpus>2</span>" in fragment.text
    stopped = admin.get("/ui/vms/a3").text
    assert "<span data-host>" not in stopped and "host none (placed when it starts)" in text(stopped)


def test_an_unknown_vm_is_a_404_page_or_fragment_in_the_apis_words(admin):
    r = admin.get("/ui/vms/nope")
    assert r.status_code == 404 and "<html" in r.text
    assert error(r.text) == {"error": "not_found", "field": "vm", "message": "vm 'nope' does not exist"}
    r = admin.get("/ui/f/vms/nope", headers={"HX-Request": "true"})
    assert r.status_code == 404 and "<html" not in r.text and error(r.text)["field"] == "vm"


# -- projects --------------------------------------------------------------------------------------
def test_projects_page_shows_quota_bars_and_a_project_page_its_vms(con, admin):
    o = con.o
    r = admin.get("/ui/projects")
    assert r.status_code == 200 and re.findall(r'data-project="(\w+)"', r.text) == ["alpha", "beta"]
    r = admin.get("/ui/projects/alpha")
    assert r.status_code == 200
    got = bars(r.text)
    over = overhead_mib_of(o, "a1") + overhead_mib_of(o, "a2")
    p = o.catalog.project("alpha")
    assert got["vCPUs"] == {"used": 3, "total": 8, "pct": 37.5, "overhead": 0} and p.used_vcpus == 3
    assert got["memory (MiB)"]["used"] == p.used_memory_mib == 3072 + over and got["memory (MiB)"]["overhead"] == over
    assert got["VMs"]["used"] == 3 and got["VMs"]["total"] == 10
    assert rows(r.text) == ["a1", "a2", "a3"] and pager(r.text)["total"] == 3
    missing = admin.get("/ui/projects/nope")
    assert missing.status_code == 404 and error(missing.text)["field"] == "project"


def test_a_project_page_with_many_vms_shows_one_page_of_them(big):
    r = big.client(ADMIN).get("/ui/projects/alpha")
    assert r.status_code == 200 and len(rows(r.text)) == PAGE_SIZE
    p = pager(r.text)
    assert p["total"] == 123 and p["next"] == PAGE_SIZE and "project=alpha" in p["next_url"]
    assert rows(big.client(ADMIN).get(p["next_url"]).text)[0] == sorted(v.name for v in big.o.vms("alpha"))[PAGE_SIZE]


def test_projects_are_paged_on_the_projects_page_and_the_overview(big):
    admin = big.client(ADMIN)
    names = sorted(p.name for p in big.o.catalog.projects())
    assert len(names) == 52 > PAGE_SIZE
    for url, target in (("/ui/projects", "#project-list"), ("/ui", "#overview-projects")):
        page = admin.get(url).text
        shown = re.findall(r'<div class="project" data-project="(\w+)"', page)
        assert shown == names[:PAGE_SIZE], url
        projects_part = page.split('id="overview-projects"')[1] if url == "/ui" else page
        p = pager(projects_part)
        assert (p["first"], p["last"], p["total"], p["next"]) == (1, PAGE_SIZE, 52, PAGE_SIZE), url
        assert re.search(rf'<nav class="pager"[^>]*>(?:(?!</nav>).)*hx-target="{target}"', projects_part, re.S)
        rest = admin.get(p["next_url"], headers={"HX-Request": "true"})
        assert rest.status_code == 200 and "<html" not in rest.text
        assert re.findall(r'data-project="(\w+)"', rest.text) == names[PAGE_SIZE:]
        assert ('<div class="card">' in rest.text) == (url == "/ui/projects")  # the same look as the page's
    assert re.findall(r'data-project="(\w+)"', big.client(ALPHA).get("/ui/f/projects?offset=0").text) == ["alpha"]
    assert admin.get("/ui/f/projects?offset=-1").status_code == 422


# -- running now, events, stream -------------------------------------------------------------------
def test_events_page_fragment_and_pane(con, admin):
    r = admin.get("/ui/events")
    assert r.status_code == 200
    listed = rows(r.text, "data-event")
    assert listed and [int(x) for x in listed] == sorted((int(x) for x in listed), reverse=True)  # newest first
    vm_only = admin.get("/ui/f/events?kind=vm", headers={"HX-Request": "true"})
    assert vm_only.status_code == 200 and "<html" not in vm_only.text
    kinds = [text(m).split()[0] for m in re.findall(r'<tr data-event="\d+"><td>[^<]*</td><td>(.*?)</td>', vm_only.text)]
    assert kinds and set(kinds) == {"vm"}
    assert pager(vm_only.text)["total"] == len(kinds)  # a few: one page
    assert rows(admin.get("/ui/f/events?kind=bogus").text, "data-event") == listed  # unknown kind: all
    pane = admin.get("/ui/f/events?pane=1")
    assert pane.status_code == 200 and 0 < len(re.findall(r"<li data-event=", pane.text)) <= 12
    assert '<a href="/ui/events">all events</a>' in pane.text
    assert admin.get("/ui/f/events?offset=-1").status_code == 422


def test_events_are_paged(big):
    admin = big.client(ADMIN)
    first = admin.get("/ui/events")
    p = pager(first.text)
    assert len(rows(first.text, "data-event")) == PAGE_SIZE and p["total"] > 2 * PAGE_SIZE and p["next"] == PAGE_SIZE
    second = admin.get(p["next_url"])
    a, b = [int(x) for x in rows(first.text, "data-event")], [int(x) for x in rows(second.text, "data-event")]
    assert len(b) == PAGE_SIZE and max(b) < min(a)


def test_tasks_fragment_says_nothing_runs_when_idle(admin):
    r = admin.get("/ui/f/tasks")
    assert r.status_code == 200 and "<html" not in r.text and "nothing runs now" in r.text


def test_the_stream_sends_tasks_events_and_the_newest_event_id_once(con, admin):
    r = admin.get("/ui/stream?once=true")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["cache-control"] == "no-cache"
    parts = {m.group(1): m.group(2) for m in re.finditer(r"event: (\w+)\n((?:data: .*\n)+)\n", r.text)}
    assert set(parts) == {"tasks", "events", "changed"}
    assert "nothing runs now" in parts["tasks"] and "<li data-event=" in parts["events"]
    newest = max(int(x) for x in re.findall(r'data-event="(\d+)"', admin.get("/ui/events").text))
    assert parts["changed"] == f"data: {newest}\n"


def test_every_page_has_the_live_pane_and_the_csrf_header_of_its_session(con, admin, alpha):
    for url in (
        "/ui",
        "/ui/hosts",
        "/ui/hosts/h1",
        "/ui/vms",
        "/ui/vms/a1",
        "/ui/projects",
        "/ui/projects/alpha",
        "/ui/events",
    ):
        r = admin.get(url)
        assert r.status_code == 200, url
        assert 'sse-connect="/ui/stream"' in r.text and 'hx-get="/ui/f/tasks"' in r.text, url
        assert f'"X-CSRF-Token": "{csrf(ADMIN)}"' in r.text, url
    assert f'"X-CSRF-Token": "{csrf(ALPHA)}"' in alpha.get("/ui").text and csrf(ALPHA) != csrf(ADMIN)


def test_static_files_are_served_and_the_javascript_stays_under_60_kb(con):
    c = con.client(None)
    static = Path(__file__).parents[1] / "src/vmplane/ui/static"
    # the serial console's (xterm.js, its fit addon, vmconsole.js) are loaded by the VM page only
    terminal = [*static.glob("xterm*.js"), static / "vmconsole.js"]
    scripts = [p for p in static.glob("*.js") if p not in terminal]  # every page's
    assert scripts and sum(p.stat().st_size for p in scripts) < 60 * 1024
    assert len(terminal) == 3 and sum(p.stat().st_size for p in terminal) < 320 * 1024
    for p in list(static.iterdir()):
        r = c.get(f"/ui/static/{p.name}")
        assert r.status_code == 200 and len(r.content) == p.stat().st_size
    assert c.get("/ui/static/nope.js").status_code == 404


# -- a member sees its project only ----------------------------------------------------------------
@pytest.mark.parametrize("url", ["/ui/vms/b1", "/ui/f/vms/b1", "/ui/projects/beta"])
def test_another_projects_objects_do_not_exist_for_a_member(con, alpha, url):
    for headers in ({}, {"HX-Request": "true"}):
        r = alpha.get(url, headers=headers)
        assert r.status_code == 404 and error(r.text)["error"] == "not_found", url
        assert "b1" not in text(r.text).replace("'b1'", "") and "beta" not in text(r.text).replace("'beta'", "")


@pytest.mark.parametrize(
    "url",
    ["/ui/hosts", "/ui/f/hosts", "/ui/hosts/h1", "/ui/hosts/nope", "/ui/f/overview/hosts", "/ui/hosts/h1/maintenance"],
)
def test_hosts_are_for_admins_only(alpha, url):
    r = alpha.get(url)
    assert r.status_code == 403 and error(r.text)["error"] == "forbidden"
    assert "h2" not in text(r.text) and 'data-host="' not in r.text


def test_a_members_lists_panes_and_stream_show_its_project_only(fresh):
    con, alpha = fresh, fresh.client(ALPHA)
    con.o.migrator.migrate("b1")  # beta's work in the log and (held) in flight
    con.executor.hold = True
    con.o.migrator.migrate("b1")
    beta_everywhere = con.client(BETA)
    assert 'data-vm="b1"' in beta_everywhere.get("/ui/f/tasks").text
    assert rows(alpha.get("/ui/vms").text) == ["a1", "a2", "a3"]
    assert rows(alpha.get("/ui/f/vms?project=beta").text) == []
    b1_host = con.o.vm("b1").host.name
    assert set(rows(alpha.get(f"/ui/f/vms?host={b1_host}").text)) == {
        v.name for v in con.o.vms("alpha") if v.host and v.host.name == b1_host
    }
    assert rows(alpha.get("/ui/f/vms?name=b").text) == [] and pager(alpha.get("/ui/f/vms?name=b").text)["total"] == 0
    assert re.findall(r'data-project="(\w+)"', alpha.get("/ui/projects").text) == ["alpha"]
    listed = alpha.get("/ui/projects/alpha")
    assert rows(listed.text) == ["a1", "a2", "a3"]
    for url in (
        "/ui/f/tasks",
        "/ui/f/events?pane=1",
        "/ui/events",
        "/ui/f/events?kind=migration",
        "/ui/stream?once=true",
        "/ui",
        "/ui/vms/a1",
    ):
        r = alpha.get(url)
        assert r.status_code == 200, url
        assert not re.search(r"\bb1\b", r.text) and "beta" not in r.text, url
    assert "nothing runs now" in alpha.get("/ui/f/tasks").text
    events = rows(alpha.get("/ui/events").text, "data-event")
    assert events and len(events) == pager(alpha.get("/ui/events").text)["total"]
    admin_events = pager(con.client(ADMIN).get("/ui/events").text)["total"]
    assert admin_events > len(events)
    member_vms = alpha.get("/ui/vms")
    assert "Project <input" not in member_vms.text and "Host <input" not in member_vms.text
    assert 'href="/ui/hosts/' not in alpha.get("/ui/vms/a1").text
    assert HostState.enabled.value not in text(alpha.get("/ui").text).split("Projects")[0]
