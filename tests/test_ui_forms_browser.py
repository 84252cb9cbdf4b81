"""Issue 33's acceptance in Debian's headless Chromium: from the console only, an admin creates a project, a
VM (started, after its plan) and a volume, attaches the volume, edits the quota and revokes a token; each
result is checked through the API. A member's browser can not create outside its project, even with a
form it edited itself. One `vmplane up --driver sim` server for the module."""

from __future__ import annotations

import pytest

from . import uikit
from .conftest import ADMIN_TOKEN, LiveServer
from .uikit import Console

expect = pytest.importorskip(
    "playwright.sync_api", reason="browser tests need Playwright for Python (pip install -e '.[test]')"
).expect


def api(server: LiveServer, method: str, path: str, **kw):
    with server.client() as c:
        return c.request(method, path, **kw)


@pytest.fixture(scope="module")
def browser():
    with uikit.chromium() as b:
        yield b


@pytest.fixture(scope="module")
def server(tmp_path_factory, browser):
    live = LiveServer(tmp_path_factory.mktemp("ui-forms"), hosts=2).start()
    try:
        body = {"name": "small", "kind": "fixed", "vcpus": 1, "memory_mib": 512}
        assert api(live, "POST", "/offerings", json=body).status_code == 201
        assert api(live, "POST", "/projects", json={"name": "alpha", "vcpus": 2, "memory_mib": 2048}).is_success
        made = api(live, "POST", "/tokens", json={"name": "alpha-member", "role": "member", "project": "alpha"})
        live.member_token = made.json()["token"]
        yield live
    finally:
        live.stop()


def test_an_admin_creates_a_project_a_vm_and_a_volume_attaches_it_edits_the_quota_and_revokes_a_token(server, browser):
    admin = Console(browser, server.url).login(ADMIN_TOKEN)
    page = admin.page
    page.on("dialog", lambda dialog: dialog.accept())  # the revoke's confirmation
    try:
        # a project
        page.goto("/ui/projects")
        page.get_by_role("link", name="New project").click()
        form = page.locator("#project-create")
        form.get_by_label("Name").fill("gamma")
        form.get_by_label("vCPUs").fill("4")
        form.get_by_label("Memory").fill("8GiB")
        form.get_by_label("VMs").fill("3")
        form.get_by_role("button", name="Create project").click()
        expect(page).to_have_url(f"{server.url}/ui/projects/gamma")
        quota = api(server, "GET", "/projects/gamma").json()["quota"]
        assert (quota["vcpus"], quota["memory_mib"], quota["vms"]) == (4, 8192, 3)

        # a VM in it, planned first, then created and started
        page.get_by_role("link", name="New VM in gamma").click()
        form = page.locator("#vm-create")
        expect(form.locator("select[name=project]")).to_have_value("gamma")
        form.get_by_label("Name").fill("g1")
        form.locator("select[name=offering]").select_option("small")
        form.get_by_role("button", name="Plan…").click()
        plan = page.locator("[data-plan=create]")
        expect(plan).to_contain_text("has room for 1 vCPU(s)")
        expect(plan).to_contain_text("its project is charged 1 VM, 1 vCPU(s)")
        assert api(server, "GET", "/vms/g1").status_code == 404  # planned only
        admin.screenshot("forms-vm-create-plan")
        page.get_by_role("button", name="Create and start").click()
        expect(page).to_have_url(f"{server.url}/ui/vms/g1")
        vm = api(server, "GET", "/vms/g1").json()
        assert vm["project"] == "gamma" and vm["state"] in ("starting", "running")

        # a volume, attached to it
        page.get_by_role("link", name="Volumes", exact=True).click()
        form = page.locator("#volume-create")
        form.get_by_label("Name").fill("gdata")
        form.locator("select[name=project]").select_option("gamma")
        form.get_by_label("Size").fill("1GiB")
        form.get_by_role("button", name="Create volume").click()
        row = page.locator("tr[data-volume=gdata]")
        expect(row).to_contain_text("1 GiB")
        expect(page.locator("#volume-list .done")).to_contain_text("volume gdata created")
        row.get_by_label("attach gdata to VM").fill("g1")
        row.get_by_role("button", name="Attach").click()
        expect(page.locator("#volume-list .done")).to_contain_text("volume gdata attached to g1")
        volume = api(server, "GET", "/volumes/gdata").json()
        assert volume["vm"] == "g1" and volume["project"] == "gamma" and volume["size_mib"] == 1024

        # the quota, edited where its use is shown
        page.goto("/ui/projects/gamma")
        form = page.locator("#quota-edit")
        expect(form).to_contain_text("1 used")  # g1's vCPU
        form.get_by_label("Memory").fill("16GiB")
        form.get_by_role("button", name="Save quota").click()
        expect(page.locator("#quota-card")).to_contain_text("quota saved")
        assert api(server, "GET", "/projects/gamma").json()["quota"]["memory_mib"] == 16384

        # a token: made (its secret shown once), then revoked
        page.get_by_role("link", name="Tokens").click()
        form = page.locator("#token-create")
        form.get_by_label("Name").fill("gamma-ci")
        form.locator("select[name=project]").select_option("gamma")
        form.get_by_role("button", name="Create token").click()
        secret = page.locator("[data-token-secret]").inner_text()
        with server.client() as c:
            c.headers["Authorization"] = f"Bearer {secret}"
            assert c.get("/vms").status_code == 200
        page.locator("tr[data-token=gamma-ci]").get_by_role("button", name="Revoke").click()
        expect(page.locator("#token-list .done")).to_contain_text("token gamma-ci revoked")
        assert "gamma-ci" not in {t["name"] for t in api(server, "GET", "/tokens").json()}
        with server.client() as c:
            c.headers["Authorization"] = f"Bearer {secret}"
            assert c.get("/vms").status_code == 401
        assert admin.errors == []
    finally:
        admin.close()


def test_a_members_browser_creates_in_its_project_and_nowhere_else(server, browser):
    member = Console(browser, server.url).login(server.member_token)
    page = member.page
    try:
        page.goto("/ui/new/vm")
        form = page.locator("#vm-create")
        options = form.locator("select[name=project] option").all_inner_texts()
        assert options == ["alpha"]
        # a form edited in the browser to name another project: the API refuses it as not existing
        page.evaluate("""() => { const s = document.querySelector('#vm-create select[name=project]');
                                 s.add(new Option('gamma', 'gamma')); s.value = 'gamma'; }""")
        form.get_by_label("Name").fill("sneaky")
        form.get_by_role("button", name="Plan…").click()
        expect(page.locator("#vm-create-result .error")).to_have_text("project 'gamma' does not exist")
        assert api(server, "GET", "/vms/sneaky").status_code == 404
        page.evaluate("() => { document.querySelector('#vm-create select[name=project]').value = 'alpha'; }")
        form.get_by_role("button", name="Plan…").click()
        page.get_by_role("button", name="Create and start").click()
        expect(page).to_have_url(f"{server.url}/ui/vms/sneaky")
        assert api(server, "GET", "/vms/sneaky").json()["project"] == "alpha"
        assert page.get_by_role("link", name="Settings").count() == 0  # admins' only
        assert member.errors == []
    finally:
        member.close()
