"""Helpers for benchmarks: a results table printed and written into bench/RESULTS.md under a heading."""

from __future__ import annotations

import datetime as dt
import platform
import re
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def table(headers: list[str], rows: list[list]) -> str:
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    fmt = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    return "\n".join([fmt(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                     + [fmt(r) for r in cells[1:]])


def write_section(name: str, body: str) -> None:
    """Replace (or add) the section `## name` of RESULTS.md with `body`."""
    stamp = f"_{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, " \
            f"Python {platform.python_version()}_"
    section = f"## {name}\n\n{stamp}\n\n{body.strip()}\n"
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n\nWritten by the scripts in bench/.\n"
    pattern = re.compile(rf"^## {re.escape(name)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = pattern.sub(section + "\n", text) if pattern.search(text) else text.rstrip() + "\n\n" + section
    RESULTS.write_text(text)
    print(body)
