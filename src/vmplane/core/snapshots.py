"""Disk snapshots' rules (issue 32), pure: a VM's disks as chains of qcow2 files, and what taking, reverting
to and deleting a snapshot does to them. External snapshots, their metadata in vmplane's store (libvirt keeps
none: a VM with snapshots still live-migrates).

A volume's **active** file is the top of its chain (the one the domain writes). Each file has a parent (its
qcow2 backing file; the first one's parent is the template's image, outside the volume's files). Taking
snapshot S freezes each disk's active file as S's **base** and puts a new empty overlay on top of it: the
overlay is the new active file. Reverting to S (a stopped VM) puts a new empty overlay on S's base, so the
VM sees the disk as it was when S was taken; the files no snapshot and no active chain needs any more are
deleted. Deleting S drops it; its base goes once nothing needs it, and a file with one child left is merged
into that child (`mergeable`), so chains do not only grow. A file is never deleted while any chain needs it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
MAX_SNAPSHOTS = 32  # per VM: a longer chain slows every read of the disk


@dataclass(frozen=True)
class Snapshot:
    name: str
    bases: Mapping[str, str]  # volume -> the file that was active when it was taken (read-only since)


@dataclass
class Disks:
    """A VM's disks: each volume's active file, and every file's parent (None: the template's image)."""

    active: dict[str, str]
    parent: dict[str, str | None] = field(default_factory=dict)

    def chain(self, file: str) -> list[str]:
        """`file` and its ancestors among the volume files, the file first."""
        out = []
        current: str | None = file
        while current is not None:
            out.append(current)
            current = self.parent.get(current)
        return out


def name_problem(name: str, taken: set[str]) -> str | None:
    """Why `name` can not name a new snapshot of a VM whose snapshots are `taken`, or None."""
    if not NAME_RE.match(name):
        return f"{name!r} is not a snapshot name: lowercase letters, digits and '-', at most 63, not ending in '-'"
    if name in taken:
        return f"the VM already has a snapshot named {name}"
    if len(taken) >= MAX_SNAPSHOTS:
        return f"the VM has {len(taken)} snapshots already, the most it may have; delete one first"
    return None


def take(disks: Disks, name: str, overlays: Mapping[str, str]) -> tuple[Snapshot, Disks]:
    """Snapshot `name` of every disk: each active file becomes its base, `overlays[volume]` (a new empty file
    on top of it) the new active file."""
    if set(overlays) != set(disks.active):
        raise ValueError("one new overlay per disk")
    snap = Snapshot(name, dict(disks.active))
    parent = dict(disks.parent)
    for volume, overlay in overlays.items():
        parent[overlay] = disks.active[volume]
    return snap, Disks(dict(overlays), parent)


def revert(disks: Disks, snap: Snapshot, overlays: Mapping[str, str]) -> Disks:
    """The disks as `snap` saw them: a new empty overlay (`overlays[volume]`) on each base of the snapshot.
    A disk added after the snapshot keeps its active file (the snapshot knows nothing of it)."""
    if set(overlays) != set(snap.bases):
        raise ValueError("one new overlay per disk of the snapshot")
    parent = dict(disks.parent)
    active = dict(disks.active)
    for volume, overlay in overlays.items():
        parent[overlay] = snap.bases[volume]
        active[volume] = overlay
    return Disks(active, parent)


def needed(disks: Disks, snaps: list[Snapshot]) -> set[str]:
    """Every file an active chain or a snapshot's base chain reads."""
    out: set[str] = set()
    for file in list(disks.active.values()) + [b for s in snaps for b in s.bases.values()]:
        out.update(disks.chain(file))
    return out


def garbage(disks: Disks, snaps: list[Snapshot]) -> set[str]:
    """The files nothing needs any more: deleted (after the host confirmed the new chain)."""
    return set(disks.parent) - needed(disks, snaps)


def mergeable(disks: Disks, snaps: list[Snapshot]) -> list[tuple[str, str]]:
    """(file, its only child) pairs where no snapshot names the file as its base: the child may be committed
    down into it (qemu-img commit / a live block commit) and the chain shortened by one. Top-down order."""
    keep = needed(disks, snaps)
    bases = {b for s in snaps for b in s.bases.values()}
    children: dict[str, list[str]] = {}
    for file, parent in disks.parent.items():
        if file in keep and parent is not None:
            children.setdefault(parent, []).append(file)
    return sorted(
        ((p, kids[0]) for p, kids in children.items() if len(kids) == 1 and p not in bases and p in disks.parent),
        key=lambda pair: -len(disks.chain(pair[1])),
    )


def charge_mib(disk_sizes_mib: Mapping[str, int], files_per_volume: Mapping[str, int]) -> int:
    """What a VM's snapshot files count in its project's storage quota: each file beyond a disk's first may
    grow to the disk's size (an overlay holds what was written since): the larger size, as for anything not
    known yet."""
    return sum(size * max(0, files_per_volume.get(v, 1) - 1) for v, size in disk_sizes_mib.items())


def migration_problem(local_pool: bool, overlays: int) -> str | None:
    """Why a VM whose disks are chains (`overlays`: files beyond each disk's first) can not live-migrate now:
    on a local pool the whole chain would have to be copied, which this version does not do (a shared pool
    copies nothing)."""
    if local_pool and overlays:
        return (
            f"its disks on a local pool are chains of snapshot overlays ({overlays} file(s) beyond the disks): a "
            "live migration copies only the top of a chain; delete its snapshots or move its disks to a shared "
            "pool first"
        )
    return None
