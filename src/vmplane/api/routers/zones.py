"""Zones and clusters."""

from fastapi import APIRouter

from ... import lifecycle
from ..deps import Admin, Orch
from ..schemas import ClusterCreate, ClusterOut, ZoneCreate, ZoneOut

router = APIRouter(tags=["zones and clusters"])


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


@router.post("/clusters", status_code=201, response_model=ClusterOut)
def create_cluster(body: ClusterCreate, orch: Orch, _: Admin):
    c = orch.catalog.create_cluster(body.name, body.zone)
    return ClusterOut(name=c.name, zone=c.zone.name)


@router.get("/clusters", response_model=list[ClusterOut])
def list_clusters(orch: Orch, _: Admin):
    return [ClusterOut(name=c.name, zone=c.zone.name) for c in orch.catalog.clusters()]


@router.delete("/clusters/{name}", status_code=204)
def delete_cluster(name: str, orch: Orch, _: Admin) -> None:
    """Refused (409) while the cluster has hosts (or VMs pinned to it), naming them; its settings go with it."""
    lifecycle.delete_cluster(orch.catalog, name)
