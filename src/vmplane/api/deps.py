"""Dependencies: the orchestrator and the authenticated caller."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from ..errors import Forbidden, NotFound, Unauthorized
from ..orchestrator import Orchestrator

bearer = HTTPBearer(auto_error=False, description="a token from `vmplane up` or `vmplane token create`")


def orchestrator(request: Request) -> Orchestrator:
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


def caller(request: Request, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> Caller:
    """The caller the authentication middleware established (declaring `bearer` documents the scheme)."""
    who = request.scope.get("state", {}).get("caller")
    if who is None:
        raise Unauthorized("an Authorization: Bearer <token> header is required")
    return who


def admin(who: Annotated[Caller, Depends(caller)]) -> Caller:
    if not who.is_admin:
        raise Forbidden("this needs an admin token")
    return who


AnyCaller = Annotated[Caller, Depends(caller)]
Admin = Annotated[Caller, Depends(admin)]
