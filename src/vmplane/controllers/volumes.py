"""Volumes: root disks and data volumes, charged to their project while they exist.

Every change is recorded in two steps around the host: first the intent (state creating, attaching,
detaching, deleting; the charge taken at once, so a crash never leaves a disk uncharged), then what
the host confirmed (read back). A host that can not answer leaves the volume in its step; `resolve()`
(start-up recovery and the sync loop) asks again and finishes or undoes it.
"""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING

from sqlalchemy.engine import Connection, Row

from vmplane.controllers.pools import view
from vmplane.core import failpoints
from vmplane.core import storagerules as R
from vmplane.core.driver import DiskSpec, DriverError
from vmplane.core.errors import AlreadyExists, Conflict, Invalid, NotFound
from vmplane.core.model import Usage, VmState
from vmplane.core.names import DOMAIN_PREFIX, check_name
from vmplane.core.quota import check_admission
from vmplane.hosts import images
from vmplane.hosts.drivers.volumefiles import same_volume
from vmplane.store import ledger as L
from vmplane.store import snapshots as SS
from vmplane.store import storageledger as SL
from vmplane.store import volumemoves as MV
from vmplane.store.schema import Offering, Pool, Project, Template, Vm, Volume, utcnow

if TYPE_CHECKING:
    from vmplane.controllers.pools import Pools
    from vmplane.plane.context import Plane

log = logging.getLogger(__name__)
_VO = Volume.__table__.c
IN_BETWEEN = ("creating", "attaching", "detaching", "deleting", "resizing")


def domain_name(vm: str) -> str:
    return DOMAIN_PREFIX + vm


def file_of(v: Row) -> str:
    """The volume's file in its pool (and in its copy's pool): the one its row recorded when it was made;
    a row made before the file names were unique (file_name None) has its name's file."""
    return v.file_name or R.volume_file(v.name, v.format)


def new_file_name(volume: str, format: str) -> str:
    """A new volume's file: its name and a token no other volume has, so that a volume never meets a file
    that an older volume of the same name left behind (a copy on a host that did not answer: review N2)."""
    return f"{R.VOLUME_PREFIX}{volume}.{uuid.uuid4().hex[:12]}.{format}"


def disk_spec(v: Row) -> DiskSpec:
    return DiskSpec(v.pool_name, file_of(v), f"{v.pool_path}/{file_of(v)}", v.device or "vda", v.format)


