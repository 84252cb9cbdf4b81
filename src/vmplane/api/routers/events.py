"""The event log: every state change of a VM, host, migration or operation, with its cause."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Response

from vmplane.api.deps import AnyCaller, Orch
from vmplane.api.paging import Paging, StrictQueryRoute, paged
from vmplane.api.schemas import EventOut
from vmplane.core import since as since_rules
from vmplane.store import events

router = APIRouter(tags=["events"], route_class=StrictQueryRoute)


def parse_since(since: str | None) -> int | dt.datetime | None:
    """core/since.py's rules, now."""
    return since_rules.parse_since(since, dt.datetime.now(dt.UTC))


@router.get("/events", response_model=list[EventOut])
def list_events(
    orch: Orch,
    who: AnyCaller,
    response: Response,
    page: Paging,
    vm: Annotated[
        str | None, Query(max_length=63, description="events of this VM (its operations and migrations too)")
    ] = None,
    host: Annotated[str | None, Query(max_length=63, description="events of this host and of what runs on it")] = None,
    kind: Literal["vm", "host", "migration", "operation", "volume", "pool"] | None = None,
    since: Annotated[
        str | None,
        Query(
            max_length=40,
            description=f"{since_rules.HELP}: only the events after the id, or at or after the moment",
        ),
    ] = None,
):
    """State changes of VMs, hosts, migrations and operations with their cause, newest first (`sort`: id,
    at, kind, subject; `-` for descending). A member sees its own project's events only (no host events).
    To follow the log, ask again with `since=<the newest id seen>&sort=id`. The total is in X-Total-Count."""
    rows, total = events.page(
        orch.db,
        page,
        vm=vm,
        host=host,
        kind=kind,
        since=parse_since(since),
        project_id=None if who.is_admin else who.project_id,
    )
    return paged(response, [EventOut(**row) for row in rows], total)
