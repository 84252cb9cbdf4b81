"""CLI output: a Rich table for people, JSON for scripts (`--output json`).

Tables fit the terminal (80 columns when piped): each list shows the few columns that matter
(`--wide` shows every field), columns that people copy (ids, names, keys) are never cut or folded,
and the other columns wrap instead.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

console = Console()
err_console = Console(stderr=True)

# Columns whose values people copy into the next command: shown whole, on one line.
KEY_COLUMNS = frozenset(
    {
        "id",
        "name",
        "key",
        "vm",
        "host",
        "source",
        "target",
        "migration",
        "operation",
        "project",
        "cluster",
        "zone",
        "token",
    }
)
SHORT = 12  # a column no wider than this is never wrapped either (states, counts, sizes)


@dataclass(frozen=True)
class Col:
    """A table column: a header and how to get its value from a row (a field name or a function)."""

    header: str
    value: str | Callable[[dict], Any] | None = None

    def of(self, row: dict) -> Any:
        if callable(self.value):
            return self.value(row)
        return row.get(self.value or self.header)


Columns = Sequence[str | Col]


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_cell(v)}" for k, v in value.items())
    if isinstance(value, list):
        return "; ".join(_cell(v) for v in value)
    return str(value)


def _as_col(c: str | Col) -> Col:
    return c if isinstance(c, Col) else Col(c)


def render(
    data,
    output: str,
    columns: Columns | None = None,
    title: str | None = None,
    wide: bool = False,
    caption: str | None = None,
) -> None:
    if output == "json":
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
        return
    rows = data if isinstance(data, list) else [data]
    if not rows:
        console.print(f"[dim]no {title or 'items'}[/dim]")
        return
    if isinstance(data, dict) and columns is None:
        table = Table(title=title, show_header=False)
        table.add_column("field", style="bold", no_wrap=True)
        table.add_column("value", overflow="fold")
        for key, value in data.items():
            table.add_row(key, _cell(value))
        console.print(table)
        return
    cols = [Col(k) for k in rows[0]] if wide or not columns else [_as_col(c) for c in columns]
    cells = [[_cell(c.of(row)) for c in cols] for row in rows]
    table = Table(title=title, caption=caption, box=box.SIMPLE_HEAD, pad_edge=False)
    for i, c in enumerate(cols):
        width = max(len(c.header), *(len(r[i]) for r in cells))
        if wide or c.header in KEY_COLUMNS or width <= SHORT:
            table.add_column(c.header, no_wrap=True, min_width=width)
        else:
            table.add_column(c.header, overflow="fold")
    for r in cells:
        table.add_row(*r)
    if wide:  # every field, on one line each, however wide the terminal (pipe it to `less -S`)
        need = sum(max(len(c.header), *(len(r[i]) for r in cells)) + 2 for i, c in enumerate(cols))
        Console(width=max(need, console.width)).print(table)
        return
    console.print(table)


def note(text: str) -> None:
    """A line for people after a table (stderr, so that stdout stays the table or the JSON)."""
    err_console.print(text, soft_wrap=True, highlight=False)


def error(body: dict, output: str) -> None:
    if output == "json":
        sys.stdout.write(json.dumps({k: v for k, v in body.items() if v is not None}) + "\n")
        return
    field = f" [dim](field: {escape(str(body['field']))})[/dim]" if body.get("field") else ""
    err_console.print(
        f"[red]error[/red] {escape(str(body.get('error')))}: {escape(str(body.get('message')))}{field}",
        highlight=False,
        soft_wrap=True,
    )
