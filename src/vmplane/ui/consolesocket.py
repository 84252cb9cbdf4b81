"""A VM's serial console over a websocket (issue 31): `GET /api/v1/vms/{name}/console` (served here, in the
console's layer: the CLI authenticates with its bearer header) and the same at `/ui/vms/{name}/console` (a
browser, with its session cookie, whose path is /ui), and the
web console's ticket route `POST /ui/vms/{name}/console/ticket` (its session and CSRF token; the ticket is
bound to the session too). Tickets: api/routers/consoles.py, store/consoletickets.py, core/consoles.py.

The ticket is sent in the websocket's first message, `{"ticket": ..., "mode": "write"|"read"}`, never in a URL
(nor logged). The upgrade is refused (HTTP 403) when a browser's `Origin` is not the console's own. Then:
guest output as binary messages; keys as binary messages (the keyboard's holder only); `{"type": "take"}`
takes the keyboard; the server's notices are JSON text (`attached`, `mode`, `notice`). Close codes: 4403 the
ticket refused (its reason), 4409 the console can not be opened, 4401 access lost, 4408 a limit passed, 1001
shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from anyio import to_thread
from fastapi import APIRouter, Request, WebSocket, WebSocketDisconnect

from vmplane.api.routers.consoles import ConsoleTicketOut, bearer_hash, issue_ticket
from vmplane.controllers.consoles import Session
from vmplane.core import consoles as rules
from vmplane.core.driver import DriverError
from vmplane.core.errors import VmplaneError
from vmplane.orchestrator import Orchestrator
from vmplane.plane import metrics
from vmplane.store import consoletickets as tickets
from vmplane.ui.consolesessions import hash_session, session_caller
from vmplane.ui.session import COOKIE, Actor, session_id

router = APIRouter(include_in_schema=False)
FIRST_MESSAGE_S = 15.0  # the ticket must come this soon after the upgrade


@router.post("/ui/vms/{name}/console/ticket", response_model=ConsoleTicketOut)
def browser_ticket(name: str, request: Request, who: Actor):
    """A ticket for the console's page: bound to this browser's session as well as its token."""
    orch: Orchestrator = request.app.state.orchestrator
    who.check_project(orch.vm(name).project_id, "vm", name)
    sid = session_id(request) or ""
    row = session_caller(orch.db, sid)
    out = issue_ticket(orch, name, row["token_hash"] if row else "", hash_session(sid))
    out.websocket = f"/ui/vms/{name}/console"  # (the session cookie's path is /ui: it never goes to /api/v1)
    return out


def _presenter(orch: Orchestrator, ws: WebSocket, vm_id: int) -> tuple[rules.Presenter, Any]:
    """Who presents the ticket (its bearer header: the CLI; its session cookie: a browser), and a check of
    whether that caller may still see the VM (None, or why not) for the session's watch."""
    from_header, sid = bearer_hash(ws.headers), ws.cookies.get(COOKIE) or None
    token_hash = from_header
    if token_hash is None and sid is not None:
        row = session_caller(orch.db, sid)
        token_hash = row["token_hash"] if row else None
    presenter = rules.Presenter(vm_id, token_hash, hash_session(sid) if sid and from_header is None else None)

    def still_allowed(project_id: int) -> str | None:
        if presenter.session_hash is not None and session_caller(orch.db, sid or "") is None:
            return "the browser's session ended (logged out, expired or its token revoked)"
        found = orch.catalog.token_by_hash(token_hash or "")
        if found is None:
            return "its token was revoked"
        _name, role, project = found
        if role != "admin" and project != project_id:
            return "its token no longer reaches this VM's project"
        return None

    return presenter, still_allowed


