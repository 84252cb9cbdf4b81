"""Backups (issue 32): `backup store create|list|delete`, `backup create|list|show|verify|restore|delete`.

A backup store is a directory every host of a cluster sees, a libvirt directory pool (`backup-NAME`) on each,
checked by a probe file. A backup copies a running VM's root disk into the store through libvirt's backup API
(hosts/drivers/libvirtbackups.py): full, or incremental on the VM's last backup in the store while its
checkpoint still describes the disk (core/backups.py). It is charged on the project's backup quota at the
disk's size before anything is written (refused naming `backups_mib` when that does not fit), then at what its
file takes, read back with its sha256. A failed backup leaves no file and no charge. A restore makes a new VM
of what the VM was (offering, template, size) whose root disk is a full copy of the backup's chain."""

from __future__ import annotations

import logging
import threading
import uuid
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from vmplane.controllers.volumes import file_of, new_file_name
from vmplane.core import backups as rules
from vmplane.core import failpoints
from vmplane.core.driver import DriverError
from vmplane.core.errors import AlreadyExists, Conflict, Invalid, NotFound, QuotaExceeded
from vmplane.core.model import UNREACHABLE_HOST_STATES, VmState
from vmplane.core.names import check_name, domain_name
from vmplane.plane.loops import settle_every
from vmplane.store import backups as B
from vmplane.store import ledger as L
from vmplane.store import snapshots as S
from vmplane.store import storageledger as SL
from vmplane.store.schema import Cluster, Host, utcnow

if TYPE_CHECKING:
    from vmplane.controllers.clones import Clones
    from vmplane.controllers.pools import Pools
    from vmplane.controllers.vms import Vms
    from vmplane.plane.context import Plane

log = logging.getLogger("vmplane.backups")
SETTLE_S = 10.0  # between two settle passes
BUSY_S = 300.0  # a backup younger than this may still be another process's job: left to it
STORE_ROOT = "/var/lib/vmplane/shared"  # a store's default path: under the hosts' shared storage


def pool_of(store: str) -> str:
    """The libvirt pool a backup store is on every host."""
    return f"backup-{store}"


