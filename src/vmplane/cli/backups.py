"""Backups: `backup store create|list|delete` (admins) and `backup create|list|show|verify|restore|delete`."""

from __future__ import annotations

import typer

from vmplane.cli.client import Client
from vmplane.cli.common import api_command, app
from vmplane.cli.output import Col, note

backup_app = typer.Typer(
    help="Backups of VMs' disks (root disk and data volumes), full or incremental, in backup stores.",
    no_args_is_help=True,
)
store_app = typer.Typer(help="Backup stores: a directory every host of a cluster sees.", no_args_is_help=True)
schedule_app = typer.Typer(help="Backups on a schedule (cron, UTC), with their retention.", no_args_is_help=True)
app.add_typer(backup_app, name="backup")
backup_app.add_typer(store_app, name="store")
backup_app.add_typer(schedule_app, name="schedule")


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{-(-n // (1 << 20))} MiB"


COLUMNS = [
    "id",
    "vm",
    "kind",
    Col("on", lambda b: str(b["parent"] or "-")),
    "state",
    "store",
    Col("file", lambda b: _mib(b["bytes"])),
    Col("written", lambda b: _mib(b["written"])),
    Col("created", lambda b: b["created_at"][:19].replace("T", " ")),
]
STORE_COLUMNS = ["name", "cluster", "path", "backups", Col("size", lambda s: _mib(s["bytes"]))]


@api_command(store_app, "create")
def store_create(
    name: str,
    cluster: str = typer.Option(..., help="every host of this cluster must see the directory"),
    path: str | None = typer.Option(None, help="the directory (default: under the hosts' shared storage)"),
    *,
    client: Client,
):
    """Create a backup store; refused unless a file written through one host is seen through the others."""
    return client.post("/backup-stores", {"name": name, "cluster": cluster} | ({"path": path} if path else {}))


@api_command(store_app, "list", lists=True)
def store_list(client: Client):
    """Backup stores, with how many backups each holds."""
    return client.get("/backup-stores"), STORE_COLUMNS, "backup stores"


@api_command(store_app, "delete")
def store_delete(name: str, client: Client):
    """Delete an empty backup store (its directory stays)."""
    client.call("DELETE", f"/backup-stores/{name}")
    note(f"backup store {name} deleted")


@api_command(backup_app, "create")
def backup_create(
    vm: str,
    store: str | None = typer.Option(None, help="the backup store (default: the only one)"),
    full: bool = typer.Option(False, help="a full backup even when an incremental one is possible"),
    *,
    client: Client,
):
    """Back up a running VM's disks (root disk and data volumes) in one job: each incremental on the VM's last
    backup in the store when its checkpoint still describes the disk (else whole; `why` says which)."""
    return client.post(f"/vms/{vm}/backups", {"full": full} | ({"store": store} if store else {}))


@api_command(backup_app, "list", lists=True)
def backup_list(vm: str | None = typer.Option(None, help="this VM's backups"), *, client: Client):
    """Backups, oldest first: an incremental's `on` is the backup it builds on."""
    return client.get("/backups", vm=vm), COLUMNS, "backups"


@api_command(backup_app, "show")
def backup_show(backup_id: int, client: Client):
    """One backup: its disks (each file's size, mode and sha256), its base and charge."""
    return client.get(f"/backups/{backup_id}")


@api_command(backup_app, "verify")
def backup_verify(backup_id: int, client: Client):
    """Read the backup's chain back and compare each file with the sha256 recorded when it was written."""
    return client.post(f"/backups/{backup_id}/verify")


@api_command(backup_app, "restore")
def backup_restore(
    backup_id: int,
    to: str | None = typer.Option(None, "--to", help="the new VM's name"),
    in_place: bool = typer.Option(False, help="the backed-up VM itself (stopped, without snapshots)"),
    start: bool = typer.Option(False, help="start it once its disk is copied"),
    pool: str | None = typer.Option(None, help="the new disks' pool (default: where the backed-up ones were)"),
    *,
    client: Client,
):
    """A new VM of what the backed-up VM was (--to), each disk a full copy of the backup's chain (a data disk
    becomes a new volume NEW-<device>); or the stopped VM itself, every disk back as the backup saw it."""
    body = {"name": to, "start": start, "in_place": in_place} | ({"pool": pool} if pool else {})
    return client.post(f"/backups/{backup_id}/restore", body)


@api_command(backup_app, "delete")
def backup_delete(backup_id: int, client: Client):
    """Delete a backup (refused while a later one is incremental on it)."""
    client.call("DELETE", f"/backups/{backup_id}")
    note(f"backup {backup_id} deleted")


@api_command(backup_app, "prune")
def backup_prune(
    vm: str,
    keep_last: int | None = typer.Option(None, min=1, help="keep the newest N backups"),
    keep_daily: int | None = typer.Option(None, min=1, help="keep the newest backup of each of the last N days"),
    *,
    client: Client,
):
    """Delete VM's backups that the retention does not keep; every backup left restores."""
    body = {k: v for k, v in {"keep_last": keep_last, "keep_daily": keep_daily}.items() if v is not None}
    return client.post(f"/vms/{vm}/backups/prune", body)


def _target(vm: str | None, project: str | None) -> str:
    if (vm is None) == (project is None):
        raise typer.BadParameter("give --vm or --project (one of them)")
    return f"/vms/{vm}/backup-schedule" if vm else f"/projects/{project}/backup-schedule"


@api_command(schedule_app, "set")
def schedule_set(
    cron: str = typer.Option(..., help="when, UTC: '0 3 * * *' is every day at 03:00"),
    vm: str | None = typer.Option(None, help="this VM"),
    project: str | None = typer.Option(None, help="every running VM of this project"),
    store: str | None = typer.Option(None, help="the backup store (default: the only one)"),
    keep_last: int | None = typer.Option(None, min=1, help="after each run: keep the newest N"),
    keep_daily: int | None = typer.Option(None, min=1, help="after each run: one a day for N days"),
    *,
    client: Client,
):
    """Back up a VM (or every running VM of a project) on a schedule; it replaces the one it had."""
    body = {"cron": cron, "store": store, "keep_last": keep_last, "keep_daily": keep_daily}
    return client.call("PUT", _target(vm, project), json={k: v for k, v in body.items() if v is not None})


@api_command(schedule_app, "list", lists=True)
def schedule_list(client: Client):
    """Schedules with their next run and what their last one did."""
    cols = ["vm", "project", "cron", "store", "keep_last", "keep_daily", "next_run_at", "last_result"]
    return client.get("/backup-schedules"), cols, "backup schedules"


@api_command(schedule_app, "delete")
def schedule_delete(vm: str | None = typer.Option(None), project: str | None = typer.Option(None), *, client: Client):
    """Stop a VM's (or a project's) scheduled backups; its backups stay."""
    client.call("DELETE", _target(vm, project))
    note("backup schedule deleted")
