"""Zones, clusters, hosts and host maintenance."""

from __future__ import annotations

import json

import typer

from vmplane.cli.client import Client
from vmplane.cli.common import (
    HOST_COLUMNS,
    Limit,
    Offset,
    Size,
    Sort,
    api_command,
    app,
    follow_migrations,
    groups,
    listed,
    maintenance_app,
    mib,
)
from vmplane.cli.output import Col, console, note, render


# -- the control-plane processes ----------------------------------------------------------------
def _hosts_cell(row: dict) -> str:
    hosts = row["hosts"]
    return ", ".join(hosts) if len(hosts) <= 4 else f"{', '.join(hosts[:3])} and {len(hosts) - 3} more"


CONTROLLER_COLUMNS = [
    Col("EPOCH", "epoch"),
    Col("NAME", lambda r: r["name"] + (" *" if r["this"] else "")),
    Col("STATE", "state"),
    Col("LEASE", lambda r: "-" if r["expires_in_s"] is None else f"{r['expires_in_s']:g} s left"),
    Col("COORDINATOR", lambda r: "yes" if r["coordinator"] else ""),
    Col("HOSTS", _hosts_cell),
    Col("OPS", "operations"),
    Col("MIGRATIONS", "migrations"),
]


@api_command(app, "controllers", lists=True)
def controllers(client: Client):
    """The control-plane processes of this store: each one's epoch (its fencing token), lease, whether it
    coordinates (recovery, settling, HA, the migration queue), the hosts whose events it listens to, and
    the operations and migrations it runs. `*` marks the process that answered."""
    return (
        client.get("/controllers"),
        CONTROLLER_COLUMNS,
        "control-plane processes",
        "a live process renews its lease every third of it; one whose lease lapses changes nothing more, "
        "and its work is taken over",
    )


# -- zones, clusters, hosts --------------------------------------------------------------------
@api_command(groups["zone"], "create")
def zone_create(name: str, client: Client):
    """Create a zone."""
    return client.post("/zones", {"name": name})


@api_command(groups["zone"], "list", lists=True)
def zone_list(client: Client):
    """List zones."""
    return client.get("/zones"), ["name"], "zones"


@api_command(groups["zone"], "delete")
def zone_delete(name: str, client: Client):
    """Delete a zone without clusters; the settings set at its scope go with it."""
    client.call("DELETE", f"/zones/{name}")
    note(f"zone {name} deleted")


CPU_MODEL_HELP = "its guests' CPU model, a named model every host runs (default: the baseline of its hosts)"


@api_command(groups["cluster"], "create")
def cluster_create(
    name: str,
    zone: str = typer.Option(..., help="zone of the cluster"),
    cpu_model: str | None = typer.Option(None, help=CPU_MODEL_HELP),
    *,
    client: Client,
):
    """Create a cluster of hosts in a zone."""
    body = {"name": name, "zone": zone, "cpu_model": cpu_model}
    return client.post("/clusters", {k: v for k, v in body.items() if v is not None})


@api_command(groups["cluster"], "update")
def cluster_update(
    name: str,
    cpu_model: str | None = typer.Option(None, help=CPU_MODEL_HELP),
    baseline: bool = typer.Option(False, "--baseline", help="back to the baseline of its hosts"),
    *,
    client: Client,
):
    """Set the cluster's guest CPU model (refused naming a host that can not run it), or --baseline. VMs that
    run keep their model until they start again."""
    if (cpu_model is None) == (not baseline):
        raise typer.BadParameter("give either --cpu-model MODEL or --baseline")
    return client.call("PATCH", f"/clusters/{name}", json={"cpu_model": cpu_model})


@api_command(groups["cluster"], "list", lists=True)
def cluster_list(client: Client):
    """List clusters, their zones and the CPU model a VM started there gets."""
    return client.get("/clusters"), ["name", "zone", Col("cpu model", "effective_cpu_model")], "clusters"


@api_command(groups["cluster"], "delete")
def cluster_delete(name: str, client: Client):
    """Delete a cluster without hosts; the settings set at its scope go with it."""
    client.call("DELETE", f"/clusters/{name}")
    note(f"cluster {name} deleted")


@api_command(groups["host"], "add")
def host_add(
    name: str,
    cluster: str = typer.Option(...),
    sim: bool = typer.Option(False, help="a simulated host"),
    cores: int | None = typer.Option(None),
    mhz: int | None = typer.Option(None),
    memory: Size = None,
    uri: str | None = typer.Option(None, help="libvirt URI of the host"),
    cpu: str | None = typer.Option(None, help="a sim host's CPU family (Westmere, Haswell, ...; default Broadwell)"),
    local_pool: bool = typer.Option(True, help="make its local pool local-NAME too, so that it takes VMs at once"),
    *,
    client: Client,
):
    """Register a host: simulated (--sim --cores --mhz --memory) or real (--uri); with its local pool
    `local-NAME` (--no-local-pool: none)."""
    if sim == bool(uri):
        raise typer.BadParameter("give either --sim (with --cores, --mhz, --memory) or --uri")
    body = {
        "name": name,
        "cluster": cluster,
        "driver": "sim" if sim else "libvirt",
        "uri": uri,
        "cores": cores,
        "cpu_mhz": mhz,
        "memory_mib": mib(memory),
        "local_pool": local_pool,
        "cpu_model": cpu,
    }
    return client.post("/hosts", {k: v for k, v in body.items() if v is not None})


