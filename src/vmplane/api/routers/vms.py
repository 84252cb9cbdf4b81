"""VMs: create, start, stop, delete, read. Long work returns 202 with an operation."""

from typing import Any, cast

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from vmplane.api.deps import AnyCaller, Caller, Orch
from vmplane.api.paging import Paging, StrictQueryRoute, paged, paged_json
from vmplane.api.routers.networks import nic_requests
from vmplane.api.schemas import (
    ColdMigrationOut,
    ExecRequest,
    ExecResult,
    MigrateRequest,
    MigrationOut,
    MigrationPlan,
    ScaleRequest,
    VmAccepted,
    VmCreate,
    VmOut,
    VmStop,
    VmSyncOut,
    VmUpdate,
)
from vmplane.api.views import migration_out, operation_out, vm_detail, vm_out
from vmplane.controllers import adopt
from vmplane.controllers.vms import Admitted
from vmplane.core.errors import Forbidden, Invalid, NotFound
from vmplane.core.guestexec import command_line
from vmplane.core.migration import POSTCOPY_FLOOR_KEY, MigrationState
from vmplane.core.migration import tuning_refusal as migration_tuning_refusal
from vmplane.core.model import VmState
from vmplane.store import guestagents as guest_agents
from vmplane.store import networks as SN

router = APIRouter(tags=["vms"], route_class=StrictQueryRoute)


def _accepted(orch, admitted: Admitted, created: bool = False) -> JSONResponse:
    op = orch.operation(admitted.operation_id) if admitted.operation_id else None
    body = VmAccepted(vm=vm_out(orch.vm(admitted.vm)), operation=operation_out(op))
    status = 202 if op is not None else (201 if created else 200)
    return JSONResponse(body.model_dump(mode="json"), status_code=status)


def _own_vm(orch, who: Caller, name: str):
    vm = orch.vm(name)
    who.check_project(vm.project_id, "vm", name)
    return vm


def _act_on(orch, who: Caller, name: str):
    """A VM the caller may change: its own, and not still being recovered after a restart (409)."""
    vm = _own_vm(orch, who, name)
    orch.recovery.check(name)
    return vm


@router.get("/vms/{name}", response_model=VmOut)
def show_vm(name: str, orch: Orch, who: AnyCaller):
    # first: the router tries its routes in order and this is the hottest read. The body built by one
    # Core select and answered as is (no ORM load, no response_model validation)
    setting = lambda zone, cluster: bool(orch.catalog.effective("enable.dynamic.scale.vm", zone, cluster))  # noqa: E731
    return JSONResponse(vm_detail(orch.db, name, None if who.is_admin else who.project_id, setting))


@router.post(
    "/vms",
    status_code=201,
    response_model=VmAccepted,
    responses={
        202: {"model": VmAccepted, "description": "created and starting"},
        200: {"description": "dry_run: the plan (host, pool, charge); nothing created"},
    },
)
def create_vm(body: VmCreate, orch: Orch, who: AnyCaller):
    if not who.is_admin:
        who.check_project(orch.catalog.project(body.project).id, "project", body.project)
    nics = nic_requests(body.networks)
    if nics and not who.is_admin:  # an admin's provider network that is not shared is not a member's to use
        with orch.db.read() as s:
            for net, _ip in nics:
                row = SN.network_row(s.connection(), net)
                if row.kind == "provider" and not row.shared:
                    raise NotFound(f"network {net!r} does not exist", field="networks")
    # (passed only when asked for: a create without NICs is the same call as before networks)
    wired: dict[str, Any] = {"networks": nics, "secgroups": body.secgroups} if nics or body.secgroups else {}
    if body.hostname is not None or body.ssh_keys or body.user_data is not None or not body.project_keys:
        wired |= {
            "hostname": body.hostname,
            "ssh_keys": body.ssh_keys,
            "user_data": body.user_data.encode() if body.user_data is not None else None,
            "project_keys": body.project_keys,
        }
    admit = orch.plan_vm if body.dry_run else orch.create_vm
    admitted = admit(
        body.name,
        body.project,
        body.offering,
        body.template,
        vcpus=body.vcpus,
        memory_mib=body.memory_mib,
        dynamically_scalable=body.dynamic_scaling,
        start=body.start,
        zone=body.zone,
        cluster=body.cluster,
        root_disk_mib=body.root_disk_mib,
        pool=body.pool,
        ha_policy=body.ha_policy,
        ha_priority=body.ha_priority,
        group=body.group,
        **wired,
    )
    if isinstance(admitted, dict):  # the dry run's plan
        return JSONResponse(admitted)
    return _accepted(orch, admitted, created=True)


