"""A real guest's serial console in the web console, in Debian's headless Chromium driven by Playwright (issue
31's acceptance; never a browser download): an admin logs in, opens a running tiny-linux VM's console (xterm.js
on the VM page's Console tab) and reads `hello` back after typing `echo hello`; a member of the VM's project, in
a second browser, opens the same console read-only and sees the same output, then takes the keyboard (the admin
is told); a member of another project is refused (the page and the ticket: 404). The ticket travels in the
websocket's first message, never in its URL. Screenshots: test-artifacts/screenshots/console-*.png.

Named *_real.py: it boots a real QEMU guest (TCG), so it runs in the real-guests tier (conftest's boots_guests)."""

from __future__ import annotations

import json
import re

import pytest

from . import uikit
from .conftest import ADMIN_TOKEN, LiveServer
from .realguest import guest, libvirt_cluster, run_json
from .test_ui_browser import api, member_token
from .uikit import SLOW_MS, Console

expect = pytest.importorskip(
    "playwright.sync_api", reason="browser tests need Playwright for Python (pip install -e '.[test]')"
).expect

VM = "c1"


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """A libvirt cluster (project p) with one running tiny-linux guest, c1; members of p and of project q."""
    server = libvirt_cluster(tmp_path_factory.mktemp("console-browser"))
    try:
        run_json(server, "offering", "create", "one", "--kind", "fixed", "--vcpus", "1", "--memory", "256MiB")
        run_json(server, "vm", "create", VM, "--project", "p", "--offering", "one", "--template", "tiny-linux",
                 "--start")  # fmt: skip
        guest(server, VM, "true", timeout=300)  # booted: its init runs (the console's shell comes at its end)
        api(server, "POST", "/projects", json={"name": "q", "vcpus": 2, "memory_mib": 2048, "vms": 2})
        server.member_token = member_token(server, "p-member", "p")
        server.other_token = member_token(server, "q-member", "q")
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser():
    with uikit.chromium() as b:
        yield b


class Viewer:
    """A logged-in browser on a VM's Console tab; the websockets it opened are kept (their URLs, first frames)."""

    def __init__(self, browser, live: LiveServer, token: str):
        self.console = Console(browser, live.url).login(token)
        self.page = self.console.page
        self.sockets: list[dict] = []
        self.page.on("websocket", self._watch)

    def _watch(self, ws) -> None:
        seen: dict = {"url": ws.url, "sent": []}
        self.sockets.append(seen)
        ws.on("framesent", lambda payload: seen["sent"].append(payload))

    def open_tab(self, vm: str = VM) -> None:
        self.page.goto(f"/ui/vms/{vm}")
        self.page.get_by_role("tab", name="Console").click()
        expect(self.page.locator("#vm-console")).to_be_visible()

    def open(self, button: str, state: str) -> None:
        self.page.get_by_role("button", name=button, exact=True).click()
        expect(self.page.locator("#vm-console")).to_have_attribute("data-console", state, timeout=60_000)

    @property
    def status(self):
        return self.page.locator("[data-console-status]")

    def line(self, text: str):
        """The terminal's rows (what the person sees, xterm.js's DOM) that read exactly `text`."""
        return self.page.locator(".xterm-rows > div").filter(has_text=re.compile(rf"^\s*{re.escape(text)}\s*$"))

    def type(self, keys: str) -> None:
        self.page.locator(".xterm-screen").click()  # the terminal has the keyboard focus
        self.page.keyboard.type(keys)
        self.page.keyboard.press("Enter")

    def screenshot(self, name: str):
        return self.console.screenshot(f"console-{name}")


