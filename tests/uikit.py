"""Helpers for the web console's browser tests: Debian's headless Chromium driven by Playwright (sync API).

Never a browser download (`playwright install`): Playwright drives /usr/bin/chromium through
`executable_path`. Screenshots go to test-artifacts/screenshots/ at the repo root (not committed), or to
$VMPLANE_SCREENSHOTS."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parent.parent
SCREENSHOTS = Path(os.environ.get("VMPLANE_SCREENSHOTS") or ROOT / "test-artifacts" / "screenshots")
SLOW_MS = 240_000  # TCG guests: a boot, a live migration, a DIMM hotplug


def require_chromium() -> None:
    path = shutil.which("chromium") or (CHROMIUM if os.access(CHROMIUM, os.X_OK) else None)
    if path is None:
        pytest.skip("browser test skipped: no chromium (Debian's `chromium` package; scripts/setup.sh --test)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("browser test skipped: Playwright for Python is not installed (pip install -e '.[test]')")


@contextmanager
def chromium():
    """Headless Chromium for a module (root needs --no-sandbox: Chromium's sandbox refuses root)."""
    from playwright.sync_api import expect, sync_playwright

    require_chromium()
    expect.set_options(timeout=15_000)
    args = ["--no-sandbox"] if os.geteuid() == 0 else []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium") or CHROMIUM, args=args)
        try:
            yield browser
        finally:
            browser.close()


class Console:
    """One logged-in browser session (its own context: cookies apart) on a console at `url`."""

    def __init__(self, browser, url: str):
        self.url = url
        self.context = browser.new_context(base_url=url, viewport={"width": 1280, "height": 800})
        self.page = self.context.new_page()
        self.errors: list[str] = []  # script errors on any page: a console must have none
        self.page.on("pageerror", lambda exc: self.errors.append(str(exc)))

    def login(self, token: str) -> Console:
        """Through the form, as a person does: /ui redirects to the login page; the token is posted."""
        from playwright.sync_api import expect

        self.page.goto("/ui")
        expect(self.page).to_have_url(f"{self.url}/ui/login")
        self.page.get_by_label("Token").fill(token)
        self.page.get_by_role("button", name="Log in").click()
        expect(self.page).to_have_url(f"{self.url}/ui")
        expect(self.page.locator("main h1")).to_have_text("Overview")
        return self

    def close(self) -> None:
        self.context.close()

    # -- no reload ---------------------------------------------------------------------------
    def mark(self) -> None:
        """A marker in the page's window: a reload or a navigation loses it."""
        self.page.evaluate("window.__marker = 1")

    def assert_not_reloaded(self) -> None:
        assert self.page.evaluate("window.__marker") == 1, "the page was reloaded or navigated away"

    # -- what a live pane showed ------------------------------------------------------------
    def record(self, selector: str) -> None:
        """Keep every content `selector` had from now on (server-sent swaps included)."""
        self.page.evaluate(
            """sel => {
            window.__seen = window.__seen || {};
            const el = document.querySelector(sel), seen = window.__seen[sel] = [el.innerHTML];
            new MutationObserver(() => seen.push(el.innerHTML)).observe(el, {childList: true, subtree: true,
                                                                              characterData: true, attributes: true});
        }""",
            selector,
        )

    def recorded(self, selector: str) -> list[str]:
        return self.page.evaluate("sel => (window.__seen || {})[sel] || []", selector)

    # -- by URL ---------------------------------------------------------------------------------
    def fetch(self, path: str, htmx: bool = False):
        """A GET with this session's cookie, as a typed URL (or, `htmx`, as htmx asks for a fragment)."""
        return self.context.request.get(path, headers={"HX-Request": "true"} if htmx else None, max_redirects=0)

    def screenshot(self, name: str) -> Path:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        path = SCREENSHOTS / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path
