"""VMs, their migrations and scaling, operations and the audit."""

from __future__ import annotations

import enum
import sys
from typing import Optional

import typer

from ..client import ApiError, Client
from ..output import error, render
from .common import (
    DEFAULT_API,
    MIGRATION_COLUMNS,
    OP_COLUMNS,
    VM_COLUMNS,
    Output,
    OutputFormat,
    Size,
    api_command,
    app,
    follow_migrations,
    groups,
    mib,
)


# -- VMs ---------------------------------------------------------------------------------------
def _follow(client: Client, accepted: dict, wait: bool, output: str = "table") -> dict:
    op = accepted.get("operation")
    if not wait or not op:
        return accepted
    done = client.wait_operation(op["id"])
    accepted["operation"] = done
    accepted["vm"] = client.get(f"/vms/{accepted['vm']['name']}")
    if done["state"] == "failed":
        raise ApiError(409, {"error": "operation_failed", "message": done["message"]})
    return accepted


@api_command(groups["vm"], "create")
def vm_create(name: str, project: str = typer.Option(...), offering: str = typer.Option(...),
              template: str = typer.Option(...), vcpus: Optional[int] = typer.Option(None), memory: Size = None,
              dynamic_scaling: bool = typer.Option(True, "--dynamic-scaling/--no-dynamic-scaling"),
              start: bool = typer.Option(False, help="start it at once"),
              wait: bool = typer.Option(True, help="with --start, wait until it runs"), *, client: Client):
    body = {"name": name, "project": project, "offering": offering, "template": template, "vcpus": vcpus,
            "memory_mib": mib(memory), "dynamically_scalable": dynamic_scaling, "start": start}
    accepted = client.post("/vms", {k: v for k, v in body.items() if v is not None})
    return _follow(client, accepted, wait)["vm"]


@api_command(groups["vm"], "list")
def vm_list(project: Optional[str] = typer.Option(None), *, client: Client):
    return client.get("/vms", project=project), VM_COLUMNS, "vms"


@api_command(groups["vm"], "show")
def vm_show(name: str, client: Client):
    return client.get(f"/vms/{name}")


@api_command(groups["vm"], "start")
def vm_start(name: str, wait: bool = typer.Option(True, help="wait until it runs"), *, client: Client):
    return _follow(client, client.post(f"/vms/{name}/start"), wait)["vm"]


@api_command(groups["vm"], "stop")
def vm_stop(name: str, wait: bool = typer.Option(True, help="wait until it stopped"),
            force: bool = typer.Option(False, help="power off at once, without asking the guest"), *, client: Client):
    return _follow(client, client.post(f"/vms/{name}/stop", {"force": force}), wait)["vm"]


@groups["vm"].command("exec")
def vm_exec(name: str, command: list[str] = typer.Argument(..., help="the command, after --"),
            timeout: float = typer.Option(60.0, help="seconds to wait for the guest"),
            api: str = typer.Option(DEFAULT_API, envvar="VMPLANE_API"),
            token: Optional[str] = typer.Option(None, envvar="VMPLANE_TOKEN"),
            output: OutputFormat = Output):
    """Run a command in the guest (libvirt hosts): `vmplane vm exec web1 -- nproc`."""
    client = Client(api, token, timeout=timeout + 30)
    try:
        result = client.post(f"/vms/{name}/exec", {"command": " ".join(command), "timeout_s": timeout})
    except ApiError as exc:
        error(exc.body, OutputFormat(output).value)
        raise typer.Exit(1)
    if OutputFormat(output).value == "json":
        render(result, "json")
    else:
        sys.stdout.write(result["output"])
    raise typer.Exit(result["exit_code"])


@groups["vm"].command("migrate")
def vm_migrate(name: str, to: Optional[str] = typer.Option(None, help="target host (default: placement chooses)"),
               dry_run: bool = typer.Option(False, help="say which host and why, change nothing"),
               wait: bool = typer.Option(False, help="follow the migration until it ends"),
               cancel: bool = typer.Option(False, help="cancel this VM's migration"),
               api: str = typer.Option(DEFAULT_API, envvar="VMPLANE_API"),
               token: Optional[str] = typer.Option(None, envvar="VMPLANE_TOKEN"), output: OutputFormat = Output):
    """Live-migrate a running VM (quota-neutral: its project's usage does not change)."""
    out = OutputFormat(output).value
    client = Client(api, token)
    try:
        if cancel:
            render(client.post(f"/vms/{name}/migrate/cancel"), out, MIGRATION_COLUMNS if out == "table" else None)
            return
        body = {"to": to, "dry_run": dry_run}
        result = client.post(f"/vms/{name}/migrate", {k: v for k, v in body.items() if v is not None})
        if wait and not dry_run:
            result = follow_migrations(client, [result["id"]], out)[0]
        render(result, out)
        if result.get("state") in ("failed", "cancelled"):
            raise typer.Exit(1)
    except ApiError as exc:
        error(exc.body, out)
        raise typer.Exit(1)


class CapSwitch(str, enum.Enum):
    on = "on"
    off = "off"


@api_command(groups["vm"], "scale")
def vm_scale(name: str, offering: Optional[str] = typer.Option(None, help="another offering (fixed ones too)"),
             vcpus: Optional[int] = typer.Option(None, min=1), memory: Size = None,
             cpu_cap: Optional[CapSwitch] = typer.Option(None, help="on or off"),
             dry_run: bool = typer.Option(False, help="say which path would be taken, change nothing"),
             wait: bool = typer.Option(True, help="wait until the guest has the new size"), *, client: Client):
    """Live-scale a running VM: vCPUs, memory and CPU cap, without a reboot."""
    body = {"offering": offering, "vcpus": vcpus, "memory_mib": mib(memory), "dry_run": dry_run,
            "cpu_cap": None if cpu_cap is None else CapSwitch(cpu_cap) == CapSwitch.on}
    result = client.post(f"/vms/{name}/scale", {k: v for k, v in body.items() if v is not None})
    if dry_run:
        return result
    done = _follow(client, result, wait)
    return {**done["vm"], "scale": (done.get("operation") or {}).get("message")}


@api_command(groups["migration"], "list")
def migration_list(vm: Optional[str] = typer.Option(None), host: Optional[str] = typer.Option(None),
                   active: bool = typer.Option(False, help="only queued or copying"), *, client: Client):
    return client.get("/migrations", vm=vm, host=host, active=active or None), MIGRATION_COLUMNS, "migrations"


@api_command(groups["migration"], "show")
def migration_show(migration_id: str, client: Client):
    return client.get(f"/migrations/{migration_id}")


@api_command(groups["vm"], "delete")
def vm_delete(name: str, client: Client):
    client.call("DELETE", f"/vms/{name}")
    return {"deleted": name}


# -- operations, tokens, audit -----------------------------------------------------------------
@api_command(groups["operation"], "list")
def operation_list(state: Optional[str] = typer.Option(None), limit: int = typer.Option(50), *, client: Client):
    return client.get("/operations", state=state, limit=limit), OP_COLUMNS, "operations"


@api_command(groups["operation"], "show")
def operation_show(op_id: str, client: Client):
    return client.get(f"/operations/{op_id}")


@api_command(app, "audit")
def audit(client: Client):
    """Check the quota ledger and host claims against what the VMs hold."""
    return client.get("/audit")
