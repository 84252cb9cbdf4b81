"""A VM's disk snapshots: `vm snapshot create|list|revert|delete` (issue 32)."""

from __future__ import annotations

import typer

from vmplane.cli.client import Client
from vmplane.cli.common import api_command, groups
from vmplane.cli.output import Col, note

snapshot_app = typer.Typer(
    help="A VM's disk snapshots: taken while it runs or is stopped, reverted while it is stopped.",
    no_args_is_help=True,
)
groups["vm"].add_typer(snapshot_app, name="snapshot")

COLUMNS = [
    "name",
    "state",
    Col("taken", lambda s: ("live" if s["live"] else "stopped") + (", quiesced" if s["quiesced"] else "")),
    Col("pause", lambda s: "-" if s["pause_ms"] is None else f"{s['pause_ms']} ms"),
    Col("created", lambda s: s["created_at"][:19].replace("T", " ")),
    Col("disks", lambda s: str(len(s["disks"]))),
]


@api_command(snapshot_app, "create")
def snapshot_create(
    vm: str,
    name: str,
    quiesce: bool = typer.Option(
        False, help="freeze the guest's file systems through its agent while the snapshot is taken (a running VM)"
    ),
    *,
    client: Client,
):
    """Snapshot every disk of VM (answered once the host shows the new overlays). Each overlay counts in the
    project's storage quota at its disk's size."""
    return client.post(f"/vms/{vm}/snapshots", {"name": name, "quiesce": quiesce})


@api_command(snapshot_app, "list", lists=True)
def snapshot_list(vm: str, client: Client):
    """The VM's snapshots, oldest first, with the guest's pause when each was taken."""
    return client.get(f"/vms/{vm}/snapshots"), COLUMNS, f"snapshots of {vm}"


@api_command(snapshot_app, "revert")
def snapshot_revert(vm: str, name: str, client: Client):
    """Put the stopped VM's disks back as snapshot NAME saw them: what was written since is dropped."""
    return client.post(f"/vms/{vm}/snapshots/{name}/revert")


@api_command(snapshot_app, "delete")
def snapshot_delete(vm: str, name: str, client: Client):
    """Delete snapshot NAME; the files no chain needs any more are deleted."""
    client.call("DELETE", f"/vms/{vm}/snapshots/{name}")
    note(f"snapshot {name} of vm {vm} deleted")


@api_command(groups["vm"], "clone")
def vm_clone(
    vm: str,
    new: str,
    snapshot: str | None = typer.Option(None, help="what this snapshot of VM kept (VM may run): a linked clone"),
    full: bool = typer.Option(False, help="a full copy that stands alone (always, without --snapshot)"),
    start: bool = typer.Option(False, help="start the new VM once its disk is made"),
    *,
    client: Client,
):
    """A new VM NEW of the same offering, template, size and project as VM, whose root disk holds what one of
    VM's snapshots kept: linked (an overlay on the snapshot's base, made at once; VM keeps that base while NEW
    exists) or --full (a copy); or a full copy of a stopped VM's disk. Data volumes are not cloned."""
    body = {"name": new, "start": start, "full": full} | ({"snapshot": snapshot} if snapshot else {})
    return client.post(f"/vms/{vm}/clone", body)
