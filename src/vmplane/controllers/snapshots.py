"""Disk snapshots (issue 32): `vm snapshot create|list|revert|delete`. External qcow2 overlays, their metadata
in vmplane's store (store/snapshots.py), the chain rules pure (core/snapshots.py).

Every step is recorded before the host is asked, and the record follows what the host confirmed (read back),
never what was asked: a snapshot is `taking` (its overlays `pending` and charged) until the domain's disks
(a running VM) or the pool's files (a stopped one) show the overlays, then `ready`; a step the host did not
confirm is undone (the overlays it may have made deleted, the charge given back); one whose answer is not
known stays in its step and is settled later by reading the host again (`settle`, start-up and every
SETTLE_S). A file no chain needs any more is marked `deleting` in the transaction that stops needing it, and
its row (and charge) go once its pool confirms it gone."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Connection, Row

from vmplane.controllers.volumes import file_of
from vmplane.core import failpoints
from vmplane.core import snapshots as rules
from vmplane.core.driver import DriverError
from vmplane.core.errors import AlreadyExists, Conflict, Invalid, NotFound
from vmplane.core.model import Usage, VmState
from vmplane.core.names import domain_name
from vmplane.core.quota import check_admission
from vmplane.plane.loops import settle_every
from vmplane.store import ledger as L
from vmplane.store import snapshots as S
from vmplane.store import storageledger as SL
from vmplane.store.schema import Vm, Volume, utcnow

if TYPE_CHECKING:
    from vmplane.controllers.pools import Pools
    from vmplane.plane.context import Plane

log = logging.getLogger("vmplane.snapshots")
_VO = Volume.__table__.c
SETTLE_S = 10.0  # between two settle passes
BUSY_S = 120.0  # a step younger than this may still be another process's call: left to it
FREEZE_S = 10.0  # a quiesced snapshot's guest is thawed within this, whatever happens to this process
_LIVE = (VmState.running.value, VmState.stopped.value)


def overlay_name(volume_file: str, snapshot_id: int) -> str:
    """A new overlay of a volume's chain: the volume's file stem, the snapshot's id and a token (a name no
    other file had: a crash's leftover is never taken for a new file)."""
    stem = volume_file.rsplit(".", 2)[0] if volume_file.count(".") >= 2 else volume_file.rsplit(".", 1)[0]
    return f"{stem}.s{snapshot_id}-{uuid.uuid4().hex[:8]}.qcow2"


