"""The console's guest-network pages (read only): the networks list and one network with its NICs. An admin
sees every network; a member its project's and the shared provider ones, and on a shared network only its
own VMs' NICs (another's network answers 404, as the API does). The VM, project and host pages show their
networks through pages.py with the reads of netqueries.py."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request

from vmplane.api.paging import StrictQueryRoute
from vmplane.ui import netqueries
from vmplane.ui.render import PAGE_SIZE, render
from vmplane.ui.session import Viewer

router = APIRouter(prefix="/ui", include_in_schema=False, route_class=StrictQueryRoute)
Offset = Annotated[int, Query(ge=0, le=2**31 - 1)]


def _scope(who) -> int | None:
    return None if who.is_admin else who.project_id


@router.get("/networks")
def networks_page(request: Request, who: Viewer, offset: Offset = 0):
    return render(request, "networks.html", section="networks", **_network_list(request, who, offset))


@router.get("/f/networks")
def networks_fragment(request: Request, who: Viewer, offset: Offset = 0):
    return render(request, "fragments/network_list.html", **_network_list(request, who, offset))


def _network_list(request: Request, who, offset: int) -> dict:
    db = request.app.state.orchestrator.db
    networks, total = netqueries.network_page(db, _scope(who), PAGE_SIZE, offset)
    return dict(networks=networks, total=total, offset=offset, params={})


@router.get("/networks/{name}")
def network_page(request: Request, name: str, who: Viewer):
    db = request.app.state.orchestrator.db
    network, nics, nic_total = netqueries.network_detail(db, name, _scope(who), PAGE_SIZE)
    return render(request, "network.html", section="networks", network=network, nics=nics, nic_total=nic_total)
