"""The serial console over a websocket on sim hosts (issue 31; the sim's console is a small line terminal:
drivers/simconsole.py): a ticket opens it once; what is typed comes back; a second viewer is read-only and
sees the same output; the keyboard is taken over explicitly; tickets are refused when replayed, expired,
issued for another VM or another caller, or shown with a wrong Origin; a member reaches only its project's
VMs; a revoked token's session closes; a live migration re-attaches the session. Real guests:
test_console_real.py."""

from __future__ import annotations

import datetime as dt
import json
import time

import pytest
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from vmplane.core.model import Offering, OfferingKind
from vmplane.plane import metrics
from vmplane.server import create_app
from vmplane.store import consoletickets as T
from vmplane.store.catalog import hash_token
from vmplane.store.schema import utcnow

from .conftest import ADMIN_TOKEN, add_sim_hosts

MEMBER, OTHER = "member-token", "other-token"
URL = "/api/v1/vms/{}/console"


@pytest.fixture
def o(orch):
    add_sim_hosts(orch, 2)
    orch.catalog.create_template("t", "tiny-linux")
    orch.catalog.create_offering(Offering("f", OfferingKind.fixed, vcpus=1, memory_mib=256))
    for project in ("p", "q"):
        orch.catalog.create_project(project, 8, 8192, 8)
    orch.catalog.ensure_admin_token("admin", ADMIN_TOKEN)
    orch.catalog.create_token("m", "member", "p", token=MEMBER)
    orch.catalog.create_token("o", "member", "q", token=OTHER)
    orch.create_vm("v1", "p", "f", "t", start=True)
    orch.create_vm("v2", "p", "f", "t", start=True)
    return orch


@pytest.fixture
def client(o):
    with TestClient(create_app(o)) as c:
        yield c


def auth(token: str = ADMIN_TOKEN) -> dict:
    return {"Authorization": f"Bearer {token}"}


def ticket(client, vm: str = "v1", token: str = ADMIN_TOKEN) -> str:
    r = client.post(f"/api/v1/vms/{vm}/console/ticket", headers=auth(token))
    assert r.status_code == 200, r.text
    return r.json()["ticket"]


def read_until(ws, text: str, limit: int = 50) -> str:
    """Guest output (binary messages) until `text` shows; notices (text) are skipped."""
    seen = ""
    for _ in range(limit):
        message = ws.receive()
        if message.get("bytes"):
            seen += message["bytes"].decode()
            if text in seen:
                return seen
    raise AssertionError(f"{text!r} never came: {seen!r}")


def notice(ws) -> dict:
    while True:
        message = ws.receive()
        if message.get("text"):
            return json.loads(message["text"])


def opened(client, vm="v1", token=ADMIN_TOKEN, mode="write", headers=None):
    ws = client.websocket_connect(URL.format(vm), headers={**auth(token), **(headers or {})})
    socket = ws.__enter__()
    socket.send_text(json.dumps({"ticket": ticket(client, vm, token), "mode": mode}))
    return ws, socket


def closed(ws) -> tuple[int, str]:
    """How the server closed the websocket (messages before it skipped)."""
    while True:
        try:
            message = ws.receive()
        except WebSocketDisconnect as exc:
            return exc.code, exc.reason
        if message["type"] == "websocket.close":
            return message["code"], message.get("reason", "")


def refused(client, vm: str, first: dict, token: str = ADMIN_TOKEN, headers=None) -> str:
    """The close reason of a websocket whose ticket is refused."""
    with client.websocket_connect(URL.format(vm), headers={**auth(token), **(headers or {})}) as ws:
        ws.send_text(json.dumps(first))
        code, reason = closed(ws)
    assert code == 4403, (code, reason)
    return reason


def test_a_ticket_opens_the_console_and_what_is_typed_comes_back(client):
    ws, s = opened(client)
    try:
        assert notice(s) == {
            "type": "attached",
            "mode": "write",
            "host": client.app.state.orchestrator.vm("v1").host.name,
        }
        s.send_bytes(b"echo hello\r")
        assert "\r\nhello\r\n" in read_until(s, "hello\r\n# ")
    finally:
        ws.__exit__(None, None, None)


