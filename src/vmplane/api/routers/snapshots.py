"""A VM's disk snapshots (issue 32): taken live or stopped, listed, reverted (a stopped VM), deleted. Each
answer comes once the host confirmed it (read back): a 409 says what was not done and that nothing was
left half-made, or that the step stays until the host answers."""

from __future__ import annotations

from datetime import datetime

from fastapi import APIRouter, Path
from pydantic import Field

from vmplane.api.deps import AnyCaller, Orch
from vmplane.api.paging import StrictQueryRoute
from vmplane.api.schemas import Request, Response
from vmplane.api.views import vm_body

router = APIRouter(tags=["vms"], route_class=StrictQueryRoute)
SnapshotName = Path(max_length=63, description="the snapshot's name")


class SnapshotCreate(Request):
    name: str = Field(max_length=63, description="lowercase letters, digits and '-'; unique within the VM")
    quiesce: bool = Field(
        False, description="freeze the guest's file systems through its agent for the snapshot (a running VM)"
    )


class SnapshotOut(Response):
    vm: str
    name: str
    state: str = Field(description="taking, ready, reverting (a step not yet confirmed by the host)")
    live: bool = Field(description="taken while the VM ran")
    quiesced: bool
    pause_ms: int | None = Field(description="how long the guest was paused (frozen, then switched to the overlays)")
    created_at: datetime
    disks: dict[str, str] = Field(description="volume -> the file the snapshot keeps (read-only since)")


def _project(orch: Orch, who: AnyCaller, vm: str) -> int | None:
    row = orch.vm(vm)
    who.check_project(row.project_id, "vm", vm)
    return None if who.is_admin else row.project_id


@router.post("/vms/{name}/snapshots", status_code=201, response_model=SnapshotOut)
def create_snapshot(name: str, body: SnapshotCreate, orch: Orch, who: AnyCaller):
    """Snapshot every disk of the VM (running or stopped; at most 32). Each overlay is charged at
    its disk's size in the project's storage quota before anything is made."""
    return orch.snapshots.take(name, body.name, body.quiesce, project_id=_project(orch, who, name))


@router.get("/vms/{name}/snapshots", response_model=list[SnapshotOut])
def list_snapshots(name: str, orch: Orch, who: AnyCaller):
    """The VM's snapshots, oldest first."""
    return orch.snapshots.listing(name, project_id=_project(orch, who, name))


@router.post("/vms/{name}/snapshots/{snapshot}/revert", response_model=SnapshotOut)
def revert_snapshot(name: str, orch: Orch, who: AnyCaller, snapshot: str = SnapshotName):
    """Put the stopped VM's disks back as the snapshot saw them (409 while it runs). What was written since is
    dropped; the other snapshots stay."""
    return orch.snapshots.revert(name, snapshot, project_id=_project(orch, who, name))


@router.delete("/vms/{name}/snapshots/{snapshot}", status_code=204)
def delete_snapshot(name: str, orch: Orch, who: AnyCaller, snapshot: str = SnapshotName):
    """Drop the snapshot; the files no chain needs any more are deleted (their charge goes once gone)."""
    orch.snapshots.delete(name, snapshot, project_id=_project(orch, who, name))


class CloneRequest(Request):
    name: str = Field(max_length=63, description="the new VM's name")
    snapshot: str | None = Field(None, max_length=63, description="what this snapshot kept (any VM state)")
    full: bool = Field(False, description="a full copy; else, of a snapshot, a linked clone (an overlay on its base)")
    start: bool = Field(False, description="start the new VM once its disk is made")


@router.post("/vms/{name}/clone", status_code=201)
def clone_vm(name: str, body: CloneRequest, orch: Orch, who: AnyCaller) -> dict:
    """A new VM (the source's offering, template, size and project) whose root disk holds what one of the
    source's snapshots kept: a linked clone (an empty overlay on the snapshot's base, which the source keeps
    while the clone exists) or, `full`, a copy; or a full copy of a stopped source's disk. Data volumes are not
    cloned."""
    done = orch.clones.clone(
        name, body.name, body.snapshot, body.start, project_id=_project(orch, who, name), full=body.full
    )
    return {"source": name, "snapshot": body.snapshot, "linked": done["linked"], "copied": done["copied"],
            "vm": vm_body(orch.db, body.name)}  # fmt: skip
