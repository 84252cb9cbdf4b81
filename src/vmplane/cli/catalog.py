"""Projects, offerings, templates, settings and tokens."""

from __future__ import annotations

from typing import Annotated

import typer

from vmplane.cli.client import Client
from vmplane.cli.common import (
    Size,
    api_command,
    groups,
    mib,
    size_help,
)
from vmplane.cli.output import Col, note


# -- projects ----------------------------------------------------------------------------------
@api_command(groups["project"], "create")
def project_create(
    name: str,
    vcpus: int = typer.Option(..., min=0, help="vCPU quota"),
    memory: str = typer.Option(..., help=size_help("memory quota"), metavar="SIZE"),
    vms: int = typer.Option(100, min=0, help="VM count quota"),
    count_overhead: bool = typer.Option(False, help="charge each VM's QEMU overhead to the quota"),
    max_concurrent_migrations: int | None = typer.Option(
        None, min=0, help="live migrations of its VMs at once; 0 or left out = unlimited"
    ),
    storage: str = typer.Option(
        "1TiB", help=size_help("storage quota (the provisioned size of its volumes and root disks)"), metavar="SIZE"
    ),
    backups: str = typer.Option(
        "1TiB", help=size_help("backup quota (what its backups take in the backup stores)"), metavar="SIZE"
    ),
    *,
    client: Client,
):
    """Create a project (a tenant) with its quota."""
    return client.post(
        "/projects",
        {
            "name": name,
            "vcpus": vcpus,
            "memory_mib": mib(memory),
            "vms": vms,
            "count_overhead": count_overhead,
            "max_concurrent_migrations": max_concurrent_migrations,
            "storage_mib": mib(storage, "--storage"),
            "backups_mib": mib(backups, "--backups"),
        },
    )


@api_command(groups["project"], "quota")
def project_quota(
    name: str,
    vcpus: int | None = typer.Option(None, min=0),
    memory: Size = None,
    vms: int | None = typer.Option(None, min=0),
    count_overhead: bool | None = typer.Option(None, "--count-overhead/--no-count-overhead"),
    max_concurrent_migrations: int | None = typer.Option(
        None, min=0, help="live migrations of its VMs at once; 0 = unlimited"
    ),
    storage: Annotated[str | None, typer.Option(help=size_help("storage quota"), metavar="SIZE")] = None,
    backups: Annotated[str | None, typer.Option(help=size_help("backup quota"), metavar="SIZE")] = None,
    *,
    client: Client,
):
    """Change a project's quota (lowering below usage is refused)."""
    body = {
        "vcpus": vcpus,
        "memory_mib": mib(memory),
        "vms": vms,
        "count_overhead": count_overhead,
        "max_concurrent_migrations": max_concurrent_migrations,
        "storage_mib": mib(storage, "--storage"),
        "backups_mib": mib(backups, "--backups"),
    }
    return client.call("PATCH", f"/projects/{name}/quota", json={k: v for k, v in body.items() if v is not None})


@api_command(groups["project"], "usage")
def project_usage(name: str, client: Client):
    """Used / quota / percent per resource, and whether the ledger equals the recomputed usage."""
    u = client.get(f"/projects/{name}/usage")
    return u


def _used_of(resource: str):
    return lambda p: f"{p['usage'][resource]}/{p['quota'][resource]}"


PROJECT_COLUMNS = [
    "name",
    Col("vcpus", _used_of("vcpus")),
    Col("memory MiB", _used_of("memory_mib")),
    Col("vms", _used_of("vms")),
    Col("storage MiB", _used_of("storage_mib")),
    Col("overhead", "count_overhead"),
]


def _range(low: str, high: str, fixed: str):
    return lambda o: o[fixed] if o[fixed] is not None else (f"{o[low]}-{o[high]}" if o[low] is not None else "any")


OFFERING_COLUMNS = [
    "name",
    "kind",
    Col("vcpus", _range("min_vcpus", "max_vcpus", "vcpus")),
    Col("memory MiB", _range("min_memory_mib", "max_memory_mib", "memory_mib")),
    Col("cap", "cpu_cap"),
    Col("scaling", "dynamic_scaling"),
    "retired",
]


def _values(setting: dict) -> str:
    return "; ".join(f"{v['scope_name'] or v['scope']}={v['value']}" for v in setting["values"]) or "-"


