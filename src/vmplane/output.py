"""CLI output: a Rich table for people, JSON for scripts (`--output json`)."""

from __future__ import annotations

import json
import sys

from rich.console import Console
from rich.table import Table

console = Console()
err_console = Console(stderr=True)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_cell(v)}" for k, v in value.items())
    if isinstance(value, list):
        return "; ".join(_cell(v) for v in value)
    return str(value)


def render(data, output: str, columns: list[str] | None = None, title: str | None = None) -> None:
    if output == "json":
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
        return
    rows = data if isinstance(data, list) else [data]
    if not rows:
        console.print(f"[dim]no {title or 'items'}[/dim]")
        return
    if isinstance(data, dict) and columns is None:
        table = Table(title=title, show_header=False)
        table.add_column("field", style="bold")
        table.add_column("value")
        for key, value in data.items():
            table.add_row(key, _cell(value))
        console.print(table)
        return
    columns = columns or list(rows[0].keys())
    table = Table(title=title)
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*(_cell(row.get(col)) for col in columns))
    console.print(table)


def error(body: dict, output: str) -> None:
    if output == "json":
        sys.stdout.write(json.dumps({k: v for k, v in body.items() if v is not None}) + "\n")
        return
    field = f" [dim](field: {body['field']})[/dim]" if body.get("field") else ""
    err_console.print(f"[red]error[/red] {body.get('error')}: {body.get('message')}{field}", highlight=False)
