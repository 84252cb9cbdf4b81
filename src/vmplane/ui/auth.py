"""Log in (an API token opens a server-side session; its id goes in the cookie) and log out (the session
ends on the server). consolesessions.py has the sessions and the cookie's rule."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import RedirectResponse

from vmplane.api.paging import StrictQueryRoute
from vmplane.core.errors import VmplaneError
from vmplane.ui.consolesessions import SESSION_MAX_AGE_S, cookie_secure, end_session, open_session
from vmplane.ui.render import render
from vmplane.ui.session import COOKIE, Actor, session_id

router = APIRouter(prefix="/ui", include_in_schema=False, route_class=StrictQueryRoute)


def _safe_next(next_url: str | None) -> str:
    """Only a console path (never another site: no open redirect)."""
    return next_url if next_url and next_url.startswith("/ui") and not next_url.startswith("//") else "/ui"


def secure_cookie(request: Request) -> bool:
    return cookie_secure(
        request.url.scheme,
        request.client.host if request.client else None,
        request.headers,
        getattr(request.app.state, "insecure_cookies", False),
    )


def _form(request: Request, next_url: str | None, error: str | None, status_code: int = 200):
    """The login form; over plain http from another machine it says why a login would not hold (the
    browser keeps a Secure cookie for https only)."""
    plain = request.url.scheme != "https" and secure_cookie(request)
    return render(
        request, "login.html", status_code=status_code, next=_safe_next(next_url), error=error, plain_http=plain
    )


@router.get("/login")
def login_form(request: Request, next: str | None = None):
    return _form(request, next, None)


@router.post("/login")
async def login(
    request: Request,
    token: Annotated[str, Form(max_length=200)] = "",
    next: Annotated[str, Form(max_length=300)] = "/ui",
):
    token = token.strip()
    try:
        if not token:
            raise VmplaneError("token: give an API token", field="token")
        sid = await run_in_threadpool(open_session, request.app.state.orchestrator.db, token)
    except VmplaneError as exc:
        return _form(request, next, exc.message, status_code=401)
    response = RedirectResponse(_safe_next(next), status_code=303)
    response.set_cookie(
        COOKIE,
        sid,
        max_age=SESSION_MAX_AGE_S,
        path="/ui",
        httponly=True,
        samesite="strict",
        secure=secure_cookie(request),
    )
    return response


@router.post("/logout")
def logout(request: Request, who: Actor):
    sid = session_id(request)
    if sid is not None:  # (always: Actor found the session)
        end_session(request.app.state.orchestrator.db, sid)  # its cookie is worthless now
    response = RedirectResponse("/ui/login", status_code=303)
    response.delete_cookie(COOKIE, path="/ui", httponly=True, samesite="strict", secure=secure_cookie(request))
    return response
