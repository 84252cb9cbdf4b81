"""Storage: pools (admins define them on hosts) and volumes (a project's disks, attached to its VMs)."""

from fastapi import APIRouter

from vmplane.api.deps import Admin, AnyCaller, Orch
from vmplane.api.paging import StrictQueryRoute
from vmplane.api.schemas import PoolCreate, PoolOut, VolumeAttach, VolumeCreate, VolumeMove, VolumeOut, VolumeResize
from vmplane.api.views import pool_out, volume_out

router = APIRouter(tags=["storage"], route_class=StrictQueryRoute)


@router.post("/pools", status_code=201, response_model=PoolOut)
def create_pool(body: PoolCreate, orch: Orch, _: Admin):
    """Defined on its host (local) or on every host of its cluster (shared, checked by a probe file)."""
    return pool_out(orch.pools.create(body.name, body.kind, body.cluster, body.host, body.path))


@router.get("/pools", response_model=list[PoolOut])
def list_pools(orch: Orch, _: Admin, refresh: bool = False):
    """`refresh` reads each pool's state and size back from its hosts first."""
    return [pool_out(r) for r in (orch.pools.refresh() if refresh else orch.pools.rows())]


@router.get("/pools/{name}", response_model=PoolOut)
def show_pool(name: str, orch: Orch, _: Admin):
    return pool_out(orch.pools.refresh(name)[0])


@router.delete("/pools/{name}", status_code=204)
def delete_pool(name: str, orch: Orch, _: Admin) -> None:
    """Refused (409) while it holds volumes; its files are left on the hosts."""
    orch.pools.delete(name)


@router.post("/volumes", status_code=201, response_model=VolumeOut)
def create_volume(body: VolumeCreate, orch: Orch, who: AnyCaller):
    """Charged to the project's storage quota (refused when over it) in the same transaction that
    takes the pool's space; then made on a host and read back."""
    project_id = orch.catalog.project(body.project).id
    who.check_project(project_id, "project", body.project)
    return volume_out(orch.volumes.create(body.name, body.project, body.size_mib, body.pool, project_id))


@router.get("/volumes", response_model=list[VolumeOut])
def list_volumes(orch: Orch, who: AnyCaller, vm: str | None = None):
    return [volume_out(r) for r in orch.volumes.rows(None if who.is_admin else who.project_id, vm=vm)]


def _project(who) -> int | None:
    return None if who.is_admin else who.project_id


@router.get("/volumes/{name}", response_model=VolumeOut)
def show_volume(name: str, orch: Orch, who: AnyCaller):
    row = orch.volumes.row(name)
    who.check_project(row.project_id, "volume", name)
    return volume_out(row)


@router.post("/volumes/{name}/attach", response_model=VolumeOut)
def attach_volume(name: str, body: VolumeAttach, orch: Orch, who: AnyCaller):
    """Hot-plugged into a running VM (confirmed by reading the domain back), or recorded for a stopped one."""
    return volume_out(orch.volumes.attach(name, body.vm, _project(who)))


@router.post("/volumes/{name}/detach", response_model=VolumeOut)
def detach_volume(name: str, orch: Orch, who: AnyCaller):
    """From a running VM: returns once the hypervisor confirmed the device left (never assumed)."""
    return volume_out(orch.volumes.detach(name, _project(who)))


@router.post("/volumes/{name}/resize", response_model=VolumeOut)
def resize_volume(name: str, body: VolumeResize, orch: Orch, who: AnyCaller):
    """Grow a volume or a root disk: live (blockResize) while its VM runs, else offline; the increase is
    charged to the storage quota first and given back if the host refuses."""
    return volume_out(orch.volumes.resize(name, body.size_mib, _project(who)))


@router.post("/volumes/{name}/move", response_model=VolumeOut)
def move_volume(name: str, body: VolumeMove, orch: Orch, who: AnyCaller):
    """Move a volume (a root disk too) to another pool: live by a block copy while its VM runs, else copied by
    a host that sees both pools. The target pool's space is claimed first; the project's charge does not
    change. It switches to the new file once read back there; its old file is then deleted. Refused (4xx
    naming the field, nothing changed): an unknown or the same pool, a pool its VM's host does not see, a
    volume with snapshots or moving already, a pool without room."""
    return volume_out(orch.volume_moves.move(name, body.pool, _project(who)))


@router.delete("/volumes/{name}", status_code=204)
def delete_volume(name: str, orch: Orch, who: AnyCaller) -> None:
    """Refused (409) while attached; its charge goes once its pool confirms the file is gone."""
    orch.volumes.delete(name, _project(who))
