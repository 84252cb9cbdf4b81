"""What the console changes: each action calls the API's own route function with the session's caller,
so that the rules (roles, recovery, quota, capacity) and the words of every refusal are the API's.
Migrate, scale and maintenance show their dry-run plan first; the plan's form carries what was planned,
and only its confirm button changes anything. Every POST carries the session's CSRF token."""

from __future__ import annotations

import html
import json
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, Response
from pydantic import BaseModel, ValidationError

from vmplane.api.deps import require_admin
from vmplane.api.errors import validation_body
from vmplane.api.paging import StrictQueryRoute
from vmplane.api.routers import backups as api_backups
from vmplane.api.routers import hosts as api_hosts
from vmplane.api.routers import snapshots as api_snapshots
from vmplane.api.routers import vms as api_vms
from vmplane.api.routers.backups import BackupCreate, RestoreRequest
from vmplane.api.routers.snapshots import SnapshotCreate
from vmplane.api.schemas import MaintenanceRequest, MigrateRequest, ScaleRequest, VmStop
from vmplane.core.errors import Invalid, VmplaneError
from vmplane.store import events
from vmplane.ui.render import error_fragment, render
from vmplane.ui.session import Actor, Viewer

router = APIRouter(prefix="/ui", include_in_schema=False, route_class=StrictQueryRoute)


_Body = TypeVar("_Body", bound=BaseModel)


