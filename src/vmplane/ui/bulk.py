"""Bulk actions on the VMs chosen in a (filtered) VM list: start, stop, or migrate off their hosts. The plan
comes first, one line per VM (for a migration the API's dry run: where it would go; for a start or a stop
what would happen, or why it is skipped); only its confirm button acts. Each VM is then one API call of
its own: one refused (the API's words) does not stop the others, and the answer says which did what."""

from __future__ import annotations

from fastapi import APIRouter, Request

from vmplane.api.paging import StrictQueryRoute
from vmplane.api.routers import vms as api_vms
from vmplane.api.schemas import MigrateRequest, VmStop
from vmplane.core.errors import Invalid, VmplaneError
from vmplane.ui.actions import _body, _model, attempt
from vmplane.ui.render import render
from vmplane.ui.session import Actor

router = APIRouter(prefix="/ui", include_in_schema=False, route_class=StrictQueryRoute)
ACTIONS = ("start", "stop", "migrate")
MAX_VMS = 100  # one request's VMs (a page of the list is 50)


async def _chosen(request: Request) -> tuple[str, list[str]]:
    form = await request.form()
    action = str(form.get("action") or "")
    names = sorted({str(v).strip() for v in form.getlist("vm") if str(v).strip()})
    if action not in ACTIONS:
        raise Invalid(f"action: {action!r} is not one of {', '.join(ACTIONS)}", field="action")
    if not names:
        raise Invalid("vm: choose at least one VM in the list", field="vm")
    if len(names) > MAX_VMS:
        raise Invalid(f"vm: at most {MAX_VMS} VMs at once, {len(names)} chosen", field="vm")
    return action, names


def _plan_one(o, who, action: str, name: str) -> dict:
    """What `action` would do to VM `name`: {vm, ok, says}; a refusal is said, not raised."""
    try:
        vm = o.vm(name)
        who.check_project(vm.project_id, "vm", name)
        if action == "migrate" and vm.state != "running":  # a stopped one runs nowhere (vm migrate moves its disks)
            return {"vm": name, "ok": False, "says": f"skipped: {vm.state}, it runs on no host"}
        if action == "migrate":
            plan = _body(api_vms.migrate_vm(name, _model(MigrateRequest, dry_run=True), o, who))
            return {"vm": name, "ok": True, "says": f"{plan['source']} → {plan['target']}: {plan['reason']}"}
        if action == "start":
            ok = vm.state == "stopped"
            return {"vm": name, "ok": ok, "says": "starts (placement picks its host)" if ok else f"skipped: {vm.state}"}
        ok = vm.state == "running"
        return {"vm": name, "ok": ok, "says": f"stops (on {vm.host.name})" if ok else f"skipped: {vm.state}"}
    except VmplaneError as exc:
        return {"vm": name, "ok": False, "says": f"refused: {exc}"}


def _do_one(o, who, action: str, name: str) -> dict:
    try:
        if action == "migrate":
            mig = _body(api_vms.migrate_vm(name, _model(MigrateRequest), o, who))
            return {"vm": name, "ok": True, "says": f"migration {str(mig['id'])[:8]} to {mig['target']} {mig['state']}"}
        call = api_vms.start_vm(name, o, who) if action == "start" else api_vms.stop_vm(name, o, who, _model(VmStop))
        op = _body(call).get("operation") or {}
        return {"vm": name, "ok": True, "says": f"operation {str(op.get('id', ''))[:8]} {op.get('state', '')}".strip()}
    except VmplaneError as exc:
        return {"vm": name, "ok": False, "says": f"refused: {exc}"}


@router.post("/vms/bulk/plan")
async def bulk_plan(request: Request, who: Actor):
    return await _bulk(request, who, confirm=False)


@router.post("/vms/bulk")
async def bulk_do(request: Request, who: Actor):
    return await _bulk(request, who, confirm=True)


async def _bulk(request: Request, who, confirm: bool):
    """The plan (each VM's dry run) or, confirmed, the action on each VM alone."""
    action, names = await _chosen(request)
    each = _do_one if confirm else _plan_one

    def act():
        o = request.app.state.orchestrator
        lines = [each(o, who, action, n) for n in names]
        return render(request, "fragments/bulk_plan.html", action=action, lines=lines, confirm=confirm)

    return await attempt(request, act)
