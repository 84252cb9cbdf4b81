"""Zones, clusters, hosts and host maintenance."""

from __future__ import annotations

from typing import Optional

import typer

from ..client import ApiError, Client
from ..output import console, error, render
from .common import (
    DEFAULT_API,
    HOST_COLUMNS,
    Output,
    OutputFormat,
    Size,
    api_command,
    follow_migrations,
    groups,
    maintenance_app,
    mib,
)


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
