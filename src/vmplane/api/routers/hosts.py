"""Hosts."""

from fastapi import APIRouter

from ..deps import Admin, Orch
from ..schemas import HostCreate, HostOut, MaintenanceRequest
from ..views import host_out

router = APIRouter(tags=["hosts"])


@router.post("/hosts", status_code=201, response_model=HostOut)
def add_host(body: HostCreate, orch: Orch, _: Admin):
    h = orch.add_host(body.name, body.cluster, body.driver, cores=body.cores, cpu_mhz=body.cpu_mhz,
                      memory_mib=body.memory_mib, uri=body.uri, migration_address=body.migration_address)
    return host_out(orch, h)


@router.post("/hosts/{name}/maintenance")
def maintenance(name: str, body: MaintenanceRequest, orch: Orch, _: Admin) -> dict:
    """enter: drain the host by live migration (within the limits); VMs that fit nowhere are listed and
    stay. exit: enable the host again. A dry run says what enter would do and changes nothing."""
    if body.action == "exit":
        return orch.migrator.exit_maintenance(name)
    return orch.migrator.enter_maintenance(name, dry_run=body.dry_run)


@router.get("/hosts", response_model=list[HostOut])
def list_hosts(orch: Orch, _: Admin):
    return [host_out(orch, h) for h in orch.hosts()]


@router.get("/hosts/{name}", response_model=HostOut)
def show_host(name: str, orch: Orch, _: Admin):
    return host_out(orch, orch.host(name))
