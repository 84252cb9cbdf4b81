"""`vmplane events`: the event log, as a table or followed live.

At 80 columns a six-column table leaves the message a few characters, so each event is one line of
short columns (time, kind, subject, old -> new, cause) with its message folded on the lines below it,
indented. `--wide` shows every field as a table; `-o json` gives the API's objects.
"""

from __future__ import annotations

import datetime as dt
import enum
import json
import sys
import textwrap
import time

import typer

from vmplane.cli.client import Client
from vmplane.cli.common import Limit, Offset, api_command, app
from vmplane.cli.output import console, note
from vmplane.core.eventfold import chain, fold

WIDTH = 80
INDENT = 4  # a message's lines start here
FOLLOW_EVERY_S = 0.5
FOLLOW_BACKLOG = 10  # events shown before following, without --limit
FOLLOW_PAGE = 1000
FOLLOW_WIDTHS = (9, 12, 22)  # kind, subject, change: fixed while following (later events are not known yet)


class Kind(str, enum.Enum):
    vm = "vm"
    host = "host"
    migration = "migration"
    operation = "operation"
    volume = "volume"
    pool = "pool"


def _local(row: dict) -> dt.datetime | None:
    try:
        return dt.datetime.fromisoformat(row["at"]).astimezone()
    except (KeyError, TypeError, ValueError):
        return None


TIME_FORMAT = "%m-%d %H:%M:%S"  # this machine's time zone, said in the header (and on each line followed)
FOLLOW_FORMAT = TIME_FORMAT + " %Z"


def subject(row: dict) -> str:
    """A VM's or host's name; an operation's or migration's id shortened to 8 characters (a prefix that
    `operation show` / `migration show` accept)."""
    return row["subject"][:8] if row["kind"] in ("operation", "migration") else row["subject"]


def change(row: dict) -> str:
    return chain(row)


def event_lines(row: dict, fmt: str, widths: tuple[int, int, int]) -> list[str]:
    """One event: its columns on a line, its message folded below, indented."""
    at = _local(row)
    cells = [
        at.strftime(fmt) if at else str(row.get("at")),
        row["kind"].ljust(widths[0]),
        subject(row).ljust(widths[1]),
        change(row).ljust(widths[2]),
        row["cause"],
    ]
    lines = ["  ".join(cells)]
    if row.get("message"):
        lines += textwrap.wrap(
            row["message"],
            WIDTH - INDENT,
            initial_indent=" " * INDENT,
            subsequent_indent=" " * INDENT,
            break_on_hyphens=False,
        )
    return lines


def print_events(rows: list[dict]) -> None:
    fmt = TIME_FORMAT
    widths = tuple(
        max(len(h), *(len(f(r)) for r in rows))
        for h, f in (("kind", lambda r: r["kind"]), ("subject", subject), ("old -> new", change))
    )
    at_width = len(dt.datetime.now().astimezone().strftime(fmt))
    header = "  ".join(
        [
            f"time ({dt.datetime.now().astimezone().strftime('%Z')})".ljust(at_width),
            "kind".ljust(widths[0]),
            "subject".ljust(widths[1]),
            "old -> new".ljust(widths[2]),
            "cause",
        ]
    )
    console.print(header, style="bold", markup=False, highlight=False, soft_wrap=True)
    for row in rows:
        for text in event_lines(row, fmt, widths):  # type: ignore[arg-type]
            console.print(text, markup=False, highlight=False, soft_wrap=True)


def _emit(rows: list[dict], output: str) -> None:
    for row in rows:
        text = json.dumps(row) if output == "json" else "\n".join(event_lines(row, FOLLOW_FORMAT, FOLLOW_WIDTHS))
        sys.stdout.write(text + "\n")
    sys.stdout.flush()


@api_command(app, "events", lists=True)
def events(
    vm: str | None = typer.Option(None, help="only this VM's events (its operations and migrations too)"),
    host: str | None = typer.Option(None, help="only this host's events and those of what runs on it"),
    kind: Kind | None = typer.Option(None, help="vm, host, migration, operation, volume or pool"),
    since: str | None = typer.Option(
        None, help="an event id (the events after it), a span back from now (30m, 1h, 2d) or an ISO 8601 date or time"
    ),
    limit: int | None = Limit(),
    offset: int | None = Offset,
    follow: bool = typer.Option(
        False, "--follow", "-f", help="then print new events as they happen, until Ctrl-C (JSON lines with -o json)"
    ),
    every: bool = typer.Option(
        False, "--every", help="every change on its own line (by default one task's changes of an object are one)"
    ),
    wide: bool = False,
    output: str = "table",
    *,
    client: Client,
):
    """State changes of VMs, hosts, migrations and operations with their cause, newest first, in this
    machine's time zone. One line per object per task (a stop: the VM `running -> stopping -> stopped`, its
    operation `- -> pending -> running -> succeeded`); --every, --wide and -o json show every change.

    --follow prints the last few oldest first, then each new one as it comes (checked every 0.5 s)."""
    filters = {"vm": vm, "host": host, "kind": kind.value if kind else None}
    if follow:
        return _follow(client, filters, since, limit, output)
    rows, total = client.get_list("/events", **filters, since=since, limit=limit, offset=offset)
    if output == "json" or wide:
        return rows, None, "events"
    if not rows:
        note("no events" + (f" at this offset ({total} in all)" if total else ""))
        return None
    print_events(rows if every else fold(rows))
    if total is not None and total > len(rows):
        note(f"showing {len(rows)} of {total}, newest first (use --limit/--offset)")
    return None


def _follow(client: Client, filters: dict, since: str | None, limit: int | None, output: str) -> None:
    backlog = client.get("/events", **filters, since=since, limit=limit or FOLLOW_BACKLOG)
    _emit(list(reversed(backlog)), output)
    last = backlog[0]["id"] if backlog else (int(since) if since and since.isdigit() else _newest(client))
    try:
        while True:
            time.sleep(FOLLOW_EVERY_S)
            new = client.get("/events", **filters, since=str(last), sort="id", limit=FOLLOW_PAGE)
            if new:
                _emit(new, output)
                last = new[-1]["id"]
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


def _newest(client: Client) -> int:
    """The id of the newest event the caller may see (0 when none): following starts after it."""
    newest = client.get("/events", limit=1)
    return newest[0]["id"] if newest else 0
