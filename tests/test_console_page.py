"""The VM page's Console tab through the ASGI app (issue 31; sim hosts, whose console is a small line terminal):
what the page carries (the tab, the vendored xterm.js, the websocket's path, never a ticket), a stopped VM's page
saying the console opens while it runs, and the browser's way in: the ticket asked for with the session and its
CSRF header, then the websocket under /ui (where the session cookie, path /ui, is sent) with the page's Origin.
In a real browser on a real guest: test_console_browser_real.py."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import WebSocketDenialResponse
from starlette.websockets import WebSocketDisconnect

from .test_console_sim import read_until
from .ui_serverkit import ALPHA, BETA, build, csrf

ORIGIN = {"Origin": "http://testserver"}


@pytest.fixture
def con(db):
    console = build(db)
    yield console
    console.o.close()


def ticket(client, vm: str, token: str):
    return client.post(f"/ui/vms/{vm}/console/ticket", headers={"X-CSRF-Token": csrf(token)})


def test_a_running_vms_page_has_the_console_tab_and_a_stopped_ones_says_it_opens_while_it_runs(con):
    alpha = con.client(ALPHA)
    page = alpha.get("/ui/vms/a1").text
    assert 'role="tab" href="#console"' in page
    for static in ("xterm-5.5.0.min.js", "xterm-addon-fit-0.10.0.min.js", "vmconsole.js", "xterm-5.5.0.css"):
        assert f"/ui/static/{static}" in page and alpha.get(f"/ui/static/{static}").status_code == 200
    assert 'data-console-state="open"' in page and "ticket" not in page.lower()  # the script asks for it
    stopped = alpha.get("/ui/vms/a3").text
    assert 'data-console-state="closed"' in stopped
    assert "The console opens while the VM runs (it is stopped now)." in stopped
    # the page's live refresh carries it too (swapped out of band: the terminal itself is not replaced)
    con.o.start_vm("a3")
    fragment = alpha.get("/ui/f/vms/a3", headers={"HX-Request": "true"}).text
    assert '<div id="vm-console-state">' in fragment and 'data-console-state="open"' in fragment


def test_the_browsers_ticket_needs_its_csrf_header_and_opens_the_socket_under_ui_with_its_cookie(con):
    alpha = con.client(ALPHA)
    refused = alpha.post("/ui/vms/a1/console/ticket")
    assert refused.status_code == 403 and '"ticket"' not in refused.text
    r = ticket(alpha, "a1", ALPHA)
    assert r.status_code == 200, r.text
    assert r.json()["websocket"] == "/ui/vms/a1/console"  # the path the page's script opens
    with alpha.websocket_connect("/ui/vms/a1/console", headers=ORIGIN) as ws:
        ws.send_text(json.dumps({"ticket": r.json()["ticket"], "mode": "write"}))
        assert json.loads(ws.receive_text())["type"] == "attached"
        ws.send_bytes(b"echo hello\r")
        assert "\r\nhello\r\n" in read_until(ws, "hello\r\n")
    again = ticket(alpha, "a1", ALPHA).json()["ticket"]
    with (
        pytest.raises((WebSocketDisconnect, WebSocketDenialResponse)),
        alpha.websocket_connect("/ui/vms/a1/console", headers={"Origin": "https://evil.example"}) as ws,
    ):
        ws.send_text(json.dumps({"ticket": again}))
        ws.receive()


def test_a_member_of_another_project_gets_no_ticket_nor_page(con):
    beta = con.client(BETA)
    assert beta.get("/ui/vms/a1").status_code == 404
    r = ticket(beta, "a1", BETA)
    assert r.status_code == 404 and '"ticket"' not in r.text
