"""The web console end to end, in Debian's headless Chromium driven by Playwright (issue 13's acceptance).

Two servers, each started once for the module: `vmplane up --driver sim` (hosts, maintenance, a member
of project alpha who must see nothing of beta, a refusal by quota, the screenshots) and a libvirt
cluster with a real QEMU guest (TCG) that the admin migrates and scales from its page, watching the
live panes, while a member of another project, logged in too, sees none of it.

Every wait is one of Playwright's auto-waiting expectations; an action must not reload the page (a
marker set in the window before it is checked after it)."""

from __future__ import annotations

import re

import pytest

from . import uikit
from .conftest import ADMIN_TOKEN, LiveServer
from .realguest import require_libvirt, run_json, scalable_cluster
from .uikit import SLOW_MS, Console

expect = pytest.importorskip(
    "playwright.sync_api", reason="browser tests need Playwright for Python (pip install -e '.[test]')"
).expect


@pytest.fixture(scope="module")
def browser():
    with uikit.chromium() as b:
        yield b


def api(server: LiveServer, method: str, path: str, **kw) -> dict:
    with server.client() as c:
        r = c.request(method, path, **kw)
        assert r.status_code < 300, f"{method} {path}: {r.status_code} {r.text}"
        return r.json() if r.content else {}


def member_token(server: LiveServer, name: str, project: str) -> str:
    return api(server, "POST", "/tokens", json={"name": name, "role": "member", "project": project})["token"]


# -- the sim cluster -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sim(tmp_path_factory, browser):
    server = LiveServer(tmp_path_factory.mktemp("ui-sim"), hosts=3).start()
    try:
        api(
            server,
            "PUT",
            "/settings/enable.dynamic.scale.vm",
            json={"value": "true", "scope": "zone", "scope_name": "zone1"},
        )
        for name, vcpus, memory in (("small", 1, 1024), ("big", 4, 4096)):
            api(
                server,
                "POST",
                "/offerings",
                json={"name": name, "kind": "fixed", "vcpus": vcpus, "memory_mib": memory, "dynamic_scaling": True},
            )
        api(server, "POST", "/projects", json={"name": "alpha", "vcpus": 3, "memory_mib": 8192, "vms": 5})
        api(server, "POST", "/projects", json={"name": "beta", "vcpus": 8, "memory_mib": 16384, "vms": 5})
        for vm, project, offering, start in (
            ("a1", "alpha", "small", True),
            ("a2", "alpha", "big", False),
            ("b1", "beta", "small", True),
            ("b2", "beta", "small", False),
        ):
            api(
                server,
                "POST",
                "/vms",
                json={"name": vm, "project": project, "offering": offering, "template": "tiny-linux", "start": start},
            )
        server.member_token = member_token(server, "alpha-member", "alpha")
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def admin(sim, browser):
    console = Console(browser, sim.url).login(ADMIN_TOKEN)
    yield console
    assert console.errors == []
    console.close()


@pytest.fixture(scope="module")
def member(sim, browser):
    console = Console(browser, sim.url).login(sim.member_token)
    yield console
    assert console.errors == []
    console.close()


def test_admin_sees_hosts_and_vms_and_takes_a_host_through_maintenance_after_its_plan(sim, admin):
    page = admin.page
    bars = page.locator("#host-bars [data-host]")
    expect(bars).to_have_count(3)  # the overview's host bars
    expect(bars.first.locator(".bar")).to_have_count(2)  # vCPUs and memory
    expect(page.locator("[data-project]")).to_have_count(2)  # alpha and beta quota bars

    page.get_by_role("link", name="Hosts", exact=True).click()
    expect(page.locator("main h1")).to_have_text("Hosts")
    expect(page.locator("#host-list tbody tr[data-host]")).to_have_count(3)
    page.get_by_role("link", name="VMs", exact=True).click()
    expect(page.locator("#vm-list tbody tr[data-vm]")).to_have_count(4)
    expect(page.locator("tr[data-vm=a1]")).to_contain_text("running")

    home = api(sim, "GET", "/vms/a1")["host"]
    on_home = sorted(v["name"] for v in api(sim, "GET", "/vms") if v["host"] == home and v["state"] == "running")
    page.goto(f"/ui/hosts/{home}")
    expect(page.locator("main h1")).to_contain_text(f"Host {home}")
    box = page.locator("#maintenance")
    admin.mark()
    box.get_by_role("button", name="Plan maintenance…").click()
    plan = box.locator("[data-plan=maintenance]")
    expect(plan).to_contain_text(f"would move {len(on_home)} VM(s)")
    for vm in on_home:
        expect(plan.locator("li", has_text=vm)).to_contain_text("→ sim")
    assert api(sim, "GET", f"/hosts/{home}")["state"] == "enabled"  # the plan changed nothing
    box.get_by_role("button", name="Enter maintenance").click()
    expect(box).to_contain_text("In maintenance")
    expect(box.get_by_role("button", name="Leave maintenance")).to_be_visible()
    admin.assert_not_reloaded()
    assert api(sim, "GET", f"/hosts/{home}")["state"] == "maintenance"
    other = admin.context.new_page()  # drained by live migration: each
    for vm in on_home:  # VM's page (live) shows it moved
        other.goto(f"/ui/vms/{vm}")
        expect(other.locator("#vm-detail [data-host]")).not_to_have_text(home)
        expect(other.locator("#vm-detail h1")).to_contain_text("running")
    other.close()

    box.get_by_role("button", name="Leave maintenance").click()
    expect(box.get_by_role("button", name="Plan maintenance…")).to_be_visible()
    admin.assert_not_reloaded()
    assert api(sim, "GET", f"/hosts/{home}")["state"] == "enabled"


