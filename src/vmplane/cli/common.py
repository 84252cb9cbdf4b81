"""Shared CLI plumbing: the Typer app and its groups, output options, API-command wrapper, waiting."""

from __future__ import annotations

import datetime as dt
import enum
import functools
import inspect
import re
import time
import typing
from typing import Annotated, NoReturn

import typer

from vmplane.cli.client import ApiError, Client
from vmplane.cli.output import Col, err_console, error, note, render
from vmplane.core.units import parse_mib

app = typer.Typer(
    help="vmplane: a control plane for KVM clusters.", no_args_is_help=True, pretty_exceptions_enable=False
)
groups = {
    name: typer.Typer(help=text, no_args_is_help=True)
    for name, text in [
        ("zone", "Zones."),
        ("cluster", "Clusters of hosts."),
        ("host", "Hypervisor hosts."),
        ("project", "Projects (tenants) and their quotas."),
        ("offering", "Compute offerings."),
        ("template", "Guest images."),
        ("setting", "Settings at global, zone or cluster scope."),
        ("vm", "Virtual machines."),
        ("operation", "Asynchronous operations."),
        ("token", "API tokens."),
        ("migration", "Live migrations."),
        ("pool", "Storage pools (local to a host, or shared by a cluster)."),
        ("volume", "Volumes: disks that outlive their VM."),
    ]
}
maintenance_app = typer.Typer(help="Drain a host by live migration, or enable it again.", no_args_is_help=True)
groups["host"].add_typer(maintenance_app, name="maintenance")
for _name, _group in groups.items():
    app.add_typer(_group, name=_name)


def _version(show: bool) -> None:
    if show:
        from vmplane import __version__

        typer.echo(f"vmplane {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_version, help="print the version and exit"
    ),
) -> None:
    """vmplane: a control plane for KVM clusters."""


DEFAULT_API = "http://127.0.0.1:8470"


class OutputFormat(str, enum.Enum):
    table = "table"
    json = "json"


Output = typer.Option(OutputFormat.table, "--output", "-o", help="table or json")
ApiOption = typer.Option(DEFAULT_API, envvar="VMPLANE_API", help="API base URL (VMPLANE_API)")
TokenOption = typer.Option(None, envvar="VMPLANE_TOKEN", help="bearer token (VMPLANE_TOKEN)")
Wide = typer.Option(False, "--wide", help="every field, not only the columns that fit 80 characters")


def mib(value: str | None, option: str = "--memory") -> int | None:
    """A size option in MiB; a bad size is a usage error naming the option (exit code 2)."""
    if value is None:
        return None
    try:
        return parse_mib(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=option) from None


# The one rule of sizes, for every size flag (units.parse_mib; the API's *_mib fields are MiB too)
SIZE_RULE = "512MiB, 16GiB, 1TiB, or a plain number of MiB"


def size_help(what: str) -> str:
    """A size flag's help: what it sizes, then the one rule."""
    return f"{what}: {SIZE_RULE}"


Size = Annotated[str | None, typer.Option(help=SIZE_RULE, metavar="SIZE")]


# API field names as the CLI's flags, for errors (`memory_mib: field required` -> `--memory: field required`)
FLAGS = {
    "memory_mib": "--memory",
    "min_memory_mib": "--min-memory",
    "max_memory_mib": "--max-memory",
    "cpu_cap": "--cpu-cap",
    "cpu_speed_mhz": "--cpu-speed",
    "dynamic_scaling": "--dynamic-scaling",
    "dynamically_scalable": "--dynamic-scaling",
    "min_vcpus": "--min-vcpus",
    "max_vcpus": "--max-vcpus",
    "max_concurrent_migrations": "--max-concurrent-migrations",
    "count_overhead": "--count-overhead",
    "cpu_mhz": "--mhz",
    "dry_run": "--dry-run",
    "scope_name": "--zone/--cluster",
    "bandwidth_mib_s": "--bandwidth",
    "max_downtime_ms": "--max-downtime",
    "timeout_s": "--timeout",
}


_FIELD_WORD = re.compile(r"(?<![\w.-])(" + "|".join(sorted(FLAGS, key=len, reverse=True)) + r")(?![\w-])")


