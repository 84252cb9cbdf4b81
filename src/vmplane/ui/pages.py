"""The console's pages and the fragments htmx swaps into them. A page is its fragments in the layout;
every list is one server-side page (PAGE_SIZE rows), sorted and filtered in SQL as the API's lists are.
A member sees its project only: what is not its own answers 404, as the API does."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request

from vmplane.api.paging import StrictQueryRoute
from vmplane.core.errors import Forbidden, Invalid, VmplaneError
from vmplane.core.eventfold import fold
from vmplane.core.model import VmState
from vmplane.store import events, groupstore
from vmplane.store.listing import Page
from vmplane.ui import charts, netqueries, queries
from vmplane.ui.render import PAGE_SIZE, error_fragment, render
from vmplane.ui.session import Viewer

router = APIRouter(prefix="/ui", include_in_schema=False, route_class=StrictQueryRoute)
Offset = Annotated[int, Query(ge=0, le=2**31 - 1)]
Text = Annotated[str | None, Query(max_length=63)]
Range = Annotated[str | None, Query(alias="range", max_length=8)]  # the graphs' span: hour, day, month


def _orch(request: Request):
    return request.app.state.orchestrator


def _scope(who) -> int | None:
    return None if who.is_admin else who.project_id


def _admin(who) -> None:
    if not who.is_admin:
        raise Forbidden("hosts are shown to admins only")


# -- overview ------------------------------------------------------------------------------------
@router.get("")
def overview(request: Request, who: Viewer):
    return render(request, "overview.html", section="overview", **_overview(request, who, 0))


@router.get("/f/overview/hosts")
def overview_hosts(request: Request, who: Viewer, offset: Offset = 0):
    _admin(who)
    return render(request, "fragments/host_bars.html", **_host_bars(request, offset))


def _overview(request: Request, who, offset: int) -> dict:
    o = _orch(request)
    context = dict(vm_counts=queries.vm_counts(o.db, _scope(who)), **_project_rows(request, who, 0, cards=False))
    if who.is_admin:
        context.update(host_counts=queries.host_counts(o.db), **_host_bars(request, offset))
    return context


def _host_bars(request: Request, offset: int) -> dict:
    """Hosts as bars, the most allocated first (by memory), one page of them."""
    o = _orch(request)
    hosts, total = o.host_page(Page(limit=PAGE_SIZE, offset=offset, sort="-used_memory_mib"))
    overhead = queries.overhead_by_host(o.db, [h.name for h in hosts])
    rows = [dict(host=h, cap=o.host_capacity(h.name), overhead=overhead.get(h.name, 0)) for h in hosts]
    return dict(host_rows=rows, host_total=total, host_offset=offset)


def _project_rows(request: Request, who, offset: int, cards: bool) -> dict:
    """One page of projects' quota bars (as cards on the projects page, a grid on the overview)."""
    o = _orch(request)
    projects, total = queries.project_page(o.db, _scope(who), PAGE_SIZE, offset)
    overhead = queries.overhead_by_project(o.db, [p.id for p in projects])
    return dict(
        projects=[dict(project=p, overhead=overhead.get(p.id, 0)) for p in projects],
        project_total=total,
        project_offset=offset,
        cards=cards,
        project_target="#project-list" if cards else "#overview-projects",
    )


# -- hosts ---------------------------------------------------------------------------------------
HOST_SORTS = ("name", "cluster", "state", "used_vcpus", "used_memory_mib")


@router.get("/hosts")
def hosts_page(
    request: Request, who: Viewer, state: Text = None, cluster: Text = None, sort: Text = None, offset: Offset = 0
):
    _admin(who)
    return render(request, "hosts.html", section="hosts", **_host_list(request, state, cluster, sort, offset))


@router.get("/f/hosts")
def hosts_fragment(
    request: Request, who: Viewer, state: Text = None, cluster: Text = None, sort: Text = None, offset: Offset = 0
):
    _admin(who)
    return render(request, "fragments/host_list.html", **_host_list(request, state, cluster, sort, offset))


