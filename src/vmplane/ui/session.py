"""Who is looking: the console's login cookie and its CSRF token.

The browser logs in with an API token. The token itself is kept in an HttpOnly, SameSite=Strict
cookie (script can not read it, another site can not send it) and checked against the store at every
request, as a bearer token is: a revoked token logs its sessions out at once, and any control-plane
process serves any request (nothing is kept in memory). Every form and htmx request that changes
something also carries a CSRF token: an HMAC of the session's token, so stateless too, and unknown to
a page that has not read it from ours.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

from fastapi import Depends, Request

from ..api.deps import Caller
from ..errors import Forbidden, VmplaneError

COOKIE = "vmplane_session"
CSRF_FIELD = "csrf"
CSRF_HEADER = "x-csrf-token"


class LoginRequired(Exception):
    """No valid session: a page redirects to the login form, an htmx request is told to (HX-Redirect)."""

    def __init__(self, message: str = ""):
        super().__init__(message)
        self.message = message


def csrf_token(token: str) -> str:
    return hmac.new(hashlib.sha256(token.encode()).digest(), b"vmplane-console-csrf", hashlib.sha256).hexdigest()


def session_token(request: Request) -> str | None:
    token = request.cookies.get(COOKIE, "").strip()
    return token or None


def ui_caller(request: Request) -> Caller:
    """The caller behind the session cookie; every console route depends on it."""
    token = session_token(request)
    if token is None:
        raise LoginRequired()
    try:
        name, role, project_id = request.app.state.orchestrator.catalog.authenticate(token)
    except VmplaneError as exc:
        raise LoginRequired(f"{exc.message}: log in again") from None
    who = Caller(name, role, project_id)
    request.state.caller, request.state.csrf = who, csrf_token(token)
    return who


async def checked_caller(request: Request, who: Annotated[Caller, Depends(ui_caller)]) -> Caller:
    """A caller whose request changes something: its CSRF token must match (form field or header)."""
    sent = request.headers.get(CSRF_HEADER)
    if sent is None and request.headers.get("content-type", "").startswith("application/x-www-form-urlencoded"):
        sent = (await request.form()).get(CSRF_FIELD)
    if not sent or not hmac.compare_digest(str(sent), request.state.csrf):
        raise Forbidden("the form's CSRF token is missing or wrong: reload the page and try again", field=CSRF_FIELD)
    return who


Viewer = Annotated[Caller, Depends(ui_caller)]
Actor = Annotated[Caller, Depends(checked_caller)]
