"""Builds the running control plane (database, orchestrator, API) and the local cluster of `vmplane up`."""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from .api.app import create_app
from .errors import NotFound
from .orchestrator import Orchestrator
from .store import Database

DEFAULT_PORT = 8470
UP_ZONE, UP_CLUSTER = "zone1", "cluster1"
UP_TOKEN_NAME = "up-admin"
SIM_HOST = {"cores": 16, "cpu_mhz": 2400, "memory_mib": 65536}


def default_db_url() -> str:
    home = Path(os.environ.get("VMPLANE_HOME", Path.home() / ".vmplane"))
    return f"sqlite:///{home / 'vmplane.db'}"


@dataclass
class ControlPlane:
    db: Database
    orchestrator: Orchestrator
    app: FastAPI

    def close(self) -> None:
        self.orchestrator.close()
        self.db.dispose()


def build(db_url: str | None = None) -> ControlPlane:
    db = Database(db_url or default_db_url())
    db.migrate()
    orch = Orchestrator(db)
    orch.load()
    return ControlPlane(db, orch, create_app(orch))


def prepare_local_cluster(orch: Orchestrator, hosts: int, driver: str) -> list[str]:
    """Zone, cluster and `hosts` hosts for `vmplane up`; existing ones are kept (restart-safe)."""
    cat = orch.catalog
    if UP_ZONE not in {z.name for z in cat.zones()}:
        cat.create_zone(UP_ZONE)
    if UP_CLUSTER not in {c.name for c in cat.clusters()}:
        cat.create_cluster(UP_CLUSTER, UP_ZONE)
    names = []
    for i in range(1, hosts + 1):
        name = f"{driver}{i}"
        try:
            orch.host(name)
        except NotFound:
            orch.add_host(name, UP_CLUSTER, driver, **SIM_HOST)
        names.append(name)
    return names


def choose_driver(requested: str) -> tuple[str, str]:
    """(driver, why). The libvirt driver is not part of this build yet, so auto means sim."""
    if requested in ("auto", "sim"):
        return "sim", "simulated hosts (libvirt hosts are not available in this build)" if requested == "auto" \
            else "simulated hosts, as asked"
    raise NotFound(f"driver {requested!r} is not available in this build; use sim", field="driver")


def serve(app: FastAPI, host: str, port: int) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)


def new_token() -> str:
    return secrets.token_urlsafe(32)
