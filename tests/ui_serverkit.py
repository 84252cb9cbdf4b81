"""The web console under test in-process (server-side tests of pages, fragments and actions): a small
cluster of sim hosts, an admin and two project members, clients that hold a session cookie, and helpers
that read the rendered HTML (rows, bars, error slots, pagers). The browser tests have theirs in uikit.py."""

from __future__ import annotations

import html
import re
from dataclasses import dataclass

from fastapi.testclient import TestClient

from vmplane.core.model import Offering, OfferingKind
from vmplane.orchestrator import InlineExecutor, Orchestrator
from vmplane.server import create_app
from vmplane.ui.render import mib
from vmplane.ui.session import COOKIE, csrf_token

from .conftest import add_sim_hosts

ADMIN, ALPHA, BETA = "ui-admin-token", "ui-alpha-token", "ui-beta-token"
GIB = 1024


class HeldExecutor(InlineExecutor):
    """Runs work in the caller's thread, or keeps it while `hold` is set: a migration or a scale stays in
    flight (queued or admitted) until release()."""

    def __init__(self):
        self.hold = False
        self.queue: list = []

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[override]
        if self.hold:
            self.queue.append((fn, args, kwargs))
        else:
            fn(*args, **kwargs)

    def release(self) -> int:
        self.hold = False
        done = 0
        while self.queue:
            fn, args, kwargs = self.queue.pop(0)
            fn(*args, **kwargs)
            done += 1
        return done


@dataclass
class Console:
    o: Orchestrator
    app: object
    executor: HeldExecutor

    def client(self, token: str | None) -> TestClient:
        """A browser on this machine (loopback: its cookie may go over plain http), logged in with `token`
        through the form (None: logged out; not a valid token: a cookie that is no session); redirects are
        not followed."""
        c = TestClient(self.app, follow_redirects=False, client=("127.0.0.1", 50000))
        if token and c.post("/ui/login", data={"token": token}).status_code != 303:
            c.cookies.set(COOKIE, token)
        return c

    def api(self, token: str) -> TestClient:
        """The REST API as the same token (to compare the console's answers with the API's)."""
        return TestClient(self.app, headers={"Authorization": f"Bearer {token}"})


def build(db) -> Console:
    """Hosts h1-h3 (16 cores, 64 GiB); projects alpha (counts overhead) and beta; VMs a1 (1 vCPU) and a2
    (2 vCPUs) running and a3 stopped in alpha, b1 running in beta; scalable offerings f1, f2, big."""
    ex = HeldExecutor()
    o = Orchestrator(db, ex)
    o.load()
    o.catalog.create_zone("z1")
    o.catalog.create_cluster("c1", "z1")
    add_sim_hosts(o, 3, cores=16, memory_mib=64 * GIB)
    o.catalog.set_setting("enable.dynamic.scale.vm", "true", "zone", "z1")
    o.catalog.create_offering(Offering("f1", OfferingKind.fixed, vcpus=1, memory_mib=1024, dynamic_scaling=True))
    o.catalog.create_offering(Offering("f2", OfferingKind.fixed, vcpus=2, memory_mib=2048, dynamic_scaling=True))
    o.catalog.create_offering(Offering("big", OfferingKind.fixed, vcpus=8, memory_mib=4096, dynamic_scaling=True))
    o.catalog.create_template("t", "tiny-linux", dynamic_scaling=True)
    o.catalog.create_project("alpha", 8, 16 * GIB, 10, count_overhead=True)
    o.catalog.create_project("beta", 4, 8 * GIB, 5)
    o.create_vm("a1", "alpha", "f1", "t", start=True)
    o.create_vm("a2", "alpha", "f2", "t", start=True)
    o.create_vm("a3", "alpha", "f1", "t")
    o.create_vm("b1", "beta", "f1", "t", start=True)
    o.catalog.ensure_admin_token("admin", ADMIN)
    o.catalog.create_token("alpha-user", "member", "alpha", token=ALPHA)
    o.catalog.create_token("beta-user", "member", "beta", token=BETA)
    return Console(o, create_app(o), ex)