def test_a_browser_types_in_a_real_guests_console_a_second_one_watches_read_only_then_takes_the_keyboard(live, browser):
    admin = Viewer(browser, live, ADMIN_TOKEN)
    admin.open_tab()
    expect(admin.page.locator("[data-console-state]")).to_have_attribute("data-console-state", "open")
    admin.open("Open console", "write")
    expect(admin.status).to_contain_text("keyboard")
    admin.type("echo hello")
    expect(admin.line("hello")).to_have_count(1, timeout=SLOW_MS)  # the guest's answer (its tty does not echo)
    shots = [admin.screenshot("writer")]

    # the ticket went in the first message of a websocket on this page's own host, never in its URL
    (socket,) = admin.sockets
    assert socket["url"] == f"{live.url.replace('http', 'ws', 1)}/ui/vms/{VM}/console", socket["url"]
    first = json.loads(socket["sent"][0])
    assert set(first) == {"ticket", "mode"} and first["mode"] == "write" and first["ticket"] not in socket["url"]

    # a member of the VM's project, in another browser, opens it read-only and sees the same output
    reader = Viewer(browser, live, live.member_token)
    reader.open_tab()
    reader.open("Open read-only", "read")
    expect(reader.status).to_contain_text("read-only")
    expect(reader.page.get_by_role("button", name="Take the keyboard")).to_be_visible()
    admin.type("echo seen-by-both")
    expect(admin.line("seen-by-both")).to_have_count(1, timeout=SLOW_MS)
    expect(reader.line("seen-by-both")).to_have_count(1, timeout=SLOW_MS)
    shots.append(reader.screenshot("reader"))

    # it takes the keyboard: the admin is told and is read-only; what the member types comes back to both
    reader.page.get_by_role("button", name="Take the keyboard").click()
    expect(reader.page.locator("#vm-console")).to_have_attribute("data-console", "write")
    expect(admin.page.locator("#vm-console")).to_have_attribute("data-console", "read")
    expect(admin.status).to_contain_text("the keyboard was taken")
    reader.type("echo typed-by-the-member")
    expect(reader.line("typed-by-the-member")).to_have_count(1, timeout=SLOW_MS)
    expect(admin.line("typed-by-the-member")).to_have_count(1, timeout=SLOW_MS)
    shots.append(admin.screenshot("taken"))

    # the terminal follows the window's size (xterm.js's fit addon)
    screen = admin.page.locator(".xterm-screen")
    wide = screen.bounding_box()["width"]
    # (below 1000 px the live panes go under the page: the main column is the window's width less its margins)
    admin.page.set_viewport_size({"width": 700, "height": 700})
    admin.page.wait_for_function(
        "w => document.querySelector('.xterm-screen').getBoundingClientRect().width < w - 100", arg=wide
    )

    reader.page.get_by_role("button", name="Close", exact=True).click()
    expect(reader.status).to_contain_text("closed: closed by its viewer")
    expect(reader.page.get_by_role("button", name="Open console")).to_be_enabled()
    assert admin.console.errors == reader.console.errors == []
    admin.console.close()
    reader.console.close()
    assert all(p.stat().st_size > 5000 for p in shots)


def test_a_member_of_another_project_is_refused(live, browser):
    other = Viewer(browser, live, live.other_token)
    response = other.page.goto(f"/ui/vms/{VM}")
    assert response.status == 404
    expect(other.page.locator("main p.error")).to_have_text(f"vm '{VM}' does not exist")
    expect(other.page.locator("#vm-console")).to_have_count(0)
    other.screenshot("other-project-refused")
    # nor does a ticket come to it by asking directly, with its own valid CSRF token
    other.page.goto("/ui")
    csrf = other.page.evaluate("JSON.parse(document.body.getAttribute('hx-headers'))['X-CSRF-Token']")
    r = other.console.context.request.post(f"/ui/vms/{VM}/console/ticket", headers={"X-CSRF-Token": csrf})
    assert r.status == 404, (r.status, r.text())
    assert "ticket" not in r.text()
    assert other.console.errors == []
    other.console.close()


def test_a_stopped_vms_page_says_its_console_opens_while_it_runs_with_its_session_open_or_not(live, browser):
    admin = Viewer(browser, live, ADMIN_TOKEN)
    admin.open_tab()
    admin.open("Open console", "write")
    run_json(live, "vm", "stop", VM, "--force")
    state = admin.page.locator("[data-console-state]")  # swapped in live with the page's details
    expect(state).to_have_attribute("data-console-state", "closed", timeout=SLOW_MS)
    expect(state).to_contain_text("The console opens while the VM runs (it is stopped now).")
    expect(admin.status).to_contain_text("keyboard · The console opens while the VM runs")  # the open one waits
    admin.screenshot("stopped")
    admin.page.get_by_role("button", name="Close", exact=True).click()
    expect(admin.status).to_have_text("closed: closed by its viewer")
    expect(admin.page.get_by_role("button", name="Open console")).to_be_disabled()
    expect(admin.page.get_by_role("button", name="Open read-only")).to_be_disabled()
    assert admin.console.errors == []
    admin.console.close()
