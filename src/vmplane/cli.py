"""The `vmplane` command line (Typer + Rich), a thin client of the REST API."""

from __future__ import annotations

import enum
import functools
import inspect
import sys
from typing import Annotated, Optional

import typer

from .client import ApiError, Client
from .output import console, error, render
from .units import parse_mib

app = typer.Typer(help="vmplane: a control plane for KVM clusters.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
groups = {name: typer.Typer(help=text, no_args_is_help=True) for name, text in [
    ("zone", "Zones."), ("cluster", "Clusters of hosts."), ("host", "Hypervisor hosts."),
    ("project", "Projects (tenants) and their quotas."), ("offering", "Compute offerings."),
    ("template", "Guest images."), ("setting", "Settings at global, zone or cluster scope."),
    ("vm", "Virtual machines."), ("operation", "Asynchronous operations."), ("token", "API tokens."),
    ("migration", "Live migrations.")]}
maintenance_app = typer.Typer(help="Drain a host by live migration, or enable it again.", no_args_is_help=True)
groups["host"].add_typer(maintenance_app, name="maintenance")
for _name, _group in groups.items():
    app.add_typer(_group, name=_name)

DEFAULT_API = "http://127.0.0.1:8470"



class OutputFormat(str, enum.Enum):
    table = "table"
    json = "json"


Output = typer.Option(OutputFormat.table, "--output", "-o", help="table or json")


def mib(value: Optional[str], option: str = "--memory") -> Optional[int]:
    """A size option in MiB; a bad size is a usage error naming the option (exit code 2)."""
    if value is None:
        return None
    try:
        return parse_mib(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=option) from None


Size = Annotated[Optional[str], typer.Option(help="512MiB, 16GiB or plain MiB", metavar="SIZE")]


def api_command(group: typer.Typer, name: str, **kwargs):
    """Register a command that talks to the API: adds --output/--api/--token and maps API errors."""

    def wrap(fn):
        sig = inspect.signature(fn)
        extra = [
            inspect.Parameter("output", inspect.Parameter.KEYWORD_ONLY, default=Output, annotation=OutputFormat),
            inspect.Parameter("api", inspect.Parameter.KEYWORD_ONLY, annotation=str, default=typer.Option(
                DEFAULT_API, envvar="VMPLANE_API", help="API base URL")),
            inspect.Parameter("token", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[str],
                              default=typer.Option(None, envvar="VMPLANE_TOKEN", help="bearer token")),
        ]
        params = [p for p in sig.parameters.values() if p.name != "client"] + extra

        @functools.wraps(fn)
        def run(*args, output: OutputFormat, api: str, token: Optional[str], **kw):
            output = OutputFormat(output).value
            client = Client(api, token)
            try:
                result = fn(*args, client=client, **kw)
            except ApiError as exc:
                error(exc.body, output)
                raise typer.Exit(1)
            if result is not None:
                data, columns, title = result if isinstance(result, tuple) else (result, None, None)
                render(data, output, columns, title)

        run.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        return group.command(name, **kwargs)(run)

    return wrap


HOST_COLUMNS = ["name", "cluster", "state", "driver", "cores", "used_vcpus", "vcpus_capacity", "memory_mib",
                "used_memory_mib", "memory_capacity_mib"]
VM_COLUMNS = ["name", "project", "state", "host", "vcpus", "memory_mib", "overhead_mib", "offering"]
OP_COLUMNS = ["id", "kind", "target", "state", "step", "progress", "message"]
MIGRATION_COLUMNS = ["vm_name", "source", "target", "state", "progress", "waiting_for", "reason"]
DONE = ("succeeded", "failed", "cancelled")


def follow_migrations(client: Client, ids: list[str], output: str, timeout_s: float = 3600) -> list[dict]:
    """Wait for migrations to end, with a Rich progress bar per VM (plain polling for --output json)."""
    import time

    from rich.progress import BarColumn, Progress, TextColumn

    deadline = time.monotonic() + timeout_s
    if output == "json":
        while True:
            rows = [client.get(f"/migrations/{i}") for i in ids]
            if all(r["state"] in DONE for r in rows) or time.monotonic() > deadline:
                return rows
            time.sleep(0.2)
    with Progress(TextColumn("{task.fields[vm]:<16}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  TextColumn("{task.fields[status]}"), console=console) as bar:
        tasks = {i: bar.add_task("", total=100, vm=i[:8], status="") for i in ids}
        while True:
            rows = [client.get(f"/migrations/{i}") for i in ids]
            for r in rows:
                status = r["state"] + (f": {r['waiting_for']}" if r["waiting_for"] else "") + (
                    f" ({r['reason']})" if r["state"] in ("failed", "cancelled") else "")
                bar.update(tasks[r["id"]], completed=r["progress"], vm=f"{r['vm_name']} -> {r['target']}",
                           status=status[:70])
            if all(r["state"] in DONE for r in rows) or time.monotonic() > deadline:
                return rows
            time.sleep(0.2)


# -- local cluster -----------------------------------------------------------------------------
@app.command()
def up(hosts: int = typer.Option(3, min=0, help="hosts to register"),
       driver: str = typer.Option("auto", help="auto, libvirt or sim"),
       db: Optional[str] = typer.Option(None, help="SQLAlchemy URL (default: SQLite in $VMPLANE_HOME)"),
       bind: str = typer.Option("127.0.0.1", help="address to listen on"),
       port: int = typer.Option(8470, help="port to listen on"),
       token: Optional[str] = typer.Option(None, envvar="VMPLANE_TOKEN",
                                           help="admin token to use (default: a new one, printed once)"),
       keep_hosts: bool = typer.Option(False, help="leave libvirt hosts and their VMs running on exit")):
    """Run a local cluster: the API and HOSTS hosts on this machine (libvirtd daemons, or simulated)."""
    from . import server
    from .errors import VmplaneError

    server.exit_on_sigterm()
    try:
        kind, why = server.choose_driver(driver)
    except VmplaneError as exc:
        raise typer.BadParameter(exc.message, param_hint="--driver") from None
    try:
        _lock = server.lock_home()  # noqa: F841 (held while this process lives)
    except VmplaneError as exc:
        console.print(f"[red]error[/red] {exc.message}")
        raise typer.Exit(1)
    plane = server.build(db)
    try:
        names = server.prepare_local_cluster(plane.orchestrator, hosts, kind)
        for finding in plane.orchestrator.reconcile():      # the hosts are up now: compare again
            console.print(f"reconcile: {finding}")
    except BaseException:
        plane.close()
        if kind == "libvirt" and not keep_hosts:
            server.stop_local_hosts()
        raise
    admin = token or server.new_token()
    try:
        plane.orchestrator.catalog.ensure_admin_token(server.UP_TOKEN_NAME, admin)
    except VmplaneError as exc:
        plane.close()
        raise typer.BadParameter(exc.message, param_hint="--token") from None
    url = f"http://{bind}:{port}"
    console.print(f"vmplane up: {why}; {len(names)} host(s): {', '.join(names) or '-'}")
    console.print(f"database: {plane.db.url}")
    console.print(f"API: {url}/api/v1   docs: {url}/docs")
    if token:
        console.print("admin token: the one given with --token / VMPLANE_TOKEN")
    else:
        console.print(f"admin token (shown once): {admin}")
        console.print(f"  export VMPLANE_API={url} VMPLANE_TOKEN={admin}")
    try:
        server.serve(plane.app, bind, port)
    finally:
        plane.close()
        if kind == "libvirt" and not keep_hosts:
            stopped = server.stop_local_hosts()
            console.print(f"vmplane up: stopped local hosts {', '.join(stopped) or '-'}")


@app.command()
def down():
    """Stop the local libvirt hosts of `vmplane up --keep-hosts` (and their VMs)."""
    from . import server

    stopped = server.stop_local_hosts()
    console.print(f"stopped local hosts: {', '.join(stopped) or 'none running'}")


@app.command()
def serve(db: Optional[str] = typer.Option(None, help="SQLAlchemy URL"),
          bind: str = typer.Option("127.0.0.1"), port: int = typer.Option(8470)):
    """Run the API alone, on an existing database."""
    from . import server

    plane = server.build(db)
    console.print(f"vmplane API on http://{bind}:{port} (database {plane.db.url})")
    try:
        server.serve(plane.app, bind, port)
    finally:
        plane.close()


# -- zones, clusters, hosts --------------------------------------------------------------------
@api_command(groups["zone"], "create")
def zone_create(name: str, client: Client):
    return client.post("/zones", {"name": name})


@api_command(groups["zone"], "list")
def zone_list(client: Client):
    return client.get("/zones"), ["name"], "zones"


@api_command(groups["cluster"], "create")
def cluster_create(name: str, zone: str = typer.Option(..., help="zone of the cluster"), *, client: Client):
    return client.post("/clusters", {"name": name, "zone": zone})


@api_command(groups["cluster"], "list")
def cluster_list(client: Client):
    return client.get("/clusters"), ["name", "zone"], "clusters"


@api_command(groups["host"], "add")
def host_add(name: str, cluster: str = typer.Option(...), sim: bool = typer.Option(False, help="a simulated host"),
             cores: Optional[int] = typer.Option(None), mhz: Optional[int] = typer.Option(None),
             memory: Size = None, uri: Optional[str] = typer.Option(None, help="libvirt URI of the host"),
             *, client: Client):
    """Register a host: simulated (--sim --cores --mhz --memory) or real (--uri)."""
    if sim == bool(uri):
        raise typer.BadParameter("give either --sim (with --cores, --mhz, --memory) or --uri")
    body = {"name": name, "cluster": cluster, "driver": "sim" if sim else "libvirt", "uri": uri,
            "cores": cores, "cpu_mhz": mhz, "memory_mib": mib(memory)}
    return client.post("/hosts", {k: v for k, v in body.items() if v is not None})


@api_command(groups["host"], "list")
def host_list(client: Client):
    return client.get("/hosts"), HOST_COLUMNS, "hosts"


@api_command(groups["host"], "show")
def host_show(name: str, client: Client):
    return client.get(f"/hosts/{name}")


# -- projects ----------------------------------------------------------------------------------
@api_command(groups["project"], "create")
def project_create(name: str, vcpus: int = typer.Option(..., min=0), memory: Size = None,
                   vms: int = typer.Option(100, min=0), count_overhead: bool = typer.Option(False),
                   max_concurrent_migrations: Optional[int] = typer.Option(None, min=1), *, client: Client):
    if memory is None:
        raise typer.BadParameter("is required", param_hint="--memory")
    return client.post("/projects", {"name": name, "vcpus": vcpus, "memory_mib": mib(memory), "vms": vms,
                                     "count_overhead": count_overhead,
                                     "max_concurrent_migrations": max_concurrent_migrations})


@api_command(groups["project"], "quota")
def project_quota(name: str, vcpus: Optional[int] = typer.Option(None, min=0), memory: Size = None,
                  vms: Optional[int] = typer.Option(None, min=0),
                  count_overhead: Optional[bool] = typer.Option(None, "--count-overhead/--no-count-overhead"),
                  max_concurrent_migrations: Optional[int] = typer.Option(None, min=0), *, client: Client):
    """Change a project's quota (lowering below usage is refused)."""
    body = {"vcpus": vcpus, "memory_mib": mib(memory), "vms": vms, "count_overhead": count_overhead,
            "max_concurrent_migrations": max_concurrent_migrations}
    return client.call("PATCH", f"/projects/{name}/quota", json={k: v for k, v in body.items() if v is not None})


@api_command(groups["project"], "usage")
def project_usage(name: str, client: Client):
    u = client.get(f"/projects/{name}/usage")
    return u


@api_command(groups["project"], "list")
def project_list(client: Client):
    return client.get("/projects"), ["name", "quota", "usage", "count_overhead"], "projects"


@api_command(groups["project"], "show")
def project_show(name: str, client: Client):
    return client.get(f"/projects/{name}")


# -- offerings and templates -------------------------------------------------------------------
@api_command(groups["offering"], "create")
def offering_create(name: str, kind: str = typer.Option(..., help="fixed, custom-constrained, custom-unconstrained"),
                    vcpus: Optional[int] = typer.Option(None), memory: Size = None,
                    min_vcpus: Optional[int] = typer.Option(None), max_vcpus: Optional[int] = typer.Option(None),
                    min_memory: Size = None, max_memory: Size = None,
                    cpu_speed: Optional[int] = typer.Option(None, help="MHz per vCPU"),
                    cpu_cap: bool = typer.Option(False), dynamic_scaling: bool = typer.Option(False),
                    *, client: Client):
    body = {"name": name, "kind": kind, "vcpus": vcpus, "memory_mib": mib(memory), "min_vcpus": min_vcpus,
            "max_vcpus": max_vcpus, "min_memory_mib": mib(min_memory, "--min-memory"),
            "max_memory_mib": mib(max_memory, "--max-memory"),
            "cpu_speed_mhz": cpu_speed, "cpu_cap": cpu_cap, "dynamic_scaling": dynamic_scaling}
    return client.post("/offerings", {k: v for k, v in body.items() if v is not None})


@api_command(groups["offering"], "list")
def offering_list(client: Client):
    return client.get("/offerings"), ["name", "kind", "vcpus", "memory_mib", "min_vcpus", "max_vcpus",
                                      "min_memory_mib", "max_memory_mib", "cpu_cap", "dynamic_scaling"], "offerings"


@api_command(groups["offering"], "show")
def offering_show(name: str, client: Client):
    return client.get(f"/offerings/{name}")


@api_command(groups["template"], "create")
def template_create(name: str, image: str = typer.Option(...), dynamically_scalable: bool = typer.Option(False),
                    *, client: Client):
    return client.post("/templates", {"name": name, "image": image, "dynamically_scalable": dynamically_scalable})


@api_command(groups["template"], "list")
def template_list(client: Client):
    return client.get("/templates"), ["name", "image", "dynamically_scalable"], "templates"


@api_command(groups["template"], "show")
def template_show(name: str, client: Client):
    return client.get(f"/templates/{name}")


# -- settings ----------------------------------------------------------------------------------
def _scope(zone: Optional[str], cluster: Optional[str]) -> tuple[str, Optional[str]]:
    if zone and cluster:
        raise typer.BadParameter("give --zone or --cluster, not both")
    return ("zone", zone) if zone else ("cluster", cluster) if cluster else ("global", None)


@api_command(groups["setting"], "set")
def setting_set(key: str, value: str, zone: Optional[str] = typer.Option(None),
                cluster: Optional[str] = typer.Option(None), *, client: Client):
    scope, scope_name = _scope(zone, cluster)
    return client.call("PUT", f"/settings/{key}", json={"value": value, "scope": scope, "scope_name": scope_name})


@api_command(groups["setting"], "get")
def setting_get(key: str, zone: Optional[str] = typer.Option(None), cluster: Optional[str] = typer.Option(None),
                *, client: Client):
    scope, scope_name = _scope(zone, cluster)
    return client.get(f"/settings/{key}", scope=scope, scope_name=scope_name)


@api_command(groups["setting"], "list")
def setting_list(client: Client):
    return client.get("/settings"), ["key", "default", "narrowest_scope", "values"], "settings"


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


@maintenance_app.command("enter")
def maintenance_enter(name: str, dry_run: bool = typer.Option(False, help="print the plan, change nothing"),
                      wait: bool = typer.Option(False, help="follow the drain until it ends"),
                      api: str = typer.Option(DEFAULT_API, envvar="VMPLANE_API"),
                      token: Optional[str] = typer.Option(None, envvar="VMPLANE_TOKEN"),
                      output: OutputFormat = Output):
    """Drain a host by live migration, within the limits; VMs that fit nowhere are listed and stay."""
    out = OutputFormat(output).value
    client = Client(api, token)
    try:
        plan = client.post(f"/hosts/{name}/maintenance", {"action": "enter", "dry_run": dry_run})
        if wait and not dry_run:
            ids = [m["migration"] for m in plan["migrations"] if m.get("migration")]
            plan["migrations"] = follow_migrations(client, ids, out) if ids else []
        if out == "json":
            render(plan, out)
        else:
            render(plan["migrations"], out, None, f"{name}: {'plan' if dry_run else 'drain'}")
            for item in plan["unplaceable"]:
                console.print(f"[yellow]stays on {name}[/yellow] {item['vm']}: {item['reason']}")
        failed = [m for m in plan["migrations"] if m.get("state") in ("failed", "cancelled")]
        if failed or plan["unplaceable"]:
            raise typer.Exit(1)
    except ApiError as exc:
        error(exc.body, out)
        raise typer.Exit(1)


@maintenance_app.command("exit")
def maintenance_exit(name: str, api: str = typer.Option(DEFAULT_API, envvar="VMPLANE_API"),
                     token: Optional[str] = typer.Option(None, envvar="VMPLANE_TOKEN"),
                     output: OutputFormat = Output):
    """Enable the host again."""
    out = OutputFormat(output).value
    try:
        render(Client(api, token).post(f"/hosts/{name}/maintenance", {"action": "exit"}), out)
    except ApiError as exc:
        error(exc.body, out)
        raise typer.Exit(1)


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


@api_command(groups["token"], "create")
def token_create(name: str, role: str = typer.Option("member", help="admin or member"),
                 project: Optional[str] = typer.Option(None), *, client: Client):
    """Create an API token; its clear text is shown once."""
    return client.post("/tokens", {"name": name, "role": role, "project": project})


@api_command(app, "audit")
def audit(client: Client):
    """Check the quota ledger and host claims against what the VMs hold."""
    return client.get("/audit")


def main() -> None:
    app(prog_name="vmplane")


if __name__ == "__main__":
    main()
