"""The settings table of docs/operations/settings.md, generated from the settings declarations.

    python scripts/settings_doc.py           rewrite the table between the markers
    python scripts/settings_doc.py --check   exit 1, saying what differs, when the document is stale

The table is written between `<!-- settings:begin -->` and `<!-- settings:end -->`; the prose around it
is the document's own. tests/test_docs_settings.py runs `check()` so that CI fails on a stale table.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

try:  # the layered package (issue 27); the flat one before the move
    from vmplane.core import settings
except ImportError:
    from vmplane import settings  # type: ignore[no-redef]

BEGIN = "<!-- settings:begin -->"
END = "<!-- settings:end -->"
DOC = Path(__file__).resolve().parent.parent / "docs" / "operations" / "settings.md"


def _cell(text: str) -> str:
    """One table cell: a `|` would end the cell, a newline the row."""
    return " ".join(text.split()).replace("|", "\\|")


def _scopes(spec: settings.SettingKey) -> str:
    """Every scope a key may be set at (the widest first), as `setting set` accepts them."""
    return ", ".join(scope for scope in settings.SCOPES if spec.allows(scope))


def table() -> str:
    """The markdown table, one row per key in declaration order."""
    rows = ["| key | type | default | range or choices | scopes | meaning |", "|---|---|---|---|---|---|"]
    for spec in settings.KEYS.values():
        rows.append(
            f"| `{spec.key}` | {spec.kind} | {_cell(spec.text(spec.default))} | {_cell(spec.range)} "
            f"| {_scopes(spec)} | {_cell(spec.description)} |"
        )
    return "\n".join(rows) + "\n"


def render(document: str) -> str:
    """`document` with the table between the markers replaced by the current one."""
    start, end = document.find(BEGIN), document.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{DOC.name} needs the markers {BEGIN} and {END}, in that order")
    return document[: start + len(BEGIN)] + "\n" + table() + document[end:]


def check(path: Path = DOC) -> list[str]:
    """The differences between the document and the code, as a unified diff; empty when it is current."""
    current = path.read_text()
    wanted = render(current)
    return list(
        difflib.unified_diff(
            current.splitlines(),
            wanted.splitlines(),
            f"{path} (as written)",
            f"{path} (from the settings module)",
            lineterm="",
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say whether the document is current")
    parser.add_argument("--doc", type=Path, default=DOC, help="the document (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.check:
        diff = check(args.doc)
        if diff:
            print(f"{args.doc} is stale: run python scripts/settings_doc.py", file=sys.stderr)
            print("\n".join(diff), file=sys.stderr)
            return 1
        print(f"{args.doc}: the settings table matches the code")
        return 0
    args.doc.write_text(render(args.doc.read_text()))
    print(f"{args.doc}: {len(settings.KEYS)} settings written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
