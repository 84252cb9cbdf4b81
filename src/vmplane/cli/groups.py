"""Placement groups, and a cluster's failover capacity (`cluster show`)."""

from __future__ import annotations

import typer

from vmplane.cli.client import Client
from vmplane.cli.common import api_command, app, groups
from vmplane.cli.output import Col, note

group_app = typer.Typer(
    help="Placement groups: a project's VMs together on one host (affinity) or apart (anti-affinity).",
    no_args_is_help=True,
)
app.add_typer(group_app, name="group")

GROUP_COLUMNS = ["name", "project", "rule", Col("VMs", lambda g: ", ".join(g["vms"]) or "-")]


@api_command(group_app, "create")
def group_create(
    name: str,
    project: str = typer.Option(..., help="the project whose VMs join it"),
    policy: str = typer.Option(..., help="anti-affinity (each VM on another host) or affinity (all on one host)"),
    soft: bool = typer.Option(
        False, help="prefer hosts that keep the policy, but place anyway when none can (default: hard, refuse)"
    ),
    *,
    client: Client,
):
    """Create a placement group; VMs join it with `vm create --group NAME`."""
    return client.post("/groups", {"name": name, "project": project, "policy": policy, "hard": not soft})


@api_command(group_app, "list", lists=True)
def group_list(client: Client):
    """Placement groups (a member: its project's) and their VMs."""
    return client.get("/groups"), GROUP_COLUMNS, "placement groups"


@api_command(group_app, "show")
def group_show(name: str, client: Client):
    """One group: its policy, its VMs and the hosts they hold."""
    return client.get(f"/groups/{name}")


@api_command(group_app, "delete")
def group_delete(name: str, client: Client):
    """Delete a group without VMs (refused while it has some, naming them)."""
    client.call("DELETE", f"/groups/{name}")
    note(f"group {name} deleted")


def cpu_model_words(c: dict) -> str:
    """What a VM started in the cluster now gets, and where that comes from."""
    baseline = c.get("cpu_baseline") or "not computed yet"
    if c.get("cpu_model"):
        return f"{c['cpu_model']} (set on the cluster; its hosts' baseline: {baseline})"
    return f"{c.get('effective_cpu_model', '-')} (its hosts' baseline)"


@api_command(groups["cluster"], "show")
def cluster_show(name: str, output: str, client: Client):
    """A cluster, its hosts, its guests' CPU model (its own or its hosts' baseline) and its failover capacity: k
    (vmplane.ha.host.failures.tolerated), the reserve held back for the HA VMs of k failed hosts, and whether it
    survives k failures now (naming the worst case)."""
    c = client.get(f"/clusters/{name}")
    if output != "table":
        return c
    f = c["failover"]
    survives = (
        "yes"
        if f["survives"]
        else (
            f"no: {f['survivable_failures']} of {f['failures_tolerated']}; the worst case, "
            f"{', '.join(f['worst_case'])} failing, needs {f['shortfall_vcpus']} vCPU / "
            f"{f['shortfall_memory_mib']} MiB "
            f"more than the other hosts have free"
        )
    )
    return {
        "name": c["name"],
        "zone": c["zone"],
        "hosts": c["hosts"],
        "cpu model": cpu_model_words(c),
        **({"cpu baseline note": c["cpu_baseline_why"]} if c.get("cpu_baseline_why") else {}),
        "host failures tolerated": f"{f['failures_tolerated']} ({f['setting']})",
        "reserve": f"{f['reserve_vcpus']} vCPU / {f['reserve_memory_mib']} MiB",
        "HA VMs claim": f"{f['ha_vcpus']} vCPU / {f['ha_memory_mib']} MiB",
        "free": f"{f['free_vcpus']} vCPU / {f['free_memory_mib']} MiB",
        "survives": survives,
        "worst case": ", ".join(f["worst_case"]) or "-",
    }
