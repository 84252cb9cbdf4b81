"""The console's network pages in Debian's headless Chromium (Playwright, never a browser download): a VM's
NICs and the networks list seen by an admin at 1280 px on `vmplane up --driver sim`, with the screenshots
kept in test-artifacts/screenshots/ (network-*.png). The pages' content is checked in test_ui_networks.py;
here: that a person gets to them from the nav and from a VM, with no script error."""

from __future__ import annotations

import pytest

from . import uikit
from .conftest import ADMIN_TOKEN, LiveServer
from .uikit import Console

expect = pytest.importorskip(
    "playwright.sync_api", reason="browser tests need Playwright for Python (pip install -e '.[test]')"
).expect


def api(server: LiveServer, method: str, path: str, **kw) -> dict:
    with server.client() as c:
        r = c.request(method, path, **kw)
        assert r.status_code < 300, f"{method} {path}: {r.status_code} {r.text}"
        return r.json() if r.content else {}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Two sim hosts; project shop with network shop-net, a group `web` (tcp 80 in) and VMs web1 (running,
    groups default and web) and web2 (stopped); a shared provider network `public` web1 has a second NIC on."""
    live = LiveServer(tmp_path_factory.mktemp("ui-net-browser"), hosts=2).start()
    try:
        api(live, "POST", "/offerings", json={"name": "small", "kind": "fixed", "vcpus": 1, "memory_mib": 1024})
        api(live, "POST", "/projects", json={"name": "shop", "vcpus": 8, "memory_mib": 16384, "vms": 5})
        api(live, "POST", "/networks", json={"name": "shop-net", "project": "shop", "cidr": "10.10.0.0/24"})
        api(
            live, "POST", "/networks", json={"name": "public", "provider": True, "shared": True, "cidr": "192.0.2.0/26"}
        )
        api(live, "POST", "/secgroups", json={"name": "web", "project": "shop"})
        api(live, "POST", "/secgroups/shop/web/rules", json={"direction": "in", "proto": "tcp", "port": 80,
                                                              "from_cidr": "0.0.0.0/0"})  # fmt: skip
        for name, networks, groups, start in (
            ("web1", ["shop-net", "public"], ["default", "web"], True),
            ("web2", ["shop-net:10.10.0.20"], [], False),
        ):
            body = {"name": name, "project": "shop", "offering": "small", "template": "tiny-linux", "start": start}
            api(live, "POST", "/vms", json={**body, "networks": networks, "secgroups": groups})
        yield live
    finally:
        live.stop()


def test_an_admin_reaches_a_vms_nics_and_the_networks_from_the_nav_and_screenshots_them(server):
    with uikit.chromium() as browser:
        admin = Console(browser, server.url).login(ADMIN_TOKEN)
        page = admin.page
        page.goto("/ui/vms/web1")
        nics = page.locator("#vm-network tr[data-nic]")
        expect(nics).to_have_count(2)
        expect(nics.first).to_contain_text("shop-net")
        expect(nics.first).to_contain_text("default, web")
        expect(nics.nth(1)).to_contain_text("shared")
        expect(page.locator("#tasks ul[data-tasks]")).to_be_visible()
        shots = [admin.screenshot("network-vm")]

        page.get_by_role("link", name="Networks", exact=True).click()
        expect(page.locator("main h1")).to_have_text("Networks")
        expect(page.locator("#network-list tr[data-network]")).to_have_count(2)
        shots.append(admin.screenshot("network-list"))

        page.locator("#network-list").get_by_role("link", name="shop-net", exact=True).click()
        expect(page.locator("main h1")).to_contain_text("Network shop-net")
        expect(page.locator("tr[data-nic]")).to_have_count(2)
        shots.append(admin.screenshot("network-detail"))

        page.goto("/ui/projects/shop")
        expect(page.locator("[data-section=networks] tr[data-secgroup]")).to_have_count(2)
        shots.append(admin.screenshot("network-project"))
        host = api(server, "GET", "/vms/web1")["host"]
        page.goto(f"/ui/hosts/{host}")
        expect(page.locator("[data-section=networks] tr[data-network]")).to_have_count(2)
        shots.append(admin.screenshot("network-host"))

        page.goto("/ui/vms/web1")  # the NICs follow the VM's page live (swapped out of band with it)
        expect(page.locator("#tasks ul[data-tasks]")).to_be_visible()
        admin.mark()
        page.evaluate("document.querySelector('#vm-network section').dataset.before = '1'")
        api(server, "POST", "/vms/web1/stop")
        expect(page.locator("#vm-detail h1")).to_contain_text("stopped")
        expect(page.locator("#vm-network section[data-before]")).to_have_count(0)  # replaced by the fresh one
        expect(page.locator("#vm-network")).to_have_count(1)
        expect(page.locator("#vm-network tr[data-nic]")).to_have_count(2)
        admin.assert_not_reloaded()
        assert admin.errors == []
        admin.close()
    assert all(p.stat().st_size > 5000 for p in shots)
