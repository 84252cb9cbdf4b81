"""Placement groups (a project's VMs together on one host, or apart) and clusters' failover capacity."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from pydantic import Field, StrictBool

from vmplane.api.deps import AnyCaller, Orch
from vmplane.api.paging import StrictQueryRoute
from vmplane.api.schemas import ClusterOut, Name, Request, Response, UtcDatetime
from vmplane.store import groupstore

router = APIRouter(tags=["placement groups"], route_class=StrictQueryRoute)


class GroupCreate(Request):
    name: Name
    project: Name
    policy: Literal["affinity", "anti-affinity"]
    hard: StrictBool = Field(
        True,
        description="hard: a placement that breaks the policy is refused; soft (false): one that keeps it is preferred",
    )


class GroupPlaced(Response):
    vm: str
    host: str


class GroupOut(Response):
    name: str
    project: str
    policy: str
    hard: bool
    rule: str = Field(description="the policy in words: anti-affinity (hard)")
    vms: list[str] = Field(description="the VMs in the group")
    placed: list[GroupPlaced] | None = Field(None, description="where its VMs hold a host (show only)")
    created_at: UtcDatetime


def _project(who) -> int | None:
    return None if who.is_admin else who.project_id


@router.post("/groups", status_code=201, response_model=GroupOut)
def create_group(body: GroupCreate, orch: Orch, who: AnyCaller):
    """A group of one project's VMs; a VM joins it at `vm create --group`."""
    return groupstore.create(orch.db, body.name, body.project, body.policy, body.hard, _project(who))


@router.get("/groups", response_model=list[GroupOut])
def list_groups(orch: Orch, who: AnyCaller):
    """Every group (a member: its project's), with its VMs."""
    return groupstore.rows(orch.db, _project(who))


@router.get("/groups/{name}", response_model=GroupOut)
def show_group(name: str, orch: Orch, who: AnyCaller):
    """One group, with the hosts its VMs hold."""
    return groupstore.show(orch.db, name, _project(who))


@router.delete("/groups/{name}", status_code=204)
def delete_group(name: str, orch: Orch, who: AnyCaller) -> None:
    """Refused (409) while VMs are in it, naming them."""
    groupstore.delete(orch.db, name, _project(who))


class ClusterFailover(Response):
    """Failover capacity (aggregate bound: free room counted as one pool, fragmentation not modelled)."""

    failures_tolerated: int = Field(description="k: vmplane.ha.host.failures.tolerated at the cluster's scope")
    setting: str
    reserve_vcpus: int = Field(description="held back: the most HA load (vCPUs) any k hosts carry")
    reserve_memory_mib: int
    free_vcpus: int = Field(description="free room of the cluster's enabled hosts, all together")
    free_memory_mib: int
    ha_vcpus: int = Field(description="what the cluster's HA VMs claim, all together")
    ha_memory_mib: int
    survives: bool = Field(description="the HA VMs of any k hosts can be restarted on the others now")
    survivable_failures: int = Field(description="how many of the k failures it can take now")
    worst_case: list[str] = Field(description="the hosts whose failure needs the most room")
    shortfall_vcpus: int
    shortfall_memory_mib: int


class ClusterDetail(ClusterOut):
    hosts: list[str]
    failover: ClusterFailover
