"""Templates and the small formatting rules they share (sizes, percentages, bars, paging links)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from urllib.parse import urlencode

from fastapi import Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates

from vmplane.core.errors import VmplaneError
from vmplane.core.eventfold import chain

HERE = Path(__file__).parent
templates = Jinja2Templates(directory=str(HERE / "templates"))
PAGE_SIZE = 50  # rows per page of every console list


def mib(value: float | None) -> str:
    """Memory and disk sizes as an operator reads them: 512 MiB, 1.5 GiB, 2 TiB (a fraction of a MiB, from a
    size in bytes: 16.3 MiB)."""
    if value is None:
        return "-"
    if abs(value) < 1024:
        return f"{value:.1f} MiB".replace(".0 ", " ") if isinstance(value, float) else f"{value} MiB"
    gib = value / 1024
    if abs(gib) < 1024:
        return f"{gib:.1f} GiB".replace(".0 ", " ")
    return f"{gib / 1024:.1f} TiB".replace(".0 ", " ")


def when(value: dt.datetime | str | None) -> str:
    """A moment as the console shows it everywhere: ISO-like with its zone, "2026-12-07 10:31:05 UTC". The store
    keeps naive UTC datetimes (and the snapshot and backup listings ISO strings ending "Z"); an aware one is
    converted. None (not yet, never) is a dash."""
    if value is None or value == "":
        return "-"
    if isinstance(value, str):
        value = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    if value.tzinfo is not None:
        value = value.astimezone(dt.UTC)
    return value.strftime("%Y-%m-%d %H:%M:%S UTC")


def shown(value: object) -> object:
    """Every {{ expression }}'s last step: a missing value (no host, no step yet) reads "-", never "None"."""
    return "-" if value is None else value


def pct(used: float, total: float) -> float:
    """Share of `total` (0-100, more when over-allocated); 0 for an empty total."""
    return round(100.0 * used / total, 1) if total else 0.0


def width(used: float, total: float) -> float:
    """A bar segment's width in percent of its track (never more than the track)."""
    return min(100.0, pct(used, total))


def query(params: dict, **changes) -> str:
    """A list URL's query string with `changes` applied (None removes a parameter)."""
    merged = {**params, **changes}
    return urlencode({k: v for k, v in merged.items() if v not in (None, "")})


templates.env.filters.update(mib=mib, when=when)
templates.env.finalize = shown
templates.env.globals.update(pct=pct, width=width, query=query, page_size=PAGE_SIZE, chain=chain)


def is_htmx(request: Request) -> bool:
    return request.headers.get("hx-request") == "true"


def render(request: Request, name: str, status_code: int = 200, headers: dict | None = None, **context) -> HTMLResponse:
    """`name` rendered with the session's caller and CSRF token (set by session.ui_caller)."""
    context.setdefault("who", getattr(request.state, "caller", None))
    context.setdefault("csrf", getattr(request.state, "csrf", ""))
    return templates.TemplateResponse(request, name, context, status_code=status_code, headers=headers)


def error_fragment(request: Request, exc: VmplaneError) -> HTMLResponse:
    """The API's words for a refusal, shown next to the control that caused it (the form's error slot).
    The status is the API's: htmx is configured (vmplane.js) to swap 4xx answers into the page."""
    return render(request, "fragments/error.html", status_code=exc.status, error=exc.as_dict())
