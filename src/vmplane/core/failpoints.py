"""Named crash points for crash tests, in the manner of etcd's gofail.

Each multi-step operation passes a named point between persisting a step and acting on it (or
between acting and persisting the result). A crash test arms one point, `VMPLANE_FAILPOINTS=name=N`
in the environment or `arm({name: N})` in a forked child, and the process kills itself with SIGKILL
the N-th time it passes there: no `finally`, no flush, exactly what a power cut or an OOM kill does
to the control plane. `VMPLANE_FAILPOINT_SIGNAL=STOP` makes it stop itself (SIGSTOP) there instead:
every thread frozen at once, as a process paused past its lease (the test resumes it with SIGCONT).
Unarmed, a point costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
import threading

# Every point, so a crash test can cover them all (and a test checks each is reached).
POINTS = (
    "start.admitted",  # the start is committed (VM starting, claim taken), no domain yet
    "start.before-domain",  # the operation has persisted its step; the domain is not started
    "start.after-domain",  # the host runs the domain; the store still says starting
    "stop.admitted",
    "stop.before-domain",
    "stop.after-domain",  # the domain is gone; its claim and charge are still held
    "migrate.admitted",  # target claimed, migration queued
    "migrate.copying",  # persisted as copying; the copy has not begun
    "migrate.mid-copy",  # memory is being copied
    "migrate.after-copy",  # the target runs the domain; the store says copying
    "migrate.checked",  # the guest answered on the target; claims not yet moved
    "scale.admitted",  # increase charged and claimed; nothing changed on the host
    "scale.migrating",  # a scale that needs room: about to admit its migration
    "scale.after-migration",  # the VM moved; the growth is not yet claimed on its new host
    "scale.after-memory",  # the guest has its new memory; vCPUs and the cap not yet changed
    "scale.before-commit",  # every driver step done; the store still has the old size
    "drain.mid",  # the host is in maintenance and some of its VMs are admitted to migrate
    "volume.before-create",  # the volume's row is charged (creating); no file on the pool yet
    "volume.after-create",  # the pool has the file; the store still says creating
    "volume.before-attach",  # the store says attaching; the domain has not been asked
    "volume.before-detach",  # the store says detaching; the domain has not been asked
    "volume.before-delete",  # the store says deleting; the file is still on the pool
    "nic.before-attach",  # the store says attaching (the NIC allocated); the domain has not been asked
    "nic.before-detach",  # the store says detaching; the domain has not been asked
    "snapshot.before-take",  # a snapshot recorded taking, its overlays charged; the host not asked
    "snapshot.after-take",  # the host made the overlays (a running domain writes them); the store says taking
    "snapshot.before-revert",  # the store says reverting, the new overlays charged; the pool not asked
    "snapshot.before-merge",  # a chain file recorded merging; the live block commit not asked
    "backup.before-write",  # a backup recorded running and charged; its file not made, no job
    "backup.after-write",  # the job wrote the file and took the checkpoint; the store says running
    "backup.mid-rewrite",  # a prune deleted a kept backup's file to make it whole; its whole copy not put back
    "network.before-apply",  # a host is about to be brought to the store's view; it holds what it held before
    "ha.before-fenced",  # a fence agent confirmed the host off; the store still says fencing
    "ha.fenced",  # the host is recorded fenced; none of its VMs restarted yet
    "ha.claimed",  # an HA VM's claim moved to its new host (starting); no domain there yet
    "ha.before-domain",  # its restart operation persisted its step; the domain is not started
)

# Points inside a transaction, for a test that freezes the process there (VMPLANE_FAILPOINT_SIGNAL=STOP): its
# PostgreSQL session then holds its locks. Not among POINTS: a kill there only rolls the transaction back, which
# the crash harness's timed kills already do.
FROZEN_POINTS = (
    "admission.serialised",  # an admission holds the admissions' lock (PostgreSQL), no row read yet
)

_armed: dict[str, int] = {}
_lock = threading.Lock()


def parse(spec: str) -> dict[str, int]:
    """`name=N,name2=M` (N defaults to 1)."""
    armed = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, count = item.partition("=")
        if name not in POINTS + FROZEN_POINTS:
            raise ValueError(f"unknown failpoint {name!r}; known: {', '.join(POINTS + FROZEN_POINTS)}")
        armed[name] = int(count or 1)
    return armed


def arm(points: dict[str, int]) -> None:
    with _lock:
        _armed.clear()
        _armed.update(points)


def hit(name: str) -> None:
    """Pass the point `name`: kill this process if it is armed and this is its N-th pass."""
    if not _armed:
        return
    with _lock:
        left = _armed.get(name)
        if left is None:
            return
        _armed[name] = left - 1
        if left > 1:
            return
    os.kill(os.getpid(), _SIGNAL)


_SIGNAL = signal.SIGSTOP if os.environ.get("VMPLANE_FAILPOINT_SIGNAL", "").upper() == "STOP" else signal.SIGKILL


arm(parse(os.environ.get("VMPLANE_FAILPOINTS", "")))
