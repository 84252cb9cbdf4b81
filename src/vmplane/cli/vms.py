"""VMs, their migrations and scaling, operations and the audit."""

from __future__ import annotations

import enum
import sys
from pathlib import Path
from typing import Annotated

import typer

from vmplane.cli.client import ApiError, Client
from vmplane.cli.common import (
    MIGRATION_COLUMNS,
    OP_COLUMNS,
    VM_COLUMNS,
    ApiOption,
    Limit,
    Offset,
    Output,
    OutputFormat,
    Size,
    Sort,
    TokenOption,
    api_command,
    app,
    fail,
    follow_migrations,
    groups,
    listed,
    mib,
    size_help,
    still_running,
)
from vmplane.cli.networks import nic_line
from vmplane.cli.output import note, render
from vmplane.core.guestexec import cli_command


# -- VMs ---------------------------------------------------------------------------------------
def _follow(client: Client, accepted: dict, wait: bool) -> dict:
    """Wait for the operation a VM request started (unless --no-wait, which says its id instead).
    Returns the accepted body with the VM and the operation as they are now."""
    op = accepted.get("operation")
    if not op:
        return accepted
    vm = accepted["vm"]["name"]
    if not wait:
        note(
            f"operation {op['id']} ({op['kind']} of vm {vm}): {op['state']}; "
            f"follow it with `vmplane operation show {op['id']}`"
        )
        return accepted
    try:
        done = client.wait_operation(op["id"])
    except KeyboardInterrupt:
        still_running(f"operation {op['id']} ({op['kind']} of vm {vm}); `vmplane operation show {op['id']}` follows it")
    accepted["operation"] = done
    accepted["vm"] = client.get(f"/vms/{vm}")
    if done["state"] == "failed":
        raise ApiError(409, {"error": "operation_failed", "message": done["message"], "field": None})
    return accepted


def _shown(accepted: dict, wait: bool, output: str) -> dict:
    """What a VM command prints: the VM; in JSON with --no-wait, the VM and its operation (to follow it;
    a table says the operation's id on stderr)."""
    return accepted["vm"] if wait or output != "json" or not accepted.get("operation") else accepted


@api_command(groups["vm"], "create")
def vm_create(
    name: str,
    project: str = typer.Option(...),
    offering: str = typer.Option(...),
    template: str = typer.Option(...),
    vcpus: int | None = typer.Option(None),
    memory: Size = None,
    dynamic_scaling: bool = typer.Option(True, "--dynamic-scaling/--no-dynamic-scaling"),
    zone: str | None = typer.Option(None, help="the zone it runs in for life (default: the only zone)"),
    cluster: str | None = typer.Option(None, help="pin it to one cluster of its zone"),
    start: bool = typer.Option(False, help="start it at once"),
    wait: bool = typer.Option(True, help="with --start, wait until it runs"),
    output: str = "table",
    root_disk: Annotated[
        str | None, typer.Option(help=size_help("root disk size (templates with a disk image)"), metavar="SIZE")
    ] = None,
    pool: str | None = typer.Option(None, help="the pool of its root disk (default: placement picks)"),
    ha: str | None = typer.Option(
        None, help="restart: run it again elsewhere when its host fails; off (default: its offering's)"
    ),
    ha_priority: int | None = typer.Option(None, help="HA restarts go highest first (0..1000)"),
    group: str | None = typer.Option(None, help="its placement group (affinity or anti-affinity)"),
    network: list[str] | None = typer.Option(
        None, help="a NIC on this network, NET or NET:IP; repeat it for more (the first is the first NIC)"
    ),
    secgroup: list[str] | None = typer.Option(
        None, help="its NICs' security group, repeatable (default: the project's default)"
    ),
    ssh_key: list[Path] | None = typer.Option(
        None, help="a file with an OpenSSH public key for the guest's root (cloud-init), repeatable", exists=True
    ),
    user_data: Path | None = typer.Option(
        None, help="a file of cloud-init user data: #cloud-config YAML or a #! script (at most 64 KiB)", exists=True
    ),
    hostname: str | None = typer.Option(None, help="the guest's hostname (cloud-init)"),
    no_project_keys: bool = typer.Option(False, help="leave the project's SSH keys (project key add) out"),
    dry_run: bool = typer.Option(False, help="check quota, placement and pool, print the plan; create nothing"),
    *,
    client: Client,
):
    """Create a VM (charging one of its project's `vms`, and its root disk's storage); with --start, admit
    and start it too. --dry-run: the plan (host, pool, charge) or the refusal; nothing is created."""
    body = {
        "name": name,
        "project": project,
        "offering": offering,
        "template": template,
        "vcpus": vcpus,
        "memory_mib": mib(memory),
        "dynamic_scaling": dynamic_scaling,
        "start": start,
        "zone": zone,
        "cluster": cluster,
        "root_disk_mib": mib(root_disk, "--root-disk"),
        "pool": pool,
        "ha_policy": ha,
        "ha_priority": ha_priority,
        "group": group,
        "networks": network or None,
        "secgroups": secgroup or None,
        "ssh_keys": [p.read_text().strip() for p in ssh_key] if ssh_key else None,
        "user_data": user_data.read_text() if user_data else None,
        "hostname": hostname,
        "project_keys": False if no_project_keys else None,
        "dry_run": True if dry_run else None,
    }
    accepted = client.post("/vms", {k: v for k, v in body.items() if v is not None})
    if dry_run:
        return accepted
    return _shown(_follow(client, accepted, wait), wait, output)


