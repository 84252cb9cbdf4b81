"""Log in (an API token, kept in the session cookie) and log out."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import RedirectResponse

from ..api.paging import StrictQueryRoute
from ..errors import VmplaneError
from .render import render
from .session import COOKIE, Actor

router = APIRouter(prefix="/ui", include_in_schema=False, route_class=StrictQueryRoute)
SESSION_MAX_AGE_S = 12 * 3600       # the browser forgets the session after this; the token lives on


def _safe_next(next_url: str | None) -> str:
    """Only a console path (never another site: no open redirect)."""
    return next_url if next_url and next_url.startswith("/ui") and not next_url.startswith("//") else "/ui"


@router.get("/login")
def login_form(request: Request, next: str | None = None):
    return render(request, "login.html", next=_safe_next(next), error=None)


@router.post("/login")
async def login(request: Request, token: Annotated[str, Form(max_length=200)] = "",
                next: Annotated[str, Form(max_length=300)] = "/ui"):
    token = token.strip()
    try:
        if not token:
            raise VmplaneError("token: give an API token", field="token")
        await run_in_threadpool(request.app.state.orchestrator.catalog.authenticate, token)
    except VmplaneError as exc:
        return render(request, "login.html", status_code=401, next=_safe_next(next), error=exc.message)
    response = RedirectResponse(_safe_next(next), status_code=303)
    response.set_cookie(COOKIE, token, max_age=SESSION_MAX_AGE_S, path="/ui", httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")
    return response


@router.post("/logout")
def logout(request: Request, who: Actor):
    response = RedirectResponse("/ui/login", status_code=303)
    response.delete_cookie(COOKIE, path="/ui", httponly=True, samesite="strict")
    return response
