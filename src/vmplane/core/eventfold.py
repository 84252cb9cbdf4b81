"""How the event log is read: one line per object per task. The log keeps every confirmed change (a stop is
the VM's `running -> stopping`, `stopping -> stopped` and its operation's three); a reader (the CLI's
`events`, the console's lists) sees the changes of one subject by one cause, each starting where the one
before ended and close together, folded into one row with the whole chain. Pure: rows in, rows out."""

from __future__ import annotations

import datetime as dt
from typing import Any

FOLD_WITHIN_S = 120  # an object's changes this close together, of one cause, are one task's


def _moment(row: dict[str, Any]) -> dt.datetime | None:
    at = row.get("at")
    if isinstance(at, str):
        try:
            at = dt.datetime.fromisoformat(at.replace("Z", "+00:00"))
        except ValueError:
            return None
    if not isinstance(at, dt.datetime):
        return None
    return at if at.tzinfo else at.replace(tzinfo=dt.UTC)  # the store's naive times are UTC


def fold(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`rows` newest first (as listed); each returned row is the last change of its group, with `states` (the
    whole chain, first old state first) and the last non-empty message; newest first."""
    folded: list[dict[str, Any]] = []
    open_rows: dict[tuple[str, str], dict[str, Any]] = {}
    for row in reversed(rows):  # oldest first
        key = (row["kind"], row["subject"])
        last = open_rows.get(key)
        at = _moment(row)
        last_at = _moment(last) if last is not None else None
        if (
            last is not None
            and last["cause"] == row["cause"]
            and last.get("new_state") == row.get("old_state")
            and at is not None
            and last_at is not None
            and (at - last_at).total_seconds() <= FOLD_WITHIN_S
        ):
            last["states"].append(row.get("new_state"))
            last.update(id=row["id"], at=row["at"], new_state=row.get("new_state"))
            last["message"] = row.get("message") or last.get("message")
            folded.remove(last)
            folded.append(last)
            continue
        entry = {**row, "states": [row.get("old_state"), row.get("new_state")]}
        open_rows[key] = entry
        folded.append(entry)
    return list(reversed(folded))


def chain(row: dict[str, Any]) -> str:
    """`running -> stopping -> stopped`; a missing state (a creation's before, a report's after) is `-`."""
    states = row.get("states") or [row.get("old_state"), row.get("new_state")]
    return " -> ".join(state or "-" for state in states)