@api_command(groups["vm"], "update")
def vm_update(
    name: str,
    ha: str | None = typer.Option(None, help="restart or off"),
    ha_priority: int | None = typer.Option(None, help="HA restarts go highest first (0..1000)"),
    *,
    client: Client,
):
    """Change what happens to a VM when its host fails: its HA policy and priority."""
    body = {"ha_policy": ha, "ha_priority": ha_priority}
    if not any(v is not None for v in body.values()):
        raise typer.BadParameter("give --ha or --ha-priority")
    return client.call("PATCH", f"/vms/{name}", json={k: v for k, v in body.items() if v is not None})


@api_command(groups["vm"], "list", lists=True)
def vm_list(
    project: str | None = typer.Option(None),
    state: str | None = typer.Option(None),
    host: str | None = typer.Option(None),
    zone: str | None = typer.Option(None),
    name: str | None = typer.Option(None, help="names starting with this"),
    limit: int | None = Limit(),
    offset: int | None = Offset,
    sort: str | None = Sort,
    *,
    client: Client,
):
    """VMs, filtered and sorted by the server (--sort name|state|project|host|vcpus|memory_mib|created_at)."""
    return listed(
        client,
        "/vms",
        "vms",
        VM_COLUMNS,
        project=project,
        state=state,
        host=host,
        zone=zone,
        name=name,
        limit=limit,
        offset=offset,
        sort=sort,
    )


@api_command(groups["vm"], "show")
def vm_show(name: str, output: str, client: Client):
    """Show one VM: size, state, host, zone, ceiling prepared at start, its NICs."""
    vm = client.get(f"/vms/{name}")
    if output == "table" and vm.get("nics") is not None:  # one NIC a line: network, address, MAC, groups
        vm["nics"] = [nic_line(n) for n in vm["nics"]] or None
    return vm


@api_command(groups["vm"], "start")
def vm_start(
    name: str, wait: bool = typer.Option(True, help="wait until it runs"), output: str = "table", *, client: Client
):
    """Start a stopped VM (its quota and a host are claimed first)."""
    return _shown(_follow(client, client.post(f"/vms/{name}/start"), wait), wait, output)


@api_command(groups["vm"], "stop")
def vm_stop(
    name: str,
    wait: bool = typer.Option(True, help="wait until it stopped"),
    force: bool = typer.Option(False, help="power off at once, without asking the guest"),
    output: str = "table",
    *,
    client: Client,
):
    """Stop a running VM: the guest is asked to power off, then forced after vmplane.vm.shutdown.timeout."""
    return _shown(_follow(client, client.post(f"/vms/{name}/stop", {"force": force}), wait), wait, output)


@api_command(groups["vm"], "reboot")
def vm_reboot(
    name: str,
    force: bool = typer.Option(False, help="reset at once (a hardware reset: unwritten data is lost)"),
    *,
    client: Client,
):
    """Reboot a running VM: its guest is asked (through its guest agent, else ACPI); it keeps running."""
    return client.post(f"/vms/{name}/reboot", {"force": force})


@groups["vm"].command("exec")
def vm_exec(
    name: str,
    command: list[str] = typer.Argument(..., help="the command and its arguments, after --"),
    timeout: float = typer.Option(60.0, help="seconds the command may run (then it is stopped in the guest, exit 1)"),
    api: str = ApiOption,
    token: str | None = TokenOption,
    output: OutputFormat = Output,
):
    """Run a command in the guest (libvirt hosts): through its guest agent, or its serial console without
    one. Two or more arguments after `--` are kept whole, as
    `kubectl exec` keeps them (`vm exec web1 -- sh -c "echo a; echo b"`); a single one is a shell line, as
    ssh runs it (`vm exec web1 -- 'nproc; free -m'`). Its standard input is empty."""
    client = Client(api, token, timeout=timeout + 30)
    try:
        result = client.post(f"/vms/{name}/exec", {"command": cli_command(command), "timeout_s": timeout})
    except ApiError as exc:
        fail(exc, OutputFormat(output).value)
    if OutputFormat(output).value == "json":
        render(result, "json")
    else:
        sys.stdout.write(result["output"])
    raise typer.Exit(result["exit_code"])


