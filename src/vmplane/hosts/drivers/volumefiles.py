"""Whether a volume file found in a pool is the one a create asked for (review N2). Both drivers'
`create_volume` return a file already there only if it is (a create retried after a crash), and
vmplane adopts no other: a file with another format, another backing image or a smaller size was made
for something else, maybe another tenant's disk."""

from __future__ import annotations

import os

from vmplane.core.driver import VolumeInfo


def same_volume(found: VolumeInfo, format: str, backing: str | None, capacity_mib: int = 0) -> bool:
    """Same format and backing image, and at least `capacity_mib` (the drivers leave the size to their
    caller: a create retried with a larger size returns the file as it is, and vmplane compares)."""

    def path(p: str | None) -> str | None:
        return os.path.normpath(p) if p else None

    return found.format == format and found.capacity_mib >= capacity_mib and path(found.backing) == path(backing)