def test_a_second_viewer_is_read_only_sees_the_same_and_takes_the_keyboard_when_it_asks(client):
    w, writer = opened(client)
    r, reader = opened(client, mode="write")  # the keyboard is held: it is read-only
    try:
        assert notice(writer)["mode"] == "write" and notice(reader)["mode"] == "read"
        writer.send_bytes(b"echo both\r")
        read_until(writer, "both\r\n")
        read_until(reader, "both\r\n")  # the same output
        reader.send_bytes(b"echo not-sent\r")
        assert "read-only" in notice(reader)["text"]
        reader.send_text(json.dumps({"type": "take"}))
        assert notice(reader) == {"type": "mode", "mode": "write", "text": "you hold the keyboard"}
        assert notice(writer) == {"type": "mode", "mode": "read", "text": "the keyboard was taken by admin"}
        reader.send_bytes(b"echo mine\r")
        read_until(writer, "mine\r\n")
    finally:
        r.__exit__(None, None, None)
        w.__exit__(None, None, None)


def test_tickets_are_refused_when_replayed_expired_for_another_vm_or_another_caller(client, o):
    used = ticket(client)
    with client.websocket_connect(URL.format("v1"), headers=auth()) as ws:
        ws.send_text(json.dumps({"ticket": used}))
        assert notice(ws)["type"] == "attached"
    before = metrics.CONSOLE_TICKETS_REFUSED.labels("replayed")._value.get()
    assert refused(client, "v1", {"ticket": used}) == "ticket refused: replayed"
    assert metrics.CONSOLE_TICKETS_REFUSED.labels("replayed")._value.get() == before + 1
    with o.db.transaction() as conn:
        old = T.issue(conn, o.vm("v1").id, hash_token(ADMIN_TOKEN), None, now=utcnow() - dt.timedelta(seconds=16))
    assert refused(client, "v1", {"ticket": old}) == "ticket refused: expired"
    assert refused(client, "v2", {"ticket": ticket(client, "v1")}) == "ticket refused: other-vm"
    assert refused(client, "v1", {"ticket": ticket(client, "v1", MEMBER)}) == "ticket refused: other-caller"
    assert refused(client, "v1", {"ticket": "made-up"}) == "ticket refused: unknown"
    assert refused(client, "v1", {"no": "ticket"}).startswith("ticket refused: the first message")


def test_a_browsers_wrong_origin_is_refused_before_the_upgrade(client):
    from starlette.testclient import WebSocketDenialResponse

    evil = {**auth(), "Origin": "https://evil.example"}
    with (
        pytest.raises((WebSocketDisconnect, WebSocketDenialResponse)),
        client.websocket_connect(URL.format("v1"), headers=evil),
    ):
        pass
    ws, s = opened(client, headers={"Origin": "http://testserver"})  # its own origin is fine
    try:
        assert notice(s)["type"] == "attached"
    finally:
        ws.__exit__(None, None, None)


def test_a_member_reaches_only_its_projects_vms(client):
    assert client.post("/api/v1/vms/v1/console/ticket", headers=auth(OTHER)).status_code == 404
    ws, s = opened(client, token=MEMBER)
    try:
        assert notice(s)["type"] == "attached"
    finally:
        ws.__exit__(None, None, None)


def test_a_stopped_vm_has_no_console_to_open(client, o):
    o.stop_vm("v2")
    r = client.post("/api/v1/vms/v2/console/ticket", headers=auth())
    assert r.status_code == 409 and r.json()["field"] == "state", r.json()


def test_a_revoked_tokens_session_closes(client, o):
    ws, s = opened(client, token=MEMBER)
    try:
        assert notice(s)["type"] == "attached"
        o.catalog.revoke_token("m")
        o.consoles.watch()  # (the watch loop's pass: every 0.25 s in a running control plane)
        assert closed(s) == (4401, "its token was revoked")
    finally:
        ws.__exit__(None, None, None)


def test_a_live_migration_re_attaches_the_session_on_the_new_host(client, o):
    ws, s = opened(client)
    try:
        source = notice(s)["host"]
        target = "h2" if source == "h1" else "h1"
        o.migrator.migrate("v1", target)
        assert o.vm("v1").host.name == target
        text = read_until(s, "re-attached")
        assert f"on {target} (it was on {source})" in text
        deadline = time.monotonic() + 10
        s.send_bytes(b"echo moved\r")
        read_until(s, "moved\r\n")
        assert time.monotonic() < deadline
    finally:
        ws.__exit__(None, None, None)