def in_cli_words(body: dict) -> dict:
    """An API error as the CLI says it: only a refused input (422 `invalid`) whose field is a flag speaks in
    flags (its field, and the input fields its message names). Anything else (a quota, a conflict, a
    setting, a sort key) keeps the API's words: its field did not come from a flag."""
    out = dict(body)
    field = out.get("field")
    if out.get("error") != "invalid" or field not in FLAGS:
        return out
    out["field"] = FLAGS[field]
    if isinstance(out.get("message"), str):
        out["message"] = _FIELD_WORD.sub(lambda m: FLAGS[m.group(1)], out["message"])
    return out


def fail(exc: ApiError, output: str) -> NoReturn:
    error(in_cli_words(exc.body), output)
    raise typer.Exit(1)


def api_command(group: typer.Typer, name: str, lists: bool = False, **kwargs):
    """Register a command that talks to the API: adds --output/--api/--token (and --wide for lists)
    and maps API errors. The function returns the data, or (data, columns, title[, caption])."""

    def wrap(fn):
        sig = inspect.signature(fn)
        extra = [
            inspect.Parameter("output", inspect.Parameter.KEYWORD_ONLY, default=Output, annotation=OutputFormat),
            inspect.Parameter("api", inspect.Parameter.KEYWORD_ONLY, annotation=str, default=ApiOption),
            inspect.Parameter("token", inspect.Parameter.KEYWORD_ONLY, annotation=str | None, default=TokenOption),
        ]
        if lists:
            extra.append(inspect.Parameter("wide", inspect.Parameter.KEYWORD_ONLY, annotation=bool, default=Wide))
        wants_output = "output" in sig.parameters  # the command reads --output itself
        wants_wide = lists and "wide" in sig.parameters  # ... or --wide
        # the annotations resolved in the command's own module (they are strings there, `from __future__ import
        # annotations`): typer would read them in this module's and lose an Annotated option's help and metavar
        hints = typing.get_type_hints(fn, include_extras=True)
        params = [
            p.replace(annotation=hints.get(p.name, p.annotation))
            for p in sig.parameters.values()
            if p.name not in ("client", "output", "wide")
        ] + extra

        @functools.wraps(fn)
        def run(*args, output: OutputFormat, api: str, token: str | None, wide: bool = False, **kw):
            fmt = OutputFormat(output).value
            client = Client(api, token)
            if wants_output:
                kw["output"] = fmt
            if wants_wide:
                kw["wide"] = wide
            try:
                result = fn(*args, client=client, **kw)
            except ApiError as exc:
                fail(exc, fmt)
            if result is not None:
                data, columns, title, caption = (
                    (tuple(result) + (None,))[:4] if isinstance(result, tuple) else (result, None, None, None)
                )
                render(data, fmt, columns, title, wide=wide, caption=caption)

        run.__signature__ = sig.replace(parameters=params)
        # Typer reads annotations too: the command's own `output: str` must not override the option's type
        run.__annotations__ = {k: v for k, v in fn.__annotations__.items() if k not in ("client", "output", "wide")}
        return group.command(name, **kwargs)(run)

    return wrap


HOST_COLUMNS = [
    "name",
    "cluster",
    "state",
    Col("vcpus", lambda r: f"{r['used_vcpus']}/{r['vcpus_capacity']}"),
    Col("memory MiB", lambda r: f"{r['used_memory_mib']}/{r['memory_capacity_mib']}"),
]
VM_COLUMNS = ["name", "project", "state", "host", "vcpus", Col("memory MiB", "memory_mib"), "offering"]


def local_time(iso: str | None, fmt: str = "%Y-%m-%d %H:%M:%S %Z") -> str:
    """An API timestamp (UTC) in this machine's time zone, with the zone said; "-" for none."""
    if not iso:
        return "-"
    try:
        return dt.datetime.fromisoformat(iso).astimezone().strftime(fmt)
    except ValueError:
        return iso


# What fits 80 columns beside a whole 36-character id (the others wrap, never cut); `--wide` shows every
# field, `show` one object.
OP_COLUMNS = [
    "id",
    "kind",
    Col("on", lambda r: r.get("vm") or r.get("host") or r.get("target")),
    Col("state", lambda r: r["state"] + (f" {r['progress']}%" if r["state"] in ("pending", "running") else "")),
    Col(
        "asked",
        lambda r: (
            f"{local_time(r.get('created_at'), '%m-%d %H:%M')} by "
            f"{(r.get('requested_by') or '?').removeprefix('user ')}"
        ),
    ),
]
MIGRATION_COLUMNS: list[str | Col] = ["id", "vm", "source", "target", "state", Col("%", "progress")]


