"""Storage pools and volumes."""

from __future__ import annotations

import typer

from vmplane.cli.client import Client
from vmplane.cli.common import api_command, groups, mib, size_help
from vmplane.cli.output import Col, note

POOL_COLUMNS = [
    "name",
    "kind",
    Col("host/cluster", lambda p: p["host"] or p["cluster"]),
    "state",
    Col("free MiB", "free_mib"),
    Col("capacity MiB", "capacity_mib"),
    "path",
]
VOLUME_COLUMNS = ["name", "project", "pool", Col("MiB", "size_mib"), "role", "state", "vm", "device"]


@api_command(groups["pool"], "create")
def pool_create(
    name: str,
    kind: str = typer.Option(..., help="local (one host's folder) or shared (every host of a cluster sees it)"),
    host: str | None = typer.Option(None, help="a local pool's host"),
    cluster: str | None = typer.Option(None, help="a shared pool's cluster"),
    path: str | None = typer.Option(
        None, help="folder on the host(s); default /var/lib/vmplane/local, or /var/lib/vmplane/shared/NAME"
    ),
    *,
    client: Client,
):
    """Define a storage pool on its host(s); a shared one is checked to be really shared."""
    body = {"name": name, "kind": kind, "host": host, "cluster": cluster, "path": path}
    return client.post("/pools", {k: v for k, v in body.items() if v is not None})


@api_command(groups["pool"], "list", lists=True)
def pool_list(client: Client):
    """Pools with their state and room, read back from their hosts."""
    return client.get("/pools", refresh="true"), POOL_COLUMNS, "pools"


@api_command(groups["pool"], "show")
def pool_show(name: str, client: Client):
    """One pool: capacity, allocation and what vmplane's volumes take of it."""
    return client.get(f"/pools/{name}")


@api_command(groups["pool"], "delete")
def pool_delete(name: str, client: Client):
    """Undefine a pool that holds no volume (its files stay on the hosts)."""
    client.call("DELETE", f"/pools/{name}")
    note(f"pool {name} deleted")


@api_command(groups["volume"], "create")
def volume_create(
    name: str,
    project: str = typer.Option(...),
    size: str = typer.Option(..., help=size_help("its size"), metavar="SIZE"),
    pool: str | None = typer.Option(None, help="default: a shared pool, else the local pool with the most room"),
    *,
    client: Client,
):
    """Create a blank volume, charged to its project's storage quota."""
    body = {"name": name, "project": project, "size_mib": mib(size, "--size"), "pool": pool}
    return client.post("/volumes", {k: v for k, v in body.items() if v is not None})


@api_command(groups["volume"], "list", lists=True)
def volume_list(vm: str | None = typer.Option(None, help="the volumes of this VM"), *, client: Client):
    """Volumes and root disks, with where they are attached."""
    return client.get("/volumes", vm=vm), VOLUME_COLUMNS, "volumes"


@api_command(groups["volume"], "show")
def volume_show(name: str, client: Client):
    """One volume."""
    return client.get(f"/volumes/{name}")


@api_command(groups["volume"], "attach")
def volume_attach(name: str, vm: str = typer.Option(...), *, client: Client):
    """Attach a volume to a VM: hot-plugged when it runs (read back from the host)."""
    return client.post(f"/volumes/{name}/attach", {"vm": vm})


@api_command(groups["volume"], "detach")
def volume_detach(name: str, client: Client):
    """Detach a volume; from a running VM, confirmed by the hypervisor (the device left the guest)."""
    return client.post(f"/volumes/{name}/detach")


@api_command(groups["volume"], "resize")
def volume_resize(
    name: str, size: str = typer.Option(..., help=size_help("the new, larger size"), metavar="SIZE"), *, client: Client
):
    """Grow a volume or a root disk (live while its VM runs); charged to the storage quota."""
    return client.post(f"/volumes/{name}/resize", {"size_mib": mib(size, "--size")})


@api_command(groups["volume"], "move")
def volume_move(name: str, pool: str = typer.Option(..., help="the pool to move it to"), *, client: Client):
    """Move a volume (or a root disk) to another pool: live by a block copy while its VM runs, else copied by a
    host that sees both pools; its old file is deleted once the new one is read back. A stopped VM's local
    disks move to another host with `vmplane vm migrate VM --to HOST`."""
    return client.post(f"/volumes/{name}/move", {"pool": pool})


@api_command(groups["volume"], "delete")
def volume_delete(name: str, client: Client):
    """Delete a detached volume and its data."""
    client.call("DELETE", f"/volumes/{name}")
    note(f"volume {name} deleted")
