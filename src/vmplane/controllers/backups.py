"""Backups (issue 32): `backup store create|list|delete`, `backup create|list|show|verify|restore|delete`.

A backup store is a directory every host of a cluster sees, a libvirt directory pool (`backup-NAME`) on each,
checked by a probe file. A backup copies every disk of a running VM (its root disk and data volumes) into the
store in one job of libvirt's backup API (hosts/drivers/libvirtbackups.py), a file per disk: each full, or
incremental on the VM's last backup in the store while that backup's checkpoint still describes the disk
(core/backups.py). It is charged on the project's backup quota at the disks' sizes before anything is
written (refused naming `backups_mib` when that does not fit), then at what its files take, read back with
their sha256. A failed backup leaves no file and no charge. Restores: controllers/backuprestores.py."""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from vmplane.controllers.volumes import file_of
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
    from vmplane.controllers.pools import Pools
    from vmplane.plane.context import Plane

log = logging.getLogger("vmplane.backups")
SETTLE_S = 10.0  # between two settle passes
PROGRESS_S = 1.0  # between two writes of a running backup's progress
BUSY_S = 300.0  # a backup younger than this may still be another process's job: left to it
STORE_ROOT = "/var/lib/vmplane/shared"  # a store's default path: under the hosts' shared storage


def pool_of(store: str) -> str:
    """The libvirt pool a backup store is on every host."""
    return f"backup-{store}"