SETTING_COLUMNS = ["key", "default", Col("set", _values)]


@api_command(groups["project"], "list", lists=True)
def project_list(client: Client):
    """Projects with used/quota per resource."""
    return client.get("/projects"), PROJECT_COLUMNS, "projects"


@api_command(groups["project"], "show")
def project_show(name: str, client: Client):
    """Show one project: quota and usage."""
    return client.get(f"/projects/{name}")


@api_command(groups["project"], "delete")
def project_delete(name: str, client: Client):
    """Delete a project; refused while it has VMs or tokens (they are named)."""
    client.call("DELETE", f"/projects/{name}")
    note(f"project {name} deleted")


# -- offerings and templates -------------------------------------------------------------------
@api_command(groups["offering"], "create")
def offering_create(
    name: str,
    kind: str = typer.Option(..., help="fixed, custom-constrained, custom-unconstrained"),
    vcpus: int | None = typer.Option(None),
    memory: Size = None,
    min_vcpus: int | None = typer.Option(None),
    max_vcpus: int | None = typer.Option(None),
    min_memory: Size = None,
    max_memory: Size = None,
    cpu_speed: int | None = typer.Option(None, help="MHz per vCPU"),
    cpu_cap: bool = typer.Option(False),
    dynamic_scaling: bool = typer.Option(False),
    root_disk: Annotated[
        str | None, typer.Option(help=size_help("root disk size (default: the template image's)"), metavar="SIZE")
    ] = None,
    max_root_disk: Annotated[
        str | None, typer.Option(help=size_help("VMs may ask for a root disk up to this"), metavar="SIZE")
    ] = None,
    ha: str | None = typer.Option(None, help="its VMs' default HA policy: restart or off"),
    cpu_model: str | None = typer.Option(
        None,
        help="its VMs' guest CPU: a named model, or host-model (the host's CPU: may block live migration to "
        "another CPU); default: their cluster's",
    ),
    *,
    client: Client,
):
    """Create a compute offering: fixed sizes or ranges, CPU speed, cap, live scaling, root disk size, CPU model."""
    body = {
        "name": name,
        "kind": kind,
        "vcpus": vcpus,
        "memory_mib": mib(memory),
        "min_vcpus": min_vcpus,
        "max_vcpus": max_vcpus,
        "min_memory_mib": mib(min_memory, "--min-memory"),
        "max_memory_mib": mib(max_memory, "--max-memory"),
        "root_disk_mib": mib(root_disk, "--root-disk"),
        "max_root_disk_mib": mib(max_root_disk, "--max-root-disk"),
        "cpu_speed_mhz": cpu_speed,
        "cpu_cap": cpu_cap,
        "dynamic_scaling": dynamic_scaling,
        "ha_policy": ha,
        "cpu_model": cpu_model,
    }
    return client.post("/offerings", {k: v for k, v in body.items() if v is not None})


@api_command(groups["offering"], "list", lists=True)
def offering_list(client: Client):
    """Offerings: fixed sizes or ranges, CPU cap, live scaling, retired."""
    return client.get("/offerings"), OFFERING_COLUMNS, "offerings"


@api_command(groups["offering"], "show")
def offering_show(name: str, client: Client):
    """Show one offering."""
    return client.get(f"/offerings/{name}")


@api_command(groups["offering"], "retire")
def offering_retire(name: str, client: Client):
    """No new VMs from this offering; VMs using it keep it."""
    return client.post(f"/offerings/{name}/retire")


@api_command(groups["offering"], "delete")
def offering_delete(name: str, client: Client):
    """Delete an offering no VM uses (else retire it)."""
    client.call("DELETE", f"/offerings/{name}")
    note(f"offering {name} deleted")


@api_command(groups["template"], "create")
def template_create(
    name: str,
    image: str | None = typer.Option(
        None,
        help="a disk image file (qcow2 or raw: imported, "
        "boots as it is), or a kernel: tiny-linux or a folder with "
        "vmlinuz and initrd.gz",
    ),
    disk: str | None = typer.Option(None, help="with a kernel: the root disk image (tiny-linux, or an image file)"),
    from_image: str | None = typer.Option(
        None, help="an image uploaded with `vmplane image upload` (boots as it is); instead of --image"
    ),
    dynamic_scaling: bool = typer.Option(False, help="its guests can be scaled live"),
    *,
    client: Client,
):
    """Register a guest image as a template; an image file is checked (qemu-img) and imported."""
    body = {
        "name": name,
        "image": image,
        "disk": disk,
        "from_image": from_image,
        "dynamic_scaling": dynamic_scaling,
    }
    return client.post("/templates", {k: v for k, v in body.items() if v is not None})


