"""Rules of `volume move` and of a stopped VM's cold migration (issue 32): which way a volume moves to another
pool (a live block copy, a copy by one host that sees both pools, a copy between two hosts), or why it can
not; and which disks of a stopped VM follow it to another host, onto which pool. Pure: plain data in, a plan
or a refusal (naming the field) out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vmplane.core.storagerules import PoolView
from vmplane.core.units import format_mib

LIVE, COLD, ACROSS = "live", "cold", "across"
MOVABLE_VM_STATES = ("running", "stopped")


@dataclass(frozen=True)
class MoveRequest:
    volume: str
    state: str  # the volume's
    size_mib: int
    source: PoolView
    target: PoolView
    source_hosts: frozenset[str]  # hosts that open the source pool's files
    target_hosts: frozenset[str]  # ... the target pool's
    overlays: int = 0  # files of its snapshot chain beyond its own
    copying: str | None = None  # a migration's copy of it not deleted yet: that pool's name
    vm: str | None = None
    vm_state: str | None = None
    vm_host: str | None = None  # where it runs
    ha: bool = False  # its VM is restarted elsewhere when its host fails
    others_reach: frozenset[str] | None = None  # hosts that open every other disk of its VM (None: it has none)
    across_hosts: bool = False  # a cold migration: a copy between two hosts' pools is allowed


@dataclass(frozen=True)
class MovePlan:
    how: str  # LIVE, COLD or ACROSS
    hosts: tuple[str, ...]  # live: its VM's host; cold: the hosts that see both pools; across: (source, target)


@dataclass(frozen=True)
class Refusal:
    kind: str  # invalid (422), conflict (409), capacity (409, no room)
    field: str
    message: str


def plan_move(r: MoveRequest) -> MovePlan | Refusal:
    """How volume `r.volume` moves to pool `r.target`, or why it does not (the first reason found)."""
    v, target = r.volume, r.target
    if target.name == r.source.name:
        return Refusal("invalid", "pool", f"volume {v} is on pool {target.name} already")
    if r.state == "moving":
        return Refusal("conflict", "volume", f"volume {v} is being moved already; retry once it moved")
    if r.state not in ("attached", "available"):
        return Refusal("conflict", "volume", f"volume {v} is {r.state}; move it once it is attached or available")
    if r.copying is not None:
        return Refusal(
            "conflict",
            "volume",
            f"volume {v} still has a copy on pool {r.copying} from a migration, being deleted; retry in a moment",
        )
    if r.overlays:
        return Refusal(
            "conflict",
            "volume",
            f"volume {v} is a chain of {r.overlays} file(s) beyond its own (snapshot overlays, or a linked clone's "
            "base): delete its VM's snapshots (a linked clone: clone it --full) "
            "before moving it (a move copies one file)",
        )
    if r.vm is not None and r.vm_state not in MOVABLE_VM_STATES:
        return Refusal("conflict", "vm", f"vm {r.vm} is {r.vm_state}; move its disks once it is running or stopped")
    if target.state != "running":
        return Refusal("conflict", "pool", f"pool {target.name} is {target.state}")
    if r.ha and target.kind == "local":
        return Refusal(
            "conflict",
            "pool",
            f"vm {r.vm} has --ha restart: pool {target.name} is local to {target.host}, and the disk would be "
            "lost with its host; move it to a shared pool",
        )
    if r.others_reach is not None and not (r.others_reach & r.target_hosts):
        return Refusal(
            "conflict",
            "pool",
            f"no host opens pool {target.name} and the other disks of vm {r.vm} together: it could not start",
        )
    if target.free_mib < r.size_mib:
        return Refusal(
            "capacity",
            "pool",
            f"pool {target.name}: {format_mib(max(target.free_mib, 0))} free of {format_mib(target.capacity_mib)}, "
            f"volume {v} takes {format_mib(r.size_mib)}",
        )
    if r.vm is not None and r.vm_state == "running":
        if r.vm_host not in r.target_hosts:
            return Refusal(
                "conflict",
                "pool",
                f"vm {r.vm} runs on {r.vm_host}, which does not see pool {target.name}"
                + (f" (local to {target.host})" if target.kind == "local" else f" (of cluster {target.cluster})"),
            )
        return MovePlan(LIVE, (r.vm_host or "",))
    both = r.source_hosts & r.target_hosts
    if both:
        return MovePlan(COLD, tuple(sorted(both)))
    if r.across_hosts and r.source_hosts and r.target_hosts:
        return MovePlan(ACROSS, (sorted(r.source_hosts)[0], sorted(r.target_hosts)[0]))
    return Refusal(
        "conflict",
        "pool",
        f"no host sees both pool {r.source.name} ({_where(r.source)}) and pool {target.name} ({_where(target)}): "
        + (
            f"a stopped VM's local disks move to another host with `vmplane vm migrate {r.vm} --to HOST`"
            if r.vm is not None
            else "attach the volume to a stopped VM and migrate it, or move it through a shared pool"
        ),
    )


def _where(pool: PoolView) -> str:
    return f"local to {pool.host}" if pool.kind == "local" else f"shared in cluster {pool.cluster}"


@dataclass(frozen=True)
class DiskFollow:
    volume: str
    size_mib: int
    source: str  # its pool
    target: str | None  # the pool it is copied to; None: it stays (the host opens it where it is)


def plan_cold_migration(
    vm: str, disks: Sequence[tuple[str, int, PoolView]], pools: Sequence[PoolView], to: str, to_cluster: str
) -> list[DiskFollow] | Refusal:
    """Where each disk of stopped VM `vm` goes for it to start on host `to`: a disk on a pool `to` opens stays;
    one on another host's local pool is copied to a running local pool of `to` with room (the same path
    first, then the most free space; several disks on one pool must fit together); a shared pool of another
    cluster is refused."""
    free = {p.name: p.free_mib for p in pools}
    out = []
    for name, size, pool in disks:
        if pool.reaches(to, to_cluster):
            out.append(DiskFollow(name, size, pool.name, None))
            continue
        if pool.kind == "shared":
            return Refusal(
                "conflict",
                "to",
                f"vm {vm}'s disk {name} is on pool {pool.name}, shared in cluster {pool.cluster}; {to} is in "
                f"cluster {to_cluster}",
            )
        mine = [p for p in pools if p.kind == "local" and p.host == to and p.state == "running"]
        fits = [p for p in mine if free[p.name] >= size]
        if not fits:
            room = ", ".join(f"{p.name} {format_mib(max(free[p.name], 0))} free" for p in mine) or "no local pool"
            return Refusal(
                "capacity",
                "to",
                f"vm {vm}'s disk {name} ({format_mib(size)}, on {pool.name}, local to {pool.host}) has no room on "
                f"{to}: {room}",
            )
        chosen = sorted(fits, key=lambda p: (p.path != pool.path, -free[p.name], p.name))[0]
        free[chosen.name] -= size
        out.append(DiskFollow(name, size, pool.name, chosen.name))
    return out
