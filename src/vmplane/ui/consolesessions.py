"""The console's server-side sessions (review N10) and the rule for their cookie.

A login opens a session: a random id, given to the browser in the cookie, of which the store keeps only
a hash (`console_sessions`), with the token the session acts as and when it ends. The API token itself
never leaves the login form. A session ends at logout (its row deleted: the cookie is worthless from
then on, wherever a copy of it is), at its expiry (SESSION_MAX_AGE_S), or with its token (revoked: the
rows go with the token, ON DELETE CASCADE, and the look-up joins the token besides). Every request looks
its session up in the store, so any control-plane process serves any request (nothing in memory).

The cookie is `Secure` unless plain http is allowed for this request (`cookie_secure`): a browser on
this machine (loopback, not through a proxy), or a control plane started with `--insecure-cookies`.
Whether a request came over https is uvicorn's word: it believes X-Forwarded-Proto only from the proxies
`vmplane serve --forwarded-allow-ips` names.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import secrets
from collections.abc import Mapping

from sqlalchemy import bindparam, delete, select

from vmplane.core.errors import Unauthorized
from vmplane.store import Database
from vmplane.store.catalog import hash_token
from vmplane.store.prepared import prepared
from vmplane.store.schema import ConsoleSession, Token, utcnow

SESSION_MAX_AGE_S = 12 * 3600  # a session ends this long after its login (the browser forgets it too)
FORWARDED = ("forwarded", "x-forwarded-for", "x-forwarded-proto", "x-forwarded-host", "x-real-ip")

_S, _T = ConsoleSession.__table__, Token.__table__
_BY_ID_HASH = (
    select(_T.c.name, _T.c.role, _T.c.project_id, _T.c.token_hash, _S.c.expires_at)
    .join(_T, _T.c.id == _S.c.token_id)
    .where(_S.c.id_hash == bindparam("digest"))
)


def hash_session(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


def open_session(db: Database, token: str, now: dt.datetime | None = None) -> str:
    """A new session acting as `token` (checked: Unauthorized if it is not valid); returns its id, the
    only copy of which goes to the browser. Sessions past their end are cleared on the way."""
    now = now or utcnow()
    session_id = secrets.token_urlsafe(32)
    with db.write() as s:
        token_id = s.scalar(select(Token.id).where(Token.token_hash == hash_token(token)))
        if token_id is None:
            raise Unauthorized("the bearer token is not valid")
        s.execute(delete(ConsoleSession).where(ConsoleSession.expires_at <= now))
        s.add(
            ConsoleSession(
                id_hash=hash_session(session_id),
                token_id=token_id,
                created_at=now,
                expires_at=now + dt.timedelta(seconds=SESSION_MAX_AGE_S),
            )
        )
    return session_id


def session_caller(db: Database, session_id: str, now: dt.datetime | None = None) -> dict | None:
    """{name, role, project_id, token_hash} of a live session (its token not revoked), or None."""
    row = prepared(db.engine, _BY_ID_HASH).first(digest=hash_session(session_id))
    if row is None or row["expires_at"] <= (now or utcnow()):
        return None
    return row


def end_session(db: Database, session_id: str) -> None:
    """Logout: the session is gone from the store (any copy of its cookie is worthless now)."""
    with db.write() as s:
        s.execute(delete(ConsoleSession).where(ConsoleSession.id_hash == hash_session(session_id)))


def is_loopback(host: str | None) -> bool:
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def cookie_secure(scheme: str, client_host: str | None, headers: Mapping[str, str], insecure_allowed: bool) -> bool:
    """Whether the session cookie must be `Secure`: always over https; over plain http unless it is
    allowed here: by `--insecure-cookies`, or for a browser on this machine (loopback). A request that
    came through a proxy (any forwarding header) is not taken for a local browser: a proxy on this machine
    would make every browser look local."""
    if scheme == "https":
        return True
    if insecure_allowed:
        return False
    through_proxy = any(name in headers for name in FORWARDED)
    return not (is_loopback(client_host) and not through_proxy)
