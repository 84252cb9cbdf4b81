"""Shared CLI plumbing: the Typer app and its groups, output options, API-command wrapper, waiting."""
from __future__ import annotations

import enum
import functools
import inspect
from typing import Annotated, Optional

import typer

from ..client import ApiError, Client
from ..output import console, error, render
from ..units import parse_mib

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

