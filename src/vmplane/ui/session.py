"""Who is looking: the console's login cookie and its CSRF token.

The browser logs in with an API token and gets a session: its cookie (HttpOnly: script can not read it;
SameSite=Strict: another site can not send it; Secure unless plain http is allowed) holds a random
session id, never the token (consolesessions.py). The session is looked up in the store at every request,
joined to its token: logout, expiry or a revoked token log it out at once, and any control-plane process
serves any request (nothing is kept in memory). Every form and htmx request that changes something also
carries a CSRF token: an HMAC keyed by the session's token's hash (the store's `token_hash`, so stateless
too), unknown to a page that has not read it from ours.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

from fastapi import Depends, Request
from starlette.datastructures import UploadFile

from vmplane.api.deps import Caller
from vmplane.core.errors import Forbidden
from vmplane.store.catalog import hash_token
from vmplane.ui.consolesessions import session_caller

COOKIE = "vmplane_session"
CSRF_FIELD = "csrf"
CSRF_HEADER = "x-csrf-token"


class LoginRequired(Exception):
    """No valid session: a page redirects to the login form, an htmx request is told to (HX-Redirect)."""

    def __init__(self, message: str = ""):
        super().__init__(message)
        self.message = message


def csrf_of_hash(token_hash: str) -> str:
    return hmac.new(bytes.fromhex(token_hash), b"vmplane-console-csrf", hashlib.sha256).hexdigest()


def csrf_token(token: str) -> str:
    """The CSRF token of the sessions of `token` (tests; the console has only the token's hash)."""
    return csrf_of_hash(hash_token(token))


def session_id(request: Request) -> str | None:
    value = request.cookies.get(COOKIE, "").strip()
    return value or None


def ui_caller(request: Request) -> Caller:
    """The caller behind the session cookie; every console route depends on it."""
    sid = session_id(request)
    if sid is None:
        raise LoginRequired()
    row = session_caller(request.app.state.orchestrator.db, sid)
    if row is None:
        raise LoginRequired("the session ended (logged out, expired or its token revoked): log in again")
    who = Caller(row["name"], row["role"], row["project_id"])
    request.state.caller, request.state.csrf = who, csrf_of_hash(row["token_hash"])
    return who


async def checked_caller(request: Request, who: Annotated[Caller, Depends(ui_caller)]) -> Caller:
    """A caller whose request changes something: its CSRF token must match (form field or header)."""
    sent: str | UploadFile | None = request.headers.get(CSRF_HEADER)
    if sent is None and request.headers.get("content-type", "").startswith("application/x-www-form-urlencoded"):
        sent = (await request.form()).get(CSRF_FIELD)
    if not sent or not hmac.compare_digest(str(sent), request.state.csrf):
        raise Forbidden("the form's CSRF token is missing or wrong: reload the page and try again", field=CSRF_FIELD)
    return who


Viewer = Annotated[Caller, Depends(ui_caller)]
Actor = Annotated[Caller, Depends(checked_caller)]