def _model(cls: type[_Body], **fields: object) -> _Body:
    """A request body built from form fields, refused in the API's words when invalid."""
    try:
        return cls(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        body = validation_body(exc.errors())
        raise Invalid(body["message"], field=body["field"]) from None


def _int(value: str | None) -> int | str | None:
    """A form's number: digits become an int; anything else is passed on for the API's own refusal."""
    value = (value or "").strip()
    if not value:
        return None
    return int(value) if value.isdigit() else value


def _bool(value: str | None) -> bool | None:
    return {"on": True, "true": True, "off": False, "false": False}.get((value or "").strip().lower())


def _body(response) -> dict:
    return json.loads(bytes(response.body)) if isinstance(response, Response) else response


async def _form(request: Request) -> dict:
    return {k: str(v) for k, v in (await request.form()).items()}


def _done(request: Request, message: str, operation: dict | None = None) -> HTMLResponse:
    return render(request, "fragments/action_done.html", message=message, operation=operation)


async def attempt(request: Request, action, error_slot: str | None = None) -> HTMLResponse:
    """`action` (the API's work, blocking) in the thread pool, recorded as caused by the session's token
    (as an API request is: `user <token>`); a refusal becomes the error fragment (the API's status and
    words) in the action's slot, or in `error_slot` (a CSS selector) where the action's target is a list
    that must stay."""
    cause = events.user_cause(request.state.caller.name)

    def as_caller():
        with events.acting_as(cause):
            return action()

    try:
        return await run_in_threadpool(as_caller)
    except VmplaneError as exc:
        refused = error_fragment(request, exc)
        if error_slot:
            refused.headers.update({"HX-Retarget": error_slot, "HX-Reswap": "innerHTML"})
        return refused


# -- VMs -----------------------------------------------------------------------------------------
@router.post("/vms/{name}/start")
async def start(request: Request, name: str, who: Actor):
    def act():
        body = _body(api_vms.start_vm(name, request.app.state.orchestrator, who))
        return _done(request, f"starting {name}", body.get("operation"))

    return await attempt(request, act)


@router.post("/vms/{name}/stop")
async def stop(request: Request, name: str, who: Actor):
    form = await _form(request)

    def act():
        stop_body = _model(VmStop, force=_bool(form.get("force")))
        body = _body(api_vms.stop_vm(name, request.app.state.orchestrator, who, stop_body))
        return _done(request, f"stopping {name}", body.get("operation"))

    return await attempt(request, act)


@router.post("/vms/{name}/delete")
async def delete(request: Request, name: str, who: Actor):
    def act():
        api_vms.delete_vm(name, request.app.state.orchestrator, who)
        return HTMLResponse(f"<p>{name} deleted</p>", headers={"HX-Redirect": "/ui/vms"})

    return await attempt(request, act)


@router.post("/vms/{name}/migrate/plan")
async def migrate_plan(request: Request, name: str, who: Actor):
    to = (await _form(request)).get("to", "").strip() or None

    def act():
        plan = _body(
            api_vms.migrate_vm(name, _model(MigrateRequest, to=to, dry_run=True), request.app.state.orchestrator, who)
        )
        return render(request, "fragments/migrate_plan.html", vm=name, plan=plan, to=to or "")

    return await attempt(request, act)


@router.post("/vms/{name}/migrate")
async def migrate(request: Request, name: str, who: Actor):
    to = (await _form(request)).get("to", "").strip() or None

    def act():
        mig = _body(api_vms.migrate_vm(name, _model(MigrateRequest, to=to), request.app.state.orchestrator, who))
        return render(request, "fragments/migrate_started.html", vm=name, migration=mig)

    return await attempt(request, act)


@router.post("/vms/{name}/snapshots")
async def snapshot_create(request: Request, name: str, who: Actor):
    form = await _form(request)

    def act():
        body = _model(SnapshotCreate, name=form.get("name", "").strip(), quiesce=_bool(form.get("quiesce")))
        snap = api_snapshots.create_snapshot(name, body, request.app.state.orchestrator, who)
        return _done_now(request, f"snapshot {snap['name']} of {name} taken ({snap['pause_ms']} ms pause)")

    return await attempt(request, act)


@router.post("/vms/{name}/snapshots/{snapshot}/revert")
async def snapshot_revert(request: Request, name: str, snapshot: str, who: Actor):
    def act():
        api_snapshots.revert_snapshot(name, request.app.state.orchestrator, who, snapshot)
        return _done_now(request, f"{name} reverted to snapshot {snapshot}: it starts as it was then")

    return await attempt(request, act)


@router.post("/vms/{name}/snapshots/{snapshot}/delete")
async def snapshot_delete(request: Request, name: str, snapshot: str, who: Actor):
    def act():
        api_snapshots.delete_snapshot(name, request.app.state.orchestrator, who, snapshot)
        return _done_now(request, f"snapshot {snapshot} of {name} deleted")

    return await attempt(request, act)


@router.post("/vms/{name}/backups")
async def backup_create(request: Request, name: str, who: Actor):
    def act():
        b = api_backups.create_backup(name, BackupCreate(), request.app.state.orchestrator, who)
        return _done_now(request, f"backup {b['id']} of {name} taken: {b['kind']} ({b['why']})")

    return await attempt(request, act)


@router.post("/backups/{backup_id}/restore")
async def backup_restore(request: Request, backup_id: api_backups.BackupId, who: Actor):
    form = await _form(request)

    def act():
        body = _model(RestoreRequest, name=form.get("name", "").strip())
        done = api_backups.restore_backup(backup_id, body, request.app.state.orchestrator, who)
        return _done_now(request, f"backup {backup_id} restored to a new VM {done['vm']} (stopped)")

    return await attempt(request, act)


@router.post("/backups/{backup_id}/delete")
async def backup_delete(request: Request, backup_id: api_backups.BackupId, who: Actor):
    def act():
        api_backups.delete_backup(backup_id, request.app.state.orchestrator, who)
        return _done_now(request, f"backup {backup_id} deleted")

    return await attempt(request, act)


def _done_now(request: Request, message: str) -> HTMLResponse:
    """An action answered once done (no operation to follow)."""
    return HTMLResponse(f'<p class="done" role="status">{html.escape(message)}.</p>')


def _scale_request(form: dict, dry_run: bool) -> ScaleRequest:
    return _model(
        ScaleRequest,
        offering=form.get("offering", "").strip() or None,
        vcpus=_int(form.get("vcpus")),
        memory_mib=_int(form.get("memory_mib")),
        cpu_cap=_bool(form.get("cpu_cap")),
        dry_run=dry_run,
    )


@router.post("/vms/{name}/scale/plan")
async def scale_plan(request: Request, name: str, who: Actor):
    form = await _form(request)

    def act():
        plan = _body(api_vms.scale_vm(name, _scale_request(form, dry_run=True), request.app.state.orchestrator, who))
        return render(
            request,
            "fragments/scale_plan.html",
            vm=name,
            plan=plan,
            asked={k: form.get(k, "") for k in ("offering", "vcpus", "memory_mib", "cpu_cap")},
        )

    return await attempt(request, act)


@router.post("/vms/{name}/scale")
async def scale(request: Request, name: str, who: Actor):
    form = await _form(request)

    def act():
        body = _body(api_vms.scale_vm(name, _scale_request(form, dry_run=False), request.app.state.orchestrator, who))
        return _done(request, f"scaling {name}", body.get("operation"))

    return await attempt(request, act)


# -- hosts ---------------------------------------------------------------------------------------
def _host(request: Request, name: str):
    return request.app.state.orchestrator.host(name)


@router.get("/hosts/{name}/maintenance")
def maintenance_controls(request: Request, name: str, who: Viewer):
    require_admin(who)
    return render(request, "fragments/maintenance.html", host=_host(request, name), plan=None)


@router.post("/hosts/{name}/maintenance/{step}")
async def maintenance(request: Request, name: str, step: str, who: Actor):
    """plan (a dry run of enter), enter, exit; the controls are rendered again with the outcome. A member
    (not an admin) or an unknown host gets the error alone: nothing of any host is shown."""

    def act():
        require_admin(who)
        if step not in ("plan", "enter", "exit"):
            raise Invalid(f"step: {step!r} is not one of plan, enter, exit", field="step")
        host = _host(request, name)
        plan = error = None
        status = 200
        try:
            body = _model(MaintenanceRequest, action="exit" if step == "exit" else "enter", dry_run=step == "plan")
            result = api_hosts.maintenance(name, body, request.app.state.orchestrator, who)
            plan = result if step == "plan" else None
        except VmplaneError as exc:
            error, status = exc.as_dict(), exc.status
        if plan is None:  # entered, left or refused: the controls show the host's state now
            host = _host(request, name)
        return render(request, "fragments/maintenance.html", status_code=status, host=host, plan=plan, error=error)

    return await attempt(request, act)