def _host_list(request: Request, state, cluster, sort, offset) -> dict:
    o = _orch(request)
    params = dict(state=state, cluster=cluster, sort=sort)
    hosts, total = o.host_page(Page(limit=PAGE_SIZE, offset=offset, sort=sort), cluster=cluster, state=state)
    overhead = queries.overhead_by_host(o.db, [h.name for h in hosts])
    rows = [dict(host=h, cap=o.host_capacity(h.name), overhead=overhead.get(h.name, 0)) for h in hosts]
    return dict(rows=rows, total=total, offset=offset, params=params, sorts=HOST_SORTS)


@router.get("/hosts/{name}")
def host_page(request: Request, name: str, who: Viewer, graph_range: Range = None):
    _admin(who)
    o = _orch(request)
    host = o.host(name)
    vms, vm_total = queries.vm_names_on_host(o.db, host.id, PAGE_SIZE)
    claims, claim_total = queries.claims_on_host(o.db, host.id, PAGE_SIZE)
    migrations = o.migrator.list(host=name, active_only=True, limit=PAGE_SIZE)
    overhead = queries.overhead_by_host(o.db, [name]).get(name, 0)
    evs, _ = events.page(o.db, Page(limit=20), host=name)
    evs = fold(evs)
    networks, network_total = netqueries.host_networks(o.db, host.cluster.zone_id, host.id, PAGE_SIZE)
    return render(
        request,
        "host.html",
        section="hosts",
        host=host,
        cap=o.host_capacity(name),
        overhead=overhead,
        vms=vms,
        vm_total=vm_total,
        claims=claims,
        claim_total=claim_total,
        migrations=migrations,
        events=evs,
        networks=networks,
        network_total=network_total,
        net_failure=o.networking.failures.get(name),
        **charts.graphs(o.db, "host", host.id, graph_range),
    )


# -- VMs -----------------------------------------------------------------------------------------
VM_SORTS = ("name", "state", "project", "host", "vcpus", "memory_mib", "created_at")


@router.get("/vms")
def vms_page(
    request: Request,
    who: Viewer,
    project: Text = None,
    host: Text = None,
    state: Text = None,
    name: Text = None,
    sort: Text = None,
    offset: Offset = 0,
):
    context = _vm_list(request, who, project, host, state, name, sort, offset)
    return render(request, "vms.html", section="vms", states=[s.value for s in VmState], **context)


@router.get("/f/vms")
def vms_fragment(
    request: Request,
    who: Viewer,
    project: Text = None,
    host: Text = None,
    state: Text = None,
    name: Text = None,
    sort: Text = None,
    offset: Offset = 0,
):
    try:
        context = _vm_list(request, who, project, host, state, name, sort, offset)
    except VmplaneError as exc:  # a bad sort or filter: said where the list would be
        return error_fragment(request, exc)
    return render(request, "fragments/vm_list.html", selectable=True, **context)


def _vm_list(request: Request, who, project, host, state, name, sort, offset) -> dict:
    o = _orch(request)
    params = dict(project=project, host=host, state=state, name=name, sort=sort)
    if state and state not in {s.value for s in VmState}:
        raise Invalid(
            f"state: {state!r} is not a VM state; one of {', '.join(s.value for s in VmState)}", field="state"
        )
    vms, total = o.vm_page(
        Page(limit=PAGE_SIZE, offset=offset, sort=sort),
        project=project,
        state=state,
        host=host,
        name=name,
        project_id=_scope(who),
    )
    return dict(vms=vms, total=total, offset=offset, params=params, sorts=VM_SORTS)


@router.get("/vms/{name}")
def vm_page(request: Request, name: str, who: Viewer, graph_range: Range = None):
    return render(request, "vm.html", section="vms", **_vm_detail(request, who, name, graph_range))


@router.get("/f/vms/{name}")
def vm_fragment(request: Request, name: str, who: Viewer):
    return render(request, "fragments/vm_detail.html", **_vm_detail(request, who, name))


