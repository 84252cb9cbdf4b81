"""A VM's serial console tickets (issue 31): `POST /vms/{name}/console/ticket` gives a ticket, single-use,
redeemable within 15 s, bound to the caller's token and the VM, for the websocket `/api/v1/vms/{name}/console`
(ui/consolesocket.py, which also issues a browser's tickets, bound to its session too)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field

from vmplane.api.deps import AnyCaller, Orch
from vmplane.api.paging import StrictQueryRoute
from vmplane.api.schemas import Response
from vmplane.core import consoles as rules
from vmplane.core.errors import Conflict
from vmplane.orchestrator import Orchestrator
from vmplane.store import consoletickets as tickets
from vmplane.store.catalog import hash_token

router = APIRouter(tags=["vms"], route_class=StrictQueryRoute)


class ConsoleTicketOut(Response):
    ticket: str = Field(description='send it as the websocket\'s first message: {"ticket": ..., "mode": "write"}')
    expires_in_s: float = Field(description="it must be presented within this many seconds, once")
    websocket: str = Field(description="the websocket's path on this server")


def bearer_hash(headers: Any) -> str | None:
    kind, _, token = (headers.get("authorization") or "").partition(" ")
    return hash_token(token.strip()) if kind.lower() == "bearer" and token.strip() else None


def issue_ticket(orch: Orchestrator, vm_name: str, token_hash: str, session_hash: str | None) -> ConsoleTicketOut:
    """A ticket for a running VM's console (409 naming its state otherwise)."""
    vm = orch.vm(vm_name)
    if vm.state not in ("running", "scaling", "migrating"):
        raise Conflict(f"vm {vm_name} is {vm.state}: its console opens while it runs", field="state")
    with orch.db.transaction() as conn:
        ticket = tickets.issue(conn, vm.id, token_hash, session_hash)
    return ConsoleTicketOut(ticket=ticket, expires_in_s=rules.TICKET_S, websocket=f"/api/v1/vms/{vm_name}/console")


@router.post("/vms/{name}/console/ticket", response_model=ConsoleTicketOut)
def console_ticket(name: str, request: Request, orch: Orch, who: AnyCaller):
    """A ticket to open the VM's serial console (the websocket `/vms/{name}/console`): single-use, within
    15 s, for this token and this VM."""
    who.check_project(orch.vm(name).project_id, "vm", name)
    return issue_ticket(orch, name, bearer_hash(request.headers) or "", None)
