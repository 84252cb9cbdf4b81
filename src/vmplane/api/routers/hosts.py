"""Hosts."""

from fastapi import APIRouter

from ..deps import Admin, Orch
from ..schemas import HostCreate, HostOut
from ..views import host_out

router = APIRouter(tags=["hosts"])


@router.post("/hosts", status_code=201, response_model=HostOut)
def add_host(body: HostCreate, orch: Orch, _: Admin):
    h = orch.add_host(body.name, body.cluster, body.driver, cores=body.cores, cpu_mhz=body.cpu_mhz,
                      memory_mib=body.memory_mib, uri=body.uri)
    return host_out(orch, h)


@router.get("/hosts", response_model=list[HostOut])
def list_hosts(orch: Orch, _: Admin):
    return [host_out(orch, h) for h in orch.hosts()]


@router.get("/hosts/{name}", response_model=HostOut)
def show_host(name: str, orch: Orch, _: Admin):
    return host_out(orch, orch.host(name))
