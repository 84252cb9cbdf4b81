"""Zones and clusters."""

from fastapi import APIRouter

from vmplane.api.deps import Admin, Orch
from vmplane.api.paging import StrictQueryRoute
from vmplane.api.routers.groups import ClusterDetail, ClusterFailover
from vmplane.api.schemas import ClusterCreate, ClusterOut, ClusterUpdate, ZoneCreate, ZoneOut
from vmplane.controllers import clustercpu
from vmplane.core import cpumodels
from vmplane.core.errors import NotFound
from vmplane.plane import reserves
from vmplane.store import lifecycle
from vmplane.store.schema import Cluster

router = APIRouter(tags=["zones and clusters"], route_class=StrictQueryRoute)


@router.post("/zones", status_code=201, response_model=ZoneOut)
def create_zone(body: ZoneCreate, orch: Orch, _: Admin):
    return ZoneOut(name=orch.catalog.create_zone(body.name).name)


@router.get("/zones", response_model=list[ZoneOut])
def list_zones(orch: Orch, _: Admin):
    return [ZoneOut(name=z.name) for z in orch.catalog.zones()]


@router.delete("/zones/{name}", status_code=204)
def delete_zone(name: str, orch: Orch, _: Admin) -> None:
    """Refused (409) while the zone has clusters (or VMs), naming them; its settings go with it."""
    lifecycle.delete_zone(orch.catalog, name)


def cluster_cpu(c: Cluster) -> dict:
    """A cluster's guest CPU fields: the admin's model, its hosts' baseline (and why it is not the hypervisor's
    own) and the model a VM started now gets."""
    return {
        "cpu_model": c.cpu_model,
        "cpu_baseline": c.cpu_baseline,
        "cpu_baseline_why": c.cpu_baseline_why,
        "effective_cpu_model": cpumodels.effective(None, c.cpu_model, c.cpu_baseline),
    }


@router.post("/clusters", status_code=201, response_model=ClusterOut)
def create_cluster(body: ClusterCreate, orch: Orch, _: Admin):
    c = orch.catalog.create_cluster(body.name, body.zone, cpu_model=body.cpu_model)
    return ClusterOut(name=c.name, zone=c.zone.name, **cluster_cpu(c))


@router.get("/clusters", response_model=list[ClusterOut])
def list_clusters(orch: Orch, _: Admin):
    return [ClusterOut(name=c.name, zone=c.zone.name, **cluster_cpu(c)) for c in orch.catalog.clusters()]


@router.patch("/clusters/{name}", response_model=ClusterOut)
def update_cluster(name: str, body: ClusterUpdate, orch: Orch, _: Admin):
    """Set the cluster's CPU model (null: back to its hosts' baseline). Refused (409) naming a host of the
    cluster that can not run it; VMs running keep their model until they start again."""
    c = clustercpu.set_model(orch.plane, name, body.cpu_model)
    return ClusterOut(name=c.name, zone=c.zone.name, **cluster_cpu(c))


@router.get("/clusters/{name}", response_model=ClusterDetail)
def show_cluster(name: str, orch: Orch, _: Admin):
    """A cluster, its hosts, and its failover capacity: k, the reserve, and whether it survives k host failures."""
    c = next((c for c in orch.catalog.clusters() if c.name == name), None)
    if c is None:
        raise NotFound(f"cluster {name!r} does not exist", field="cluster")
    hosts = sorted(h.name for h in orch.hosts() if h.cluster.name == name)
    failover = ClusterFailover.model_validate(reserves.cluster_report(orch.plane, name))
    return ClusterDetail(name=c.name, zone=c.zone.name, hosts=hosts, failover=failover, **cluster_cpu(c))


@router.delete("/clusters/{name}", status_code=204)
def delete_cluster(name: str, orch: Orch, _: Admin) -> None:
    """Refused (409) while the cluster has hosts (or VMs pinned to it), naming them; its settings go with it."""
    lifecycle.delete_cluster(orch.catalog, name)