@router.websocket("/api/v1/vms/{name}/console")
@router.websocket("/ui/vms/{name}/console")
async def console_socket(ws: WebSocket, name: str):
    orch: Orchestrator = ws.app.state.orchestrator
    host = ws.headers.get("host")
    if rules.origin_refusal(ws.headers.get("origin"), host, ws.url.scheme) is not None:
        metrics.CONSOLE_TICKETS_REFUSED.labels("origin").inc()
        await ws.close(4403, "ticket refused: origin")  # before the upgrade: an HTTP 403
        return
    await ws.accept()
    try:
        first = json.loads(await asyncio.wait_for(ws.receive_text(), FIRST_MESSAGE_S))
        ticket, mode = str(first["ticket"]), str(first.get("mode", "write"))
    except (TimeoutError, ValueError, KeyError, TypeError, WebSocketDisconnect):
        metrics.CONSOLE_TICKETS_REFUSED.labels("unknown").inc()
        await _close(ws, 4403, 'ticket refused: the first message must be {"ticket": ...}')
        return
    try:
        vm = await to_thread.run_sync(orch.vm, name)
    except VmplaneError:
        metrics.CONSOLE_TICKETS_REFUSED.labels("other-vm").inc()
        await _close(ws, 4403, "ticket refused: other-vm")
        return
    presenter, allowed = _presenter(orch, ws, vm.id)
    why = await to_thread.run_sync(_redeem, orch, ticket, presenter)
    if why is not None:
        metrics.CONSOLE_TICKETS_REFUSED.labels(why).inc()
        await _close(ws, 4403, f"ticket refused: {why}")
        return
    found = await to_thread.run_sync(orch.catalog.token_by_hash, presenter.token_hash or "")
    who = found[0] if found else "?"  # the token's name (a browser's session acts as its token), for events
    await _serve(ws, orch, name, who, mode if mode in rules.MODES else "read", lambda: allowed(vm.project_id))


def _redeem(orch: Orchestrator, ticket: str, presenter: rules.Presenter) -> str | None:
    with orch.db.transaction() as conn:
        return tickets.redeem(conn, ticket, presenter)


async def _close(ws: WebSocket, code: int, reason: str) -> None:
    with contextlib.suppress(RuntimeError, WebSocketDisconnect):
        await ws.close(code, reason[:120])


async def _serve(ws: WebSocket, orch: Orchestrator, vm: str, who: str, mode: str, still_allowed) -> None:
    """Bridge the websocket and the VM's console until either side ends."""
    loop = asyncio.get_running_loop()
    out: asyncio.Queue = asyncio.Queue()
    session = Session(
        vm=vm,
        who=who,
        mode=mode,
        send=lambda item: loop.call_soon_threadsafe(out.put_nowait, ("data", item)),
        close=lambda code, why: loop.call_soon_threadsafe(out.put_nowait, ("close", (code, why))),
        still_allowed=still_allowed,
    )
    try:
        await to_thread.run_sync(orch.consoles.attach, session)
    except (DriverError, VmplaneError) as exc:
        await _close(ws, 4409, str(exc))
        return
    sender = asyncio.create_task(_send_out(ws, out))
    try:
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                break
            if message.get("bytes") is not None:
                await to_thread.run_sync(orch.consoles.write, session, message["bytes"])
            elif message.get("text"):
                await _control(orch, session, message["text"])
    except WebSocketDisconnect:
        pass
    finally:
        sender.cancel()
        await to_thread.run_sync(orch.consoles.detach, session)


async def _control(orch: Orchestrator, session: Session, text: str) -> None:
    try:
        kind = json.loads(text).get("type")
    except (ValueError, AttributeError):
        return
    if kind == "take":
        await to_thread.run_sync(orch.consoles.take, session)


async def _send_out(ws: WebSocket, out: asyncio.Queue) -> None:
    with contextlib.suppress(WebSocketDisconnect, RuntimeError):
        while True:
            kind, item = await out.get()
            if kind == "close":
                await _close(ws, *item)
                return
            if isinstance(item, bytes):
                await ws.send_bytes(item)
            else:
                await ws.send_text(json.dumps(item))
