"""Live updates: one server-sent-event stream per open page (`/ui/stream`).

Once a second the stream looks at what runs now and at the newest event the caller may see, and sends
only what changed: `tasks` (the "Running now" pane, rendered), `events` (the event pane, rendered) and
`changed` (the newest event id: a page's own parts, e.g. a VM's detail, fetch themselves again on it).
Nothing is polled by the browser; an idle console costs one small read per second per open page."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from vmplane.api.paging import StrictQueryRoute
from vmplane.ui.consolesessions import session_caller
from vmplane.ui.pages import events_context, tasks_context
from vmplane.ui.render import templates
from vmplane.ui.session import Viewer, session_id

router = APIRouter(prefix="/ui", include_in_schema=False, route_class=StrictQueryRoute)
INTERVAL_S = 1.0
KEEPALIVE_S = 15.0


def sse(event: str, data: str) -> str:
    return f"event: {event}\n" + "".join(f"data: {line}\n" for line in data.splitlines() or [""]) + "\n"


def snapshot(o, who, csrf: str, sid: str | None = None) -> tuple[str, str, int | None] | None:
    """What the panes show now; None once the session `sid` ended (logout, expiry, revoked token)."""
    if sid is not None and session_caller(o.db, sid) is None:
        return None
    tasks = templates.env.get_template("fragments/tasks.html").render(who=who, csrf=csrf, **tasks_context(o, who))
    evs = events_context(o, who)
    pane = templates.env.get_template("fragments/event_pane.html").render(who=who, csrf=csrf, **evs)
    return tasks, pane, (evs["events"][0]["id"] if evs["events"] else None)


@router.get("/stream")
async def stream(request: Request, who: Viewer, once: bool = False):
    """`once`: send the current state and end (for scripts and tests; a browser keeps the stream open)."""
    o, csrf, sid = request.app.state.orchestrator, request.state.csrf, session_id(request)

    async def events():
        sent_tasks = sent_pane = None
        sent_newest: int | None = -1
        quiet = 0.0
        while not await request.is_disconnected():
            now = await run_in_threadpool(snapshot, o, who, csrf, sid)
            if now is None:
                return  # the session ended: an open page learns nothing more
            tasks, pane, newest = now
            out = []
            if tasks != sent_tasks:
                out.append(sse("tasks", tasks))
            if pane != sent_pane:
                out.append(sse("events", pane))
            if newest != sent_newest:
                out.append(sse("changed", str(newest)))
            sent_tasks, sent_pane, sent_newest = tasks, pane, newest
            if out:
                quiet = 0.0
                yield "".join(out)
            elif (quiet := quiet + INTERVAL_S) >= KEEPALIVE_S:
                quiet = 0.0
                yield ": keepalive\n\n"  # proxies close idle streams
            if once:
                return
            await asyncio.sleep(INTERVAL_S)

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