class Backups:
    def __init__(self, plane: Plane, pools: Pools, vms: Vms, clones: Clones):
        self.plane, self.pools, self.vms, self.clones = plane, pools, vms, clones
        self._stop = threading.Event()
        self._busy: set[int] = set()  # backups a call of this process is writing now

    def start(self) -> None:
        settle_every(SETTLE_S, self.settle, self._stop, "backup-settle", log)

    def stop(self) -> None:
        self._stop.set()

    def settle(self, force: bool = False) -> None:
        """Backups a crash (or a host that did not answer) left `running` or `deleting`: a running one is
        undone (its job aborted, its checkpoint and file deleted, its charge given back: an unfinished backup
        is never taken for a backup); a deleting one's file deleted again."""
        with self.plane.db.read() as s:
            conn = s.connection()
            stuck = [r for r in B.backup_rows(conn, states=("running", "deleting")) if r.id not in self._busy]
            vms = {r.id: (L.vm_row(conn, vm_id=r.vm_id) if r.vm_id is not None else None) for r in stuck}
        now = utcnow()
        for r in stuck:
            vm = vms[r.id]
            if vm is not None and vm.host_name and not self.plane.membership.settles(vm.host_name):
                continue  # another process's host: its call may be in flight
            if not force and (now - r.created_at).total_seconds() < BUSY_S:
                continue
            try:
                if r.state == "running":
                    if vm is not None and vm.host_name in self.plane.drivers:
                        self.plane.drivers[vm.host_name].abort_backup(domain_name(vm.name), r.checkpoint)
                    self._undo(r, "not taken: its process ended before it was confirmed; undone")
                else:
                    self.delete(r.id)
            except (DriverError, Conflict) as exc:
                log.info("backup %s left %s: %s", r.id, r.state, exc)

    # -- stores --------------------------------------------------------------------------------------
    def create_store(self, name: str, cluster: str, path: str | None = None) -> dict[str, Any]:
        check_name(name)
        path = path or f"{STORE_ROOT}/{pool_of(name)}"
        if not path.startswith("/") or ".." in path.split("/"):
            raise Invalid(f"path must be an absolute directory, got {path!r}", field="path")
        with self.plane.db.read() as s:
            conn = s.connection()
            if any(r.name == name for r in B.store_rows(conn)):
                raise AlreadyExists(f"backup store {name!r} already exists", field="name")
            c = conn.execute(select(Cluster.id).where(Cluster.name == cluster)).first()
            if c is None:
                raise NotFound(f"cluster {cluster!r} does not exist", field="cluster")
            hosts = [r[0] for r in conn.execute(select(Host.name).where(Host.cluster_id == c[0]).order_by(Host.name))]
        if not hosts:
            raise Conflict(f"cluster {cluster} has no host to define the store on", field="cluster")
        self.pools.define_everywhere(pool_of(name), path, hosts)
        if not self.pools.probe_shared(pool_of(name), hosts):
            self.pools.undefine(pool_of(name), hosts)
            raise Conflict(
                f"backup store {name}: {path} is not seen by every host of cluster {cluster}: a file written "
                f"through {hosts[0]} is not seen by the others",
                field="path",
            )
        with self.plane.db.transaction() as conn:
            B.insert_store(conn, name, path, c[0])
        return self.store(name)

    def stores(self) -> list[dict[str, Any]]:
        with self.plane.db.read() as s:
            conn = s.connection()
            return [self._store_view(conn, r) for r in B.store_rows(conn)]

    def store(self, name: str) -> dict[str, Any]:
        with self.plane.db.read() as s:
            conn = s.connection()
            return self._store_view(conn, B.store_row(conn, name))

    @staticmethod
    def _store_view(conn, r) -> dict[str, Any]:
        backups = B.backup_rows(conn, store_id=r.id)
        return {
            "name": r.name,
            "path": r.path,
            "cluster": r.cluster,
            "backups": len(backups),
            "bytes": sum(b.bytes or 0 for b in backups),
        }

    def delete_store(self, name: str) -> None:
        with self.plane.db.read() as s:
            conn = s.connection()
            r = B.store_row(conn, name)
            if B.backup_rows(conn, store_id=r.id):
                raise Conflict(f"backup store {name} holds backups: delete them first", field="name")
            hosts = [h[0] for h in conn.execute(select(Host.name).where(Host.cluster_id == r.cluster_id))]
        self.pools.undefine(pool_of(name), hosts)
        with self.plane.db.transaction() as conn:
            B.delete_store(conn, r.id, name)

    # -- backups -------------------------------------------------------------------------------------
    def create(self, vm: str, store: str | None = None, full: bool = False, project_id: int | None = None) -> dict:
        """Back up a running VM's root disk (full or incremental, core/backups.choose_kind); answered once the
        file is written and read back."""
        with self.plane.db.transaction() as conn:
            row = L.vm_row(conn, name=vm, lock=True)
            if project_id is not None and row.project_id != project_id:
                raise NotFound(f"vm {vm!r} does not exist", field="vm")
            if row.state != VmState.running.value:
                raise Conflict(f"vm {vm} is {row.state}; a backup is taken of a running VM", field="vm")
            busy = S.busy_problem(conn, row.id, vm)
            if busy:
                raise Conflict(busy, field="vm")
            root = next((v for v in SL.vm_volumes(conn, row.id) if v.role == "root"), None)
            if root is None:
                raise Conflict(f"vm {vm} has no root disk: there is nothing to back up", field="vm")
            st = self.store_for(conn, store)
            last = B.last_ready(conn, row.id, st.id)
            kind, parent_id, why = rules.choose_kind(
                full, rules.Last(last.id, last.checkpoint, last.disk_file) if last else None, file_of(root)
            )
            project, quota, used = B.quota(conn, row.project_id, lock=True)
            charge = rules.charge_before_mib(root.size_mib)
            if used + charge > quota:
                raise QuotaExceeded(
                    f"project {project}: backups_mib quota exceeded: {used} MiB used + {charge} MiB asked (the "
                    f"disk's size, until the backup is written) > quota {quota} MiB",
                    field="backups_mib",
                )
            B.charge(conn, row.project_id, charge)
            offering, template = self._names(conn, row)
            backup_id = B.insert_backup(
                conn,
                store_id=st.id,
                vm_id=row.id,
                vm_name=vm,
                project_id=row.project_id,
                offering=offering,
                template=template,
                vcpus=row.vcpus,
                memory_mib=row.memory_mib,
                kind=kind,
                parent_id=parent_id,
                checkpoint="",
                size_mib=root.size_mib,
                disk_file=file_of(root),
                file=f"vmb-{vm}-{uuid.uuid4().hex[:12]}.qcow2",
                charged_mib=charge,
            )
            B.set_backup(conn, backup_id, checkpoint=rules.checkpoint_name(row.id, backup_id))
            b = B.backup_row(conn, backup_id)
            parent = B.backup_row(conn, parent_id) if parent_id else None
            B.event(conn, b, None, "running", f"{kind}: {why}")
        self._busy.add(backup_id)
        try:
            failpoints.hit("backup.before-write")
            written = self._write(row, root, b, parent)
        except (DriverError, Conflict) as exc:
            try:
                self.plane.drivers[row.host_name].abort_backup(domain_name(vm), b.checkpoint)
            except DriverError as cleanup:
                log.warning("backup %s: its checkpoint may be left (%s)", backup_id, cleanup)
            self._undo(b, f"not taken: {exc}")
            raise Conflict(f"backup of vm {vm} was not taken: {exc}", field="vm") from None
        finally:
            self._busy.discard(backup_id)
        return self.show(backup_id) | {"why": why, "written": written}

    @staticmethod
    def _names(conn, row) -> tuple[str, str]:
        from vmplane.store.schema import Offering, Template

        o = conn.execute(select(Offering.name).where(Offering.id == row.offering_id)).scalar_one()
        t = conn.execute(select(Template.name).where(Template.id == row.template_id)).scalar_one()
        return o, t

    def store_for(self, conn, store: str | None):
        if store is not None:
            return B.store_row(conn, store)
        stores = B.store_rows(conn)
        if len(stores) == 1:
            return stores[0]
        names = ", ".join(s.name for s in stores) or "none yet: backup store create NAME --cluster C"
        raise Invalid(f"name the backup store (--store): {names}", field="store")

    def _write(self, row, root, b, parent) -> int:
        """The backup's file made in the store (on its parent's file for an incremental), the VM's checkpoints
        defined where it runs, the backup job run, the file read back; then the record."""
        driver = self.plane.drivers[row.host_name]
        pool = pool_of(b.store)
        path = f"{b.store_path}/{b.file}"
        backing = f"{b.store_path}/{parent.file}" if parent else None
        driver.create_volume(pool, b.file, b.size_mib, "qcow2", backing, "qcow2" if backing else None)
        domain = domain_name(row.name)
        with self.plane.db.read() as s:
            driver.define_checkpoints(domain, B.chain_checkpoints(s.connection(), row.id, file_of(root)))
        written = driver.backup_disk(
            domain, root.device or "vda", path, parent.checkpoint if parent else None, b.checkpoint
        )
        failpoints.hit("backup.after-write")
        xml = driver.checkpoint_xml(domain, b.checkpoint)
        sha256, size = driver.volume_sha256(pool, b.file)
        after = rules.charge_after_mib(size)
        with self.plane.db.transaction() as conn:
            B.set_backup(
                conn,
                b.id,
                state="ready",
                bytes=size,
                written=written,
                sha256=sha256,
                checkpoint_xml=xml,
                charged_mib=after,
                finished_at=utcnow(),
            )
            B.charge(conn, b.project_id, after - b.charged_mib)
            B.event(conn, b, "running", "ready", f"{written} bytes transferred; its file {size} bytes, sha256 {sha256}")
        return written

    def _undo(self, b, note: str) -> None:
        """A backup that was not taken: its file (if made) deleted, then its row and charge."""
        try:
            if not self._delete_file(b):
                return  # left running: its file is still there (the audit names the row)
        except (DriverError, Conflict) as exc:
            log.warning("backup %s: its file %s not deleted (%s)", b.id, b.file, exc)
            return
        with self.plane.db.transaction() as conn:
            B.remove_backup(conn, B.backup_row(conn, b.id), note)

    def _delete_file(self, b) -> bool:
        """Delete a backup's file from its store; whether the store confirms it gone (read back)."""
        driver = self._store_driver(b)
        driver.delete_volume(pool_of(b.store), b.file)
        return driver.volume(pool_of(b.store), b.file) is None

    def _store_driver(self, b):
        with self.plane.db.read() as s:
            hosts = [h[0] for h in s.connection().execute(
                select(Host.name).join(Cluster, Cluster.id == Host.cluster_id)
                .join(B.STORES, B.STORES.c.cluster_id == Cluster.id).where(B.STORES.c.id == b.store_id)
                .order_by(Host.name)
            )]  # fmt: skip
        for host in hosts:
            if host in self.plane.drivers and self.plane.capacity.index.host(host).state not in UNREACHABLE_HOST_STATES:
                return self.plane.drivers[host]
        raise Conflict(f"no host of backup store {b.store} answers now", field="store")

    def listing(self, vm: str | None = None, project_id: int | None = None) -> list[dict[str, Any]]:
        with self.plane.db.read() as s:
            return [self._view(r) for r in B.backup_rows(s.connection(), vm=vm, project_id=project_id)]

    def show(self, backup_id: int, project_id: int | None = None) -> dict[str, Any]:
        with self.plane.db.read() as s:
            return self._view(B.backup_row(s.connection(), backup_id, project_id))

    @staticmethod
    def _view(r) -> dict[str, Any]:
        return {
            "id": r.id,
            "vm": r.vm_name,
            "project": r.project,
            "store": r.store,
            "kind": r.kind,
            "parent": r.parent_id,
            "state": r.state,
            "size_mib": r.size_mib,
            "file": r.file,
            "bytes": r.bytes,
            "written": r.written,
            "sha256": r.sha256,
            "charged_mib": r.charged_mib,
            "created_at": r.created_at.isoformat() + "Z",
            "finished_at": r.finished_at.isoformat() + "Z" if r.finished_at else None,
        }

    def verify(self, backup_id: int, project_id: int | None = None) -> dict[str, Any]:
        """Read the backup's file (and its chain's) back and compare with the sha256 recorded when written."""
        with self.plane.db.read() as s:
            conn = s.connection()
            b = B.backup_row(conn, backup_id, project_id)
            chain = [b]
            while chain[-1].parent_id is not None:
                chain.append(B.backup_row(conn, chain[-1].parent_id))
        if b.state != "ready":
            raise Conflict(f"backup {backup_id} is {b.state}; only a ready backup is verified", field="backup")
        driver = self._store_driver(b)
        checked = []
        for x in chain:
            try:
                sha256, size = driver.volume_sha256(pool_of(x.store), x.file)
            except DriverError as exc:
                checked.append({"id": x.id, "ok": False, "error": str(exc)})
                continue
            checked.append({"id": x.id, "ok": (sha256, size) == (x.sha256, x.bytes), "sha256": sha256, "bytes": size})
        return {"id": backup_id, "ok": all(c["ok"] for c in checked), "chain": checked}

    def delete(self, backup_id: int, project_id: int | None = None) -> None:
        with self.plane.db.transaction() as conn:
            b = B.backup_row(conn, backup_id, project_id)
            problem = rules.delete_problem(backup_id, B.children(conn, backup_id))
            if problem:
                raise Conflict(problem, field="backup")
            if b.state == "running":
                raise Conflict(f"backup {backup_id} is being written; delete it once it ended", field="backup")
            B.set_backup(conn, b.id, state="deleting")
        try:
            gone = self._delete_file(b)
        except DriverError as exc:
            raise Conflict(
                f"backup {backup_id}: its file was not deleted ({exc}); it stays deleting", field="backup"
            ) from None
        if not gone:
            raise Conflict(f"backup {backup_id}: the store still lists its file; it stays deleting", field="backup")
        with self.plane.db.transaction() as conn:
            B.remove_backup(conn, B.backup_row(conn, backup_id), "deleted; its file is gone")

    def prune(
        self, vm: str, keep_last: int | None, keep_daily: int | None, project_id: int | None = None
    ) -> dict[str, Any]:
        """Retention for one VM's backups (core/backups.kept): the others are deleted, newest first; a kept
        backup built on a pruned one is made whole first (a full copy of its chain, read back, takes its
        place), so that every backup left restores."""
        for name, value in (("keep_last", keep_last), ("keep_daily", keep_daily)):
            if value is not None and value < 1:
                raise Invalid(f"{name} must be 1 or more, got {value}", field=name)
        with self.plane.db.read() as s:
            rows = [r for r in B.backup_rows(s.connection(), vm=vm, project_id=project_id) if r.state == "ready"]
        if not rows:
            raise NotFound(f"vm {vm!r} has no backup", field="vm")
        keep = rules.kept([(r.id, r.created_at) for r in rows], keep_last, keep_daily)
        pruned = {r.id for r in rows} - keep
        made_whole = []
        for backup_id, kids in rules.prune_order(pruned, {r.id: r.parent_id for r in rows}):
            for kid in kids:
                self._make_whole(kid)
                made_whole.append(kid)
            self.delete(backup_id)
        return {"vm": vm, "kept": sorted(keep), "deleted": sorted(pruned), "made_whole": made_whole}

    def _make_whole(self, backup_id: int) -> None:
        """An incremental backup replaced by a full copy of its chain (its own data and its parents'), read
        back; it then builds on nothing. Its checkpoint stays: the next incremental still builds on it."""
        with self.plane.db.read() as s:
            b = B.backup_row(s.connection(), backup_id)
        driver = self._store_driver(b)
        pool = pool_of(b.store)
        file = f"vmb-{b.vm_name}-{uuid.uuid4().hex[:12]}.qcow2"
        try:
            driver.clone_volume(pool, file, f"{b.store_path}/{b.file}")
            sha256, size = driver.volume_sha256(pool, file)
        except DriverError as exc:
            raise Conflict(
                f"backup {backup_id} could not be made whole: {exc}; nothing was pruned after it", field="backup"
            ) from None
        after = rules.charge_after_mib(size)
        with self.plane.db.transaction() as conn:
            B.set_backup(
                conn, b.id, file=file, parent_id=None, kind="full", bytes=size, sha256=sha256, charged_mib=after
            )
            B.charge(conn, b.project_id, after - b.charged_mib)
            B.event(
                conn, b, "ready", "ready", f"made whole (a full copy of its chain, {size} bytes) before its base went"
            )
        try:
            driver.delete_volume(pool, b.file)
        except DriverError as exc:
            log.warning("backup %s: its former file %s left in the store (%s)", backup_id, b.file, exc)

    def restore_in_place(self, backup_id: int, project_id: int | None = None) -> dict[str, Any]:
        """The backed-up VM itself (stopped, without snapshots) gets its root disk back as the backup saw it: a
        full copy of the backup's chain on the disk's pool, read back, then the disk switched to it and its
        former file deleted. Its next backup is full (the copy holds no bitmap)."""
        with self.plane.db.read() as s:
            conn = s.connection()
            b = B.backup_row(conn, backup_id, project_id)
            if b.state != "ready":
                raise Conflict(f"backup {backup_id} is {b.state}; only a ready backup is restored", field="backup")
            if b.vm_id is None:
                raise Conflict(f"vm {b.vm_name} is gone: restore backup {backup_id} to a new VM (--to)", field="vm")
            vm = L.vm_row(conn, vm_id=b.vm_id)
            if vm.state != VmState.stopped.value:
                raise Conflict(f"vm {vm.name} is {vm.state}; stop it before restoring it in place", field="vm")
            if S.snapshot_rows(conn, vm.id) or S.busy_problem(conn, vm.id, vm.name):
                raise Conflict(f"vm {vm.name} has snapshots; delete them before restoring it in place", field="vm")
            root = next((v for v in SL.vm_volumes(conn, vm.id) if v.role == "root"), None)
            if root is None or S.extra_files(conn, root.id):
                raise Conflict(f"vm {vm.name}'s root disk is a chain of files; restore to a new VM (--to)", field="vm")
        pool = self.pools.row(root.pool_name)
        file = new_file_name(root.name, "qcow2")  # a file no volume had: the restored copy
        try:
            driver = self.pools.driver_for(pool)
            driver.clone_volume(pool.name, file, f"{b.store_path}/{b.file}")
            if driver.volume(pool.name, file) is None:
                raise DriverError(driver.host, f"{file} is not in pool {pool.name} after the copy")
        except (DriverError, Conflict) as exc:
            raise Conflict(
                f"backup {backup_id} was not restored into vm {vm.name}: {exc}; it is unchanged", field="vm"
            ) from None
        old = file_of(root)
        with self.plane.db.transaction() as conn:
            now = L.vm_row(conn, vm_id=vm.id, lock=True)
            if now.state != VmState.stopped.value:  # started meanwhile: the copy goes, the VM keeps its disk
                raise Conflict(f"vm {vm.name} was started meanwhile; nothing was restored", field="vm")
            SL.set_volume(
                conn,
                SL.volume_row(conn, root.name, lock=True),
                file_name=file,
                note=f"restored from backup {backup_id}",
            )
            B.event(conn, b, "ready", "ready", f"restored in place into vm {vm.name}")
        try:
            driver.delete_volume(pool.name, old)
        except DriverError as exc:
            log.warning("vm %s: its former disk file %s left on pool %s (%s)", vm.name, old, pool.name, exc)
        return {"backup": backup_id, "vm": vm.name, "copied": file}

    def restore(self, backup_id: int, to: str, start: bool = False, pool: str | None = None,
                project_id: int | None = None) -> dict[str, Any]:  # fmt: skip
        """A new VM `to` of what the backed-up VM was, its root disk a full copy of the backup's chain."""
        b = self.show(backup_id, project_id)
        with self.plane.db.read() as s:
            row = B.backup_row(s.connection(), backup_id)
        if row.state != "ready":
            raise Conflict(f"backup {backup_id} is {row.state}; only a ready backup is restored", field="backup")
        self.vms.create_vm(
            to, b["project"], row.offering, row.template, vcpus=row.vcpus, memory_mib=row.memory_mib,
            root_disk_mib=row.size_mib, pool=pool,
        )  # fmt: skip
        copied = self.clones.copy_into(to, f"{row.store_path}/{row.file}", f"backup {backup_id}")
        if start:
            self.vms.start_vm(to)
        return {"backup": backup_id, "vm": to, "copied": copied}

    def check(self) -> list[str]:
        """The audit's part: each project's backup charge equals its backups'; no backup left running."""
        problems = []
        with self.plane.db.read() as s:
            conn = s.connection()
            for p in conn.execute(select(B.PROJECTS.c.id, B.PROJECTS.c.name, B.PROJECTS.c.used_backup_mib)).all():
                again = B.recomputed(conn, p.id)
                if again != p.used_backup_mib:
                    problems.append(f"project {p.name}: backup charge {p.used_backup_mib} MiB, its backups {again} MiB")
        return problems