class Snapshots:
    def __init__(self, plane: Plane, pools: Pools):
        self.plane = plane
        self.pools = pools
        self._stop = threading.Event()
        self._busy: set[int] = set()  # snapshots a call of this process is stepping now

    def start(self) -> None:
        settle_every(SETTLE_S, self.settle, self._stop, "snapshot-settle", log)

    def stop(self) -> None:
        self._stop.set()

    # -- reading -------------------------------------------------------------------------------------
    def listing(self, vm: str, project_id: int | None = None) -> list[dict[str, Any]]:
        with self.plane.db.read() as s:
            conn = s.connection()
            row = self._vm(conn, vm, project_id)
            snaps = S.snapshot_rows(conn, row.id)
            volumes = {v.id: v.name for v in SL.vm_volumes(conn, row.id)}
            bases = S.bases(conn, [r.id for r in snaps])
        return [self._view(vm, r, {volumes.get(v, str(v)): f for v, f in bases.get(r.id, {}).items()}) for r in snaps]

    @staticmethod
    def _view(vm: str, r: Row[Any], bases: dict[str, str]) -> dict[str, Any]:
        return {
            "vm": vm,
            "name": r.name,
            "state": r.state,
            "live": r.live,
            "quiesced": r.quiesced,
            "pause_ms": r.pause_ms,
            "created_at": r.created_at.isoformat() + "Z",
            "disks": dict(sorted(bases.items())),
        }

    def _vm(self, conn: Connection, vm: str, project_id: int | None, lock: bool = False) -> Row[Any]:
        row = L.vm_row(conn, name=vm, lock=lock)
        if project_id is not None and row.project_id != project_id:
            raise NotFound(f"vm {vm!r} does not exist", field="vm")
        return row

    # -- take ----------------------------------------------------------------------------------------
    def take(self, vm: str, name: str, quiesce: bool = False, project_id: int | None = None) -> dict[str, Any]:
        """Snapshot every disk of `vm` (running or stopped); charged before anything is made."""
        with self.plane.db.transaction() as conn:
            row = self._vm(conn, vm, project_id, lock=True)
            if row.state not in _LIVE:
                raise Conflict(f"vm {vm} is {row.state}; snapshot a running or stopped VM", field="vm")
            if quiesce and row.state != VmState.running.value:
                raise Invalid(
                    f"vm {vm} is stopped: its file systems are quiet already; drop --quiesce", field="quiesce"
                )
            problem = S.busy_problem(conn, row.id, vm)
            if problem:
                raise Conflict(problem, field="vm")
            existing = {r.name for r in S.snapshot_rows(conn, row.id)}
            why = rules.name_problem(name, existing)
            if why:
                raise (AlreadyExists if name in existing else Invalid)(why, field="name")
            volumes = SL.vm_volumes(conn, row.id)
            if not volumes:
                raise Conflict(f"vm {vm} has no disk to snapshot", field="vm")
            for v in volumes:
                if v.state != "attached" or v.copy_pool_id is not None:
                    raise Conflict(f"vm {vm}'s volume {v.name} is {v.state}; retry once it is attached", field="vm")
            p = L.lock_project(conn, row.project_id)
            check_admission(
                p.name, L.quota_row(p), L.ledger_row(p), Usage(storage_mib=sum(v.size_mib for v in volumes))
            )
            snap_id = S.insert_snapshot(conn, row.id, name, live=row.state == VmState.running.value, quiesced=quiesce)
            for v in volumes:
                if not SL.take_on_pool(conn, v.pool_id, v.size_mib):
                    raise Conflict(
                        f"pool {v.pool_name} has no room for an overlay of volume {v.name} ({v.size_mib} MiB)",
                        field="pool",
                    )
                base = file_of(v)
                overlay = overlay_name(base, snap_id)
                S.first_file(conn, v, base)
                S.add_file(conn, v, overlay, base)
                S.add_base(conn, snap_id, v.id, base, overlay)
            S.event(
                conn,
                vm,
                name,
                None,
                "taking",
                row.project_id,
                f"{len(volumes)} disk(s)" + (", quiesced" if quiesce else ""),
            )
        self._busy.add(snap_id)
        try:
            return self._take(vm, row, snap_id, name, quiesce)
        finally:
            self._busy.discard(snap_id)

    def _take(self, vm: str, row: Row[Any], snap_id: int, name: str, quiesce: bool) -> dict[str, Any]:
        plan = self._plan(snap_id)
        error: Exception | None = None
        pause_ms = None
        try:
            failpoints.hit("snapshot.before-take")
            if row.state == VmState.running.value:  # the domain's host; a stopped VM's disks: their pools'
                pause_ms = self._take_live(self.plane.drivers[row.host_name], vm, plan, quiesce)
            else:
                for v, base, overlay in plan:
                    base_path = f"{v.pool_path}/{base}"
                    self._driver_for(v).create_volume(v.pool_name, overlay, v.size_mib, "qcow2", base_path, v.format)
            failpoints.hit("snapshot.after-take")
        except (DriverError, Conflict) as exc:
            error = exc
        made = self._made(row, plan)
        if made is None:  # the host did not answer: left taking, settled by asking again
            raise Conflict(
                f"snapshot {name} of vm {vm}: the host did not confirm the overlays ({error}); it stays taking "
                "and is settled once the host answers",
                field="vm",
            )
        if all(made.values()):
            self._confirm(vm, snap_id, plan, pause_ms)
            return next(s for s in self.listing(vm) if s["name"] == name)
        self._undo_take(vm, snap_id, plan, made, f"not taken: {error or 'the host made only part of it'}")
        field = "quiesce" if isinstance(error, _FreezeFailed) else "vm"
        raise Conflict(f"snapshot {name} of vm {vm} was not taken: {error}", field=field)

    def _take_live(self, driver, vm: str, plan, quiesce: bool) -> int | None:
        domain = domain_name(vm)
        overlays = {v.device or "vda": f"{v.pool_path}/{overlay}" for v, _base, overlay in plan}
        if not quiesce:
            t0 = time.monotonic()
            driver.snapshot_disks(domain, overlays)
            return round((time.monotonic() - t0) * 1000)
        try:
            driver.fs_freeze(domain, thaw_after_s=FREEZE_S)
        except DriverError as exc:
            raise _FreezeFailed(
                f"--quiesce needs the guest agent to freeze the file systems, and it did not: {exc}"
            ) from None
        t0 = time.monotonic()
        try:
            driver.snapshot_disks(domain, overlays)
        finally:
            try:
                driver.fs_thaw(domain)
            except DriverError as exc:
                log.warning("thaw of %s after its snapshot: %s (its guard thaws it within %g s)", vm, exc, FREEZE_S)
        return round((time.monotonic() - t0) * 1000)

    def _plan(self, snap_id: int) -> list[tuple[Row[Any], str, str]]:
        """(volume, base, overlay) of each disk of a snapshot."""
        with self.plane.db.read() as s:
            conn = s.connection()
            files = S.bases(conn, [snap_id]).get(snap_id, {})
            overlays = S.overlays(conn, snap_id)
            vols = {v.id: v for v in SL.volume_rows(conn, _VO.id.in_(list(files)))} if files else {}
        return [(vols[vid], files[vid], overlays[vid]) for vid in sorted(files) if vid in vols]

    def _driver_for(self, v: Row[Any]):
        return self.pools.driver_for(self.pools.row(v.pool_name))

    def _made(self, row: Row[Any], plan) -> dict[int, bool] | None:
        """Per volume: whether its overlay is there and on top (the domain opens it, for a running VM; the
        pool holds it on its base, for a stopped one). None: the host did not answer."""
        try:
            if row.state == VmState.running.value:
                have = self.plane.drivers[row.host_name].domain_disks(domain_name(row.name))
                return {v.id: have.get(v.device or "vda") == f"{v.pool_path}/{overlay}" for v, _b, overlay in plan}
            out = {}
            for v, base, overlay in plan:
                info = self._driver_for(v).volume(v.pool_name, overlay)
                out[v.id] = info is not None and info.backing == f"{v.pool_path}/{base}"
            return out
        except (DriverError, Conflict, KeyError):
            return None

    def _confirm(self, vm: str, snap_id: int, plan, pause_ms: int | None) -> None:
        with self.plane.db.transaction() as conn:
            row = L.vm_row(conn, name=vm, lock=True)
            if not any(r.id == snap_id and r.state == "taking" for r in S.snapshot_rows(conn, row.id)):
                raise Conflict(
                    f"snapshot of vm {vm} was settled by another process meanwhile; see the audit", field="vm"
                )
            for v, _base, overlay in plan:
                S.set_file_state(conn, v.id, overlay, "live")
                SL.set_volume(conn, v, file_name=overlay)
            S.set_snapshot(conn, snap_id, state="ready", pause_ms=pause_ms)
            name = next(r.name for r in S.snapshot_rows(conn, row.id) if r.id == snap_id)
            pause = f"; the guest paused {pause_ms} ms" if pause_ms is not None else ""
            S.event(conn, vm, name, "taking", "ready", row.project_id, f"read back: the disks open the overlays{pause}")

    def _undo_take(self, vm: str, snap_id: int, plan, made: dict[int, bool], note: str) -> None:
        """The overlays of a take the host did not confirm whole: those it made are deleted (a stopped VM's;
        a running domain switched to none of them, libvirt's ATOMIC), then the rows and charge go."""
        gone = True
        with self.plane.db.read() as s:
            row = L.vm_row(s.connection(), name=vm)
        for v, _base, overlay in plan:
            if made.get(v.id) and row.state == VmState.running.value:
                gone = False  # the domain opens it: never deleted under it (settle decides again)
                continue
            try:
                driver = self._driver_for(v)
                driver.delete_volume(v.pool_name, overlay)
                gone = gone and driver.volume(v.pool_name, overlay) is None
            except (DriverError, Conflict):
                gone = False
        if not gone:
            return  # left taking: settle() tries again
        with self.plane.db.transaction() as conn:
            row = L.vm_row(conn, name=vm, lock=True)
            for v, _base, overlay in plan:
                S.drop_file(conn, SL.volume_row(conn, v.name), overlay)
            name = next((r.name for r in S.snapshot_rows(conn, row.id) if r.id == snap_id), "?")
            S.remove_snapshot(conn, snap_id)
            S.event(conn, vm, name, "taking", "deleted", row.project_id, note)

    # -- revert --------------------------------------------------------------------------------------
    def revert(self, vm: str, name: str, project_id: int | None = None) -> dict[str, Any]:
        """The VM's disks as snapshot `name` saw them (a stopped VM): a new empty overlay on each of its
        bases, made and read back before the record switches to it; the files no chain needs then go."""
        with self.plane.db.transaction() as conn:
            row = self._vm(conn, vm, project_id, lock=True)
            snap = S.snapshot_row(conn, row.id, name)
            if snap is None:
                raise NotFound(f"vm {vm} has no snapshot {name!r}", field="snapshot")
            if row.state != VmState.stopped.value:
                raise Conflict(f"vm {vm} is {row.state}; stop it before reverting it to a snapshot", field="vm")
            problem = S.busy_problem(conn, row.id, vm)
            if problem:
                raise Conflict(problem, field="vm")
            bases = S.bases(conn, [snap.id])[snap.id]
            volumes = [v for v in SL.vm_volumes(conn, row.id) if v.id in bases]
            p = L.lock_project(conn, row.project_id)
            check_admission(
                p.name, L.quota_row(p), L.ledger_row(p), Usage(storage_mib=sum(v.size_mib for v in volumes))
            )
            plan = []
            for v in volumes:
                if not SL.take_on_pool(conn, v.pool_id, v.size_mib):
                    raise Conflict(f"pool {v.pool_name} has no room for an overlay of volume {v.name}", field="pool")
                overlay = overlay_name(bases[v.id], snap.id)
                S.add_file(conn, v, overlay, bases[v.id])
                plan.append((v, bases[v.id], overlay))
            S.set_snapshot(conn, snap.id, state="reverting")
            S.event(conn, vm, name, "ready", "reverting", row.project_id, f"{len(plan)} disk(s)")
        self._busy.add(snap.id)
        try:
            error: Exception | None = None
            try:
                failpoints.hit("snapshot.before-revert")
                for v, base, overlay in plan:
                    self._driver_for(v).create_volume(
                        v.pool_name, overlay, v.size_mib, "qcow2", f"{v.pool_path}/{base}", v.format
                    )
            except (DriverError, Conflict) as exc:
                error = exc
            made = self._made(row, plan)
            if made is not None and all(made.values()):
                self._switch(vm, snap.id, plan)
                return next(s for s in self.listing(vm) if s["name"] == name)
            if made is None:
                raise Conflict(
                    f"revert of vm {vm} to {name}: the pool did not answer ({error}); it stays reverting and is "
                    "settled once it answers",
                    field="vm",
                )
            self._undo_revert(vm, snap.id, plan)
            raise Conflict(
                f"vm {vm} was not reverted to {name}: {error or 'the pool made only part of it'}", field="vm"
            )
        finally:
            self._busy.discard(snap.id)

    def _switch(self, vm: str, snap_id: int, plan) -> None:
        """The reverted disks open their new overlays; the files no chain needs now are marked deleting."""
        with self.plane.db.transaction() as conn:
            row = L.vm_row(conn, name=vm, lock=True)
            for v, _base, overlay in plan:
                S.set_file_state(conn, v.id, overlay, "live")
                SL.set_volume(conn, SL.volume_row(conn, v.name), file_name=overlay)
            S.set_snapshot(conn, snap_id, state="ready")
            name = next(r.name for r in S.snapshot_rows(conn, row.id) if r.id == snap_id)
            doomed = self._collect(conn, row)
            S.event(
                conn,
                vm,
                name,
                "reverting",
                "ready",
                row.project_id,
                f"reverted; {len(doomed)} file(s) no longer needed",
            )
        self._delete_files(vm)

    def _undo_revert(self, vm: str, snap_id: int, plan) -> None:
        for v, _base, overlay in plan:
            try:
                self._driver_for(v).delete_volume(v.pool_name, overlay)
            except (DriverError, Conflict):
                pass
        with self.plane.db.transaction() as conn:
            L.vm_row(conn, name=vm, lock=True)
            for v, _base, overlay in plan:
                S.set_file_state(conn, v.id, overlay, "deleting")  # gone once the pool confirms it
            S.set_snapshot(conn, snap_id, state="ready")
        self._delete_files(vm)

    # -- delete --------------------------------------------------------------------------------------
    def delete(self, vm: str, name: str, project_id: int | None = None) -> None:
        """Drop snapshot `name`: its metadata at once; the files no chain needs then are deleted (a base the
        active chain reads stays: merging it into its child is the next step of this issue)."""
        with self.plane.db.transaction() as conn:
            row = self._vm(conn, vm, project_id, lock=True)
            snap = S.snapshot_row(conn, row.id, name)
            if snap is None:
                raise NotFound(f"vm {vm} has no snapshot {name!r}", field="snapshot")
            if snap.state != "ready":
                raise Conflict(
                    f"snapshot {name} of vm {vm} is {snap.state}; retry once it is settled", field="snapshot"
                )
            S.remove_snapshot(conn, snap.id)
            doomed = self._collect(conn, row)
            S.event(conn, vm, name, "ready", "deleted", row.project_id, f"{len(doomed)} file(s) no longer needed")
        self._delete_files(vm)
        if row.state == VmState.running.value:
            self.merge(vm)  # a stopped VM's chains are merged once it runs (settle)

    # -- merge ---------------------------------------------------------------------------------------
    def merge(self, vm: str) -> int:
        """Shorten a running VM's chains: a file that no snapshot keeps and that has one child gets the child
        committed into it (core/snapshots.mergeable; a live block commit), then the child is deleted. How
        many files were merged; a host that does not merge one leaves the rest for the next settle pass."""
        merged = 0
        while True:
            with self.plane.db.read() as s:
                conn = s.connection()
                row = L.vm_row(conn, name=vm)
                if row.state != VmState.running.value or S.busy_problem(conn, row.id, vm):
                    return merged
                volumes = SL.vm_volumes(conn, row.id)
                files = S.chain_files(conn, [v.id for v in volumes])
                if any(f.state in ("pending", "merging") for f in files):
                    return merged
                disks = S.disks(conn, volumes, {v.id: file_of(v) for v in volumes})
                pairs = rules.mergeable(disks, S.ready_snapshots(conn, row.id))
            owner = {f.file: f.volume_id for f in files}
            pair = next(((p, c) for p, c in pairs if owner.get(c) is not None), None)
            if pair is None:
                return merged
            volume = next(v for v in volumes if v.id == owner[pair[1]])
            if not self._merge_one(row, volume, *pair):
                return merged
            merged += 1

    def _merge_one(self, row: Row[Any], v: Row[Any], parent: str, child: str) -> bool:
        with self.plane.db.transaction() as conn:
            S.set_file_state(conn, v.id, child, "merging")
        driver, domain, target = self.plane.drivers[row.host_name], domain_name(row.name), v.device or "vda"
        error: Exception | None = None
        try:
            failpoints.hit("snapshot.before-merge")
            driver.commit_disk(domain, target, f"{v.pool_path}/{child}", f"{v.pool_path}/{parent}")
        except DriverError as exc:
            error = exc
        try:
            chain = driver.domain_chain(domain, target)
        except DriverError:
            return False  # left merging: the settle pass reads the domain again
        return self._merged(row, v, parent, child, chain, error)

    def _merged(self, row: Row[Any], v: Row[Any], parent: str, child: str, chain: list[str], error) -> bool:
        """Record what the domain reads now: `child` gone from its chain (merged: the records follow, and the
        file goes), or still there (not merged: it stays, live)."""
        merged = f"{v.pool_path}/{child}" not in chain
        with self.plane.db.transaction() as conn:
            now = SL.volume_row(conn, v.name, lock=True)
            if not merged:
                S.set_file_state(conn, v.id, child, "live")
                log.warning("vm %s: %s was not merged into %s (%s)", row.name, child, parent, error)
                return False
            if file_of(now) == child:
                SL.set_volume(conn, now, file_name=parent)
            S.reparent(conn, v.id, child, parent)
            S.set_file_state(conn, v.id, child, "deleting")
            SL.file_event(conn, now, f"{child} merged into {parent} (a live block commit); the chain is shorter by one")
        self._delete_files(row.name)
        return True

    def _collect(self, conn: Connection, row: Row[Any]) -> set[str]:
        """Mark deleting the files of the VM's chains that neither an active chain nor a snapshot needs."""
        volumes = SL.vm_volumes(conn, row.id)
        disks = S.disks(conn, volumes, {v.id: file_of(v) for v in volumes})
        files = S.chain_files(conn, [v.id for v in volumes])
        pending = {f.file for f in files if f.state == "pending"}
        doomed = rules.garbage(disks, S.ready_snapshots(conn, row.id)) - pending
        for f in files:
            if f.file in doomed:
                S.set_file_state(conn, f.volume_id, f.file, "deleting")
        return doomed

    def _delete_files(self, vm: str | None = None) -> None:
        """Delete the files marked deleting (of `vm`, or all); each row goes once its pool confirms it gone."""
        with self.plane.db.read() as s:  # the files first: a settle pass reads no volume without one
            conn = s.connection()
            doomed = S.chain_files(conn, state="deleting")
            where = [_VO.id.in_({f.volume_id for f in doomed})] + ([Vm.name == vm] if vm is not None else [])
            volumes = {v.id: v for v in SL.volume_rows(conn, *where)} if doomed else {}
            doomed = [f for f in doomed if f.volume_id in volumes]
        for f in doomed:
            v = volumes[f.volume_id]
            try:
                driver = self._driver_for(v)
                driver.delete_volume(v.pool_name, f.file)
                if driver.volume(v.pool_name, f.file) is not None:
                    continue
            except (DriverError, Conflict) as exc:
                log.info("snapshot file %s of volume %s: not deleted yet (%s)", f.file, v.name, exc)
                continue
            with self.plane.db.transaction() as conn:
                S.drop_file(conn, SL.volume_row(conn, v.name), f.file)

    # -- settle --------------------------------------------------------------------------------------
    def settle(self, force: bool = False) -> None:
        """Snapshots a crash (or a host that did not answer) left in a step: finished or undone by reading
        the host; files marked deleting: deleted. `force`: also steps younger than BUSY_S (start-up)."""
        with self.plane.db.read() as s:
            conn = s.connection()
            stuck = [r for r in S.unfinished(conn) if r.id not in self._busy]
            vms = {r.id: L.vm_row(conn, vm_id=r.vm_id) for r in stuck}
        now = utcnow()
        for r in stuck:
            vm = vms[r.id]
            if vm.host_name and not self.plane.membership.settles(vm.host_name):
                continue  # another process's host: that process settles it (its call may be in flight)
            if not force and (now - r.step_at).total_seconds() < BUSY_S:
                continue
            plan = self._plan(r.id)
            if r.state == "taking":
                made = self._made(vm, plan)
                if made is None:
                    continue
                if all(made.values()):
                    self._confirm(vm.name, r.id, plan, None)
                else:
                    self._undo_take(vm.name, r.id, plan, made, "not taken: settled after the step was cut short")
            elif r.state == "reverting":
                pend = self._pending_plan(vm)
                made = self._made(vm, pend)
                if made is None:
                    continue
                if pend and all(made.values()):
                    self._switch(vm.name, r.id, pend)
                else:
                    self._undo_revert(vm.name, r.id, pend)
        self._delete_files()
        self._settle_merges()

    def _settle_merges(self) -> None:
        """Merges a crash cut short (a file left `merging`: the domain read again), then the chains of running
        VMs that can be shortened (a snapshot deleted while the VM was stopped, or a merge that failed)."""
        with self.plane.db.read() as s:
            conn = s.connection()
            vms = [L.vm_row(conn, vm_id=i) for i in S.chained_vms(conn)]
            merging = S.chain_files(conn, state="merging")
            ids = list({f.volume_id for f in merging})
            volumes = {v.id: v for v in SL.volume_rows(conn, _VO.id.in_(ids))} if ids else {}
            by_id = {v.vm_id: L.vm_row(conn, vm_id=v.vm_id) for v in volumes.values() if v.vm_id is not None}
        for f in merging:
            v = volumes[f.volume_id]
            vm = by_id.get(v.vm_id) if v.vm_id is not None else None
            if vm is None or vm.state == VmState.stopped.value:
                # no domain opens it now (its VM stopped, or the volume was detached): any block job is gone and
                # the chain as recorded still reads right, unless the pivot came before the crash and the VM
                # then ran on (a window of milliseconds): recorded live
                with self.plane.db.transaction() as conn:
                    S.set_file_state(conn, v.id, f.file, "live")
                    SL.file_event(
                        conn, v, f"{f.file}: its merge was cut short and no domain has it now; kept as it was"
                    )
                continue
            if vm.state != VmState.running.value or vm.host_name not in self.plane.drivers:
                continue
            try:
                chain = self.plane.drivers[vm.host_name].domain_chain(domain_name(vm.name), v.device or "vda")
            except DriverError:
                continue
            if f.parent is not None:
                self._merged(vm, v, f.parent, f.file, chain, "settled after the merge was cut short")
        for vm in vms:
            if vm.state == VmState.running.value and self.plane.membership.settles(vm.host_name or ""):
                try:
                    self.merge(vm.name)
                except (DriverError, Conflict, NotFound) as exc:
                    log.info("vm %s: chain not merged now (%s)", vm.name, exc)

    def _pending_plan(self, vm: Row[Any]) -> list[tuple[Row[Any], str, str]]:
        with self.plane.db.read() as s:
            conn = s.connection()
            volumes = {v.id: v for v in SL.vm_volumes(conn, vm.id)}
            files = S.chain_files(conn, list(volumes))
        return [(volumes[f.volume_id], f.parent or "", f.file) for f in files if f.state == "pending"]


class _FreezeFailed(Conflict):
    def __init__(self, message: str):
        super().__init__(message, field="quiesce")


__all__ = ["Snapshots"]
