"""The console's pages that manage what VMs use: volumes (create, attach, detach, resize, delete), API tokens
(create with the secret shown once, revoke), placement groups and settings at every scope. Each action
calls the API's route function with the session's caller (its rules, roles and words), and answers the
list it changed, rendered again, with its outcome above it; a refusal is the API's, in the form's slot."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse

from vmplane.api.deps import require_admin
from vmplane.api.paging import StrictQueryRoute
from vmplane.api.routers import groups as api_groups
from vmplane.api.routers import settings as api_settings
from vmplane.api.routers import storage as api_storage
from vmplane.api.routers import tokens as api_tokens
from vmplane.api.routers.groups import GroupCreate
from vmplane.api.schemas import PoolCreate, SettingSet, TokenCreate, VolumeAttach, VolumeCreate, VolumeResize
from vmplane.core.errors import Invalid
from vmplane.store import groupstore
from vmplane.store.listing import Page
from vmplane.ui.actions import _bool, _form, _model, attempt
from vmplane.ui.forms import size
from vmplane.ui.render import PAGE_SIZE, render
from vmplane.ui.session import Actor, Viewer

router = APIRouter(prefix="/ui", include_in_schema=False, route_class=StrictQueryRoute)
Scope = Annotated[str | None, Query(max_length=16)]
ScopeName = Annotated[str | None, Query(max_length=63)]


def _orch(request: Request):
    return request.app.state.orchestrator


def _scope(who) -> int | None:
    return None if who.is_admin else who.project_id


def _text(form: dict, key: str) -> str | None:
    return (form.get(key) or "").strip() or None


# -- volumes -------------------------------------------------------------------------------------
def volume_context(request: Request, who, done: str | None = None) -> dict:
    o = _orch(request)
    vms, _total = o.vm_page(Page(limit=PAGE_SIZE * 10, sort="name"), project_id=_scope(who))
    return dict(
        volumes=o.volumes.rows(_scope(who)),
        vm_names=[v.name for v in vms],
        projects=[p for p in o.catalog.projects() if who.is_admin or p.id == who.project_id],
        pools=o.pools.rows() if who.is_admin else [],
        done=done,
    )


@router.get("/volumes")
def volumes_page(request: Request, who: Viewer):
    pools = pool_context(request) if who.is_admin else {}
    return render(request, "volumes.html", section="volumes", **volume_context(request, who), pool_view=pools)


def _volume_list(request: Request, who, done: str) -> HTMLResponse:
    return render(request, "fragments/volume_list.html", **volume_context(request, who, done))


@router.post("/volumes")
async def volume_create(request: Request, who: Actor):
    form = await _form(request)

    def act():
        body = _model(
            VolumeCreate,
            name=_text(form, "name") or "",
            project=_text(form, "project") or "",
            size_mib=size(form, "size", "size_mib"),
            pool=_text(form, "pool"),
        )
        v = api_storage.create_volume(body, _orch(request), who)
        return _volume_list(request, who, f"volume {v.name} created on pool {v.pool} ({v.state})")

    return await attempt(request, act, "#manage-error")


@router.post("/volumes/{name}/{step}")
async def volume_step(request: Request, name: str, step: str, who: Actor):
    """attach (to the form's VM), detach, resize (to the form's size), delete."""
    form = await _form(request)

    def act():
        o = _orch(request)
        if step == "attach":
            v = api_storage.attach_volume(name, _model(VolumeAttach, vm=_text(form, "vm") or ""), o, who)
            return _volume_list(request, who, f"volume {name} attached to {v.vm} as {v.device}")
        if step == "detach":
            api_storage.detach_volume(name, o, who)
            return _volume_list(request, who, f"volume {name} detached")
        if step == "resize":
            body = _model(VolumeResize, size_mib=size(form, "size", "size_mib"))
            v = api_storage.resize_volume(name, body, o, who)
            return _volume_list(request, who, f"volume {name} is {v.size_mib} MiB now")
        if step == "delete":
            api_storage.delete_volume(name, o, who)
            return _volume_list(request, who, f"volume {name} deleted")
        raise Invalid(f"step: {step!r} is not one of attach, detach, resize, delete", field="step")

    return await attempt(request, act, "#manage-error")


# -- pools (admin) ------------------------------------------------------------------------------
def pool_context(request: Request, done: str | None = None) -> dict:
    o = _orch(request)
    return dict(
        pools=o.pools.rows(),
        pool_hosts=[h.name for h in o.hosts()],
        clusters=[c.name for c in o.catalog.clusters()],
        done=done,
    )


@router.post("/pools")
async def pool_create(request: Request, who: Actor):
    form = await _form(request)

    def act():
        require_admin(who)
        body = _model(
            PoolCreate,
            name=_text(form, "name") or "",
            kind=_text(form, "kind"),
            host=_text(form, "host") if form.get("kind") == "local" else None,
            cluster=_text(form, "cluster") if form.get("kind") == "shared" else None,
            path=_text(form, "path"),
        )
        p = api_storage.create_pool(body, _orch(request), who)
        return render(
            request, "fragments/pool_list.html", **pool_context(request, f"pool {p.name} created ({p.state})")
        )

    return await attempt(request, act, "#pool-error")


@router.post("/pools/{name}/delete")
async def pool_delete(request: Request, name: str, who: Actor):
    def act():
        require_admin(who)
        api_storage.delete_pool(name, _orch(request), who)
        return render(request, "fragments/pool_list.html", **pool_context(request, f"pool {name} deleted"))

    return await attempt(request, act, "#pool-error")


# -- tokens --------------------------------------------------------------------------------------
def token_context(request: Request, who, done: str | None = None, secret: dict | None = None) -> dict:
    o = _orch(request)
    return dict(
        tokens=o.catalog.tokens(_scope(who)),
        projects=o.catalog.projects() if who.is_admin else [],
        done=done,
        secret=secret,
    )


@router.get("/tokens")
def tokens_page(request: Request, who: Viewer):
    return render(request, "tokens.html", section="tokens", **token_context(request, who))


@router.post("/tokens")
async def token_create(request: Request, who: Actor):
    """An admin's: the new token's secret is shown here once (only its hash is kept)."""
    form = await _form(request)

    def act():
        require_admin(who)
        body = _model(
            TokenCreate, name=_text(form, "name") or "", role=_text(form, "role"), project=_text(form, "project")
        )
        made = api_tokens.create_token(body, _orch(request), who)
        context = token_context(request, who, f"token {made.name} created", secret=made.model_dump())
        return render(request, "fragments/token_list.html", **context)

    return await attempt(request, act, "#manage-error")


@router.post("/tokens/{name}/revoke")
async def token_revoke(request: Request, name: str, who: Actor):
    def act():
        api_tokens.revoke_token(name, _orch(request), who)
        if name == who.name:  # its own: this session ended with it
            return HTMLResponse("", headers={"HX-Redirect": "/ui/login"})
        return render(request, "fragments/token_list.html", **token_context(request, who, f"token {name} revoked"))

    return await attempt(request, act, "#manage-error")


# -- placement groups ----------------------------------------------------------------------------
def group_context(request: Request, who, project: str, done: str | None = None) -> dict:
    o = _orch(request)
    p = o.catalog.project(project)
    who.check_project(p.id, "project", project)
    return dict(project_groups=groupstore.rows(o.db, p.id), group_project=project, done=done)


@router.post("/projects/{project}/groups")
async def group_create(request: Request, project: str, who: Actor):
    form = await _form(request)

    def act():
        body = _model(
            GroupCreate,
            name=_text(form, "name") or "",
            project=project,
            policy=_text(form, "policy"),
            hard=_bool(form.get("hard")) is True,
        )
        api_groups.create_group(body, _orch(request), who)
        context = group_context(request, who, project, f"group {body.name} created")
        return render(request, "fragments/placement_groups.html", **context)

    return await attempt(request, act, "#group-error")


@router.post("/projects/{project}/groups/{name}/delete")
async def group_delete(request: Request, project: str, name: str, who: Actor):
    def act():
        group_context(request, who, project)  # its project is the caller's to see
        api_groups.delete_group(name, _orch(request), who)
        context = group_context(request, who, project, f"group {name} deleted")
        return render(request, "fragments/placement_groups.html", **context)

    return await attempt(request, act, "#group-error")


# -- settings ------------------------------------------------------------------------------------
def settings_context(request: Request, scope: str | None, scope_name: str | None, done: str | None = None) -> dict:
    """Every key's value where the page looks (global, a zone or a cluster) and where it comes from, with
    the values set at each scope."""
    o = _orch(request)
    scope = scope if scope in ("zone", "cluster") else "global"
    scope_name = scope_name if scope != "global" else None
    rows = []
    for entry in o.catalog.list_settings():
        effective = o.catalog.get_setting(entry["key"], scope, scope_name)
        rows.append({**entry, "value": effective["value"], "source": effective["source"]})
    return dict(
        settings=rows,
        scope=scope,
        scope_name=scope_name,
        zones=[z.name for z in o.catalog.zones()],
        clusters=[c.name for c in o.catalog.clusters()],
        done=done,
    )


@router.get("/settings")
def settings_page(request: Request, who: Viewer, scope: Scope = None, scope_name: ScopeName = None):
    require_admin(who)
    return render(request, "settings.html", section="settings", **settings_context(request, scope, scope_name))


@router.post("/settings")
async def setting_set(request: Request, who: Actor):
    """Set (a value given) or unset (`unset`) a key at the form's scope; the list is shown again where it
    was looked at."""
    form = await _form(request)

    def act():
        require_admin(who)
        key = _text(form, "key") or ""
        scope, scope_name = _text(form, "scope") or "global", _text(form, "scope_name")
        o = _orch(request)
        if _bool(form.get("unset")):
            out = api_settings.unset_setting(key, o, who, scope, scope_name)
            done = f"{key} unset at {scope} {scope_name or ''}: {out['value']} from {out['source']}"
        else:
            body = _model(SettingSet, value=form.get("value", ""), scope=scope, scope_name=scope_name)
            out = api_settings.set_setting(key, body, o, who)
            warned = f" (warning: {'; '.join(out['warnings'])})" if out["warnings"] else ""
            done = f"{key} = {out['value']} at {scope} {scope_name or ''}{warned}"
        view_scope, view_name = _text(form, "view_scope"), _text(form, "view_scope_name")
        return render(request, "fragments/settings_list.html", **settings_context(request, view_scope, view_name, done))

    return await attempt(request, act, "#manage-error")
