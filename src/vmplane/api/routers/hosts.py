"""Hosts."""

from fastapi import APIRouter, Response

from vmplane.api.deps import Admin, Caller, Orch
from vmplane.api.paging import Paging, StrictQueryRoute, paged
from vmplane.api.schemas import FenceAgents, FenceRequest, HostCreate, HostFailure, HostOut, MaintenanceRequest
from vmplane.api.views import host_out
from vmplane.core.errors import Conflict
from vmplane.core.model import HostState

router = APIRouter(tags=["hosts"], route_class=StrictQueryRoute)


@router.post("/hosts", status_code=201, response_model=HostOut)
def add_host(body: HostCreate, orch: Orch, _: Admin):
    h = orch.add_host(
        body.name,
        body.cluster,
        body.driver,
        cores=body.cores,
        cpu_mhz=body.cpu_mhz,
        memory_mib=body.memory_mib,
        uri=body.uri,
        migration_address=body.migration_address,
        local_pool=body.local_pool,
        cpu_model=body.cpu_model,
    )
    return host_out(orch, h)


@router.post("/hosts/{name}/maintenance")
def maintenance(name: str, body: MaintenanceRequest, orch: Orch, _: Admin) -> dict:
    """enter: drain the host by live migration (within the limits); VMs that fit nowhere are listed and
    stay. exit: enable the host again. A dry run says what enter would do and changes nothing."""
    if body.action == "exit":
        return orch.maintenance.exit(name)
    return orch.maintenance.enter(name, dry_run=body.dry_run)


@router.get("/hosts", response_model=list[HostOut])
def list_hosts(
    orch: Orch,
    _: Admin,
    response: Response,
    page: Paging,
    cluster: str | None = None,
    zone: str | None = None,
    state: HostState | None = None,
):
    """Hosts, filtered and sorted (`sort`: name, cluster, zone, state, cores, memory_mib, used_vcpus,
    used_memory_mib). The total is in the X-Total-Count header."""
    hosts, total = orch.host_page(page, cluster=cluster, zone=zone, state=state and state.value)
    return paged(response, [host_out(orch, h) for h in hosts], total)


@router.delete("/hosts/{name}", status_code=204)
def delete_host(name: str, orch: Orch, _: Admin) -> None:
    """Refused (409) while anything is placed on the host (VMs, claims, active migrations), naming it.
    Enter maintenance first to drain it. Its local pools go with it when empty (a volume left on one is
    named in the refusal)."""
    orch.remove_host(name, local_pools=True)


@router.get("/hosts/{name}", response_model=HostOut)
def show_host(name: str, orch: Orch, _: Admin):
    return host_out(orch, orch.host(name))


@router.post("/hosts/{name}/fence")
def fence_host(name: str, body: FenceRequest, orch: Orch, who: Admin) -> dict:
    """Fence a host that does not answer now, without waiting for `vmplane.ha.grace` (its fence agents
    power it off, then its HA VMs run elsewhere); `confirm_off`: the operator's word that it is off.
    Refused (409) for a host that answers."""
    return orch.ha.fence(name, confirm_off=body.confirm_off, who=_who(who))


@router.put("/hosts/{name}/fence-agents")
def set_fence_agents(name: str, body: FenceAgents, orch: Orch, _: Admin) -> dict:
    """How the host is powered off when it fails: agents tried in order (local, ipmi, redfish, sim)."""
    return {"host": name, "agents": [a.get("agent") for a in orch.ha.set_agents(name, body.agents)]}


@router.post("/hosts/{name}/fail")
def fail_host(name: str, body: HostFailure, orch: Orch, _: Admin) -> dict:
    """The nemesis, for drills on local and simulated clusters: make the host fail (power, daemon or
    network). Refused (409) for a remote host."""
    return orch.ha.nemesis(name, body.mode)


@router.post("/hosts/{name}/recover")
def recover_host(name: str, orch: Orch, who: Admin) -> dict:
    """Recover a host. One that a failed recovery left `fencing` or `fenced` with HA VMs still unknown
    (no recovery in flight): its recovery runs again (the answer names the operation). Otherwise, on a local
    or simulated host, undo the nemesis: power it on, start its daemon again, or heal its network. 409 when
    there is nothing left to recover (a remote host that no recovery left anything on)."""
    if orch.ha.has_stranded(name):
        return orch.ha.recover(name, who=_who(who))
    try:
        return orch.ha.nemesis(name, None)
    except Conflict as exc:
        raise Conflict(
            f"host {name}: nothing is left to recover (no HA VM of it is unknown; {exc.message})", field="host"
        ) from None


def _who(who: Caller) -> str:
    return f"an operator (token {who.name})" if getattr(who, "name", None) else "an operator"
