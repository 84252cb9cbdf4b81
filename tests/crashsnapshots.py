"""The crash harness's snapshot and backup steps (issue 32), for tests/crashkit.py: snapshots taken of VMs
with disks (running or stopped), reverted (stopped VMs), deleted (a running VM's chain then merged live);
backups of running VMs (full or incremental), the newest deleted; the steps toward each of their crash
points, and what must hold after a restart: no snapshot left in a step, no chain file left pending, merging
or deleting (its pool answering), no backup left running or deleting, every overlay in a pool owned and the
backup charge exact (the audit)."""

from __future__ import annotations

from vmplane.store import snapshots as S
from vmplane.store import storageledger as SL

TRIES = 5


def _with_disks(o, *states: str) -> list[str]:
    with o.db.read() as s:
        vm_ids = {v.vm_id for v in SL.volume_rows(s.connection()) if v.vm_id is not None}
    return [v.name for v in o.vms() if v.state in states and v.id in vm_ids]


def _snapshots(o, vm: str) -> list[str]:
    return [s["name"] for s in o.snapshots.listing(vm) if s["state"] == "ready"]


def _with_snapshots(o, *states: str) -> list[str]:
    return [vm for vm in _with_disks(o, *states) if _snapshots(o, vm)]


def take(o, rng, n):
    """A snapshot of a VM with disks (running mostly)."""
    running, stopped = _with_disks(o, "running"), _with_disks(o, "stopped")
    if pick := (running if running and rng.random() < 0.7 else running + stopped):
        o.snapshots.take(rng.choice(pick), f"s{n}-{rng.randrange(1000)}")


def revert(o, rng, n):
    if pick := _with_snapshots(o, "stopped"):
        vm = rng.choice(pick)
        o.snapshots.revert(vm, rng.choice(_snapshots(o, vm)))


def delete(o, rng, n):
    """A snapshot deleted (of a running VM mostly: its chain is merged live)."""
    running, stopped = _with_snapshots(o, "running"), _with_snapshots(o, "stopped")
    if pick := (running if running and rng.random() < 0.7 else running + stopped):
        vm = rng.choice(pick)
        o.snapshots.delete(vm, rng.choice(_snapshots(o, vm)))


def backup(o, rng, n):
    """A backup of a running VM with disks (full now and then)."""
    if pick := _with_disks(o, "running"):
        o.backups.create(rng.choice(pick), full=rng.random() < 0.2)


def delete_backup(o, rng, n):
    """A backup no later one builds on, deleted."""
    with o.db.read() as s:
        from vmplane.store import backups as BK

        conn = s.connection()
        leaves = [b.id for b in BK.backup_rows(conn) if b.state == "ready" and not BK.children(conn, b.id)]
    if leaves:
        o.backups.delete(rng.choice(leaves))


def prune(o, rng, n):
    """A VM's backups pruned to its newest one (made whole first when it builds on another)."""
    if pick := sorted({b["vm"] for b in o.backups.listing() if b["state"] == "ready"}):
        o.backups.prune(rng.choice(pick), keep_last=1, keep_daily=None)


ACTIONS = ((take, 2), (revert, 1), (delete, 1), (backup, 2), (delete_backup, 1), (prune, 1))


def _first(attempts) -> bool:
    from .crashkit import _first_accepted  # (crashkit imports this module)

    return _first_accepted(attempts)


def toward_take(o, rng, n):
    vms = _with_disks(o, "running", "stopped")
    rng.shuffle(vms)
    if not _first([lambda v=v: o.snapshots.take(v, f"s{n}-{rng.randrange(1000)}") for v in vms[:TRIES]]):
        from .crashkit import _create

        _create(o, rng, n)


def toward_revert(o, rng, n):
    """A stopped VM with a snapshot reverted; else a stopped VM with disks snapshotted; else a running one
    with a snapshot stopped; else a snapshot taken."""
    stopped = _with_snapshots(o, "stopped")
    rng.shuffle(stopped)
    if _first([lambda v=v: o.snapshots.revert(v, rng.choice(_snapshots(o, v))) for v in stopped[:TRIES]]):
        return
    cold = _with_disks(o, "stopped")
    if _first([lambda v=v: o.snapshots.take(v, f"s{n}-{rng.randrange(1000)}") for v in cold[:TRIES]]):
        return
    if _first([lambda v=v: o.stop_vm(v, force=True) for v in _with_snapshots(o, "running")[:TRIES]]):
        return
    toward_take(o, rng, n)


def toward_merge(o, rng, n):
    """A running VM's snapshot deleted (its chain merged live); else a running VM snapshotted."""
    running = _with_snapshots(o, "running")
    rng.shuffle(running)
    if not _first([lambda v=v: o.snapshots.delete(v, rng.choice(_snapshots(o, v))) for v in running[:TRIES]]):
        toward_take(o, rng, n)


def toward_backup(o, rng, n):
    """A running VM with disks backed up; else a stopped one started; else one created."""
    running = _with_disks(o, "running")
    rng.shuffle(running)
    if _first([lambda v=v: o.backups.create(v) for v in running[:TRIES]]):
        return
    if _first([lambda v=v: o.start_vm(v) for v in _with_disks(o, "stopped")[:TRIES]]):
        return
    from .crashkit import _create

    _create(o, rng, n)


def toward_rewrite(o, rng, n):
    """A VM whose newest backup is incremental pruned to it (made whole: its file rewritten); else a backup."""
    newest: dict[str, dict] = {}
    for b in o.backups.listing():
        if b["state"] == "ready":
            newest[b["vm"]] = b
    if _first([lambda v=v: o.backups.prune(v, 1, None) for v, b in newest.items() if b["parent"]][:TRIES]):
        return
    toward_backup(o, rng, n)


TOWARD = {
    "backup.mid-rewrite": toward_rewrite,
    "backup.before-write": toward_backup,
    "backup.after-write": toward_backup,
    "snapshot.before-take": toward_take,
    "snapshot.after-take": toward_take,
    "snapshot.before-revert": toward_revert,
    "snapshot.before-merge": toward_merge,
}


def problems(o, waiting_pools: set[str]) -> list[str]:
    """After the settle pass: snapshots and chain files left between two steps."""
    o.snapshots.settle(force=True)
    o.backups.settle(force=True)
    out = []
    with o.db.read() as s:
        conn = s.connection()
        volumes = {v.id: v for v in SL.volume_rows(conn)}
        from vmplane.store import backups as BK

        ready = BK.backup_rows(conn, states=("ready",))
        for b in BK.backup_rows(conn):
            if b.state != "ready":
                out.append(f"backup {b.id} of vm {b.vm_name} left {b.state}")
        disks = BK.disk_rows(conn, [b.id for b in ready])
    for b in ready:  # every backup left restores: each of its files, and its base's, in the store
        chain = [b] + [p for p in ready if p.id == b.parent_id]
        for d in (d for x in chain for d in disks[x.id]):
            if d.whole_file is not None:
                out.append(f"backup {b.id}'s {d.device} left half made whole")
            if o.backups._store_driver(b).volume(f"backup-{b.store}", d.file) is None:
                out.append(f"backup {b.id}: its chain's file {d.file} is not in the store")
    with o.db.read() as s:
        conn = s.connection()
        for r in S.unfinished(conn):
            out.append(f"snapshot {r.name} of vm id {r.vm_id} left {r.state}")
        for f in S.chain_files(conn):
            v = volumes.get(f.volume_id)
            if f.state != "live" and v is not None and v.pool_name not in waiting_pools:
                out.append(f"volume {v.name}: chain file {f.file} left {f.state}")
    return out