def _vm_detail(request: Request, who, name: str, graph_range: str | None = None) -> dict:
    o = _orch(request)
    vm = o.vm(name)
    who.check_project(vm.project_id, "vm", name)
    evs, _ = events.page(o.db, Page(limit=20), vm=name, project_id=_scope(who))
    evs = fold(evs)
    migrations, _ = o.migrator.page(Page(limit=5), vm=name, project_id=_scope(who))
    offerings = [off for off in o.catalog.offerings() if not off.retired]
    return dict(
        vm=vm,
        operations=queries.vm_operations(o.db, vm.id),
        events=evs,
        migrations=migrations,
        offerings=offerings,
        nics=netqueries.vm_nics(o.db, vm.id),
        agent=netqueries.vm_agent(o.db, vm.id, vm.state),
        snapshots=o.snapshots.listing(name),
        backups=o.backups.listing(name, project_id=_scope(who)),
        **charts.graphs(o.db, "vm", vm.id, graph_range),
    )


# -- projects ------------------------------------------------------------------------------------
@router.get("/projects")
def projects_page(request: Request, who: Viewer, offset: Offset = 0):
    return render(request, "projects.html", section="projects", **_project_rows(request, who, offset, cards=True))


@router.get("/f/projects")
def projects_fragment(request: Request, who: Viewer, offset: Offset = 0, cards: bool = False):
    return render(request, "fragments/project_grid.html", **_project_rows(request, who, offset, cards))


@router.get("/projects/{name}")
def project_page(request: Request, name: str, who: Viewer, offset: Offset = 0, graph_range: Range = None):
    o = _orch(request)
    p = o.catalog.project(name)
    who.check_project(p.id, "project", name)
    vms, total = o.vm_page(Page(limit=PAGE_SIZE, offset=offset), project=name, project_id=_scope(who))
    overhead = queries.overhead_by_project(o.db, [p.id]).get(p.id, 0)
    networks, network_total = netqueries.network_page(o.db, p.id, PAGE_SIZE)
    groups, group_total = netqueries.project_groups(o.db, p.id, PAGE_SIZE)
    placement = groupstore.rows(o.db, p.id)
    return render(
        request,
        "project.html",
        section="projects",
        project=p,
        overhead=overhead,
        vms=vms,
        total=total,
        offset=offset,
        params=dict(project=name),
        networks=networks,
        network_total=network_total,
        groups=groups,
        group_total=group_total,
        project_groups=placement,
        group_project=p.name,
        **charts.graphs(o.db, "project", p.id, graph_range),
    )


# -- running now, events -------------------------------------------------------------------------
@router.get("/f/tasks")
def tasks_fragment(request: Request, who: Viewer):
    return render(request, "fragments/tasks.html", **tasks_context(request.app.state.orchestrator, who))


def tasks_context(o, who) -> dict:
    migrations, operations, backups = queries.in_flight(o.db, _scope(who))
    return dict(migrations=migrations, operations=operations, backups=backups)


@router.get("/events")
def events_page(request: Request, who: Viewer, kind: Text = None, offset: Offset = 0):
    return render(request, "events.html", section="events", **_events(request, who, kind, offset, PAGE_SIZE))


@router.get("/f/events")
def events_fragment(request: Request, who: Viewer, kind: Text = None, offset: Offset = 0, pane: bool = False):
    if pane:
        return render(request, "fragments/event_pane.html", **events_context(_orch(request), who))
    return render(request, "fragments/event_list.html", **_events(request, who, kind, offset, PAGE_SIZE))


def events_context(o, who, limit: int = 12) -> dict:
    """The pane's newest events, one line per object per task (core/eventfold.py): read three times as many
    changes as lines shown."""
    rows, _ = events.page(o.db, Page(limit=limit * 3), project_id=_scope(who))
    return dict(events=fold(rows)[:limit])


def _events(request: Request, who, kind, offset: int, limit: int) -> dict:
    o = _orch(request)
    if kind is not None and kind not in ("vm", "host", "migration", "operation", "volume", "pool"):
        kind = None
    rows, total = events.page(o.db, Page(limit=limit, offset=offset), kind=kind, project_id=_scope(who))
    # the Events page is the log itself, every change (paged exactly); the pane and a VM's or host's page fold
    return dict(events=rows, total=total, offset=offset, params=dict(kind=kind))
