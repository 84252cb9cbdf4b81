"""Storage rules (pure): which pool takes a disk, a root disk's size, guest device names, and how a
migration treats each disk of a VM. Plain data in, decisions or errors out; the shell (pools.py,
volumes.py, the migrator) reads the store and the hosts around them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from vmplane.core.errors import Conflict, InsufficientCapacity, Invalid
from vmplane.core.units import format_mib

LOCAL_PATH = "/var/lib/vmplane/local"  # a host's own disk: the default path of a local pool
SHARED_PATH = "/var/lib/vmplane/shared"  # the mount every host of a cluster shares: shared pools below it
IMAGES_PATH = "/var/lib/vmplane/images"  # the image store every host sees: template images
IMAGE_POOL = "vmplane-images"  # the libvirt pool of the image store, on every host
VOLUME_PREFIX = "vmp-"  # files of vmplane's volumes: the audit knows them by it
POOL_KINDS = ("local", "shared")
MAX_DATA_VOLUMES = 16


@dataclass(frozen=True)
class PoolView:
    """A pool as the rules see it: where it is, its size and what vmplane's volumes take of it."""

    name: str
    kind: str  # local / shared
    cluster: str
    host: str | None  # a local pool's host
    path: str
    state: str
    capacity_mib: int
    used_mib: int

    @property
    def free_mib(self) -> int:
        return self.capacity_mib - self.used_mib

    def reaches(self, host: str, cluster: str) -> bool:
        """Whether a domain on `host` (of `cluster`) can open this pool's files."""
        return self.host == host if self.kind == "local" else self.cluster == cluster


def volume_file(volume: str, format: str) -> str:
    """The file name of a vmplane volume in its pool."""
    return f"{VOLUME_PREFIX}{volume}.{format}"


def default_pool_path(kind: str, name: str) -> str:
    """A local pool is the host's own folder (the same path on every host: a disk copied by a migration
    lands at the same path); a shared pool is a folder of the shared mount."""
    return LOCAL_PATH if kind == "local" else f"{SHARED_PATH}/{name}"


def check_pool_request(kind: str, host: str | None, cluster: str | None, path: str | None) -> None:
    if kind not in POOL_KINDS:
        raise Invalid(f"kind must be one of {', '.join(POOL_KINDS)}, not {kind!r}", field="kind")
    if kind == "local" and not host:
        raise Invalid("a local pool belongs to a host: give --host", field="host")
    if kind == "shared" and host:
        raise Invalid("a shared pool belongs to a cluster, not to a host: give --cluster", field="host")
    if kind == "shared" and not cluster:
        raise Invalid("a shared pool needs --cluster (every host of it sees the pool)", field="cluster")
    if path is not None and (not path.startswith("/") or ".." in path.split("/") or len(path) > 1000):
        raise Invalid("path must be an absolute folder path without '..'", field="path")


def root_disk_size(
    template_mib: int, offering_mib: int | None, offering_max_mib: int | None, asked_mib: int | None, offering: str
) -> int:
    """A root disk is at least its image (a qcow2 overlay can not be smaller than what it backs). Without
    an ask it takes the offering's size, else the image's. An offering with a maximum allows asks up to
    it; one without allows only that default size."""
    default = offering_mib or template_mib
    if asked_mib is None:
        size = default
    else:
        if asked_mib <= 0:
            raise Invalid(f"root_disk_mib must be greater than zero, got {asked_mib}", field="root_disk_mib")
        if offering_max_mib is None and asked_mib != default:
            raise Invalid(
                f"offering {offering} is fixed at a {format_mib(default)} root disk "
                f"({'its size' if offering_mib else 'the template image'}); {format_mib(asked_mib)} "
                f"cannot be asked for",
                field="root_disk_mib",
            )
        if offering_max_mib is not None and asked_mib > offering_max_mib:
            raise Invalid(
                f"root_disk_mib={asked_mib} is above offering {offering}'s maximum {format_mib(offering_max_mib)}",
                field="root_disk_mib",
            )
        size = asked_mib
    if size < template_mib:
        raise Invalid(
            f"root_disk_mib={size} is smaller than the template image ({format_mib(template_mib)})",
            field="root_disk_mib",
        )
    return size


