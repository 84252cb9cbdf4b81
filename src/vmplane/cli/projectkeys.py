"""`vmplane project key add|list|remove`: a project's SSH keys, put in its new VMs' cloud-init seeds."""

from __future__ import annotations

from pathlib import Path

import typer

from vmplane.cli.client import Client
from vmplane.cli.common import api_command, groups
from vmplane.cli.output import note

key_app = typer.Typer(help="A project's SSH keys: in the cloud-init seed of every VM it creates.", no_args_is_help=True)
groups["project"].add_typer(key_app, name="key")
KEY_COLUMNS = ["name", "key", "created_at"]


@api_command(key_app, "add")
def key_add(
    project: str,
    name: str,
    file: Path = typer.Argument(..., exists=True, help="an OpenSSH .pub file"),
    *,
    client: Client,
):
    """Add a key (VMs made before keep their seed)."""
    return client.post(f"/projects/{project}/keys", {"name": name, "key": file.read_text().strip()})


@api_command(key_app, "list", lists=True)
def key_list(project: str, client: Client):
    """The project's keys."""
    return client.get(f"/projects/{project}/keys"), KEY_COLUMNS, "keys"


@api_command(key_app, "remove")
def key_remove(project: str, name: str, client: Client):
    """Remove a key (VMs made before keep it in their seed)."""
    client.call("DELETE", f"/projects/{project}/keys/{name}")
    note(f"key {name} removed from project {project}")