class Volumes:
    def __init__(self, plane: Plane, pools: Pools):
        self.plane = plane
        self.pools = pools

    # -- reading ---------------------------------------------------------------------------------
    def rows(self, project_id: int | None = None, vm: str | None = None) -> list[Row]:
        where = []
        if project_id is not None:
            where.append(_VO.project_id == project_id)
        if vm is not None:
            where.append(Vm.name == vm)
        with self.plane.db.transaction() as conn:
            return SL.volume_rows(conn, *where)

    def row(self, name: str) -> Row:
        with self.plane.db.transaction() as conn:
            return SL.volume_row(conn, name)

    def disks_of(self, vm_id: int) -> tuple[DiskSpec, ...]:
        """The disks the VM's domain opens; the template images they are overlays on are put in its
        host's image pool first (a root disk on a shared pool may start on a host that never had its
        image: the start failed with "Cannot access backing file")."""
        with self.plane.db.engine.connect() as conn, conn.begin():  # one read: no write lock, no lease check
            disks = SL.vm_volumes(conn, vm_id)
            host = L.vm_row(conn, vm_id=vm_id).host_name
        return self._specs(disks, host)

    def for_start(self, vm: Row, disks: list[Row]) -> tuple[DiskSpec, ...]:
        """disks_of for a VM whose start has just read its volumes (`disks`, in the step's transaction):
        any still `creating` (a crash between the create's commit and the file) is made first, on or
        for its host, and then they are read again."""
        pending = [v.name for v in disks if v.state == "creating"]
        for name in pending:
            self._make(name, prefer_host=vm.host_name)
        return self.disks_of(vm.id) if pending else self._specs(disks, vm.host_name)

    def _specs(self, disks: list[Row], host: str | None) -> tuple[DiskSpec, ...]:
        driver = self.plane.drivers.get(host) if host else None
        if driver is not None:
            for template in sorted({v.template for v in disks if v.template is not None}):
                t = self.plane.catalog.template(template)
                assert t.disk_image is not None and t.disk_format is not None  # a disk's template has an image
                images.ensure_on_host(driver, t.disk_image, t.disk_format)
        return tuple(disk_spec(v) for v in disks)

    @staticmethod
    def check_ready(conn: Connection, vm_id: int, vm: str) -> None:
        """A VM starts only with every disk confirmed there (not creating, deleting or being moved, no
        snapshot step in flight)."""
        problem = SS.busy_problem(conn, vm_id, vm)
        if problem:
            raise Conflict(problem, field="state")
        for v in SL.vm_volumes(conn, vm_id):
            if v.state != "attached":
                raise Conflict(
                    f"vm {vm}'s volume {v.name} is {v.state}; it can start once the volume is attached", field="state"
                )

    def storage_hosts(self, conn: Connection, vm_id: int) -> frozenset[str] | None:
        """Hosts that open every disk of the VM (None: it has none)."""
        disks = SL.vm_volumes(conn, vm_id)
        if not disks:
            return None
        hosts: set[str] | None = None
        for v in disks:
            pool = SL.pool_row(conn, v.pool_name)
            reach = set(self.pools.hosts_of(pool))
            hosts = reach if hosts is None else hosts & reach
        return frozenset(hosts or ())

    # -- data volumes ----------------------------------------------------------------------------
    def create(
        self, name: str, project: str, size_mib: int, pool: str | None = None, project_id: int | None = None
    ) -> Row:
        """A blank qcow2 volume; charged and given pool space in the admitting transaction, then made on a
        host and read back. A host that refuses: nothing is left (the row and charge go)."""
        check_name(name)
        if size_mib <= 0:
            raise Invalid(f"size must be greater than zero, got {size_mib} MiB", field="size")
        with self.plane.db.transaction() as conn:
            p = L.lock_project(conn, project_id, name=None if project_id is not None else project)
            check_admission(p.name, L.quota_row(p), L.ledger_row(p), Usage(storage_mib=size_mib))
            chosen = R.choose_pool(self.pools.views(conn), size_mib, name=pool)
            pool_id = SL.pool_row(conn, chosen.name).id
            self.pools.take(conn, chosen, pool_id, size_mib)
            self._ensure_new(conn, name)
            SL.insert_volume(
                conn,
                name=name,
                project_id=p.id,
                pool_id=pool_id,
                size_mib=size_mib,
                format="qcow2",
                role="data",
                file_name=new_file_name(name, "qcow2"),
                note=f"{size_mib} MiB on {chosen.name}",
            )
        return self._make(name)

    @staticmethod
    def _ensure_new(conn: Connection, name: str) -> None:
        row = conn.execute(Volume.__table__.select().where(_VO.name == name)).first()
        if row is not None and row.state == "deleting":  # its file, or a copy of it, is not confirmed gone yet
            raise AlreadyExists(
                f"volume {name!r} is still being deleted (a pool has not confirmed its file gone); retry once it is",
                field="name",
            )
        if row is not None:
            raise AlreadyExists(f"volume {name!r} already exists", field="name")

    def _make(self, name: str, prefer_host: str | None = None) -> Row:
        """Create the volume a `creating` row stands for, on a host of its pool; read back."""
        v = self.row(name)
        pool = self.pools.row(v.pool_name)
        spec = disk_spec(v)
        try:
            driver = self.pools.driver_for(pool, prefer=prefer_host)
            backing = backing_format = None
            if v.template is not None:
                t = self.plane.catalog.template(v.template)
                assert t.disk_image is not None and t.disk_format is not None  # a disk's template has an image
                backing, backing_format = images.ensure_on_host(driver, t.disk_image, t.disk_format), t.disk_format
            failpoints.hit("volume.before-create")
            # a file already there is adopted only as this row's own (a create retried after a crash)
            found = driver.volume(pool.name, spec.volume)
            foreign = found is not None and not same_volume(found, "qcow2", backing, v.size_mib)
            info = found or driver.create_volume(pool.name, spec.volume, v.size_mib, "qcow2", backing, backing_format)
            failpoints.hit("volume.after-create")
        except (DriverError, Conflict) as exc:
            self._undo_create(v, pool, exc)
            raise Conflict(f"volume {name} could not be created on pool {pool.name}: {exc}", field="pool") from None
        if foreign:
            self._drop_creating(
                v,
                f"not created: pool {pool.name} (read on {driver.host}) holds {spec.volume}, a "
                f"file this volume did not make; it is left alone (the audit reports it)",
            )
            raise Conflict(
                f"volume {name} could not be created on pool {pool.name}: the pool holds {spec.volume} "
                f"already, a file this volume did not make",
                field="pool",
            )
        if info.capacity_mib < v.size_mib:
            raise Conflict(
                f"volume {name}: pool {pool.name} made it {info.capacity_mib} MiB, not {v.size_mib}", field="size"
            )
        with self.plane.db.transaction() as conn:
            now = SL.volume_row(conn, name, lock=True)
            SL.set_volume(conn, now, state="attached" if now.vm_id else "available", note=f"created at {info.path}")
            return SL.volume_row(conn, name)

    def _undo_create(self, v: Row, pool: Row, exc: Exception) -> None:
        """The create failed: the row goes only if the pool confirms the file is not there."""
        try:
            driver = self.pools.driver_for(pool)
            there = driver.volume(pool.name, disk_spec(v).volume) is not None
        except (DriverError, Conflict):
            return  # can not tell: left `creating`, charged; resolve() asks again
        with self.plane.db.transaction() as conn:
            now, _vm = self._locked(conn, v.name)  # (a new VM's root disk: its VM first)
            if there:
                SL.set_volume(conn, now, state="attached" if now.vm_id else "available", note="created (read back)")
            else:
                L.lock_project(conn, now.project_id)
                SL.remove_volume(conn, now, note=f"not created: {exc}")

    def _drop_creating(self, v: Row, note: str) -> None:
        """A `creating` row whose file can not be made: it goes (and its charge and pool space)."""
        with self.plane.db.transaction() as conn:
            now, _vm = self._locked(conn, v.name)
            if now.state == "creating":
                L.lock_project(conn, now.project_id)
                SL.remove_volume(conn, now, note=note)

    def attach(self, name: str, vm: str, project_id: int | None = None) -> Row:
        with self.plane.db.transaction() as conn:
            self._owned(SL.volume_row(conn, name), project_id)  # another project's: 404 before any lock
            row = L.vm_row(conn, name=vm, lock=True)  # the VM first (_locked)
            v = SL.volume_row(conn, name, lock=True)
            self._owned(v, project_id)  # (deleted and made again in another project meanwhile)
            if row.project_id != v.project_id:
                raise Conflict(f"volume {name} is in project {v.project}; vm {vm} is not", field="vm")
            if v.state != "available":
                raise Conflict(
                    f"volume {name} is {v.state}"
                    + (f" (to {v.vm_name})" if v.vm_name else "")
                    + "; only an available volume can be attached",
                    field="volume",
                )
            if row.state not in (VmState.running.value, VmState.stopped.value):
                raise Conflict(f"vm {vm} is {row.state}; attach a volume to a running or stopped VM", field="vm")
            reach = self.storage_hosts(conn, row.id)
            pool = SL.pool_row(conn, v.pool_name)
            if row.ha_policy == "restart" and pool.kind != "shared":
                raise Conflict(
                    f"vm {vm} has --ha restart: volume {name} is on {pool.name}, a {pool.kind} pool, and "
                    f"would be lost with its host; attach a volume of a shared pool",
                    field="volume",
                )
            mine = set(self.pools.hosts_of(pool))
            if row.host_name and row.host_name not in mine:
                raise Conflict(
                    f"volume {name} is on pool {pool.name}, which {row.host_name} (vm {vm}'s host) can not open",
                    field="volume",
                )
            if reach is not None and not (reach & mine):
                raise Conflict(
                    f"volume {name} is on pool {pool.name}; no host opens it and vm {vm}'s disks together",
                    field="volume",
                )
            device = R.next_device(d.device for d in SL.vm_volumes(conn, row.id))
            live = row.state == VmState.running.value
            SL.set_volume(
                conn,
                v,
                state="attaching" if live else "attached",
                vm_id=row.id,
                device=device,
                vm_name=vm,
                note=f"as {device}" + (" (hot-plug)" if live else ""),
            )
        if not live:
            return self.row(name)
        return self._plug(name, row.host_name, vm)

    def _plug(self, name: str, host: str, vm: str) -> Row:
        v = self.row(name)
        driver = self.plane.drivers[host]
        error = None
        try:
            failpoints.hit("volume.before-attach")
            driver.attach_disk(domain_name(vm), disk_spec(v))
        except DriverError as exc:
            error = exc
        return self._settle_plug(name, host, vm, error)

    def _settle_plug(self, name: str, host: str, vm: str, error: Exception | None) -> Row:
        """Record what the domain has now (read back), whatever the request answered."""
        v = self.row(name)
        try:
            present = disk_spec(v).path in self.plane.drivers[host].domain_disks(domain_name(vm)).values()
        except DriverError as exc:
            raise Conflict(
                f"volume {name}: {host} did not say whether vm {vm} has it ({exc}); it stays {v.state} "
                f"until the host answers",
                field="volume",
            ) from None
        with self.plane.db.transaction() as conn:
            now = SL.volume_row(conn, name, lock=True)
            if present:
                SL.set_volume(conn, now, state="attached", note=f"{vm} has it as {now.device} (read back)")
            else:
                SL.set_volume(
                    conn,
                    now,
                    state="available",
                    vm_id=None,
                    device=None,
                    note=f"{vm} does not have it (read back)" + (f": {error}" if error else ""),
                )
        if error is not None and not present and v.state == "attaching":
            raise Conflict(f"volume {name} could not be attached to {vm}: {error}", field="volume")
        if error is not None and present and v.state == "detaching":
            raise Conflict(f"volume {name} is still attached to {vm}: {error}", field="volume")
        return self.row(name)

    def _locked(self, conn: Connection, name: str, project_id: int | None = None) -> tuple[Row, Row | None]:
        """The volume (of project `project_id` when given: else 404, before any lock) and its VM's row, both
        locked: the VM first, as a VM's own transactions lock them (a delete locks the VM, then its
        volumes; a migration's end its VM, then the copied volumes), so that two writers never wait on each
        other in opposite orders (a deadlock on PostgreSQL). A volume moved to another VM (or whose VM was
        deleted) between the two reads is a 409."""
        seen = SL.volume_row(conn, name)
        self._owned(seen, project_id)
        try:
            vm = L.vm_row(conn, vm_id=seen.vm_id, lock=True) if seen.vm_id is not None else None
        except NotFound:  # deleted while this waited for it: the volume's row says what it is now
            vm = None
        v = SL.volume_row(conn, name, lock=True)
        if v.vm_id != seen.vm_id or (v.vm_id is not None and vm is None):
            raise Conflict(f"volume {name} changed while it was locked ({v.state}); ask again", field="volume")
        return v, vm

    def detach(self, name: str, project_id: int | None = None) -> Row:
        with self.plane.db.transaction() as conn:
            v, row = self._locked(conn, name, project_id)
            if v.role == "root":
                raise Conflict(f"volume {name} is vm {v.vm_name}'s root disk; it can not be detached", field="volume")
            if v.state != "attached" or row is None:
                raise Conflict(f"volume {name} is {v.state}; only an attached volume can be detached", field="volume")
            if row.state not in (VmState.running.value, VmState.stopped.value):
                raise Conflict(f"vm {row.name} is {row.state}; detach once it is running or stopped", field="vm")
            busy = SS.busy_problem(conn, row.id, row.name)  # a snapshot step or a merge on its disks
            if busy:
                raise Conflict(busy, field="vm")
            live = row.state == VmState.running.value
            if not live:
                SL.set_volume(conn, v, state="available", vm_id=None, device=None, note=f"from stopped vm {row.name}")
            else:
                SL.set_volume(conn, v, state="detaching", note=f"from {row.name} (unplug asked)")
        if not live:
            return self.row(name)
        error = None
        try:
            failpoints.hit("volume.before-detach")
            self.plane.drivers[row.host_name].detach_disk(domain_name(row.name), v.device)
        except DriverError as exc:
            error = exc
        return self._settle_plug(name, row.host_name, row.name, error)

    def delete(self, name: str, project_id: int | None = None) -> None:
        with self.plane.db.transaction() as conn:
            v = SL.volume_row(conn, name, lock=True)
            self._owned(v, project_id)
            if v.vm_id is not None or v.state != "available":
                raise Conflict(
                    f"volume {name} is {v.state}"
                    + (f" (vm {v.vm_name})" if v.vm_name else "")
                    + "; only an available (detached) volume can be deleted",
                    field="volume",
                )
            clones = SS.clones_problem(conn, f"volume {name}", volume_id=v.id)
            if clones:
                raise Conflict(clones, field="volume")
            SL.set_volume(conn, v, state="deleting")
        self._unmake(name)

    def _unmake(self, name: str) -> None:
        """Delete the file a `deleting` row stands for; the row (and charge) go once the pool confirms. A
        copy a migration left of it (copy_pool_id: its host did not answer the cleanup yet) is deleted
        next: the row then stands for the copy alone, `deleting`, until the copy's pool confirms it gone,
        so that the copy is never forgotten (review N2)."""
        v = self.row(name)
        pool = self.pools.row(v.pool_name)
        file = disk_spec(v).volume
        with self.plane.db.read() as s:  # its snapshots' files (issue 32): the top of the chain first
            chain = [f.file for f in reversed(SS.chain_files(s.connection(), [v.id])) if f.file != file]
        try:
            driver = self.pools.driver_for(pool)
            failpoints.hit("volume.before-delete")
            driver.delete_volume(pool.name, file)
            for older in chain:
                driver.delete_volume(pool.name, older)
            gone = all(driver.volume(pool.name, f) is None for f in [file, *chain])
        except (DriverError, Conflict) as exc:
            raise Conflict(
                f"volume {name}: pool {pool.name} did not confirm the delete ({exc}); it stays deleting and is retried",
                field="volume",
            ) from None
        with self.plane.db.transaction() as conn:
            now = SL.volume_row(conn, name, lock=True)
            L.lock_project(conn, now.project_id)
            copy = now.copy_pool_name if gone else None
            if copy is not None:  # a migration's copy is left: the row stands for it until it is gone
                SL.keep_for_copy(conn, now, note=f"deleted from {pool.name}; its copy on {copy} is deleted next")
            elif gone:
                extra = SS.extra_files(conn, now.id)  # its chain's overlays, each charged at its size
                L.add_to_ledger(conn, now.project_id, Usage(storage_mib=-extra * now.size_mib))
                SL.add_to_pool(conn, now.pool_id, -extra * now.size_mib)
                SS.forget_volume(conn, now.id)
                SL.remove_volume(
                    conn, now, note=f"deleted from {pool.name}" + (f" with {extra} overlay(s)" if extra else "")
                )
            else:
                SL.set_volume(conn, now, state="available", note="the pool still lists it")
        if not gone:
            raise Conflict(f"volume {name}: pool {pool.name} still lists it after the delete", field="volume")
        if copy is not None:
            self._unmake(name)  # the copy now (its pool not answering: left deleting, retried)

    def resize(self, name: str, size_mib: int, project_id: int | None = None) -> Row:
        """Grow a volume (root disks too): the increase is charged and taken on its pool first, in one
        transaction; then the host grows it: live through the running domain (blockResize), else the
        file (offline). Read back: the record takes the size the pool reports; a host that refused gives
        the increase back. Shrinking is refused (a file system does not survive it)."""
        with self.plane.db.transaction() as conn:
            v, vm = self._locked(conn, name, project_id)
            if size_mib <= v.size_mib:
                raise Invalid(
                    f"volume {name} is {v.size_mib} MiB; it can only grow (asked {size_mib} MiB)", field="size"
                )
            if v.state not in ("attached", "available") or v.copy_pool_id is not None:
                raise Conflict(
                    f"volume {name} is {v.state}"
                    + (" and being copied" if v.copy_pool_id else "")
                    + "; resize it once it is attached or available",
                    field="volume",
                )
            if vm is not None and vm.state not in (VmState.running.value, VmState.stopped.value):
                raise Conflict(
                    f"vm {vm.name} is {vm.state}; resize its disks once it is running or stopped", field="vm"
                )
            overlays = SS.extra_files(conn, v.id)
            if overlays:  # each file of a chain is charged at the volume's size: one size for all of them
                raise Conflict(
                    f"volume {name} is a chain of {overlays} snapshot overlay(s) on its file: delete its snapshots "
                    "(the chain is merged while its VM runs) before resizing it",
                    field="volume",
                )
            grow = size_mib - v.size_mib
            p = L.lock_project(conn, v.project_id)
            check_admission(p.name, L.quota_row(p), L.ledger_row(p), Usage(storage_mib=grow))
            pool = SL.pool_row(conn, v.pool_name)
            self.pools.take(conn, view(pool), pool.id, grow)
            L.add_to_ledger(conn, p.id, Usage(storage_mib=grow))
            SL.set_volume(conn, v, state="resizing", size_mib=size_mib, note=f"{v.size_mib} -> {size_mib} MiB")
            live = vm is not None and vm.state == VmState.running.value
        error = None
        try:
            if live and vm is not None:  # (live: vm is not None)
                self.plane.drivers[vm.host_name].grow_disk(domain_name(vm.name), v.device, size_mib)
            else:
                self.pools.driver_for(pool).resize_volume(pool.name, disk_spec(v).volume, size_mib)
        except (DriverError, Conflict) as exc:
            error = exc
        return self._settle_size(name, v.size_mib, size_mib, error)

    def _settle_size(self, name: str, old_mib: int, asked_mib: int, error: Exception | None) -> Row:
        """Keep the charge of the size the pool reports. While it can not say, the volume stays
        `resizing`, charged at the larger size, and resolve() reads it again (it stayed larger in the
        record for good: the audit found the pool's file smaller)."""
        v = self.row(name)
        pool = self.pools.row(v.pool_name)
        try:
            info = self.pools.driver_for(pool).volume(pool.name, disk_spec(v).volume)
        except (DriverError, Conflict) as exc:
            raise Conflict(
                f"volume {name}: pool {pool.name} did not say its size after the grow to {asked_mib} "
                f"MiB ({error or exc}); it stays resizing and is read again",
                field="size",
            ) from None
        if info is None:
            raise Conflict(f"volume {name}: pool {pool.name} does not list it; it stays resizing", field="size")
        with self.plane.db.transaction() as conn:
            now, _vm = self._locked(conn, name)  # its VM, then it, then its project (as a VM's delete)
            back = asked_mib - max(info.capacity_mib, old_mib) if info.capacity_mib < asked_mib else 0
            if back:
                L.lock_project(conn, now.project_id)
                L.add_to_ledger(conn, now.project_id, Usage(storage_mib=-back))
                SL.add_to_pool(conn, now.pool_id, -back)
            state = ("attached" if now.vm_id else "available") if now.state == "resizing" else now.state
            SL.set_volume(conn, now, state=state, size_mib=asked_mib - back, note=f"{asked_mib - back} MiB (read back)")
        if error is not None:
            raise Conflict(f"volume {name} could not be grown to {asked_mib} MiB: {error}", field="size")
        return self.row(name)

    @staticmethod
    def _owned(v: Row, project_id: int | None) -> None:
        if project_id is not None and v.project_id != project_id:
            raise NotFound(f"volume {v.name!r} does not exist", field="volume")

    # -- root disks ------------------------------------------------------------------------------
    def root_size(self, template: Template, offering: Offering, asked_mib: int | None) -> int:
        assert template.disk_mib is not None  # asked only of a template with a disk image (its size known)
        return R.root_disk_size(
            template.disk_mib, offering.root_disk_mib, offering.max_root_disk_mib, asked_mib, offering.name
        )

    def root_pool(
        self, conn: Connection, size_mib: int, pool: str | None, host: str | None, cluster: str | None,
        clusters: frozenset[str] | None = None,
    ) -> R.PoolView:  # fmt: skip
        """A new root disk's pool: on its host, in its cluster, or (not placed yet) in one of the `clusters` of
        its zone, so that the VM can start there."""
        return R.choose_pool(self.pools.views(conn), size_mib, name=pool, host=host, cluster=cluster, clusters=clusters)

    def reach_for_new(self, conn: Connection, size_mib: int, pool: str | None, cluster: str | None) -> frozenset[str]:
        """Hosts a new VM with a root disk of this size could start on: those that open a pool with room."""
        hosts: set[str] = set()
        for p in self.pools.views(conn):
            if (pool is not None and p.name != pool) or R.pool_refusal(p, size_mib, None, cluster, None):
                continue
            row = SL.pool_row(conn, p.name)
            hosts.update(self.pools.hosts_of(row))
        return frozenset(hosts)

    def add_root(
        self,
        conn: Connection,
        vm_id: int,
        vm: str,
        project_id: int,
        template_id: int,
        size_mib: int,
        chosen: R.PoolView,
    ) -> None:
        """In the VM's admitting transaction (its storage already on the ledger): the root disk's row and
        its pool space."""
        pool_id = SL.pool_row(conn, chosen.name).id
        self.pools.take(conn, chosen, pool_id, size_mib)
        self._ensure_new(conn, f"{vm}-root")
        SL.insert_volume(
            conn,
            charge=False,
            name=f"{vm}-root",
            project_id=project_id,
            pool_id=pool_id,
            size_mib=size_mib,
            format="qcow2",
            role="root",
            template_id=template_id,
            vm_id=vm_id,
            device="vda",
            file_name=new_file_name(f"{vm}-root", "qcow2"),
            note=f"root disk of {vm}, {size_mib} MiB on {chosen.name}",
        )

    def make_root(self, vm: str, host: str | None) -> None:
        self._make(f"{vm}-root", prefer_host=host)

    @staticmethod
    def check_settled(conn: Connection, vm_id: int, vm: str) -> None:
        """A VM is deleted only when no disk of it is between an attach or a detach (or being moved)."""
        for v in SL.vm_volumes(conn, vm_id):
            if v.state in ("attaching", "detaching", "moving"):
                raise Conflict(f"vm {vm}'s volume {v.name} is {v.state}; delete the VM once it settled", field="state")

    @staticmethod
    def release_disks(conn: Connection, vm_id: int, keep: bool) -> list[str]:
        """In the transaction that deletes a VM: its root disk goes to `deleting` (or, kept, becomes a
        data volume) and its volumes are detached (they outlive it). Returns the volumes to delete once
        the transaction committed (delete_files)."""
        doomed = []
        for v in SL.vm_volumes(conn, vm_id):
            if v.role == "root" and not keep:
                SL.set_volume(conn, v, state="deleting", vm_id=None, device=None, note=f"vm {v.vm_name} deleted")
                doomed.append(v.name)
            elif v.state in ("creating", "resizing"):  # not confirmed yet: resolve() finishes it
                SL.set_volume(conn, v, vm_id=None, device=None, role="data", note=f"kept; vm {v.vm_name} deleted")
            else:
                SL.set_volume(
                    conn,
                    v,
                    state="available",
                    vm_id=None,
                    device=None,
                    role="data",
                    note=f"kept; vm {v.vm_name} deleted",
                )
        return doomed

    def delete_files(self, names: list[str]) -> None:
        """Delete `deleting` volumes' files; one a pool does not confirm stays `deleting` (still charged)
        and the storage settle controller asks again."""
        for name in names:
            try:
                self._unmake(name)
            except Conflict as exc:
                log.warning("%s", exc)

    # -- recovery --------------------------------------------------------------------------------
    def resolve(self, min_age_s: float = 0.0) -> list[str]:
        """Finish or undo every volume left between two steps (for `min_age_s` at least: younger ones
        may still be carried by the request that started them), by asking its pool / its VM's host."""
        done = []
        now = utcnow()
        for v in [
            r for r in self.rows() if r.state in IN_BETWEEN and (now - r.updated_at).total_seconds() >= min_age_s
        ]:
            try:
                if v.state == "creating":
                    self._make(v.name)
                elif v.state == "resizing":
                    self._settle_size(v.name, 0, v.size_mib, None)
                elif v.state == "deleting":
                    self._unmake(v.name)
                elif v.vm_name:
                    with self.plane.db.transaction() as conn:
                        host = L.vm_row(conn, vm_id=v.vm_id).host_name
                    if host:
                        self._settle_plug(v.name, host, v.vm_name, None)
                    elif not self._settle_stopped(v.name):
                        continue  # its VM is between two steps: asked again next pass
                done.append(v.name)
            except Conflict as exc:
                log.info("volume %s left %s: %s", v.name, v.state, exc)
        return done

    def adopt_unplugged(self) -> list[str]:
        """Data volumes attached (in the store) to a running VM whose domain no longer has them: an unplug
        the guest completed after the detach request gave up (it was read back attached then; libvirt's
        device-removed event comes late). Recorded available once a second read agrees."""

        def missing() -> set[tuple[str, str, str]]:
            with self.plane.db.transaction() as conn:
                rows = SL.volume_rows(conn, _VO.state == "attached", _VO.role == "data")
                vms = {r.vm_id: L.vm_row(conn, vm_id=r.vm_id) for r in rows if r.vm_id is not None}
                # every file of a volume's chain, a snapshot's overlay not confirmed yet included: a domain that
                # opens one of them has the volume (issue 32: the crash harness caught a snapshot in flight
                # taken for an unplug)
                chains: dict[int, set[str]] = {}
                for f in SS.chain_files(conn, [r.id for r in rows]):
                    chains.setdefault(f.volume_id, set()).add(f.file)
            have: dict[int, set[str] | None] = {}
            found = set()
            for r in rows:
                vm = vms.get(r.vm_id)
                if vm is None or vm.state != VmState.running.value or vm.host_name not in self.plane.drivers:
                    continue
                if vm.id not in have:
                    try:
                        have[vm.id] = set(self.plane.drivers[vm.host_name].domain_disks(domain_name(vm.name)).values())
                    except DriverError:
                        have[vm.id] = None  # can not tell: nothing is changed
                paths = have[vm.id]
                known = {disk_spec(r).path} | {f"{r.pool_path}/{f}" for f in chains.get(r.id, ())}
                if paths is not None and not known & paths:
                    found.add((r.name, vm.name, vm.host_name))
            return found

        gone = missing()
        gone = gone & missing() if gone else gone
        done = []
        for name, vm, host in sorted(gone):
            try:
                with self.plane.db.transaction() as conn:
                    now, row = self._locked(conn, name)
                    if now.state != "attached" or now.vm_name != vm or row is None:
                        continue
                    if row.state != VmState.running.value or row.host_name != host:
                        continue
                    SL.set_volume(
                        conn,
                        now,
                        state="available",
                        vm_id=None,
                        device=None,
                        note=f"the domain of {vm} on {host} no longer has it (unplugged late; read back)",
                    )
            except Conflict:
                continue  # it moved meanwhile: the next pass reads it again
            done.append(name)
        return done

    def _settle_stopped(self, name: str) -> bool:
        """A hot-plug or unplug whose VM stopped before it was settled (no domain to ask): finished as
        on a stopped VM (attaching: attached, its domain gets it at the next start; detaching: available).
        Left as it is (False) while the VM is in another state than stopped."""
        with self.plane.db.transaction() as conn:
            now, vm = self._locked(conn, name)
            if now.state not in ("attaching", "detaching") or vm is None:
                return True
            if vm.state not in (VmState.stopped.value, VmState.error.value):  # neither has a domain
                return False
            if now.state == "attaching":
                SL.set_volume(conn, now, state="attached", note=f"vm {vm.name} stopped meanwhile: attached cold")
            else:
                SL.set_volume(
                    conn,
                    now,
                    state="available",
                    vm_id=None,
                    device=None,
                    note=f"vm {vm.name} stopped meanwhile: detached cold",
                )
        return True

    def usage_check(self, conn: Connection) -> list[str]:
        """Pools' used_mib == the volumes (and copies, moves in flight, leftover files) on them; the audit
        reports any difference."""
        problems = []
        leftovers = MV.leftover_mib(conn)  # a moved volume's old file, a failed move's copy (issue 32)
        for p in conn.execute(Pool.__table__.select()).all():
            rows = conn.execute(
                Volume.__table__.select().where(
                    (_VO.pool_id == p.id) | (_VO.copy_pool_id == p.id) | (_VO.move_pool_id == p.id)
                )
            ).all()
            files = SS.file_counts(conn)  # a volume's chain: each file at its size (issue 32)
            total = (
                sum(r.size_mib * files.get(r.id, 1) for r in rows if r.pool_id == p.id)
                + sum(r.size_mib for r in rows if r.copy_pool_id == p.id)
                + sum(r.size_mib for r in rows if r.move_pool_id == p.id)
                + leftovers.get(p.id, 0)
            )
            if total != p.used_mib:
                problems.append(f"pool {p.name}: used {p.used_mib} MiB recorded, volumes take {total} MiB")
        for p in conn.execute(Project.__table__.select()).all():
            files = SS.file_counts(conn)
            total = sum(
                r.size_mib * files.get(r.id, 1)
                for r in conn.execute(Volume.__table__.select().where(_VO.project_id == p.id))
            )
            if total != p.used_storage_mib:
                problems.append(f"project {p.name}: storage ledger {p.used_storage_mib} MiB, volumes {total} MiB")
        return problems


__all__ = ["Volumes", "disk_spec", "view"]
