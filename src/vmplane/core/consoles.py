"""The serial console's rules (issue 31), pure: when a console ticket is refused, and whether a browser's
`Origin` is the console's own.

A ticket is single-use, redeemable within TICKET_S of its issue, bound to the caller (the token's hash), the
VM and, when a browser asked for it, the console session (its hash). Refusals name one reason each (the
metric's label, the close message): unknown, replayed, expired, other-vm, other-caller, other-session, origin.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from urllib.parse import urlsplit

TICKET_S = 15.0
REASONS = ("unknown", "replayed", "expired", "other-vm", "other-caller", "other-session", "origin")
MODES = ("write", "read")


@dataclass(frozen=True)
class Ticket:
    vm_id: int
    token_hash: str
    session_hash: str | None  # a browser's console session; None for the API (the CLI)
    expires_at: dt.datetime
    used_at: dt.datetime | None


@dataclass(frozen=True)
class Presenter:
    """Who presents a ticket at the websocket: the token behind its bearer header or its session cookie."""

    vm_id: int
    token_hash: str | None
    session_hash: str | None


def refusal(ticket: Ticket | None, who: Presenter, now: dt.datetime) -> str | None:
    """Why `ticket` is refused to `who` now (one of REASONS), or None when it is good."""
    if ticket is None:
        return "unknown"
    if ticket.used_at is not None:
        return "replayed"
    if now > ticket.expires_at:
        return "expired"
    if ticket.vm_id != who.vm_id:
        return "other-vm"
    if who.token_hash is None or ticket.token_hash != who.token_hash:
        return "other-caller"
    if ticket.session_hash is not None and ticket.session_hash != who.session_hash:
        return "other-session"
    return None


def origin_refusal(origin: str | None, host: str | None, scheme: str) -> str | None:
    """Why a websocket upgrade's `Origin` is refused: a browser always sends one, and it must be the
    console's own (the scheme and host:port it was served from). A client that sends none (the CLI) is
    not a browser: its ticket and its token bind it."""
    if origin is None:
        return None
    if not host:
        return "origin"
    parts = urlsplit(origin)
    want = "https" if scheme in ("https", "wss") else "http"
    if parts.scheme != want or parts.netloc.lower() != host.lower():
        return "origin"
    return None


def ended(now: float, opened: float, last_activity: float, idle_s: float, max_s: float) -> str | None:
    """Why a session ends now (its idle or absolute limit passed), in words, or None."""
    if now - opened >= max_s:
        return f"the session reached its limit of {max_s:g} s (vmplane.console.session.max)"
    if now - last_activity >= idle_s:
        return f"the session was idle for {idle_s:g} s (vmplane.console.idle.timeout)"
    return None
