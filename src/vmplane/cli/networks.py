"""Guest networks, security groups and their rules, and a VM's groups (`vm secgroup add|remove`)."""

from __future__ import annotations

import typer

from vmplane.cli.client import Client
from vmplane.cli.common import api_command, app, groups
from vmplane.cli.output import Col, note

network_app = typer.Typer(
    help="Guest networks: a project's isolated networks, and admins' provider networks (the hosts' uplink).",
    no_args_is_help=True,
)
secgroup_app = typer.Typer(
    help="Security groups: what reaches a project's NICs, and what leaves them.", no_args_is_help=True
)
rule_app = typer.Typer(help="A security group's rules.", no_args_is_help=True)
vm_secgroup_app = typer.Typer(help="A VM's security groups (every NIC of the VM).", no_args_is_help=True)
app.add_typer(network_app, name="network")
app.add_typer(secgroup_app, name="secgroup")
secgroup_app.add_typer(rule_app, name="rule")
groups["vm"].add_typer(vm_secgroup_app, name="secgroup")
vm_nic_app = typer.Typer(help="A VM's network cards, added and removed while it runs.", no_args_is_help=True)
groups["vm"].add_typer(vm_nic_app, name="nic")

NETWORK_COLUMNS = [
    "name",
    "kind",
    "project",
    "cidr",
    Col("addresses", lambda n: f"{n['addresses_used']}/{n['addresses_total']}"),
    "shared",
    "zone",
]
SECGROUP_COLUMNS = ["name", "project", Col("rules", "rule_count"), Col("NICs", "member_count")]
NIC_COLUMNS = ["network", "ip", "mac", Col("secgroups", lambda n: ", ".join(n["secgroups"]) or "-")]


def _given(body: dict) -> dict:
    return {k: v for k, v in body.items() if v is not None}


def nic_line(nic: dict) -> str:
    """A VM's NIC on one line (`vm show`): network, address, MAC, groups, and its state when not attached."""
    state = "" if nic.get("state", "attached") == "attached" else f" ({nic['state']})"
    groups_ = ",".join(nic.get("secgroups") or []) or "none"
    return f"{nic['network']} {nic['ip']} {nic['mac'] or '-'} groups: {groups_}{state}"


def rule_line(rule: dict) -> str:
    """A rule as `secgroup show` prints it: `#3 in tcp 22 from 0.0.0.0/0`."""
    port = f" {rule['port']}" if rule.get("port") else ""
    towards = "from" if rule["direction"] == "in" else "to"
    peer = rule["from_cidr"] or f"group {rule['from_group']}"
    return f"#{rule['id']} {rule['direction']} {rule['proto']}{port} {towards} {peer}"


# -- networks -------------------------------------------------------------------------------------------
@api_command(network_app, "create")
def network_create(
    name: str,
    cidr: str = typer.Option(..., help="an IPv4 network of at least 8 addresses, like 10.10.0.0/24"),
    project: str | None = typer.Option(None, help="an isolated network's project"),
    provider: bool = typer.Option(False, help="a provider network, bridged to the hosts' uplink (admin)"),
    shared: bool = typer.Option(False, help="a provider network every project's VMs may use"),
    gateway: str | None = typer.Option(None, help="its gateway, a host address inside it (default: the first)"),
    zone: str | None = typer.Option(None, help="its zone (default: the only zone)"),
    *,
    client: Client,
):
    """Create a project's isolated network (--project) or a provider network (--provider [--shared])."""
    body = {"name": name, "project": project, "cidr": cidr, "gateway": gateway, "zone": zone}
    return client.post("/networks", {**_given(body), "provider": provider, "shared": shared})


@api_command(network_app, "list", lists=True)
def network_list(client: Client):
    """Networks (a member: its project's and the shared provider ones), with their addresses used/free."""
    return client.get("/networks"), NETWORK_COLUMNS, "networks"


@api_command(network_app, "show")
def network_show(name: str, output: str, client: Client):
    """One network and the NICs on it."""
    n = client.get(f"/networks/{name}")
    if output != "table":
        return n
    n["addresses"] = f"{n.pop('addresses_used')} used of {n.pop('addresses_total')}"
    n["nics"] = [f"{x['vm']} {x['ip']} {x['mac'] or '-'}" for x in n["nics"] or []] or None
    return n


@api_command(network_app, "delete")
def network_delete(name: str, client: Client):
    """Delete a network no NIC uses (refused while one does, naming the VMs)."""
    client.call("DELETE", f"/networks/{name}")
    note(f"network {name} deleted")