def choose_pool(
    pools: Sequence[PoolView],
    need_mib: int,
    *,
    name: str | None = None,
    host: str | None = None,
    cluster: str | None = None,
    hosts_in_scope: Iterable[str] | None = None,
    clusters: Iterable[str] | None = None,
) -> PoolView:
    """The pool a new disk goes to. Named: that pool, if it has room and reaches `host` (when the VM
    is placed). Else: a shared pool of the VM's cluster (its VM can then run on any host of it), else a
    local pool of its host (or, while it is not placed, of any host in scope), the one with the most
    room first; `clusters`: only in those (a VM not placed yet: its zone's). Refusals name each pool and why."""
    allowed = set(clusters) if clusters is not None else None
    if name is not None:
        pool = next((p for p in pools if p.name == name), None)
        if pool is None:
            raise Invalid(f"pool {name!r} does not exist", field="pool")
        reason = pool_refusal(pool, need_mib, host, cluster, None, allowed)
        if reason:
            raise InsufficientCapacity(f"pool {name}: {reason}", field="pool")
        return pool
    scope = set(hosts_in_scope) if hosts_in_scope is not None else None
    fits, refusals = [], []
    for pool in pools:
        reason = pool_refusal(pool, need_mib, host, cluster, scope, allowed)
        (refusals.append(f"{pool.name}: {reason}") if reason else fits.append(pool))
    if not fits:
        shown = "; ".join(refusals[:5]) or "no pool exists (pool create)"
        raise InsufficientCapacity(f"no pool can hold a {format_mib(need_mib)} disk: {shown}", field="pool")
    return min(fits, key=lambda p: (p.kind != "shared", -p.free_mib, p.name))


def pool_refusal(
    pool: PoolView,
    need_mib: int,
    host: str | None,
    cluster: str | None,
    scope: set[str] | None,
    clusters: set[str] | None = None,
) -> str | None:
    """Why `pool` can not take a disk of `need_mib` for a VM on `host` / in `cluster` / within the hosts
    of `scope` / in one of `clusters` (each None: any), in words; None when it can."""
    if pool.state != "running":
        return f"is {pool.state}"
    if cluster is not None and pool.cluster != cluster:
        return f"is in cluster {pool.cluster}, not {cluster}"
    if clusters is not None and pool.cluster not in clusters:
        return f"is in cluster {pool.cluster}, outside the VM's zone"
    if host is not None and pool.kind == "local" and pool.host != host:
        return f"is local to {pool.host}, the VM runs on {host}"
    if scope is not None and pool.kind == "local" and pool.host not in scope:
        return f"is local to {pool.host}, outside the VM's scope"
    if pool.free_mib < need_mib:
        return (
            f"{format_mib(max(pool.free_mib, 0))} free of {format_mib(pool.capacity_mib)}, {format_mib(need_mib)} asked"
        )
    return None


def next_device(used: Iterable[str]) -> str:
    """The first free virtio device name after vda (the root disk's)."""
    taken = set(used)
    for i in range(1, MAX_DATA_VOLUMES + 1):
        dev = "vd" + chr(ord("a") + i)
        if dev not in taken:
            return dev
    raise Conflict(f"a VM takes at most {MAX_DATA_VOLUMES} volumes", field="vm")


@dataclass(frozen=True)
class DiskMove:
    """What a migration does with one disk: `shared` (the target opens the same file), or `copy` (its
    overlay is copied to `target_pool` on the target host, which must have `size_mib` free)."""

    volume: str
    device: str
    how: str  # shared / copy
    source_pool: str
    target_pool: str
    size_mib: int


def plan_disk_moves(
    disks: Sequence[tuple[str, str, int, str]], pools: Sequence[PoolView], target_host: str, target_cluster: str
) -> list[DiskMove]:
    """For each disk (volume, device, size, pool) of a VM: shared when its pool is shared and reaches
    the target; else copied to a local pool of the target host at the same path (the domain's
    definition names the same file there), with room for it. Refused naming the disk when neither
    holds: a migration never starts that would leave a disk behind."""
    by_pool = {p.name: p for p in pools}
    moves: list[DiskMove] = []
    taken: dict[str, int] = {}
    for volume, device, size, pool_name in disks:
        source = by_pool[pool_name]
        if source.kind == "shared":
            if source.cluster != target_cluster:
                raise Conflict(
                    f"volume {volume} is on shared pool {source.name} of cluster {source.cluster}; "
                    f"{target_host} is in cluster {target_cluster} and can not open it",
                    field="to",
                )
            moves.append(DiskMove(volume, device, "shared", source.name, source.name, size))
            continue
        target = _copy_target(source, by_pool.values(), target_host, size + taken.get(source.path, 0))
        if target is None:
            raise InsufficientCapacity(
                f"volume {volume} is on {source.name}, local to {source.host}: {target_host} has no running local "
                f"pool at {source.path} with {format_mib(size)} free to copy it to",
                field="to",
            )
        taken[source.path] = taken.get(source.path, 0) + size
        moves.append(DiskMove(volume, device, "copy", source.name, target.name, size))
    return moves


def _copy_target(source: PoolView, pools: Iterable[PoolView], host: str, need_mib: int) -> PoolView | None:
    fits = [
        p
        for p in pools
        if p.kind == "local"
        and p.host == host
        and p.path == source.path
        and p.state == "running"
        and p.free_mib >= need_mib
    ]
    return max(fits, key=lambda p: p.free_mib, default=None)
