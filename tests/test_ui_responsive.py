"""The console on a phone (400 px), a tablet (800 px) and a desktop (1400 px), in headless Chromium (issue 33):
every page is screenshot at the three widths into test-artifacts/screenshots/ (responsive-<page>-<width>.png)
and none scrolls sideways (`scrollWidth <= clientWidth` of the document); tables scroll inside themselves.
Names are the longest vmplane takes (63 characters) and stay inside their cards on the overview.

One sim server (`vmplane up --driver sim`, SQLite) and one browser for the module; each page is loaded once
and looked at at every width (the viewport is resized: the layout is CSS only, no script measures it)."""

from __future__ import annotations

import pytest

from . import uikit
from .conftest import ADMIN_TOKEN, LiveServer
from .uikit import Console

expect = pytest.importorskip(
    "playwright.sync_api", reason="browser tests need Playwright for Python (pip install -e '.[test]')"
).expect

WIDTHS = (400, 800, 1400)  # a phone, a tablet, a desktop
PROJECT = "p" * 55 + "-project"  # 63 characters each: the longest name vmplane takes
HOST = "h" * 58 + "-host"
VM = "v" * 60 + "-vm"
NETWORK = "n" * 55 + "-network"
assert {len(PROJECT), len(HOST), len(VM), len(NETWORK)} == {63}

PAGES = [
    ("overview", "/ui"),
    ("hosts", "/ui/hosts"),
    ("host", f"/ui/hosts/{HOST}"),
    ("vms", "/ui/vms"),
    ("vm", f"/ui/vms/{VM}"),
    ("vm-stopped", "/ui/vms/idle"),
    ("projects", "/ui/projects"),
    ("project", f"/ui/projects/{PROJECT}"),
    ("networks", "/ui/networks"),
    ("network", f"/ui/networks/{NETWORK}"),
    ("events", "/ui/events"),
]
# the console's form pages (the lead's VM create form and the others): (screenshot name, path) each, checked
# at the three widths as the pages above are
FORM_PAGES: list[tuple[str, str]] = [
    ("vm-create", "/ui/new/vm"),
    ("project-create", "/ui/new/project"),
    ("volumes", "/ui/volumes"),
    ("tokens", "/ui/tokens"),
    ("settings", "/ui/settings"),
]

PAINTED = """() => new Promise(done => requestAnimationFrame(() => requestAnimationFrame(done)))"""  # laid out again
FITS = """() => ({scroll: document.documentElement.scrollWidth, client: document.documentElement.clientWidth})"""
# every name heading of a card (a project's or a host's) drawn inside its card: no overlap with the next one
INSIDE = """sel => [...document.querySelectorAll(sel)].flatMap(card => {
    const box = card.getBoundingClientRect();
    return [...card.querySelectorAll('h3 a')].flatMap(a => [...a.getClientRects()]
        .filter(r => r.left < box.left - 0.5 || r.right > box.right + 0.5)
        .map(r => `${a.textContent}: ${r.left}-${r.right} outside ${box.left}-${box.right}`));
})"""


@pytest.fixture(scope="module")
def browser():
    with uikit.chromium() as b:
        yield b


def api(server: LiveServer, method: str, path: str, **kw) -> dict:
    with server.client() as c:
        r = c.request(method, path, **kw)
        assert r.status_code < 300, f"{method} {path}: {r.status_code} {r.text}"
        return r.json() if r.content else {}


@pytest.fixture(scope="module")
def sim(tmp_path_factory, browser):
    """Three sim hosts and one more of a long name; project acme and a long-named project (its VMs: one of a
    long name, running with a NIC on a long-named network; one stopped, on no host)."""
    server = LiveServer(tmp_path_factory.mktemp("ui-responsive"), hosts=3).start()
    try:
        api(
            server,
            "POST",
            "/hosts",
            json={"name": HOST, "cluster": "cluster1", "cores": 32, "cpu_mhz": 2400, "memory_mib": 1 << 20},
        )
        api(server, "POST", "/offerings", json={"name": "small", "kind": "fixed", "vcpus": 1, "memory_mib": 1536})
        api(server, "POST", "/projects", json={"name": "acme", "vcpus": 8, "memory_mib": 16384, "vms": 5})
        api(server, "POST", "/projects", json={"name": PROJECT, "vcpus": 64, "memory_mib": 3 << 20, "vms": 50})
        api(server, "POST", "/networks", json={"name": NETWORK, "project": PROJECT, "cidr": "10.20.0.0/24"})
        for name, project, start, networks in ((VM, PROJECT, True, [NETWORK]), ("idle", PROJECT, False, [])):
            api(
                server,
                "POST",
                "/vms",
                json={"name": name, "project": project, "offering": "small", "template": "tiny-linux"}
                | {"start": start, "networks": networks},
            )
        api(
            server,
            "POST",
            "/vms",
            json={"name": "a1", "project": "acme", "offering": "small", "template": "tiny-linux"},
        )
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def admin(sim, browser):
    console = Console(browser, sim.url).login(ADMIN_TOKEN)
    yield console
    assert console.errors == []
    console.close()


def loaded(console: Console) -> None:
    """The live panes have their first content (their height counts in the screenshot)."""
    expect(console.page.locator("#tasks ul[data-tasks]")).to_be_visible()
    expect(console.page.locator("#events-pane ul[data-events]")).to_be_visible()


def at_every_width(console: Console, name: str) -> list[str]:
    """The loaded page at each width: a screenshot, and what scrolls sideways (none: an empty list)."""
    wrong = []
    if not console.page.locator('meta[name=viewport][content*="width=device-width"]').count():
        wrong.append(f"{name}: no viewport meta (a phone would lay it out 980 px wide and zoom out)")
    for w in WIDTHS:
        console.page.set_viewport_size({"width": w, "height": 900})
        console.page.evaluate(PAINTED)
        console.screenshot(f"responsive-{name}-{w}")
        fit = console.page.evaluate(FITS)
        if fit["scroll"] > fit["client"]:
            wrong.append(f"{name} at {w} px: the page is {fit['scroll']} px wide in {fit['client']}")
    return wrong


def test_every_page_fits_a_phone_a_tablet_and_a_desktop_without_sideways_scroll(sim, admin, browser):
    wrong = []
    for name, path in PAGES + FORM_PAGES:
        response = admin.page.goto(path)
        assert response is not None and response.status == 200, (path, response and response.status)
        loaded(admin)
        wrong += at_every_width(admin, name)
    anonymous = Console(browser, sim.url)
    anonymous.page.goto("/ui/login")
    expect(anonymous.page.get_by_label("Token")).to_be_visible()
    wrong += at_every_width(anonymous, "login")
    anonymous.close()
    assert wrong == [], "\n".join(wrong)
    assert len(list(uikit.SCREENSHOTS.glob("responsive-*.png"))) >= 3 * (len(PAGES) + len(FORM_PAGES) + 1)


def test_long_names_stay_inside_their_cards_on_the_overview_and_the_projects_page(admin):
    page = admin.page
    for path in ("/ui", "/ui/projects"):
        page.goto(path)
        expect(page.locator(f"[data-project={PROJECT}] h3 a")).to_have_text(PROJECT)  # the whole name, wrapped
        if path == "/ui":
            expect(page.locator(f"[data-host={HOST}] h3 a")).to_have_text(HOST)
        for w in WIDTHS:
            page.set_viewport_size({"width": w, "height": 900})
            assert page.evaluate(INSIDE, "[data-project], [data-host]") == [], (path, w)