# -- reading the HTML ----------------------------------------------------------------------------
def text(markup: str) -> str:
    """The page's words: tags dropped, entities decoded, spaces squeezed."""
    words = re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", markup))).strip()
    return re.sub(r" ([:,.;])(?=\s|$)", r"\1", words)  # "a1 : h1" (a tag's edge) reads "a1: h1"


def rows(markup: str, attr: str = "data-vm") -> list[str]:
    """The list's rows in order, by their data attribute (data-vm, data-host, data-event, ...)."""
    return re.findall(rf'<tr {attr}="([^"]+)"', markup)


def row(markup: str, name: str, attr: str = "data-vm") -> str:
    """One table row's words."""
    m = re.search(rf'<tr {attr}="{re.escape(name)}">(.*?)</tr>', markup, re.S)
    assert m, f"no row {attr}={name}"
    return text(m.group(1))


def block(markup: str, attr: str, name: str) -> str:
    """The markup of a <div {attr}="name"> (a host's or a project's bars), up to the next one."""
    m = re.search(
        rf'<div class="\w+" {attr}="{re.escape(name)}">(.*?)(?=<div class="\w+" {attr}=|</section>|\Z)', markup, re.S
    )
    assert m, f"no block {attr}={name}"
    return m.group(1)


def bars(markup: str) -> dict[str, dict]:
    """The bars of a block: label -> {used, total, pct, overhead} as rendered (title and label agree). A bar in
    MiB is keyed "memory (MiB)": its title is exact in MiB, its label in human units (mib: 3 GiB)."""
    out = {}
    for title, label in re.findall(
        r'<div class="bar" title="([^"]*)">\s*<div class="bar-label"><span>[^<]*</span>'
        r"<span>([^<]*)</span>",
        markup,
    ):
        m = re.match(r"(.+?): (-?\d+) of (\d+)( MiB)?(?: \((\d+)(?: MiB)? overhead\))?$", html.unescape(title))
        assert m, title
        lm = re.match(r"(.+?) / (.+?) · ([\d.]+)%", html.unescape(label))
        assert lm, label
        used, total = (int(m.group(2)), int(m.group(3)))
        said = (mib(used), mib(total)) if m.group(4) else (str(used), str(total))
        assert (lm.group(1), lm.group(2)) == said  # the label says what the title says
        out[m.group(1) + (" (MiB)" if m.group(4) else "")] = {
            "used": int(m.group(2)),
            "total": int(m.group(3)),
            "pct": float(lm.group(3)),
            "overhead": int(m.group(5) or 0),
        }
    return out


def error(markup: str) -> dict:
    """The error slot: {error, field, message} as rendered (p.error)."""
    m = re.search(r'<p class="error" role="alert"([^>]*)>(.*?)</p>', markup, re.S)
    assert m, f"no error slot in {markup[:300]}"
    attrs = dict(re.findall(r'data-([a-z]+)="([^"]*)"', m.group(1)))
    return {"error": attrs.get("error"), "field": attrs.get("field"), "message": html.unescape(m.group(2)).strip()}


def pager(markup: str) -> dict:
    """The pager: the range it shows, its total and the offsets of its previous and next links."""
    m = re.search(r'<nav class="pager"[^>]*>(.*?)</nav>', markup, re.S)
    assert m, "no pager"
    nav = html.unescape(m.group(1))
    shown = re.search(r"<span>(\d+)–(\d+) of (\d+)</span>", nav)
    links = {label: url for url, label in re.findall(r'hx-get="([^"]+)"[^>]*>(‹ Previous|Next ›)</a>', nav)}

    def offset(label):
        if label not in links:
            return None
        found = re.search(r"[?&]offset=(\d+)", links[label])
        return int(found.group(1)) if found else 0

    return {
        "first": int(shown.group(1)),
        "last": int(shown.group(2)),
        "total": int(shown.group(3)),
        "prev": offset("‹ Previous"),
        "next": offset("Next ›"),
        "next_url": links.get("Next ›"),
    }


def csrf(token: str) -> str:
    return csrf_token(token)
