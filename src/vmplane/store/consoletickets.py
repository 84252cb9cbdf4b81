"""Serial console tickets in the store (issue 31): issued by any control-plane process, redeemed once by any
(the websocket may land on another process than the ticket's request). Only a ticket's sha256 is kept. A
ticket presented is spent, refused or not: a second presentation is a replay whatever the first one was.
The rules are core/consoles.py."""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets

from sqlalchemy import delete, insert, select, update
from sqlalchemy.engine import Connection

from vmplane.core import consoles as rules
from vmplane.store.schema import ConsoleTicket, utcnow

TICKETS = ConsoleTicket.__table__
KEEP_S = 3600  # spent and expired tickets are deleted this long after they expired


def digest(ticket: str) -> str:
    return hashlib.sha256(ticket.encode()).hexdigest()


def issue(
    conn: Connection, vm_id: int, token_hash: str, session_hash: str | None, now: dt.datetime | None = None
) -> str:
    """A new ticket for `vm_id`, bound to the caller's token (and a browser's session); the ticket itself."""
    now = now or utcnow()
    ticket = secrets.token_urlsafe(32)
    conn.execute(
        insert(TICKETS).values(
            digest=digest(ticket),
            vm_id=vm_id,
            token_hash=token_hash,
            session_hash=session_hash,
            expires_at=now + dt.timedelta(seconds=rules.TICKET_S),
        )
    )
    conn.execute(delete(TICKETS).where(TICKETS.c.expires_at < now - dt.timedelta(seconds=KEEP_S)))
    return ticket


def redeem(conn: Connection, ticket: str, who: rules.Presenter, now: dt.datetime | None = None) -> str | None:
    """Spend `ticket` for `who`: None when it opens the console, else why not (core/consoles.REASONS)."""
    now = now or utcnow()
    row = conn.execute(select(TICKETS).where(TICKETS.c.digest == digest(ticket))).first()
    if row is None:
        return "unknown"
    found = rules.Ticket(row.vm_id, row.token_hash, row.session_hash, row.expires_at, row.used_at)
    why = rules.refusal(found, who, now)
    if row.used_at is None:  # spent now, whatever the answer; a concurrent redeem of it lost the race
        spent = conn.execute(
            update(TICKETS).where(TICKETS.c.id == row.id, TICKETS.c.used_at.is_(None)).values(used_at=now)
        ).rowcount
        if not spent:
            return "replayed"
    return why