EXIT_MOVED_UNHEALTHY = 3  # `vm migrate --wait`: the VM moved, but its guest did not answer on the target


@groups["vm"].command("migrate")
def vm_migrate(
    name: str,
    to: str | None = typer.Option(None, help="target host (default: placement chooses)"),
    dry_run: bool = typer.Option(False, help="say which host and why, change nothing"),
    wait: bool = typer.Option(True, help="follow the migration until it ends (--no-wait: print its id)"),
    cancel: bool = typer.Option(False, help="cancel this VM's migration"),
    policy: str | None = typer.Option(None, help="vmplane (default) or hypervisor-default"),
    bandwidth: int | None = typer.Option(None, min=1, help="pre-copy bandwidth cap, MiB/s (admins only)"),
    postcopy: bool | None = typer.Option(
        None, "--postcopy/--no-postcopy", help="switch to post-copy during the copy (admins only)"
    ),
    max_downtime: int | None = typer.Option(None, min=1, help="longest pause allowed, ms (admins only)"),
    api: str = ApiOption,
    token: str | None = TokenOption,
    output: OutputFormat = Output,
):
    """Live-migrate a running VM (quota-neutral: its project's usage does not change); a stopped VM migrates
    cold: its local disks are copied to local pools of the target host, and it stays stopped.

    With --wait, exits 1 if it failed or was cancelled (the VM stayed), and 3 if the VM moved but its guest
    does not answer on the target (moved-unhealthy)."""
    out = OutputFormat(output).value
    client = Client(api, token)
    try:
        if cancel:
            render(client.post(f"/vms/{name}/migrate/cancel"), out, MIGRATION_COLUMNS if out == "table" else None)
            return
        body = {
            "to": to,
            "dry_run": dry_run,
            "policy": policy,
            "bandwidth_mib_s": bandwidth,
            "postcopy": postcopy,
            "max_downtime_ms": max_downtime,
        }
        result = client.post(f"/vms/{name}/migrate", {k: v for k, v in body.items() if v is not None})
        if "copied" in result:  # a stopped VM migrated cold: done (or planned) when the answer came
            render(result, out)
            return
        if wait and not dry_run:
            result = follow_migrations(client, [result["id"]], out)[0]
        elif not dry_run:
            note(
                f"migration {result['id']} is {result['state']}; follow it with `vmplane migration show "
                f"{result['id']}`, cancel it with `vmplane vm migrate {name} --cancel`"
            )
        render(result, out)
        if result.get("state") == "moved-unhealthy":  # moved; its guest did not answer there (docs/design/migration.md)
            raise typer.Exit(EXIT_MOVED_UNHEALTHY)
        if result.get("state") in ("failed", "cancelled", "postcopy-failed"):
            raise typer.Exit(1)
    except ApiError as exc:
        fail(exc, out)


class CapSwitch(str, enum.Enum):
    on = "on"
    off = "off"


@api_command(groups["vm"], "scale")
def vm_scale(
    name: str,
    offering: str | None = typer.Option(None, help="another offering (fixed ones too)"),
    vcpus: int | None = typer.Option(None, min=1),
    memory: Size = None,
    cpu_cap: CapSwitch | None = typer.Option(None, help="on or off"),
    dry_run: bool = typer.Option(False, help="say which path would be taken, change nothing"),
    wait: bool = typer.Option(True, help="wait until the guest has the new size"),
    output: str = "table",
    root_disk: Annotated[
        str | None,
        typer.Option(
            help=size_help("grow its root disk to SIZE (live while it runs; `volume resize NAME-root`)"), metavar="SIZE"
        ),
    ] = None,
    *,
    client: Client,
):
    """Live-scale a running VM: vCPUs, memory and CPU cap, without a reboot. A stopped VM is resized
    offline (offering and size; nothing charged until it next starts; its CPU cap follows its offering).
    --root-disk grows its root disk (charged to the storage quota at once)."""
    if root_disk is not None:
        if offering is not None or vcpus is not None or memory is not None or cpu_cap is not None or dry_run:
            raise typer.BadParameter("--root-disk is a change of its own: give it alone")
        return client.post(f"/volumes/{name}-root/resize", {"size_mib": mib(root_disk, "--root-disk")})
    if offering is None and vcpus is None and memory is None and cpu_cap is None:
        raise typer.BadParameter("give --offering, --vcpus and/or --memory, --cpu-cap on|off, or --root-disk")
    body = {
        "offering": offering,
        "vcpus": vcpus,
        "memory_mib": mib(memory),
        "dry_run": dry_run,
        "cpu_cap": None if cpu_cap is None else CapSwitch(cpu_cap) == CapSwitch.on,
    }
    result = client.post(f"/vms/{name}/scale", {k: v for k, v in body.items() if v is not None})
    if dry_run:
        if output == "table":  # [from, to] pairs read better as arrows
            result = {k: f"{v[0]} -> {v[1]}" if k in ("vcpus", "memory_mib") else v for k, v in result.items()}
        return result
    done = _follow(client, result, wait)
    return {**done["vm"], "scale": (done.get("operation") or {}).get("message")} if wait else done