@router.patch("/vms/{name}", response_model=VmOut)
def update_vm(name: str, body: VmUpdate, orch: Orch, who: AnyCaller):
    """Change what happens to the VM when its host fails (its HA policy and priority)."""
    _own_vm(orch, who, name)
    orch.ha.set_policy(name, body.ha_policy, body.ha_priority)
    return vm_out(orch.vm(name))


@router.get("/vms", response_model=list[VmOut])
def list_vms(
    orch: Orch,
    who: AnyCaller,
    page: Paging,
    project: str | None = None,
    state: VmState | None = None,
    host: str | None = None,
    zone: str | None = None,
    name: str | None = None,
):
    """VMs, filtered (`name` is a prefix) and sorted (`sort`: name, state, vcpus, memory_mib, created_at,
    project, host; `-` for descending) in the database. A filter naming nothing that exists gives `[]`.
    The total is in the X-Total-Count header."""
    vms, total = orch.vm_page(
        page,
        project=project,
        state=state and state.value,
        host=host,
        zone=zone,
        name=name,
        project_id=None if who.is_admin else who.project_id,
    )
    with orch.db.read() as s:
        agents = guest_agents.views(s.connection(), [v.id for v in vms])
    return paged_json([vm_out(v, agents.get(v.id)).model_dump(mode="json") for v in vms], total)


@router.post("/vms/{name}/start", status_code=202, response_model=VmAccepted)
def start_vm(name: str, orch: Orch, who: AnyCaller):
    _act_on(orch, who, name)
    return _accepted(orch, orch.start_vm(name))


@router.post("/vms/{name}/stop", status_code=202, response_model=VmAccepted)
def stop_vm(name: str, orch: Orch, who: AnyCaller, body: VmStop | None = None):
    _act_on(orch, who, name)
    return _accepted(orch, orch.stop_vm(name, force=body.force if body else False))


@router.post("/vms/{name}/reboot")
def reboot_vm(name: str, orch: Orch, who: AnyCaller, body: VmStop | None = None) -> dict:
    """Ask the running guest to reboot (its guest agent, else ACPI), or with `force` reset it at once; the VM
    keeps running (a reboot from inside the guest keeps it running too). 409 naming why when it can not."""
    _act_on(orch, who, name)
    return orch.reboots.reboot(name, force=body.force if body else False)


@router.post("/vms/{name}/exec", response_model=ExecResult)
def exec_in_vm(name: str, body: ExecRequest, orch: Orch, who: AnyCaller):
    """Run a command in the guest through its QEMU guest agent, or its serial console without one (libvirt
    hosts; a person holding the console is never kicked off): an argv keeps its argument boundaries, a
    string is one shell line (guestexec.py)."""
    _own_vm(orch, who, name)
    output, code = orch.exec_in_guest(name, command_line(body.command), body.timeout_s)
    return ExecResult(output=output, exit_code=code)


@router.delete("/vms/{name}", status_code=204)
def delete_vm(name: str, orch: Orch, who: AnyCaller, keep_disk: bool = False):
    """Its root disk is deleted with it, or kept as a volume (`keep_disk`); its volumes are detached."""
    _act_on(orch, who, name)
    orch.delete_vm(name, keep_disk=keep_disk)


@router.post(
    "/vms/{name}/migrate",
    status_code=202,
    response_model=MigrationOut | MigrationPlan,
    responses={
        200: {"model": MigrationPlan | ColdMigrationOut, "description": "dry run: the plan; a stopped VM: moved"}
    },
)
def migrate_vm(name: str, body: MigrateRequest, orch: Orch, who: AnyCaller):
    """Live-migrate a running VM. Quota-neutral: the project's usage does not change. The target is
    claimed now; the copy starts when the migration limits allow (it waits in a queue, never refused).
    Choosing the target host (`to`) needs an admin token: tenants do not pick hypervisors. So does tuning
    the copy (bandwidth, post-copy, downtime): members choose a named `policy` only. A post-copy bandwidth
    below `vmplane.migration.postcopy.min.bandwidth` (default 64 MiB/s) is refused (422): a post-copy can not be
    aborted.

    A stopped VM migrates cold (200): its local disks are copied to local pools of the target host (a disk
    on a shared pool the target opens stays), all switched together once read back there; it stays stopped
    and starts on the target next."""
    vm = _act_on(orch, who, name)
    if body.to is not None and not who.is_admin:
        raise Forbidden(
            "choosing the target host needs an admin token; leave out `to` and placement picks one", field="to"
        )
    overrides: dict[str, Any] = {
        k: v
        for k, v in (
            ("bandwidth_mib_s", body.bandwidth_mib_s),
            ("postcopy", body.postcopy),
            ("max_downtime_ms", body.max_downtime_ms),
            ("postcopy_bandwidth_mib_s", body.postcopy_bandwidth_mib_s),
        )
        if v is not None
    }
    floor = int(cast(int, orch.catalog.effective(POSTCOPY_FLOOR_KEY, None, None)))
    refused = migration_tuning_refusal(overrides, who.is_admin, floor)  # tuning is an operator's (review N11)
    if refused:
        kind, field, message = refused
        raise (Forbidden if kind == "forbidden" else Invalid)(message, field=field)
    if body.policy != "vmplane":
        overrides["policy"] = body.policy
    if vm.state == "stopped" and not overrides:  # a cold migration (issue 32)
        cold = orch.volume_moves.migrate_stopped(name, to=body.to, dry_run=body.dry_run)
        return JSONResponse(ColdMigrationOut(**cold).model_dump(mode="json"), status_code=200)
    result = orch.migrator.migrate(name, to=body.to, dry_run=body.dry_run, params=overrides or None)
    if body.dry_run:
        return JSONResponse(MigrationPlan(**result).model_dump(mode="json"), status_code=200)
    return JSONResponse(migration_out(result).model_dump(mode="json"), status_code=202)