class Backups:
    def __init__(self, plane: Plane, pools: Pools):
        self.plane, self.pools = plane, pools
        self._stop = threading.Event()
        self._busy: set[int] = set()  # backups a call of this process is writing now

    def start(self) -> None:
        settle_every(SETTLE_S, self.settle, self._stop, "backup-settle", log)

    def stop(self) -> None:
        self._stop.set()

    def settle(self, force: bool = False) -> None:
        """Backups a crash (or a host that did not answer) left `running` or `deleting`: a running one is
        undone (its job aborted, its checkpoint and file deleted, its charge given back: an unfinished backup
        is never taken for a backup); a deleting one's file deleted again; a backup a prune was making whole
        gets its files rewritten from the whole copies it named."""
        with self.plane.db.read() as s:
            conn = s.connection()
            stuck = [r for r in B.backup_rows(conn, states=("running", "deleting")) if r.id not in self._busy]
            vms = {r.id: (L.vm_row(conn, vm_id=r.vm_id) if r.vm_id is not None else None) for r in stuck}
            rewrites = B.rewrites(conn, utcnow() - dt.timedelta(seconds=0 if force else BUSY_S))
        for backup_id in rewrites:  # a prune a crash cut short while it made a backup whole
            if backup_id not in self._busy and self._settles_store(backup_id):
                try:
                    self._rewrite_whole(backup_id)
                except (DriverError, Conflict) as exc:
                    log.info("backup %s not made whole yet: %s", backup_id, exc)
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
        """Back up a running VM's disks, its root disk and data volumes, in one job (each disk full or
        incremental, core/backups.choose_kind); answered once the files are written and read back."""
        with self.plane.db.transaction() as conn:
            row = L.vm_row(conn, name=vm, lock=True)
            if project_id is not None and row.project_id != project_id:
                raise NotFound(f"vm {vm!r} does not exist", field="vm")
            stopped = row.state == VmState.stopped.value
            if row.state != VmState.running.value and not stopped:
                raise Conflict(f"vm {vm} is {row.state}; a backup is taken of a running or stopped VM", field="vm")
            busy = S.busy_problem(conn, row.id, vm)
            if busy:
                raise Conflict(busy, field="vm")
            volumes = [v for v in SL.vm_volumes(conn, row.id) if v.device]
            if not volumes:
                raise Conflict(f"vm {vm} has no disk: there is nothing to back up", field="vm")
            st = self.store_for(conn, store)
            last = B.last_ready(conn, row.id, st.id)
            last_disks = B.disk_rows(conn, [last.id])[last.id] if last else []
            kind, parent_id, modes, why = rules.choose_kind(
                full,
                rules.Last(last.id, last.checkpoint, {d.volume: d.disk_file for d in last_disks}) if last else None,
                {v.name: file_of(v) for v in volumes},
            )
            if stopped:  # no backup job without a domain: each disk's chain copied whole, no checkpoint taken
                kind, parent_id, modes = "full", None, dict.fromkeys(modes, "full")
                why = "the VM is stopped: each disk copied whole (the next backup of the running VM builds on " + (
                    f"backup {last.id})" if last else "nothing)"
                )
            project, quota, used = B.quota(conn, row.project_id, lock=True)
            charge = rules.charge_before_mib([v.size_mib for v in volumes])
            if used + charge > quota:
                raise QuotaExceeded(
                    f"project {project}: backups_mib quota exceeded: {used} MiB used + {charge} MiB asked (the "
                    f"disks' sizes, until the backup is written) > quota {quota} MiB",
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
                size_mib=sum(v.size_mib for v in volumes),
                charged_mib=charge,
            )
            if not stopped:
                B.set_backup(conn, backup_id, checkpoint=rules.checkpoint_name(row.id, backup_id))
            for v in volumes:
                B.insert_disk(
                    conn,
                    backup_id=backup_id,
                    device=v.device,
                    volume=v.name,
                    role=v.role,
                    pool=v.pool_name,
                    mode=modes[v.name],
                    size_mib=v.size_mib,
                    disk_file=file_of(v),
                    file=f"vmb-{vm}-{v.device}-{uuid.uuid4().hex[:12]}.qcow2",
                )
            b = B.backup_row(conn, backup_id)
            disks = B.disk_rows(conn, [backup_id])[backup_id]
            bases = {d.volume: d.file for d in last_disks}
            parent = B.backup_row(conn, parent_id) if parent_id else None
            B.event(conn, b, None, "running", f"{kind} of {len(disks)} disk(s): {why}")
        self._busy.add(backup_id)
        try:
            failpoints.hit("backup.before-write")
            if stopped:
                written = self._copy_stopped(b, disks, {v.name: v for v in volumes})
            else:
                written = self._write(row, b, disks, parent, bases)
        except (DriverError, Conflict) as exc:
            if not stopped:
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

    def _write(self, row, b, disks, parent, bases: dict[str, str]) -> int:
        """Each disk's file made in the store (an incremental disk's on its parent's file), the VM's
        checkpoints defined where it runs, one backup job for every disk, the files read back; then the
        record."""
        driver = self.plane.drivers[row.host_name]
        pool = pool_of(b.store)
        for d in disks:
            backing = f"{b.store_path}/{bases[d.volume]}" if d.mode == "incremental" else None
            driver.create_volume(pool, d.file, d.size_mib, "qcow2", backing, "qcow2" if backing else None)
        domain = domain_name(row.name)
        with self.plane.db.read() as s:
            xmls = B.chain_checkpoints(s.connection(), row.id, [d.disk_file for d in disks])
        driver.define_checkpoints(domain, xmls)
        targets = {d.device: (f"{b.store_path}/{d.file}", d.mode == "incremental") for d in disks}
        written = driver.backup_disks(
            domain, targets, parent.checkpoint if parent else None, b.checkpoint, on_progress=self._progress(b.id)
        )
        failpoints.hit("backup.after-write")
        xml = driver.checkpoint_xml(domain, b.checkpoint)
        self._confirm(b, {d.id: driver.volume_sha256(pool, d.file) for d in disks}, written, xml)
        return written

    def _copy_stopped(self, b, disks, volumes: dict[str, Any]) -> int:
        """A stopped VM's backup: each disk's chain copied whole into the store (`createXMLFrom`, by a host of
        the store's cluster that has the disk's pool), read back; then the record."""
        pool = pool_of(b.store)
        with self.plane.db.read() as s:
            cluster = B.store_row(s.connection(), b.store).cluster
        read, written = {}, 0
        for d in disks:
            v = volumes[d.volume]
            driver = self.pools.driver_for(self.pools.row(v.pool_name))
            if self.plane.capacity.hosts[driver.host].cluster != cluster:
                raise Conflict(f"volume {v.name}'s pool {v.pool_name} is not seen from cluster {cluster}, where "
                               f"backup store {b.store} is", field="store")  # fmt: skip
            driver.clone_volume(pool, d.file, f"{v.pool_path}/{file_of(v)}")
            failpoints.hit("backup.after-write")
            read[d.id] = driver.volume_sha256(pool, d.file)
            written += read[d.id][1]
        self._confirm(b, read, written, None)
        return written

    def _confirm(self, b, read: dict[int, tuple[str, int]], written: int, xml: str | None) -> None:
        """The backup's files read back (sha256, size by disk row): it is ready, charged at what they take."""
        after = rules.charge_after_mib([size for _sha, size in read.values()])
        with self.plane.db.transaction() as conn:
            for disk_id, (sha256, size) in read.items():
                B.set_disk(conn, disk_id, sha256=sha256, bytes=size)
            total = sum(size for _sha, size in read.values())
            B.set_backup(
                conn,
                b.id,
                state="ready",
                progress=100,
                bytes=total,
                written=written,
                checkpoint_xml=xml,
                charged_mib=after,
                finished_at=utcnow(),
            )
            B.charge(conn, b.project_id, after - b.charged_mib)
            B.event(
                conn,
                b,
                "running",
                "ready",
                f"{written} bytes transferred; {len(read)} file(s), {total} bytes, read back",
            )

    def _progress(self, backup_id: int) -> Callable[[int, int], None]:
        """What the job reports, kept on the backup (whole percents, at most once a second): "Running now"."""
        last = [-1, 0.0]

        def report(done: int, total: int) -> None:
            pct, now = min(99, done * 100 // max(total, 1)), time.monotonic()
            if pct != last[0] and now - last[1] >= PROGRESS_S:
                last[:] = [pct, now]
                with self.plane.db.transaction() as conn:
                    B.set_backup(conn, backup_id, progress=pct)

        return report

    def _undo(self, b, note: str) -> None:
        """A backup that was not taken: its files (those made) deleted, then its row and charge."""
        try:
            if not self._delete_files(b):
                return  # left running: a file is still there (the audit names the row)
        except (DriverError, Conflict) as exc:
            log.warning("backup %s: its files not deleted (%s)", b.id, exc)
            return
        with self.plane.db.transaction() as conn:
            B.remove_backup(conn, B.backup_row(conn, b.id), note)

    def _delete_files(self, b) -> bool:
        """Delete a backup's files from its store; whether the store confirms them gone (read back)."""
        with self.plane.db.read() as s:
            files = [d.file for d in B.disk_rows(s.connection(), [b.id])[b.id]]
        driver = self._store_driver(b)
        for file in files:
            driver.delete_volume(pool_of(b.store), file)
        return all(driver.volume(pool_of(b.store), file) is None for file in files)

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
            conn = s.connection()
            rows = B.backup_rows(conn, vm=vm, project_id=project_id)
            disks = B.disk_rows(conn, [r.id for r in rows])
            return [self._view(r, disks[r.id]) for r in rows]

    def show(self, backup_id: int, project_id: int | None = None) -> dict[str, Any]:
        with self.plane.db.read() as s:
            conn = s.connection()
            return self._view(B.backup_row(conn, backup_id, project_id), B.disk_rows(conn, [backup_id])[backup_id])

    @staticmethod
    def _view(r, disks) -> dict[str, Any]:
        return {
            "id": r.id,
            "vm": r.vm_name,
            "project": r.project,
            "store": r.store,
            "kind": r.kind,
            "parent": r.parent_id,
            "state": r.state,
            "progress": r.progress,
            "size_mib": r.size_mib,
            "bytes": r.bytes,
            "written": r.written,
            "charged_mib": r.charged_mib,
            "disks": [
                {
                    "device": d.device,
                    "volume": d.volume,
                    "role": d.role,
                    "pool": d.pool,
                    "mode": d.mode,
                    "size_mib": d.size_mib,
                    "file": d.file,
                    "bytes": d.bytes,
                    "sha256": d.sha256,
                }
                for d in disks
            ],
            "created_at": r.created_at.isoformat() + "Z",
            "finished_at": r.finished_at.isoformat() + "Z" if r.finished_at else None,
        }

    def verify(self, backup_id: int, project_id: int | None = None) -> dict[str, Any]:
        """Read the backup's files (and its chain's) back and compare with the sha256 recorded when written."""
        with self.plane.db.read() as s:
            conn = s.connection()
            b = B.backup_row(conn, backup_id, project_id)
            chain = [b]
            while chain[-1].parent_id is not None:
                chain.append(B.backup_row(conn, chain[-1].parent_id))
            disks = B.disk_rows(conn, [x.id for x in chain])
        if b.state != "ready":
            raise Conflict(f"backup {backup_id} is {b.state}; only a ready backup is verified", field="backup")
        driver = self._store_driver(b)
        checked = []
        for x in chain:
            for d in disks[x.id]:
                one: dict[str, Any] = {"id": x.id, "device": d.device, "file": d.file}
                try:
                    sha256, size = driver.volume_sha256(pool_of(x.store), d.file)
                except DriverError as exc:
                    checked.append(one | {"ok": False, "error": str(exc)})
                    continue
                checked.append(one | {"ok": (sha256, size) == (d.sha256, d.bytes), "sha256": sha256, "bytes": size})
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
            gone = self._delete_files(b)
        except DriverError as exc:
            raise Conflict(
                f"backup {backup_id}: its files were not deleted ({exc}); it stays deleting", field="backup"
            ) from None
        if not gone:
            raise Conflict(f"backup {backup_id}: the store still lists its files; it stays deleting", field="backup")
        with self.plane.db.transaction() as conn:
            B.remove_backup(conn, B.backup_row(conn, backup_id), "deleted; its files are gone")

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
                self._busy.add(kid)
                try:
                    self._make_whole(kid)
                finally:
                    self._busy.discard(kid)
                made_whole.append(kid)
            self.delete(backup_id)
        return {"vm": vm, "kept": sorted(keep), "deleted": sorted(pruned), "made_whole": made_whole}

    def _make_whole(self, backup_id: int) -> None:
        """An incremental backup made whole before its base goes: each incremental disk's file rewritten in
        place (later backups' files keep it as their backing file: its name must stay) with a full copy of its
        chain. The copy is made and read back first, and named on the disk (`whole_file`) before the file is
        rewritten from it: a crash in between is finished by the settle pass. Its checkpoint stays: the next
        incremental still builds on it."""
        with self.plane.db.read() as s:
            conn = s.connection()
            b = B.backup_row(conn, backup_id)
            disks = B.disk_rows(conn, [backup_id])[backup_id]
        driver = self._store_driver(b)
        pool = pool_of(b.store)
        copies: list[str] = []
        try:
            for d in disks:
                if d.mode == "incremental" and d.whole_file is None:
                    file = f"vmb-{b.vm_name}-{d.device}-{uuid.uuid4().hex[:12]}.qcow2"
                    driver.clone_volume(pool, file, f"{b.store_path}/{d.file}")
                    copies.append(file)
                    driver.volume_sha256(pool, file)  # read back before anything names it
                    with self.plane.db.transaction() as conn:
                        B.set_disk(conn, d.id, whole_file=file, whole_at=utcnow())
        except DriverError as exc:
            for file in copies:
                self._forget_file(driver, pool, file)
            with self.plane.db.transaction() as conn:
                for d in disks:
                    if d.whole_file is None:  # (named by an earlier try: the settle pass uses it)
                        B.set_disk(conn, d.id, whole_file=None, whole_at=None)
            raise Conflict(
                f"backup {backup_id} could not be made whole: {exc}; nothing was pruned after it", field="backup"
            ) from None
        self._rewrite_whole(backup_id)

    def _settles_store(self, backup_id: int) -> bool:
        """Whether this process settles the backup's store (the one that owns the host it is reached through)."""
        with self.plane.db.read() as s:
            b = B.backup_row(s.connection(), backup_id)
        try:
            return self.plane.membership.settles(self._store_driver(b).host)
        except Conflict:
            return False

    def _rewrite_whole(self, backup_id: int) -> None:
        """Each disk with a whole copy: its file deleted and made again from the copy (same name, no backing
        file), read back and recorded, the copy deleted; then the backup builds on nothing."""
        with self.plane.db.read() as s:
            conn = s.connection()
            b = B.backup_row(conn, backup_id)
            disks = B.disk_rows(conn, [backup_id])[backup_id]
        driver = self._store_driver(b)
        pool = pool_of(b.store)
        for d in disks:
            if d.whole_file is None:
                continue
            try:
                driver.delete_volume(pool, d.file)
                failpoints.hit("backup.mid-rewrite")
                driver.clone_volume(pool, d.file, f"{b.store_path}/{d.whole_file}")
                sha256, size = driver.volume_sha256(pool, d.file)
            except DriverError as exc:
                raise Conflict(
                    f"backup {backup_id}'s {d.device} is being made whole: {exc}; the settle pass finishes it",
                    field="backup",
                ) from None
            with self.plane.db.transaction() as conn:
                B.set_disk(conn, d.id, mode="full", bytes=size, sha256=sha256, whole_file=None, whole_at=None)
            self._forget_file(driver, pool, d.whole_file)
        with self.plane.db.transaction() as conn:
            disks = B.disk_rows(conn, [backup_id])[backup_id]
            sizes = [d.bytes or 0 for d in disks]
            after = rules.charge_after_mib(sizes)
            B.set_backup(conn, b.id, parent_id=None, kind="full", bytes=sum(sizes), charged_mib=after)
            B.charge(conn, b.project_id, after - b.charged_mib)
            B.event(conn, b, "ready", "ready", f"made whole ({sum(sizes)} bytes) before its base went")

    @staticmethod
    def _forget_file(driver, pool: str, file: str) -> None:
        try:
            driver.delete_volume(pool, file)
        except DriverError as exc:
            log.warning("a backup file %s left in the store (%s)", file, exc)

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
