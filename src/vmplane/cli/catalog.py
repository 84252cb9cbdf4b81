"""Projects, offerings, templates, settings and tokens."""

from __future__ import annotations

from typing import Optional

import typer

from ..client import Client
from .common import (
    Size,
    api_command,
    groups,
    mib,
)


# -- projects ----------------------------------------------------------------------------------
@api_command(groups["project"], "create")
def project_create(name: str, vcpus: int = typer.Option(..., min=0), memory: Size = None,
                   vms: int = typer.Option(100, min=0), count_overhead: bool = typer.Option(False),
                   max_concurrent_migrations: Optional[int] = typer.Option(None, min=1), *, client: Client):
    if memory is None:
        raise typer.BadParameter("is required", param_hint="--memory")
    return client.post("/projects", {"name": name, "vcpus": vcpus, "memory_mib": mib(memory), "vms": vms,
                                     "count_overhead": count_overhead,
                                     "max_concurrent_migrations": max_concurrent_migrations})


@api_command(groups["project"], "quota")
def project_quota(name: str, vcpus: Optional[int] = typer.Option(None, min=0), memory: Size = None,
                  vms: Optional[int] = typer.Option(None, min=0),
                  count_overhead: Optional[bool] = typer.Option(None, "--count-overhead/--no-count-overhead"),
                  max_concurrent_migrations: Optional[int] = typer.Option(None, min=0), *, client: Client):
    """Change a project's quota (lowering below usage is refused)."""
    body = {"vcpus": vcpus, "memory_mib": mib(memory), "vms": vms, "count_overhead": count_overhead,
            "max_concurrent_migrations": max_concurrent_migrations}
    return client.call("PATCH", f"/projects/{name}/quota", json={k: v for k, v in body.items() if v is not None})


@api_command(groups["project"], "usage")
def project_usage(name: str, client: Client):
    u = client.get(f"/projects/{name}/usage")
    return u


@api_command(groups["project"], "list")
def project_list(client: Client):
    return client.get("/projects"), ["name", "quota", "usage", "count_overhead"], "projects"


@api_command(groups["project"], "show")
def project_show(name: str, client: Client):
    return client.get(f"/projects/{name}")


# -- offerings and templates -------------------------------------------------------------------
@api_command(groups["offering"], "create")
def offering_create(name: str, kind: str = typer.Option(..., help="fixed, custom-constrained, custom-unconstrained"),
                    vcpus: Optional[int] = typer.Option(None), memory: Size = None,
                    min_vcpus: Optional[int] = typer.Option(None), max_vcpus: Optional[int] = typer.Option(None),
                    min_memory: Size = None, max_memory: Size = None,
                    cpu_speed: Optional[int] = typer.Option(None, help="MHz per vCPU"),
                    cpu_cap: bool = typer.Option(False), dynamic_scaling: bool = typer.Option(False),
                    *, client: Client):
    body = {"name": name, "kind": kind, "vcpus": vcpus, "memory_mib": mib(memory), "min_vcpus": min_vcpus,
            "max_vcpus": max_vcpus, "min_memory_mib": mib(min_memory, "--min-memory"),
            "max_memory_mib": mib(max_memory, "--max-memory"),
            "cpu_speed_mhz": cpu_speed, "cpu_cap": cpu_cap, "dynamic_scaling": dynamic_scaling}
    return client.post("/offerings", {k: v for k, v in body.items() if v is not None})


@api_command(groups["offering"], "list")
def offering_list(client: Client):
    return client.get("/offerings"), ["name", "kind", "vcpus", "memory_mib", "min_vcpus", "max_vcpus",
                                      "min_memory_mib", "max_memory_mib", "cpu_cap", "dynamic_scaling"], "offerings"


@api_command(groups["offering"], "show")
def offering_show(name: str, client: Client):
    return client.get(f"/offerings/{name}")


@api_command(groups["template"], "create")
def template_create(name: str, image: str = typer.Option(...), dynamically_scalable: bool = typer.Option(False),
                    *, client: Client):
    return client.post("/templates", {"name": name, "image": image, "dynamically_scalable": dynamically_scalable})


@api_command(groups["template"], "list")
def template_list(client: Client):
    return client.get("/templates"), ["name", "image", "dynamically_scalable"], "templates"


@api_command(groups["template"], "show")
def template_show(name: str, client: Client):
    return client.get(f"/templates/{name}")


# -- settings ----------------------------------------------------------------------------------
def _scope(zone: Optional[str], cluster: Optional[str]) -> tuple[str, Optional[str]]:
    if zone and cluster:
        raise typer.BadParameter("give --zone or --cluster, not both")
    return ("zone", zone) if zone else ("cluster", cluster) if cluster else ("global", None)


@api_command(groups["setting"], "set")
def setting_set(key: str, value: str, zone: Optional[str] = typer.Option(None),
                cluster: Optional[str] = typer.Option(None), *, client: Client):
    scope, scope_name = _scope(zone, cluster)
    return client.call("PUT", f"/settings/{key}", json={"value": value, "scope": scope, "scope_name": scope_name})


@api_command(groups["setting"], "get")
def setting_get(key: str, zone: Optional[str] = typer.Option(None), cluster: Optional[str] = typer.Option(None),
                *, client: Client):
    scope, scope_name = _scope(zone, cluster)
    return client.get(f"/settings/{key}", scope=scope, scope_name=scope_name)


@api_command(groups["setting"], "list")
def setting_list(client: Client):
    return client.get("/settings"), ["key", "default", "narrowest_scope", "values"], "settings"


@api_command(groups["token"], "create")
def token_create(name: str, role: str = typer.Option("member", help="admin or member"),
                 project: Optional[str] = typer.Option(None), *, client: Client):
    """Create an API token; its clear text is shown once."""
    return client.post("/tokens", {"name": name, "role": role, "project": project})