BETA = re.compile(r"(?<![\w-])(beta|b1|b2)(?![\w-])")  # project beta's names, as whole words


def no_beta(html: str, where: str) -> None:
    found = BETA.search(html)
    if found is not None:
        around = html[max(0, found.start() - 200) : found.end() + 200]
        raise AssertionError(f"{where} shows {found.group(0)!r} of project beta: ...{around}...")


def loaded(console: Console) -> None:
    """The page's live panes have their first content (htmx loaded them, then the stream)."""
    expect(console.page.locator("#tasks ul[data-tasks]")).to_be_visible()
    expect(console.page.locator("#events-pane ul[data-events]")).to_be_visible()


def test_a_member_sees_and_reaches_nothing_of_another_project(sim, admin, member):
    # the admin does see beta (else the checks below would prove nothing): its newest events included
    admin.page.goto("/ui/vms")
    expect(admin.page.locator("#vm-list tr[data-vm=b1]")).to_be_visible()
    api(sim, "POST", "/vms/b2/start")
    expect(admin.page.locator("#events-pane")).to_contain_text("vm b2")  # pushed over the stream
    assert BETA.search(admin.fetch("/ui/stream?once=1").text())
    admin.page.goto("/ui/events")
    expect(admin.page.locator("#event-list")).to_contain_text("b1")

    page = member.page
    page.goto("/ui")
    loaded(member)
    expect(page.locator("[data-project]")).to_have_count(1)  # its own quota bars only
    expect(page.locator("[data-project=alpha]")).to_be_visible()
    expect(page.locator("#host-bars")).to_have_count(0)  # hosts are the admin's
    expect(page.get_by_role("link", name="Hosts", exact=True)).to_have_count(0)
    no_beta(page.content(), "the overview (with its tasks and events panes)")

    page.get_by_role("link", name="VMs", exact=True).click()
    expect(page.locator("#vm-list tr[data-vm]")).to_have_count(2)
    expect(page.locator("#vm-list tr[data-vm=a1]")).to_be_visible()
    no_beta(page.content(), "the VM list")
    page.get_by_role("link", name="Events", exact=True).click()
    expect(page.locator("#event-list tr[data-event]").first).to_be_visible()
    no_beta(page.content(), "the events page")
    page.get_by_role("link", name="Projects", exact=True).click()
    expect(page.locator("[data-project]")).to_have_count(1)
    no_beta(page.content(), "the projects page")

    # typed into the address bar: a page of its own words, 404 as the API says, 403 for admin pages
    response = page.goto("/ui/vms/b1")
    assert response.status == 404
    expect(page.locator("main h1")).to_have_text("not found")
    expect(page.locator("main p.error")).to_have_text("vm 'b1' does not exist")
    for path, status in (
        ("/ui/vms/b2", 404),
        ("/ui/projects/beta", 404),
        ("/ui/hosts", 403),
        ("/ui/hosts/sim1", 403),
        ("/ui/vms?project=beta", 200),
        ("/ui/events?kind=vm", 200),
    ):
        r = member.fetch(path)
        assert r.status == status, (path, r.status, r.text()[:300])
        if status == 200:  # (the filter asked for is echoed in its links: not a leak)
            no_beta(r.text().replace("project=beta", ""), path)
    # the fragments htmx asks for, by URL too: the same answers, as fragments (no layout)
    for path, status in (
        ("/ui/f/vms/b1", 404),
        ("/ui/f/hosts", 403),
        ("/ui/f/overview/hosts", 403),
        ("/ui/hosts/sim1/maintenance", 403),
        ("/ui/f/vms?project=beta", 200),
        ("/ui/f/vms?name=b", 200),
        ("/ui/f/vms?sort=project", 200),
        ("/ui/f/events", 200),
        ("/ui/f/events?kind=vm", 200),
        ("/ui/f/events?pane=1", 200),
        ("/ui/f/tasks", 200),
        ("/ui/stream?once=1", 200),
    ):
        r = member.fetch(path, htmx=True)
        assert r.status == status, (path, r.status, r.text()[:300])
        assert "<html" not in r.text(), path
        if status == 200:
            no_beta(r.text().replace("project=beta", ""), path)
        else:
            assert 'class="error"' in r.text(), (path, r.text())
    assert 'data-vm="a1"' in member.fetch("/ui/f/vms", htmx=True).text()  # the same list does show alpha
    # nor can it act on beta's VMs (with its own valid CSRF token): the API's 404
    csrf = page.evaluate("JSON.parse(document.body.getAttribute('hx-headers'))['X-CSRF-Token']")
    for action in ("start", "stop", "delete", "migrate/plan", "scale/plan"):
        r = member.context.request.post(
            f"/ui/vms/b1/{action}", headers={"HX-Request": "true", "X-CSRF-Token": csrf}, form={"vcpus": "2"}
        )
        assert r.status == 404, (action, r.status, r.text())
    assert api(sim, "GET", "/vms/b1")["state"] == "running"


