"""No Python `None` reaches a console page (issue 33's audit): a cluster full of objects with missing parts (a
stopped VM on no host, a VM with no group, a provider network of no project, a migration and an operation still
waiting with no detail yet, a snapshot with no pause measured, a backup not written yet) is walked page by page,
following every link and every fragment the pages ask htmx for, as an admin and as a member; no answer shows
the word None. Dates show their zone and sizes their unit there too."""

from __future__ import annotations

import re
from collections import deque

import pytest

from vmplane.store import events, groupstore

from .ui_serverkit import ADMIN, ALPHA, build, text

LONG = "x" * 55 + "-longest"  # 63 characters: the longest name vmplane takes
assert len(LONG) == 63
NONE = re.compile(r"\bNone\b")
LINK = re.compile(r'(?:href|hx-get)="(/ui[^"#]*)"')
SORTED = re.compile(r"[?&]sort=[^&]*")  # a list sorted otherwise: the same rows, walked once
SKIP = ("/ui/stream", "/ui/static/", "/ui/logout", "/ui/login")


@pytest.fixture(scope="module")
def con(tmp_path_factory):
    from vmplane.store import Database

    from .stores import store_url

    db = Database(store_url(tmp_path_factory.mktemp("ui-none")))
    db.migrate()
    console = build(db)
    o, api = console.o, console.api(ADMIN)

    def ok(r):
        assert r.status_code < 300, r.text
        return r.json() if r.content else {}

    o.catalog.create_project(LONG, 8, 16 * 1024, 10)
    groupstore.create(o.db, "spread", "alpha", "anti-affinity", False, None)
    ok(api.post("/api/v1/networks", json={"name": "lan", "project": "alpha", "cidr": "10.10.0.0/24"}))
    ok(
        api.post(
            "/api/v1/networks", json={"name": "uplink", "cidr": "192.168.50.0/24", "provider": True, "shared": True}
        )
    )
    o.catalog.create_template("disk", "tiny-linux", disk="tiny-linux")
    o.pools.create("shared", "shared", cluster="c1")
    ok(api.post("/api/v1/vms", json={"name": LONG, "project": LONG, "offering": "f1", "template": "t", "start": True}))
    ok(
        api.post(
            "/api/v1/vms",
            json={"name": "d1", "project": "alpha", "offering": "f1", "template": "disk", "start": True}
            | {"pool": "shared", "group": "spread", "networks": ["lan", "uplink"]},
        )
    )
    ok(api.post("/api/v1/vms/d1/snapshots", json={"name": "before"}))
    o.backups.create_store("bk", "c1")
    o.backups.create("d1")
    with o.db.transaction() as conn:  # events that change no state (the audit saw "host sim3 → None")
        events.record(conn, "host", "h3", message="a domain vmplane does not know runs here", host="h3")
        events.record(conn, "vm", "a1", message="console opened", vm="a1", project_id=o.vm("a1").project_id)
    console.executor.hold = True  # a migration and a scale admitted, not yet run: no step detail, no progress
    ok(api.post("/api/v1/vms/a1/migrate", json={}))
    ok(api.post("/api/v1/vms/b1/scale", json={"offering": "f2"}))
    yield console
    console.executor.release()
    o.close()
    db.dispose()


def walk(client, start: str = "/ui", limit: int = 400) -> dict[str, str]:
    """Every console URL reachable from `start` by its links and htmx GETs (fragments asked as htmx asks)."""
    seen: dict[str, str] = {}
    queue = deque([start, "/ui/events?kind=vm", "/ui/f/events?pane=1", "/ui/f/tasks"])
    while queue and len(seen) < limit:
        url = queue.popleft().replace("&amp;", "&")
        if url in seen or url.startswith(SKIP) or SORTED.search(url):
            continue
        r = client.get(url, headers={"HX-Request": "true"} if url.startswith("/ui/f/") else None)
        assert r.status_code < 500, (url, r.status_code, r.text[:500])
        seen[url] = r.text
        queue.extend(LINK.findall(r.text))
    return seen


@pytest.mark.parametrize("token", [ADMIN, ALPHA], ids=["admin", "member"])
def test_no_page_or_fragment_shows_none_even_for_objects_with_missing_parts(con, token):
    pages = walk(con.client(token))
    assert len(pages) > (25 if token == ADMIN else 12), sorted(pages)  # the walk did reach the pages
    for must in ("/ui/vms/a3", "/ui/vms/d1", "/ui/networks/uplink", "/ui/f/vms/d1"):
        assert must in pages, sorted(pages)
    shown = {url: NONE.search(text(html)) for url, html in pages.items()}
    assert not [url for url, found in shown.items() if found], {
        url: text(pages[url])[max(0, m.start() - 150) : m.end() + 150] for url, m in shown.items() if m
    }


def test_missing_parts_read_as_words_dates_carry_their_zone_and_sizes_their_unit(con):
    admin = con.client(ADMIN)
    stopped = text(admin.get("/ui/vms/a3").text)
    assert "host none (placed when it starts)" in stopped and "placement group none" in stopped
    d1 = admin.get("/ui/vms/d1").text
    assert "placement group spread (anti-affinity)" in text(d1)
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC"
    for section in ("snapshots", "backups"):  # their Created column
        part = d1.split(f'data-section="{section}"')[1].split("</section>")[0]
        assert re.search(rf"<td>{stamp}</td>", part), part
    assert re.search(rf"<td>{stamp}</td></tr>", d1.split("<h2>Operations</h2>")[1])
    events = admin.get("/ui/events").text
    assert len(re.findall(rf"<td>{stamp}</td>", events)) >= 10
    assert not re.search(r"\d\d:\d\d:\d\d(?! UTC)", text(events))  # no time without its zone
    hosts = text(admin.get("/ui/hosts").text)
    assert re.search(r"\d+(\.\d)? GiB / 64 GiB", hosts) and "65536" not in hosts
