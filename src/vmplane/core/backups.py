"""Backups' rules (issue 32), pure: whether a backup is full or incremental, what it is charged before it is
written, and which backups may be deleted.

A backup is incremental on the VM's last ready backup in the same store when libvirt's checkpoint of that
backup still describes the disk: the disk's active file is the one the checkpoint's bitmap lives in (a
snapshot or a revert since puts a new file on top: its writes are in no bitmap, so the next backup is full).
A backup is charged at its disk's size before anything is written (the larger size, as for anything not
known yet), then at what its file takes once read back. A backup another one is incremental on is deleted
only after it (a chain never dangles)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

MIB = 1 << 20


@dataclass(frozen=True)
class Last:
    """The VM's last ready backup in the store: its id, checkpoint and the disk's active file then."""

    id: int
    checkpoint: str
    disk_file: str


def choose_kind(full_asked: bool, last: Last | None, disk_file: str) -> tuple[str, int | None, str]:
    """(kind, parent id, why) of a new backup of a disk whose active file is `disk_file` now."""
    if full_asked:
        return "full", None, "a full backup was asked"
    if last is None:
        return "full", None, "no earlier backup of this VM in this store"
    if last.disk_file != disk_file:
        return "full", None, f"a snapshot or a revert since backup {last.id} put a new file on the disk"
    return "incremental", last.id, f"the changes since backup {last.id} (checkpoint {last.checkpoint})"


def charge_before_mib(disk_mib: int) -> int:
    """What a backup is charged before it is written: its disk's size (it holds at most that)."""
    return disk_mib


def charge_after_mib(file_bytes: int) -> int:
    """What a written backup is charged: its file's size, whole MiB up."""
    return max(1, -(-file_bytes // MIB))


def delete_problem(backup_id: int, children: list[int]) -> str | None:
    """Why backup `backup_id` can not be deleted now: a later one is incremental on it."""
    if children:
        later = ", ".join(str(c) for c in sorted(children))
        return f"backup {backup_id} is the base of backup {later}: delete {later} first (a chain never dangles)"
    return None


def checkpoint_name(vm_id: int, backup_id: int) -> str:
    return f"vmp-{vm_id}-{backup_id}"


def kept(backups: list[tuple[int, dt.datetime]], keep_last: int | None, keep_daily: int | None) -> set[int]:
    """The backups (id, taken at) a retention keeps: the `keep_last` newest, and the newest of each of the
    `keep_daily` most recent days that have one. With neither given, all of them."""
    if keep_last is None and keep_daily is None:
        return {b for b, _ in backups}
    newest_first = sorted(backups, key=lambda b: (b[1], b[0]), reverse=True)
    keep = {b for b, _ in newest_first[: keep_last or 0]}
    days: list[dt.date] = []
    for b, at in newest_first:
        if keep_daily and at.date() not in days and len(days) < keep_daily:
            days.append(at.date())
            keep.add(b)
    return keep


def prune_order(pruned: set[int], parent: dict[int, int | None]) -> list[tuple[int, list[int]]]:
    """(backup, its children that stay) for each pruned backup, newest first: a kept child is made whole (a
    full copy of its chain) before its parent goes, so that no backup is left on a missing file."""
    children: dict[int, list[int]] = {}
    for b, p in parent.items():
        if p is not None:
            children.setdefault(p, []).append(b)
    return [(b, sorted(c for c in children.get(b, []) if c not in pruned)) for b in sorted(pruned, reverse=True)]


def next_run(cron: str, after: dt.datetime) -> dt.datetime:
    """The first time after `after` (UTC, naive) that the cron expression names; Invalid-worthy ValueError
    naming the expression when it is not one (5 fields: minute hour day month weekday)."""
    from croniter import croniter

    if len(cron.split()) != 5 or not croniter.is_valid(cron):
        raise ValueError(f"{cron!r} is not a cron expression (5 fields: minute hour day-of-month month day-of-week)")
    nxt: dt.datetime = croniter(cron, after).get_next(dt.datetime)
    return nxt