@api_command(groups["template"], "list", lists=True)
def template_list(client: Client):
    """Templates (guest images)."""
    return (
        client.get("/templates"),
        ["name", "image", Col("disk MiB", "disk_mib"), Col("scaling", "dynamic_scaling"), "retired"],
        "templates",
    )


@api_command(groups["template"], "show")
def template_show(name: str, client: Client):
    """Show one template."""
    return client.get(f"/templates/{name}")


@api_command(groups["template"], "retire")
def template_retire(name: str, client: Client):
    """No new VMs from this template; VMs using it keep it."""
    return client.post(f"/templates/{name}/retire")


@api_command(groups["template"], "delete")
def template_delete(name: str, client: Client):
    """Delete a template no VM uses (else retire it)."""
    client.call("DELETE", f"/templates/{name}")
    note(f"template {name} deleted")


# -- settings ----------------------------------------------------------------------------------
def _scope(zone: str | None, cluster: str | None) -> tuple[str, str | None]:
    if zone and cluster:
        raise typer.BadParameter("give --zone or --cluster, not both")
    return ("zone", zone) if zone else ("cluster", cluster) if cluster else ("global", None)


def _warn(result: dict) -> dict:
    for warning in result.get("warnings") or []:
        note(f"[yellow]warning[/yellow] over capacity: {warning}")
    return result


# negative values (`setting set kvm.cpu.dynamic.scaling.capacity -1`) are values, not options
@api_command(groups["setting"], "set", context_settings={"ignore_unknown_options": True})
def setting_set(
    key: str,
    value: str = typer.Argument(..., help="checked against the key's range (`setting list`)"),
    zone: str | None = typer.Option(None),
    cluster: str | None = typer.Option(None),
    *,
    client: Client,
):
    """Set a value at global, zone or cluster scope; prints the hosts a lower factor leaves over capacity."""
    scope, scope_name = _scope(zone, cluster)
    return _warn(
        client.call("PUT", f"/settings/{key}", json={"value": value, "scope": scope, "scope_name": scope_name})
    )


@api_command(groups["setting"], "unset")
def setting_unset(
    key: str, zone: str | None = typer.Option(None), cluster: str | None = typer.Option(None), *, client: Client
):
    """Remove the value set at this scope: the key takes the inherited value again (shown)."""
    scope, scope_name = _scope(zone, cluster)
    return _warn(
        client.call(
            "DELETE", f"/settings/{key}", params={"scope": scope, **({"scope_name": scope_name} if scope_name else {})}
        )
    )


@api_command(groups["setting"], "get")
def setting_get(
    key: str, zone: str | None = typer.Option(None), cluster: str | None = typer.Option(None), *, client: Client
):
    """The effective value of a setting at a scope, and where it comes from."""
    scope, scope_name = _scope(zone, cluster)
    return client.get(f"/settings/{key}", scope=scope, scope_name=scope_name)


@api_command(groups["setting"], "list", lists=True)
def setting_list(client: Client):
    """Every setting key, its default and where it is set (--wide: ranges, scopes and descriptions)."""
    return client.get("/settings"), SETTING_COLUMNS, "settings"


@api_command(groups["token"], "create")
def token_create(
    name: str,
    role: str = typer.Option("member", help="admin or member"),
    project: str | None = typer.Option(None, help="a member token's project (none for admin)"),
    *,
    client: Client,
):
    """Create an API token; its clear text is shown once."""
    return client.post("/tokens", {"name": name, "role": role, "project": project})


@api_command(groups["token"], "list", lists=True)
def token_list(client: Client):
    """Tokens (never their secrets): all for an admin, its project's for a member."""
    return client.get("/tokens"), ["name", "role", "project", "created_at"], "tokens"


@api_command(groups["token"], "revoke")
def token_revoke(name: str, client: Client):
    """Revoke a token: every control-plane process refuses it at once."""
    client.call("DELETE", f"/tokens/{name}")
    note(f"token {name} revoked")