def test_a_refusal_by_quota_shows_the_apis_words_next_to_its_control_without_a_reload(sim, member):
    page = member.page
    with sim.client() as c:  # what the API itself says to this member (nothing is changed)
        c.headers["Authorization"] = f"Bearer {sim.member_token}"
        said_start = c.post("/vms/a2/start").json()
        said_scale = c.post("/vms/a1/scale", json={"offering": "big", "dry_run": True}).json()
    assert said_start["error"] == said_scale["error"] == "quota_exceeded", (said_start, said_scale)

    page.goto("/ui/vms/a2")
    loaded(member)
    member.mark()
    page.locator("#act-power").get_by_role("button", name="Start").click()
    error = page.locator("#act-power #power-result p.error")
    expect(error).to_have_text(said_start["message"])
    member.assert_not_reloaded()
    assert api(sim, "GET", "/vms/a2")["state"] == "stopped"

    page.goto("/ui/vms/a1")
    member.mark()
    scale = page.locator("#act-scale")
    scale.get_by_label("Offering").select_option("big")
    scale.get_by_role("button", name="Plan scale…").click()
    expect(scale.locator("#scale-result p.error")).to_have_text(said_scale["message"])
    member.assert_not_reloaded()
    assert api(sim, "GET", "/vms/a1")["vcpus"] == 1


def test_screenshots_of_the_main_pages(sim, admin, member, browser):
    page = admin.page
    shots = []
    for name, path in (
        ("overview", "/ui"),
        ("hosts", "/ui/hosts"),
        ("vms", "/ui/vms"),
        ("projects", "/ui/projects"),
        ("project", "/ui/projects/alpha"),
        ("events", "/ui/events"),
    ):
        page.goto(path)
        loaded(admin)
        shots.append(admin.screenshot(name))
    host = api(sim, "GET", "/vms/b1")["host"]
    page.goto(f"/ui/hosts/{host}")
    loaded(admin)
    page.locator("#maintenance").get_by_role("button", name="Plan maintenance…").click()
    expect(page.locator("[data-plan=maintenance]")).to_be_visible()
    shots.append(admin.screenshot("host-with-maintenance-plan"))
    page.goto("/ui/vms/b1")
    loaded(admin)
    page.locator("#act-migrate").get_by_role("button", name="Plan migration…").click()
    expect(page.locator("[data-plan=migrate]")).to_be_visible()
    page.locator("#act-scale").get_by_label("Offering").select_option("big")
    page.locator("#act-scale").get_by_role("button", name="Plan scale…").click()
    expect(page.locator("[data-plan=scale]")).to_be_visible()
    shots.append(admin.screenshot("vm-with-plans"))
    member.page.goto("/ui")
    loaded(member)
    shots.append(member.screenshot("member-overview"))
    member.page.goto("/ui/vms/a2")
    member.page.locator("#act-power").get_by_role("button", name="Start").click()
    expect(member.page.locator("#power-result p.error")).to_be_visible()
    shots.append(member.screenshot("member-vm-refused-by-quota"))
    anonymous = Console(browser, sim.url)
    anonymous.page.goto("/ui")
    expect(anonymous.page.get_by_label("Token")).to_be_visible()
    shots.append(anonymous.screenshot("login"))
    anonymous.close()
    assert all(p.stat().st_size > 5000 for p in shots)


