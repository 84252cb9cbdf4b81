"""A project's SSH keys (issue 30): put in the cloud-init seed of every VM the project creates, unless the
create says `project_keys: false`."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter
from pydantic import Field

from vmplane.api.deps import AnyCaller, Orch
from vmplane.api.paging import StrictQueryRoute
from vmplane.api.schemas import Name, Request, Response, UtcDatetime
from vmplane.store import seeds as SS

router = APIRouter(tags=["projects"], route_class=StrictQueryRoute)


class KeyAdd(Request):
    name: Name
    key: Annotated[str, Field(max_length=16384, description="one OpenSSH public key line")]


class KeyOut(Response):
    name: str
    key: str
    created_at: UtcDatetime


def _project_id(orch, who, name: str) -> int:
    p = orch.catalog.project(name)
    who.check_project(p.id, "project", name)
    return int(p.id)


@router.post("/projects/{name}/keys", status_code=201, response_model=KeyOut)
def add_key(name: str, body: KeyAdd, orch: Orch, who: AnyCaller):
    """Add a key; VMs created from now on get it (VMs made before keep their seed)."""
    project_id = _project_id(orch, who, name)
    with orch.db.transaction() as conn:
        return SS.add_project_key(conn, project_id, body.name, body.key)


@router.get("/projects/{name}/keys", response_model=list[KeyOut])
def list_keys(name: str, orch: Orch, who: AnyCaller):
    project_id = _project_id(orch, who, name)
    with orch.db.read() as s:
        return SS.project_keys(s.connection(), project_id)


@router.delete("/projects/{name}/keys/{key}", status_code=204)
def remove_key(name: str, key: str, orch: Orch, who: AnyCaller) -> None:
    """Remove a key; VMs made before keep it in their seed."""
    project_id = _project_id(orch, who, name)
    with orch.db.transaction() as conn:
        SS.remove_project_key(conn, project_id, key)