# -- security groups ------------------------------------------------------------------------------------
Project = typer.Option(..., help="the group's project")


@api_command(secgroup_app, "create")
def secgroup_create(name: str, project: str = Project, *, client: Client):
    """Create a security group without rules (its NICs take nothing in, send nothing out, until rules say)."""
    return client.post("/secgroups", {"name": name, "project": project})


@api_command(secgroup_app, "list", lists=True)
def secgroup_list(project: str | None = typer.Option(None, help="this project's groups"), *, client: Client):
    """Security groups with their counts of rules and member NICs."""
    return client.get("/secgroups", project=project), SECGROUP_COLUMNS, "security groups"


@api_command(secgroup_app, "show")
def secgroup_show(name: str, project: str = Project, *, output: str, client: Client):
    """One group: its rules (with the ids `secgroup rule remove` takes) and its member NICs."""
    g = client.get(f"/secgroups/{project}/{name}")
    if output != "table":
        return g
    g["rules"] = [rule_line(r) for r in g["rules"] or []] or None
    g["members"] = [f"{m['vm']} {m['network']} {m['ip']}" for m in g["members"] or []] or None
    return g


@api_command(secgroup_app, "delete")
def secgroup_delete(name: str, project: str = Project, *, client: Client):
    """Delete a group no NIC is in and no other group's rule names (refused naming them)."""
    client.call("DELETE", f"/secgroups/{project}/{name}")
    note(f"security group {name} deleted")


@api_command(rule_app, "add")
def secgroup_rule_add(
    name: str,
    project: str = Project,
    direction: str = typer.Option(..., help="in (reaching its NICs) or out (leaving them)"),
    proto: str = typer.Option(..., help="tcp, udp, icmp or any"),
    port: str | None = typer.Option(None, help="tcp and udp: a port (22) or a range (22-23); default: every port"),
    from_cidr: str | None = typer.Option(None, "--from", help="from (in) or to (out) this CIDR, like 0.0.0.0/0"),
    from_group: str | None = typer.Option(None, help="... or the members of this group of the project"),
    *,
    client: Client,
):
    """Add a rule; it applies to the group's running NICs at once."""
    body = {"direction": direction, "proto": proto, "port": port, "from_cidr": from_cidr, "from_group": from_group}
    return client.post(f"/secgroups/{project}/{name}/rules", _given(body))


@api_command(rule_app, "remove")
def secgroup_rule_remove(name: str, rule_id: int, project: str = Project, *, client: Client):
    """Remove a rule by its id (`secgroup show` lists them); connections it let in stay open."""
    client.call("DELETE", f"/secgroups/{project}/{name}/rules/{rule_id}")
    note(f"rule {rule_id} removed from security group {name}")


# -- a VM's groups --------------------------------------------------------------------------------------
@api_command(vm_secgroup_app, "add")
def vm_secgroup_add(vm: str, group: str, client: Client):
    """Every NIC of the VM joins the group (of the VM's project)."""
    return client.post(f"/vms/{vm}/secgroups", {"group": group}), NIC_COLUMNS, f"NICs of {vm}"


@api_command(vm_secgroup_app, "remove")
def vm_secgroup_remove(vm: str, group: str, client: Client):
    """Every NIC of the VM leaves the group."""
    return client.call("DELETE", f"/vms/{vm}/secgroups/{group}"), NIC_COLUMNS, f"NICs of {vm}"


# -- a VM's NICs ------------------------------------------------------------------------------------------
@api_command(vm_nic_app, "add")
def vm_nic_add(
    vm: str,
    network: str = typer.Option(..., help="the network of the new NIC"),
    ip: str | None = typer.Option(None, help="its address (default: the lowest free one)"),
    secgroup: list[str] = typer.Option([], help="its security groups, repeatable (default: the project's default)"),
    *,
    client: Client,
):
    """Add a NIC: hot-plugged into a running VM (answered once the VM has it), recorded for a stopped one."""
    return client.post(f"/vms/{vm}/nics", _given({"network": network, "ip": ip, "secgroups": secgroup}))


@api_command(vm_nic_app, "remove")
def vm_nic_remove(vm: str, mac: str, client: Client):
    """Remove a NIC by its MAC (`vm show` lists them): answered once the guest let it go."""
    client.call("DELETE", f"/vms/{vm}/nics/{mac}")
    note(f"NIC {mac} removed from vm {vm}")