@api_command(groups["vm"], "sync")
def vm_sync(name: str, output: str = "table", *, client: Client):
    """Adopt what the host really runs for a VM into the record (size, CPU cap, state, host): its charge
    and host claim follow. A VM grown beyond its project's quota is adopted and reported, never stopped."""
    result = client.post(f"/vms/{name}/sync")
    if output == "table":
        return {
            "vm": result["vm"],
            "host": result["host"],
            "changes": [f"{c['field']}: {c['record']} -> {c['host']}" for c in result["changes"]] or "in sync",
            **({"over_quota": result["over_quota"]} if result["over_quota"] else {}),
        }
    return result


@api_command(groups["migration"], "list", lists=True)
def migration_list(
    vm: str | None = typer.Option(None),
    host: str | None = typer.Option(None, help="leaving or entering this host"),
    state: str | None = typer.Option(None),
    active: bool = typer.Option(False, help="only queued, copying or checking"),
    limit: int | None = Limit(),
    offset: int | None = Offset,
    sort: str | None = Sort,
    *,
    client: Client,
):
    """Migrations, newest first (--sort created_at|started_at|finished_at|vm|source|target|state|progress)."""
    return listed(
        client,
        "/migrations",
        "migrations",
        MIGRATION_COLUMNS,
        vm=vm,
        host=host,
        state=state,
        active=active or None,
        limit=limit,
        offset=offset,
        sort=sort,
    )


@api_command(groups["migration"], "show")
def migration_show(migration_id: str, client: Client):
    """Show one migration (id or a unique prefix of 4+ characters): progress, statistics, reason."""
    return client.get(f"/migrations/{migration_id}")


@api_command(groups["vm"], "delete")
def vm_delete(
    name: str, keep_disk: bool = typer.Option(False, help="keep its root disk as a volume"), *, client: Client
):
    """Delete a stopped VM (its `vms` charge is given back); its root disk goes too unless --keep-disk,
    and its volumes are detached (they outlive it)."""
    client.call("DELETE", f"/vms/{name}", params={"keep_disk": "true"} if keep_disk else None)
    return {"deleted": name}


# -- operations, tokens, audit -----------------------------------------------------------------
@api_command(groups["operation"], "list", lists=True)
def operation_list(
    state: str | None = typer.Option(None),
    kind: str | None = typer.Option(None),
    vm: str | None = typer.Option(None),
    host: str | None = typer.Option(None, help="drains of this host"),
    limit: int | None = Limit(50),
    offset: int | None = Offset,
    sort: str | None = Sort,
    *,
    client: Client,
):
    """Operations, newest first (--sort created_at|updated_at|kind|state|progress)."""
    return listed(
        client,
        "/operations",
        "operations",
        OP_COLUMNS,
        state=state,
        kind=kind,
        vm=vm,
        host=host,
        limit=limit,
        offset=offset,
        sort=sort,
    )


@api_command(groups["operation"], "show")
def operation_show(op_id: str, client: Client):
    """Show one operation (id or a unique prefix of 4+ characters): state, step, progress, message."""
    return client.get(f"/operations/{op_id}")


@api_command(app, "audit")
def audit(output: str = "table", *, client: Client):
    """Check the record against the ledger, claims and hosts; exit 1 on any problem.

    Compares the quota ledger with the usage recomputed from the VMs, host claims with what runs,
    and what every host runs with the record, so `vmplane audit || alert` works."""
    result = client.get("/audit")
    if not result["ok"]:
        render(result, output)
        raise typer.Exit(1)
    return result