def migration_note(m: dict) -> str | None:
    """What a migration waits for, or why it failed: printed under a migration table."""
    if m.get("state") == "postcopy-failed":  # needs an operator's eye: why, and what vmplane does
        return f"{vm_of(m)}: postcopy-failed: {m.get('reason')}; {m.get('waiting_for') or ''}".rstrip("; ")
    if m.get("waiting_for"):
        return f"{vm_of(m)}: waits for {m['waiting_for']}"
    if m.get("state") in ("failed", "cancelled", "moved-unhealthy") and m.get("reason"):
        return f"{vm_of(m)}: {m['state']}: {m['reason']}"
    return None


DONE = ("succeeded", "failed", "cancelled", "moved-unhealthy")
STOP_WAITING = DONE + ("postcopy-failed",)  # a failed post-copy needs an operator: waiting ends there


def vm_of(migration: dict) -> str:
    return migration.get("vm") or migration.get("vm_name") or "?"


def still_running(what: str, how_to_cancel: str | None = None) -> NoReturn:
    """Ctrl-C while waiting: the work goes on without us; say so and how to act on it."""
    tail = f"; to cancel: {how_to_cancel}" if how_to_cancel else ""
    note(f"stopped waiting; {what} goes on{tail}")
    raise typer.Exit(130)


def follow_migrations(client: Client, ids: list[str], output: str, timeout_s: float = 3600) -> list[dict]:
    """Wait for migrations to end, with a progress bar per VM on stderr (plain polling for --output json).
    Ctrl-C stops the waiting, not the migrations."""
    from rich.progress import BarColumn, Progress, TextColumn

    deadline = time.monotonic() + timeout_s
    rows: list[dict] = []
    try:
        with Progress(
            TextColumn("{task.fields[vm]:<16}"),
            BarColumn(),
            TextColumn("{task.percentage:>3.0f}%"),
            TextColumn("{task.fields[status]}"),
            console=err_console,
            disable=output == "json",
        ) as bar:
            tasks = {i: bar.add_task("", total=100, vm=i[:8], status="") for i in ids}
            while True:
                rows = [client.get(f"/migrations/{i}") for i in ids]
                for r in rows:
                    status = (
                        r["state"]
                        + (f": {r['waiting_for']}" if r.get("waiting_for") else "")
                        + (f" ({r['reason']})" if r["state"] in ("failed", "cancelled", "postcopy-failed") else "")
                    )
                    bar.update(
                        tasks[r["id"]], completed=r["progress"], vm=f"{vm_of(r)} -> {r['target']}", status=status[:70]
                    )
                if all(r["state"] in STOP_WAITING for r in rows) or time.monotonic() > deadline:
                    return rows
                time.sleep(0.2)
    except KeyboardInterrupt:
        pending = [r for r in rows if r["state"] not in DONE] or [{"id": i} for i in ids]
        names = ", ".join(f"{r['id']} ({vm_of(r)})" if "state" in r else r["id"] for r in pending)
        cancel = " / ".join(f"vmplane vm migrate {vm_of(r)} --cancel" for r in pending if "state" in r)
        still_running(f"migration {names}", cancel or None)


# -- lists: filters, paging and sorting are the server's -------------------------------------------
def Limit(default: int | None = None):  # noqa: N802 (an option, as typer.Option)
    return typer.Option(default, min=1, max=1000, help="show at most this many (the server's default is 100)")


Offset = typer.Option(None, min=0, help="skip this many first")
Sort = typer.Option(None, help="the field to sort by; -FIELD for descending", metavar="FIELD")


def listed(client: Client, path: str, noun: str, columns, **params) -> tuple:
    """(rows, columns, title, caption) for api_command; the caption says when the page is not all."""
    rows, total = client.get_list(path, **params)
    if not rows and total:
        noun = f"{noun} at this offset ({total} in all)"
    caption = (
        f"showing {len(rows)} of {total} (use --limit/--offset)" if total is not None and total > len(rows) else None
    )
    return rows, columns, noun, caption
