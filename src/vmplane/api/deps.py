"""Dependencies: the orchestrator and the authenticated caller.

They are `async def` although they never await: they do no I/O, and a plain `def` dependency costs a
hop to the threadpool and back on every request (FastAPI runs sync dependencies there)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from vmplane.core.errors import Forbidden, NotFound, Unauthorized
from vmplane.orchestrator import Orchestrator


async def orchestrator(request: Request) -> Orchestrator:
    return request.app.state.orchestrator


Orch = Annotated[Orchestrator, Depends(orchestrator)]


@dataclass(frozen=True)
class Caller:
    name: str
    role: str
    project_id: int | None

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    def check_project(self, project_id: int, noun: str, name: str) -> None:
        """Members see only their project's objects; others are reported as not existing."""
        if not self.is_admin and project_id != self.project_id:
            raise NotFound(f"{noun} {name!r} does not exist", field=noun)


async def caller(request: Request) -> Caller:
    """The caller the authentication middleware established. The bearer scheme is documented in the OpenAPI
    schema (app.openapi_with_bearer), not by a dependency: FastAPI would solve that on every request."""
    who = request.scope.get("state", {}).get("caller")
    if who is None:
        raise Unauthorized("an Authorization: Bearer <token> header is required")
    return who


def require_admin(who: Caller) -> Caller:
    """403 unless the caller is an admin (the console's actions call it directly)."""
    if not who.is_admin:
        raise Forbidden("this needs an admin token")
    return who


async def admin(who: Annotated[Caller, Depends(caller)]) -> Caller:
    return require_admin(who)


AnyCaller = Annotated[Caller, Depends(caller)]
Admin = Annotated[Caller, Depends(admin)]
