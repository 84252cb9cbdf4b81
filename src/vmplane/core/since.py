"""`--since` / `since=`: an event id, a time span back from now (`90s`, `30m`, `1h`, `2d`, `1w`) or an ISO
8601 date or timestamp (without an offset: UTC). Pure: `now` is given."""

from __future__ import annotations

import datetime as dt
import re

from vmplane.core.errors import Invalid

_SPAN = re.compile(r"^(\d{1,6})\s*(s|m|h|d|w)$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
HELP = "an event id (the events after it), a span back from now (30m, 1h, 2d) or an ISO 8601 date or timestamp"


def parse_since(since: str | None, now: dt.datetime) -> int | dt.datetime | None:
    """An event id (int), or the moment (aware UTC when `now` is) from which events count."""
    if since is None:
        return None
    text = since.strip().lower()
    if text.isdigit():
        return int(text)
    span = _SPAN.match(text)
    if span:
        return now - dt.timedelta(seconds=int(span.group(1)) * _SECONDS[span.group(2)])
    try:
        moment = dt.datetime.fromisoformat(since.strip())
    except ValueError:
        raise Invalid(
            f"since: {since!r} is not {HELP} (e.g. 42, 1h, 2026-12-07 or 2026-12-07T12:00:00+00:00)", field="since"
        ) from None
    return moment if moment.tzinfo else moment.replace(tzinfo=dt.UTC)