@api_command(groups["host"], "list", lists=True)
def host_list(
    cluster: str | None = typer.Option(None),
    zone: str | None = typer.Option(None),
    state: str | None = typer.Option(None, help="enabled, maintenance, disabled or down"),
    limit: int | None = Limit(),
    offset: int | None = Offset,
    sort: str | None = Sort,
    *,
    client: Client,
):
    """Hosts and their capacity (--sort name|cluster|zone|state|cores|memory_mib|used_vcpus|used_memory_mib)."""
    return listed(
        client,
        "/hosts",
        "hosts",
        HOST_COLUMNS,
        cluster=cluster,
        zone=zone,
        state=state,
        limit=limit,
        offset=offset,
        sort=sort,
    )


@api_command(groups["host"], "delete")
def host_delete(name: str, client: Client):
    """Remove a host that holds nothing (drain it first: `host maintenance enter`)."""
    client.call("DELETE", f"/hosts/{name}")
    note(f"host {name} deleted")


@api_command(groups["host"], "show")
def host_show(name: str, client: Client):
    """Show one host: capacity under overcommit, what is claimed, state."""
    return client.get(f"/hosts/{name}")


@api_command(groups["host"], "fence")
def host_fence(
    name: str,
    confirm_off: bool = typer.Option(
        False, help="your word that the host is off (pulled the plug, checked its BMC): no agent is asked"
    ),
    *,
    client: Client,
):
    """Fence a host that does not answer now, without waiting for vmplane.ha.grace: its fence agents power
    it off, then its HA VMs run elsewhere (`operation show` follows the recovery)."""
    return client.post(f"/hosts/{name}/fence", {"confirm_off": confirm_off})


@api_command(groups["host"], "fence-agents")
def host_fence_agents(
    name: str,
    agents: str = typer.Argument(
        ...,
        help='JSON list, tried in order: \'[{"agent": "local"}]\', \'[{"agent": "ipmi", "address": "10.0.0.5", '
        '"username": "admin", "password": "secret"}]\', redfish: address, system, username, password',
    ),
    *,
    client: Client,
):
    """Set how a host is powered off when it fails (its fence agents, tried in order)."""
    try:
        parsed = json.loads(agents)
    except ValueError as exc:
        raise typer.BadParameter(f"AGENTS is not JSON: {exc}") from None
    return client.call("PUT", f"/hosts/{name}/fence-agents", json={"agents": parsed})


@api_command(groups["host"], "fail")
def host_fail(
    name: str,
    mode: str = typer.Option(
        ...,
        help="power (daemon and guests killed), daemon (libvirtd "
        "killed, guests run on) or network (unreachable, guests "
        "run on)",
    ),
    *,
    client: Client,
):
    """The nemesis, for drills on local and simulated clusters: make a host fail. Refused for remote hosts."""
    return client.post(f"/hosts/{name}/fail", {"mode": mode})


@api_command(groups["host"], "recover")
def host_recover(name: str, client: Client):
    """Recover a host: one a failed HA recovery left fencing or fenced with HA VMs still unknown has its
    recovery run again (`operation show` follows it); else, on a local or simulated host, undo `host fail`
    (its daemon runs and answers again). Refused when nothing is left to recover."""
    return client.post(f"/hosts/{name}/recover")


DRAIN_COLUMNS: list[str | Col] = [
    "vm",
    "target",
    "migration",
    "state",
    Col("note", lambda r: r.get("reason") or r.get("note")),
]


@api_command(maintenance_app, "enter")
def maintenance_enter(
    name: str,
    dry_run: bool = typer.Option(False, help="print the plan, change nothing"),
    wait: bool = typer.Option(
        True, help="follow the drain until it ends (--no-wait: return once its migrations are admitted)"
    ),
    output: str = "table",
    *,
    client: Client,
):
    """Drain a host by live migration, within the limits; VMs that fit nowhere are listed and stay.

    Exits 1 when a VM stays on the host or a migration fails (a dry run too, when a VM would stay)."""
    plan = client.post(f"/hosts/{name}/maintenance", {"action": "enter", "dry_run": dry_run})
    rows = plan["migrations"]
    if wait and not dry_run:
        ids = [m["migration"] for m in rows if m.get("migration")]
        final = {m["id"]: m for m in follow_migrations(client, ids, output)} if ids else {}
        for m in rows:
            if m.get("migration") in final:
                done = final[m["migration"]]
                m.update(state=done["state"], target=done["target"], reason=done.get("reason") or None)
    if output == "json":
        render(plan, output)
    elif rows:
        render(rows, output, DRAIN_COLUMNS, f"{name}: {'plan' if dry_run else 'drain'}")
    if output != "json":
        for item in plan["unplaceable"]:
            console.print(f"[yellow]stays on {name}[/yellow] {item['vm']}: {item['reason']}", soft_wrap=True)
        moving = "would migrate" if dry_run else "migrated" if wait else "migrating"
        state = "would enter maintenance" if dry_run else f"is now in {plan['state']}"
        summary = f"{len(rows)} VM(s) {moving}" if rows else "no running VMs to migrate"
        stay = f", {len(plan['unplaceable'])} stay on it" if plan["unplaceable"] else ""
        console.print(f"{name} {state}; {summary}{stay}", soft_wrap=True)
    failed = [m for m in rows if m.get("state") in ("failed", "cancelled", "postcopy-failed")]
    if failed or plan["unplaceable"]:
        raise typer.Exit(1)


@api_command(maintenance_app, "exit")
def maintenance_exit(name: str, client: Client):
    """Enable the host again (placement may use it)."""
    return client.post(f"/hosts/{name}/maintenance", {"action": "exit"})