# -- a real QEMU guest ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real(tmp_path_factory, browser):
    """Two local libvirt hosts, one real guest `web` (TCG) in project p; a member of project `mine`."""
    require_libvirt()
    server = scalable_cluster(tmp_path_factory.mktemp("ui-real"), 2, 1024, {"f1": (1, "256MiB"), "f2": (2, "512MiB")})
    try:
        run_json(
            server, "vm", "create", "web", "--project", "p", "--offering", "f1", "--template", "scalable", "--start"
        )
        api(server, "POST", "/projects", json={"name": "mine", "vcpus": 2, "memory_mib": 2048, "vms": 2})
        server.member_token = member_token(server, "mine-member", "mine")
        yield server
    finally:
        server.stop()


def test_admin_migrates_then_scales_a_real_guest_from_its_page_watching_it_live(real, browser):
    admin = Console(browser, real.url).login(ADMIN_TOKEN)
    other = Console(browser, real.url).login(real.member_token)  # a member of another project, watching
    page = admin.page
    expect(page.locator("#host-bars [data-host]")).to_have_count(2)
    page.get_by_role("link", name="Hosts", exact=True).click()
    expect(page.locator("#host-list tr[data-host=lv1]")).to_contain_text("enabled")
    expect(page.locator("#host-list tr[data-host=lv2]")).to_contain_text("enabled")
    page.get_by_role("link", name="VMs", exact=True).click()
    expect(page.locator("#vm-list tr[data-vm=web]")).to_contain_text("running")
    page.locator("#vm-list").get_by_role("link", name="web", exact=True).click()
    expect(page.locator("#vm-detail h1")).to_contain_text("web")
    loaded(admin)
    loaded(other)
    source = page.locator("#vm-detail [data-host]").inner_text()
    target = "lv2" if source == "lv1" else "lv1"
    for console in (admin, other):
        console.record("#tasks")
        console.record("#events-pane")
    admin.mark()

    # migrate: the plan (target and why) first, then the migration, followed live
    migrate = page.locator("#act-migrate")
    migrate.get_by_role("button", name="Plan migration…").click()
    plan = migrate.locator("[data-plan=migrate]")
    expect(plan.locator("[data-target]")).to_have_text(target)
    expect(plan.locator("p.muted")).not_to_be_empty()  # placement's reason
    assert api(real, "GET", "/vms/web")["host"] == source  # a plan changes nothing
    migrate.get_by_role("button", name="Migrate now").click()
    expect(migrate.locator("#migrate-result [data-migration]")).to_contain_text(f"to {target}")
    # the detail follows by itself (it fetches itself again on the stream's `changed`)
    expect(page.locator("#vm-detail [data-host]")).to_have_text(target, timeout=SLOW_MS)
    row = page.locator("#vm-detail tr[data-migration]").first
    expect(row).to_contain_text("succeeded", timeout=SLOW_MS)
    expect(row).to_contain_text("100%")
    expect(page.locator("#tasks")).to_contain_text("nothing runs now", timeout=SLOW_MS)
    admin.assert_not_reloaded()
    shown = [h for h in admin.recorded("#tasks") if 'data-task="migration" data-vm="web"' in h]
    assert shown, "the migration never showed under Running now"
    progress = [int(v) for h in shown for v in re.findall(r'<progress max="100" value="(\d+)"', h)]
    assert progress == sorted(progress), progress  # it only went forward
    assert api(real, "GET", "/vms/web")["host"] == target

    # scale: the plan (its path) first, then the scale, the new size seen in the detail
    scale = page.locator("#act-scale")
    scale.get_by_label("Offering").select_option("f2")
    scale.get_by_role("button", name="Plan scale…").click()
    plan = scale.locator("[data-plan=scale]")
    expect(plan).to_contain_text("web")
    expect(plan.locator(".muted").first).to_contain_text(re.compile(r"\w"))  # the path, e.g. in-place
    assert api(real, "GET", "/vms/web")["vcpus"] == 1
    scale.get_by_role("button", name="Scale now").click()
    expect(scale.locator("#scale-result p.done")).to_contain_text("scaling web")
    expect(page.locator("#vm-detail [data-vcpus]")).to_have_text("2", timeout=SLOW_MS)
    expect(page.locator("#vm-detail [data-memory]")).to_have_text("512 MiB", timeout=SLOW_MS)
    expect(page.locator("#vm-detail h1")).to_contain_text("running", timeout=SLOW_MS)
    admin.assert_not_reloaded()
    vm = api(real, "GET", "/vms/web")
    assert (vm["vcpus"], vm["memory_mib"], vm["offering"], vm["host"]) == (2, 512, "f2", target)
    admin.screenshot("real-vm-after-migrate-and-scale")

    # the member of `mine`, on its overview all along, saw none of it
    for pane in ("#tasks", "#events-pane"):
        seen = other.recorded(pane)
        assert seen and not [h for h in seen if re.search(r"(?<![\w-])web(?![\w-])", h)], (pane, seen)
    assert admin.errors == other.errors == []
    admin.close()
    other.close()