@router.post("/vms/{name}/migrate/cancel", response_model=MigrationOut)
def cancel_migration(name: str, orch: Orch, who: AnyCaller):
    _act_on(orch, who, name)
    return migration_out(orch.migrator.cancel(name))


@router.get("/migrations", response_model=list[MigrationOut])
def list_migrations(
    orch: Orch,
    who: AnyCaller,
    response: Response,
    page: Paging,
    vm: str | None = None,
    host: str | None = None,
    state: MigrationState | None = None,
    active: bool = False,
):
    """Migrations, newest first; `host` matches the source or the target; `active`: queued, copying,
    checking or postcopy-failed. `sort`: created_at, started_at, finished_at, vm, source, target, state,
    progress. The total is in the X-Total-Count header."""
    rows, total = orch.migrator.page(
        page,
        vm=vm,
        host=host,
        state=state and state.value,
        active_only=active,
        project_id=None if who.is_admin else who.project_id,
    )
    return paged(response, [migration_out(r) for r in rows], total)


@router.get("/migrations/{migration_id}", response_model=MigrationOut)
def show_migration(migration_id: str, orch: Orch, who: AnyCaller):
    """By id, or by a unique prefix of it (at least 4 characters; 409 naming the matches when several)."""
    return migration_out(orch.migrator.find(migration_id, None if who.is_admin else who.project_id))


@router.post(
    "/vms/{name}/scale",
    status_code=202,
    response_model=VmAccepted,
    responses={200: {"description": "dry run: the plan"}},
)
def scale_vm(name: str, body: ScaleRequest, orch: Orch, who: AnyCaller):
    """Live-scale a running VM: another offering (fixed ones too) or custom values within the offering's
    ranges, and/or the CPU cap on or off. Every refusal names its cause. When its host lacks room and
    auto.migrate.vm.on.live.scale.insufficient.capacity is on, the VM moves first. A stopped VM is resized
    offline (200, done at once): its offering or size changes (checked as at create), nothing is charged
    until it next starts (whose admission checks the quota); `cpu_cap` is refused (it follows the offering)."""
    _act_on(orch, who, name)
    if body.offering is None and body.vcpus is None and body.memory_mib is None and body.cpu_cap is None:
        raise Invalid("give an offering, vcpus / memory_mib, or cpu_cap", field="offering")
    result = orch.scaler.scale(
        name,
        offering=body.offering,
        vcpus=body.vcpus,
        memory_mib=body.memory_mib,
        cpu_cap=body.cpu_cap,
        dry_run=body.dry_run,
    )
    if body.dry_run:
        return JSONResponse(result, status_code=200)
    accepted = _accepted(orch, Admitted(name, result["operation_id"]))
    if result.get("path") == "offline resize":  # a stopped VM: done at once (charged when it starts)
        accepted.status_code = 200
    return accepted


@router.post("/vms/{name}/sync", response_model=VmSyncOut)
def sync_vm(name: str, orch: Orch, who: AnyCaller):
    """Adopt what the hosts really run for this VM into the record: its size (vCPUs the guest may use,
    memory), CPU cap, state (no host runs it: stopped) and host, with its charge and host claim. A VM
    grown beyond its project's quota is adopted and reported (`over_quota`), never stopped. 409 while an
    operation or a migration owns the VM."""
    _act_on(orch, who, name)
    return VmSyncOut(**adopt.sync_vm(orch.plane, name))
