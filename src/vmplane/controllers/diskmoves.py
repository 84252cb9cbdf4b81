"""What a live migration does with a VM's disks (the migrator calls in at admission, before the copy
and when the migration ends).

A disk on a shared pool stays where it is: the target opens the same file. A disk on a local pool is
copied with the memory (libvirt's VIR_MIGRATE_NON_SHARED_INC: only the overlay travels, its template
image is put in the target's image pool first) into a local pool of the target host at the same path.
At admission the copy's space is claimed on that pool (`volumes.copy_pool_id`; the project is never
charged twice). When the migration ends, whichever copy is not the VM's is deleted, confirmed by its
pool: the target's copy when the VM stayed, the source's once the guest was checked healthy on the
target. A copy that can not be deleted now stays claimed and is retried (`cleanup`, from the sync).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from sqlalchemy import update
from sqlalchemy.engine import Connection

from vmplane.controllers.volumes import file_of
from vmplane.core import storagerules as R
from vmplane.core.driver import DriverError, MigrationParams, PoolSpec
from vmplane.core.errors import Conflict, InsufficientCapacity
from vmplane.core.migration import ACTIVE
from vmplane.hosts import images
from vmplane.store import ledger as L
from vmplane.store import storageledger as SL
from vmplane.store.schema import Volume

if TYPE_CHECKING:
    from vmplane.controllers.pools import Pools
    from vmplane.plane.context import Plane

log = logging.getLogger(__name__)
_VO = Volume.__table__.c


class DiskMoves:
    def __init__(self, plane: Plane, pools: Pools):
        self.plane = plane
        self.pools = pools

    def reach(self, conn: Connection, vm_id: int) -> frozenset[str] | None:
        """Hosts every disk of the VM can follow it to (None: it has no disk): a shared pool's cluster,
        or hosts with a running local pool at the same path and room for the copy."""
        disks = SL.vm_volumes(conn, vm_id)
        if not disks:
            return None
        pools = self.pools.views(conn)
        hosts: set[str] | None = None
        for v in disks:
            source = next(p for p in pools if p.name == v.pool_name)
            if source.kind == "shared":
                reach = {h for h, meta in self.plane.capacity.hosts.items() if meta.cluster == source.cluster}
            else:
                reach = {
                    p.host
                    for p in pools
                    if p.kind == "local"
                    and p.path == source.path
                    and p.state == "running"
                    and p.free_mib >= v.size_mib
                    and p.host
                }
            hosts = reach if hosts is None else hosts & reach
        return frozenset(hosts or ())

    def admit(self, conn: Connection, vm_id: int, target: str) -> list[R.DiskMove]:
        """In the migration's admitting transaction: plan each disk's move and claim the copies' space."""
        disks = SL.vm_volumes(conn, vm_id)
        if not disks:
            return []
        for v in disks:
            if v.state == "moving":
                raise Conflict(
                    f"volume {v.name} is being moved to pool {v.move_pool_name}; retry once it moved", field="vm"
                )
            if v.copy_pool_id is not None:
                raise Conflict(
                    f"volume {v.name} still has a copy on pool {v.copy_pool_name} from an earlier "
                    f"migration, being deleted; retry in a moment",
                    field="vm",
                )
        moves = R.plan_disk_moves(
            [(v.name, v.device or "vda", v.size_mib, v.pool_name) for v in disks],
            self.pools.views(conn),
            target,
            self.plane.capacity.hosts[target].cluster,
        )
        for move in moves:
            if move.how != "copy":
                continue
            pool = SL.pool_row(conn, move.target_pool)
            if not SL.take_on_pool(conn, pool.id, move.size_mib):
                raise InsufficientCapacity(
                    f"pool {pool.name} on {target} has no room for volume {move.volume} "
                    f"({move.size_mib} MiB) any more; retry",
                    field="to",
                )
            conn.execute(update(Volume.__table__).where(_VO.name == move.volume).values(copy_pool_id=pool.id))
        return moves

    def prepare(self, vm_id: int, target_host: str, params: MigrationParams) -> MigrationParams:
        """Right before the copy: make each copied disk's overlay in the target's pool (its backing image
        there first), and say which disks libvirt copies and whether the others are shared."""
        with self.plane.db.transaction() as conn:
            disks = SL.vm_volumes(conn, vm_id)
            copy_pools = {v.name: SL.pool_row(conn, v.copy_pool_name) for v in disks if v.copy_pool_name}
        if not disks:
            return params
        target = self.plane.drivers[target_host]
        copied: list[str] = []
        for v in disks:
            backing = backing_format = None
            if v.template is not None:  # a shared disk's backing image must be on the target too
                t = self.plane.catalog.template(v.template)
                assert t.disk_image is not None and t.disk_format is not None  # a disk's template has an image
                backing, backing_format = images.ensure_on_host(target, t.disk_image, t.disk_format), t.disk_format
            pool = copy_pools.get(v.name)
            if pool is None:
                continue
            target.define_pool(PoolSpec(pool.name, pool.path))
            self._fresh_target(target, pool.name, v)
            target.create_volume(pool.name, file_of(v), v.size_mib, v.format, backing, backing_format)
            copied.append(v.device or "vda")
        return replace(params, copy_disks=tuple(copied), shared_disks=len(copied) < len(disks))

    def _fresh_target(self, target, pool: str, v) -> None:
        """The copy's file must be new: a file already at its place (left by an earlier attempt, or by a
        volume of the same name made before file names were unique) is removed first, confirmed, and
        the removal recorded. Adopted, its clusters the mirror does not overwrite (sync=top copies only
        what the source overlay allocated) would show through to the guest (review N2)."""
        file = file_of(v)
        if target.volume(pool, file) is None:
            return
        target.delete_volume(pool, file)
        if target.volume(pool, file) is not None:
            raise DriverError(target.host, f"pool {pool} still holds {file} after it was deleted")
        with self.plane.db.transaction() as conn:
            SL.file_event(
                conn,
                SL.volume_row(conn, v.name),
                f"a file {file} already in pool {pool} on {target.host} (no copy of it) removed before the copy",
            )

    @staticmethod
    def swap(conn: Connection, vm_id: int) -> None:
        """The VM moved (in the transaction that moves its claims): its disks are the copies now; the
        source's files become the copies to delete."""
        for v in SL.vm_volumes(conn, vm_id):
            if v.copy_pool_id is not None:
                conn.execute(
                    update(Volume.__table__)
                    .where(_VO.id == v.id)
                    .values(pool_id=v.copy_pool_id, copy_pool_id=v.pool_id)
                )

    def cleanup(self, vm_id: int | None = None) -> list[str]:
        """Delete the copy each volume has on its copy pool (no migration carries it any more), confirmed
        by the pool; then its space there is released. Returns the volumes cleaned."""
        with self.plane.db.transaction() as conn:
            where = [_VO.copy_pool_id.is_not(None)] + ([_VO.vm_id == vm_id] if vm_id is not None else [])
            rows = SL.volume_rows(conn, *where)
            busy = {r.vm_id for r in rows if r.vm_id and self._migrating(conn, r.vm_id)}
        cleaned = []
        for v in rows:
            if v.vm_id in busy:
                continue
            pool = self.pools.row(v.copy_pool_name)
            file = file_of(v)
            try:
                driver = self.pools.driver_for(pool)
                driver.delete_volume(pool.name, file)
                gone = driver.volume(pool.name, file) is None
            except (DriverError, Conflict) as exc:
                log.warning("copy of volume %s on pool %s not deleted yet: %s", v.name, pool.name, exc)
                continue
            if not gone:
                continue
            with self.plane.db.transaction() as conn:
                now = SL.volume_row(conn, v.name, lock=True)
                if now.copy_pool_id != pool.id:
                    continue
                conn.execute(update(Volume.__table__).where(_VO.id == now.id).values(copy_pool_id=None))
                SL.add_to_pool(conn, pool.id, -now.size_mib)
                SL.set_volume(conn, now, note=f"its copy on {pool.name} deleted")
            cleaned.append(v.name)
        return cleaned

    @staticmethod
    def _migrating(conn: Connection, vm_id: int) -> bool:
        m = L.MIGRATIONS.c
        active = [s.value for s in ACTIVE]
        return conn.execute(L.MIGRATIONS.select().where(m.vm_id == vm_id, m.state.in_(active))).first() is not None
