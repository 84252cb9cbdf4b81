"""The console's create and edit forms for VMs and projects: a VM's create form (its plan first, from the
API's dry run), a project's create form and its quota's edit form. Each POST builds the API's own request
body from the form and calls the API's route function with the session's caller, so that the rules, the
roles and the words of every refusal are the API's (a member creates only in its own project)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from vmplane.api.deps import require_admin
from vmplane.api.paging import StrictQueryRoute
from vmplane.api.routers import projects as api_projects
from vmplane.api.routers import vms as api_vms
from vmplane.api.schemas import ProjectCreate, QuotaUpdate, VmCreate
from vmplane.core.errors import Invalid
from vmplane.core.units import format_mib, parse_mib
from vmplane.store import groupstore
from vmplane.ui.actions import _body, _bool, _form, _int, _model, attempt
from vmplane.ui.queries import overhead_by_project
from vmplane.ui.render import render, templates
from vmplane.ui.session import Actor, Viewer

router = APIRouter(prefix="/ui", include_in_schema=False, route_class=StrictQueryRoute)
# a size put back into a form: exact (16GiB, 1500MiB), so that saving the form unchanged changes nothing
templates.env.filters["exact_mib"] = lambda value: format_mib(value).replace(" ", "")
VM_FIELDS = ("name", "project", "offering", "template", "vcpus", "memory", "zone", "ha_policy", "group",
             "networks", "ssh_keys", "start")  # fmt: skip
QUOTA_FIELDS = ("vcpus", "memory", "vms", "storage", "backups")


def size(form: dict, key: str, field: str) -> int | str | None:
    """A form's size ("512", "512MiB", "4 GiB": the CLI's rule, MiB without a unit); a bad one is refused
    naming the API's field."""
    text = (form.get(key) or "").strip()
    if not text:
        return None
    if text.strip("0") == "":  # a quota of nothing
        return 0
    try:
        return parse_mib(text)
    except ValueError as exc:
        raise Invalid(f"{field}: {exc}", field=field) from None


def _lines(text: str | None, sep: str | None = None) -> list[str] | None:
    items = [i.strip() for i in (text or "").split(sep)] if sep else [i.strip() for i in (text or "").splitlines()]
    return [i for i in items if i] or None


# -- VM create -----------------------------------------------------------------------------------
@router.get("/new/vm")
def new_vm_page(request: Request, who: Viewer, project: str | None = None):
    o = request.app.state.orchestrator
    projects = [p for p in o.catalog.projects() if who.is_admin or p.id == who.project_id]
    scope = None if who.is_admin else who.project_id
    return render(
        request,
        "new_vm.html",
        section="vms",
        projects=projects,
        chosen=project or (projects[0].name if len(projects) == 1 else ""),
        offerings=[off for off in o.catalog.offerings() if not off.retired],
        templates=o.catalog.templates(),
        zones=o.catalog.zones(),
        groups=groupstore.rows(o.db, scope),
    )


def vm_request(form: dict, dry_run: bool) -> VmCreate:
    return _model(
        VmCreate,
        name=(form.get("name") or "").strip(),
        project=(form.get("project") or "").strip(),
        offering=(form.get("offering") or "").strip(),
        template=(form.get("template") or "").strip(),
        vcpus=_int(form.get("vcpus")),
        memory_mib=size(form, "memory", "memory_mib"),
        zone=(form.get("zone") or "").strip() or None,
        ha_policy=(form.get("ha_policy") or "").strip() or None,
        group=(form.get("group") or "").strip() or None,
        networks=_lines(form.get("networks"), ","),
        ssh_keys=_lines(form.get("ssh_keys")),
        start=bool(_bool(form.get("start"))),
        dry_run=dry_run,
    )


@router.post("/new/vm/plan")
async def vm_plan(request: Request, who: Actor):
    """The API's dry run: where it would run, its disk's pool, what its project is charged; the plan's
    Create button carries the form as it was planned."""
    form = await _form(request)

    def act():
        plan = _body(api_vms.create_vm(vm_request(form, dry_run=True), request.app.state.orchestrator, who))
        asked = {k: form.get(k, "") for k in VM_FIELDS}
        return render(request, "fragments/vm_create_plan.html", plan=plan, asked=asked)

    return await attempt(request, act)


@router.post("/new/vm")
async def vm_create(request: Request, who: Actor):
    form = await _form(request)

    def act():
        body = vm_request(form, dry_run=False)
        api_vms.create_vm(body, request.app.state.orchestrator, who)
        return HTMLResponse(
            f'<p class="done" role="status">{body.name} created.</p>', headers={"HX-Redirect": f"/ui/vms/{body.name}"}
        )

    return await attempt(request, act)


# -- projects ------------------------------------------------------------------------------------
@router.get("/new/project")
def new_project_page(request: Request, who: Viewer):
    require_admin(who)
    return render(request, "new_project.html", section="projects")


@router.post("/new/project")
async def project_create(request: Request, who: Actor):
    form = await _form(request)

    def act():
        require_admin(who)
        body = _model(
            ProjectCreate,
            name=(form.get("name") or "").strip(),
            vcpus=_int(form.get("vcpus")),
            memory_mib=size(form, "memory", "memory_mib"),
            vms=_int(form.get("vms")),
            storage_mib=size(form, "storage", "storage_mib"),
            backups_mib=size(form, "backups", "backups_mib"),
            count_overhead=bool(_bool(form.get("count_overhead"))),
        )
        api_projects.create_project(body, request.app.state.orchestrator, who)
        return HTMLResponse(
            f'<p class="done" role="status">project {body.name} created.</p>',
            headers={"HX-Redirect": f"/ui/projects/{body.name}"},
        )

    return await attempt(request, act)


@router.post("/projects/{name}/quota")
async def quota_update(request: Request, name: str, who: Actor):
    """An admin's quota edit: only what the form changes is sent; the card shows the new quota and use."""
    form = await _form(request)

    def act():
        require_admin(who)
        o = request.app.state.orchestrator
        body = _model(
            QuotaUpdate,
            vcpus=_int(form.get("vcpus")),
            memory_mib=size(form, "memory", "memory_mib"),
            vms=_int(form.get("vms")),
            storage_mib=size(form, "storage", "storage_mib"),
            backups_mib=size(form, "backups", "backups_mib"),
        )
        api_projects.set_quota(name, body, o, who)
        project = o.catalog.project(name)
        row = {"project": project, "overhead": overhead_by_project(o.db, [project.id]).get(project.id, 0)}
        return render(request, "fragments/quota_card.html", row=row, project=project, saved=True)

    return await attempt(request, act, "#quota-error")
