"""Backups' rules (issue 32), pure: whether a backup is full or incremental, what it is charged before it is
written, and which backups may be deleted.

A backup holds every disk of its VM. A disk is incremental on the VM's last ready backup in the same store when
libvirt's checkpoint of that backup still describes it: the disk's active file is the one the checkpoint's
bitmap lives in (a snapshot or a revert since puts a new file on top: its writes are in no bitmap, so that
disk is copied whole). A backup is charged at its disks' sizes before anything is written (the larger size,
as for anything not known yet), then at what its files take once read back. A backup another one is
incremental on is deleted only after it (a chain never dangles)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

MIB = 1 << 20


@dataclass(frozen=True)
class Last:
    """The VM's last ready backup in the store: its id, checkpoint, and each disk's active file then (by volume)."""

    id: int
    checkpoint: str
    disk_files: dict[str, str]


def choose_kind(
    full_asked: bool, last: Last | None, disk_files: dict[str, str]
) -> tuple[str, int | None, dict[str, str], str]:
    """(kind, parent id, each volume's mode, why) of a new backup of disks whose active files (by volume) are
    `disk_files` now. A disk is incremental on the last backup when that backup holds the same volume and the
    file its checkpoint's bitmap is in is still the disk's active file; else full (a snapshot, a revert or a
    restore since, or a volume attached since). The backup is incremental when one of its disks is."""
    full = dict.fromkeys(disk_files, "full")
    if full_asked:
        return "full", None, full, "a full backup was asked"
    if last is None:
        return "full", None, full, "no earlier backup of this VM in this store"
    modes = {v: "incremental" if last.disk_files.get(v) == f else "full" for v, f in disk_files.items()}
    if "incremental" not in modes.values():
        return "full", None, modes, f"a snapshot or a revert since backup {last.id} put a new file on every disk"
    why = f"the changes since backup {last.id} (checkpoint {last.checkpoint})"
    fresh = sorted(v for v, m in modes.items() if m == "full")
    if fresh:
        why += f"; {', '.join(fresh)} whole (a new file or a new disk since)"
    return "incremental", last.id, modes, why


def charge_before_mib(disk_mibs: list[int]) -> int:
    """What a backup is charged before it is written: its disks' sizes (it holds at most that)."""
    return sum(disk_mibs)


def charge_after_mib(file_bytes: list[int]) -> int:
    """What a written backup is charged: each of its files' size, whole MiB up."""
    return sum(max(1, -(-b // MIB)) for b in file_bytes)


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
