"""Storage pools: defined on their hosts through the driver (libvirt's storage API), their size read back.

A local pool is one host's folder; a shared pool is a folder every host of a cluster sees (an NFS export;
on local hosts a folder of the hosts' base mounted into each). A shared pool is trusted as shared only
once a probe volume created through one host was seen by every other host (`shared_checked`): a path
that is only *named* alike on two hosts would make a "shared" migration lose the disk.
"""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING

from sqlalchemy import select
from sqlalchemy.engine import Connection, Row

from vmplane.core import storagerules as R
from vmplane.core.driver import Driver, DriverError, PoolInfo, PoolSpec
from vmplane.core.errors import AlreadyExists, Conflict, InsufficientCapacity, NotFound
from vmplane.core.names import check_name
from vmplane.store import events
from vmplane.store import storageledger as SL
from vmplane.store import volumemoves as MV
from vmplane.store.schema import Cluster, Host, Pool, Volume

if TYPE_CHECKING:
    from vmplane.plane.context import Plane

log = logging.getLogger(__name__)


def view(row: Row) -> R.PoolView:
    return R.PoolView(
        row.name, row.kind, row.cluster_name, row.host_name, row.path, row.state, row.capacity_mib, row.used_mib
    )


class Pools:
    def __init__(self, plane: Plane):
        self.plane = plane

    # -- reading ---------------------------------------------------------------------------------
    def views(self, conn: Connection) -> list[R.PoolView]:
        return [view(r) for r in SL.pool_rows(conn)]

    def rows(self, cluster: str | None = None, host: str | None = None) -> list[Row]:
        where = []
        if cluster is not None:
            where.append(Cluster.__table__.c.name == cluster)
        if host is not None:
            where.append(Host.__table__.c.name == host)
        with self.plane.db.transaction() as conn:
            return SL.pool_rows(conn, *where)

    def row(self, name: str) -> Row:
        with self.plane.db.transaction() as conn:
            return SL.pool_row(conn, name)

    def hosts_of(self, pool: Row) -> list[str]:
        """The hosts that open this pool's files: its host, or every host of its cluster."""
        if pool.kind == "local":
            return [pool.host_name]
        return [name for name, meta in self.plane.capacity.hosts.items() if meta.cluster == pool.cluster_name]

    def driver_for(self, pool: Row, prefer: str | None = None) -> Driver:
        """A driver of a host that sees the pool (`prefer` first), defining the pool there if needed."""
        hosts = self.hosts_of(pool)
        if prefer in hosts:
            hosts = [prefer] + [h for h in hosts if h != prefer]
        errors = []
        for host in hosts:
            if host not in self.plane.drivers:
                continue
            driver = self.plane.drivers[host]
            try:
                driver.define_pool(PoolSpec(pool.name, pool.path))
                return driver
            except DriverError as exc:
                errors.append(str(exc))
        raise Conflict(f"pool {pool.name}: no host answers ({'; '.join(errors) or 'it has no host'})", field="pool")

    # -- changing --------------------------------------------------------------------------------
    def create(
        self, name: str, kind: str, cluster: str | None = None, host: str | None = None, path: str | None = None
    ) -> Row:
        """Define a pool on its host(s) and record what they report; nothing is left behind if a host
        refuses (the definitions made are removed)."""
        check_name(name)
        R.check_pool_request(kind, host, cluster, path)
        path = path or R.default_pool_path(kind, name)
        with self.plane.db.read() as s:
            if s.scalar(select(Pool.id).where(Pool.name == name)) is not None:
                raise AlreadyExists(f"pool {name!r} already exists", field="name")
            if kind == "local":
                h = s.scalars(select(Host).where(Host.name == host)).first()
                if h is None:
                    raise NotFound(f"host {host!r} does not exist", field="host")
                cluster_id, host_id, hosts = h.cluster_id, h.id, [h.name]
                clash = s.scalars(select(Pool.name).where(Pool.host_id == h.id, Pool.path == path)).first()
                if clash:
                    raise Conflict(f"host {host} already has pool {clash} at {path}", field="path")
            else:
                c = s.scalars(select(Cluster).where(Cluster.name == cluster)).first()
                if c is None:
                    raise NotFound(f"cluster {cluster!r} does not exist", field="cluster")
                cluster_id, host_id = c.id, None
                hosts = list(s.scalars(select(Host.name).where(Host.cluster_id == c.id).order_by(Host.name)))
                if not hosts:
                    raise Conflict(f"cluster {cluster} has no host to define the pool on", field="cluster")
        infos = self.define_everywhere(name, path, hosts)
        checked = kind == "shared" and self.probe_shared(name, hosts)
        if kind == "shared" and not checked:
            self.undefine(name, hosts)
            raise Conflict(
                f"pool {name}: {path} is not shared by the hosts of cluster {cluster}: a file created "
                f"through {hosts[0]} is not seen by the others",
                field="path",
            )
        info = infos[0]
        with self.plane.db.transaction() as conn:
            conn.execute(
                Pool.__table__.insert(),
                dict(
                    name=name,
                    kind=kind,
                    cluster_id=cluster_id,
                    host_id=host_id,
                    path=path,
                    state=info.state,
                    capacity_mib=info.capacity_mib,
                    allocation_mib=info.allocation_mib,
                    available_mib=info.available_mib,
                    used_mib=0,
                    shared_checked=checked,
                ),
            )
            events.record(
                conn,
                "pool",
                name,
                old_state=None,
                new_state=info.state,
                message=f"{kind} pool at {path} on {', '.join(hosts)}",
                host=host,
            )
            return SL.pool_row(conn, name)

    def define_everywhere(self, name: str, path: str, hosts: list[str]) -> list[PoolInfo]:
        infos, done = [], []
        for host in hosts:
            try:
                infos.append(self.plane.drivers[host].define_pool(PoolSpec(name, path)))
                done.append(host)
            except DriverError as exc:
                self.undefine(name, done)
                raise Conflict(f"pool {name} could not be defined: {exc}", field="name") from None
        return infos

    def undefine(self, name: str, hosts: list[str]) -> None:
        for host in hosts:
            try:
                self.plane.drivers[host].remove_pool(name)
            except DriverError as exc:
                log.warning("pool %s left defined on %s: %s", name, host, exc)

    def probe_shared(self, name: str, hosts: list[str]) -> bool:
        """Create a tiny volume through the first host, look for it through every other host."""
        if len(hosts) < 2:
            return True
        probe = f"{R.VOLUME_PREFIX}probe-{uuid.uuid4().hex[:8]}.raw"
        first = self.plane.drivers[hosts[0]]
        try:
            first.create_volume(name, probe, 1, format="raw")
            return all(self.plane.drivers[h].volume(name, probe) is not None for h in hosts[1:])
        except DriverError as exc:
            log.warning("shared check of pool %s failed: %s", name, exc)
            return False
        finally:
            try:
                first.delete_volume(name, probe)
            except DriverError:
                pass

    def delete(self, name: str) -> None:
        pool = self.row(name)
        with self.plane.db.read() as s:
            used = list(
                s.scalars(
                    select(Volume.name)
                    .where(
                        (Volume.pool_id == pool.id)
                        | (Volume.copy_pool_id == pool.id)
                        | (Volume.move_pool_id == pool.id)
                    )
                    .limit(5)
                )
            )
            used += sorted(f"{f} (left by a move, being deleted)" for f in MV.leftover_files(s.connection(), pool.id))
        if used:
            raise Conflict(f"pool {name} holds volumes ({', '.join(used)}); delete or move them first", field="name")
        self.undefine(name, self.hosts_of(pool))
        with self.plane.db.transaction() as conn:
            conn.execute(Pool.__table__.delete().where(Pool.__table__.c.id == pool.id))
            events.record(conn, "pool", name, old_state=pool.state, new_state="deleted", host=pool.host_name)

    def refresh(self, name: str | None = None) -> list[Row]:
        """Read every pool's state and size back from a host that sees it; a pool no host answers for
        is `unknown`, and placement leaves it alone."""
        rows = [self.row(name)] if name else self.rows()
        for pool in rows:
            state, info = "unknown", None
            for host in self.hosts_of(pool):
                driver = self.plane.drivers.get(host)
                if driver is None:
                    continue
                try:
                    info = driver.pool_info(pool.name)
                except DriverError:
                    continue
                state = info.state if info else "missing"
                break
            fields: dict[str, object] = {"state": state}
            if info is not None:
                fields.update(
                    capacity_mib=info.capacity_mib, allocation_mib=info.allocation_mib, available_mib=info.available_mib
                )
            with self.plane.db.transaction() as conn:
                conn.execute(Pool.__table__.update().where(Pool.__table__.c.id == pool.id).values(**fields))
        return [self.row(name)] if name else self.rows()

    def take(self, conn: Connection, pool: R.PoolView, pool_id: int, mib: int) -> None:
        """Take `mib` on the pool (compare-and-add); refused naming its room, or, if it fitted when read,
        naming the request that took the room meanwhile."""
        if pool.free_mib < mib:
            raise InsufficientCapacity(
                f"pool {pool.name}: {max(pool.free_mib, 0)} MiB free of {pool.capacity_mib} MiB, {mib} MiB asked",
                field="pool",
            )
        if not SL.take_on_pool(conn, pool_id, mib):
            raise InsufficientCapacity(
                f"pool {pool.name} has no room for {mib} MiB any more (another request took it); retry", field="pool"
            )
