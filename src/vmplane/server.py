"""Builds the running control plane (database, orchestrator, API) and the local cluster of `vmplane up`."""

from __future__ import annotations

import faulthandler
import logging
import os
import secrets
import signal
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from sqlalchemy import update

from vmplane.api.app import create_api
from vmplane.core.errors import Invalid, NotFound
from vmplane.core.names import local_pool_name
from vmplane.hosts import localhosts
from vmplane.hosts.guest import build as guest
from vmplane.orchestrator import Orchestrator
from vmplane.plane.membership import DEFAULT_LEASE_S
from vmplane.store import Database
from vmplane.store.schema import Host
from vmplane.ui import install as install_console

DEFAULT_PORT = 8470
UP_ZONE, UP_CLUSTER = "zone1", "cluster1"
UP_SHARED_POOL = "shared"
UP_TOKEN_NAME = "up-admin"
SIM_HOST = {"cores": 16, "cpu_mhz": 2400, "memory_mib": 65536}
DEFAULT_FORWARDED_ALLOW_IPS = "127.0.0.1"  # a proxy on this machine; `--forwarded-allow-ips` names others


def default_db_url() -> str:
    return f"sqlite:///{home() / 'vmplane.db'}"


@dataclass
class ControlPlane:
    db: Database
    orchestrator: Orchestrator
    app: FastAPI

    def close(self) -> None:
        self.orchestrator.close()
        self.db.dispose()


def build(
    db_url: str | None = None,
    recover: bool = True,
    name: str | None = None,
    lease_s: float = DEFAULT_LEASE_S,
    api_url: str | None = None,
    insecure_cookies: bool = False,
) -> ControlPlane:
    """The control plane of a store; its start-up recovery runs in the background (the API answers at
    once; /healthz shows what is still recovered), or, with `recover=False`, when the caller says
    (`orchestrator.recovery.run(background=True)`: `vmplane up` once its local hosts run). `name`: this
    process among the control planes of the store (controllers.py; a restart under the same name takes
    over its previous incarnation's work at once). `insecure_cookies`: create_app."""
    db = Database(db_url or default_db_url())
    db.migrate()
    orch = Orchestrator(db, name=name, lease_s=lease_s, api_url=api_url)
    orch.load(background=True, recover=recover)
    orch.start_monitor()
    return ControlPlane(db, orch, create_app(orch, insecure_cookies=insecure_cookies))


def create_app(orch: Orchestrator, insecure_cookies: bool = False) -> FastAPI:
    """The REST API (api/app.create_api) with the web console at /ui: same process, same rules.
    `insecure_cookies`: the console's session cookie may go over plain http from any client (`vmplane
    serve --insecure-cookies`; ui/consolesessions.py), not only to a browser on this machine."""
    app = create_api(orch, insecure_cookies=insecure_cookies)
    install_console(app)
    return app


def home() -> Path:
    return Path(os.environ.get("VMPLANE_HOME", Path.home() / ".vmplane"))


def hosts_dir() -> Path:
    return home() / "hosts"


def local_host_memory(hosts: int, driver: str, asked_mib: int | None = None) -> int:
    """The memory each host of `vmplane up` reports. libvirt hosts share this machine: together at most its
    memory less the control plane's reserve, split evenly unless `--host-memory` says (localhosts.py);
    Invalid naming `host_memory` when asked for more. Simulated hosts are the size asked (default 64 GiB)."""
    if driver != "libvirt":
        return asked_mib or SIM_HOST["memory_mib"]
    try:
        return localhosts.host_memory_mib(localhosts.machine_memory_mib(), hosts, asked_mib)
    except ValueError as exc:
        raise Invalid(str(exc), field="host_memory") from None


def set_host_memory(orch: Orchestrator, name: str, memory_mib: int) -> None:
    """Record the memory a host offers (a local host's share of the machine) and rebuild the capacity
    index from the store."""
    with orch.db.write() as s:
        s.execute(update(Host).where(Host.name == name).values(memory_mib=memory_mib))
    orch.rebuild_index()


def prepare_local_cluster(orch: Orchestrator, hosts: int, driver: str, host_memory_mib: int | None = None) -> list[str]:
    """Zone, cluster, the `tiny-linux` template and `hosts` hosts for `vmplane up`: simulated ones, or
    libvirtd daemons started on this machine (adopted when already running). Restart-safe: what
    exists is kept, each host's memory set to its share again (local_host_memory)."""
    memory_mib = local_host_memory(hosts, driver, host_memory_mib)
    cat = orch.catalog
    if UP_ZONE not in {z.name for z in cat.zones()}:
        cat.create_zone(UP_ZONE)
    if UP_CLUSTER not in {c.name for c in cat.clusters()}:
        cat.create_cluster(UP_CLUSTER, UP_ZONE)
    if guest.IMAGE_NAME not in {t.name for t in cat.templates()}:  # the test guest, with a root disk
        cat.create_template(guest.IMAGE_NAME, guest.IMAGE_NAME, dynamic_scaling=True, disk=guest.IMAGE_NAME)
    prefix = "lv" if driver == "libvirt" else "sim"
    names = []
    for i in range(1, hosts + 1):
        name = f"{prefix}{i}"
        local = None
        if driver == "libvirt":
            local = localhosts.start(hosts_dir(), name, i - 1, netns=localhosts.netns_available())
        try:
            host = orch.host(name)
        except NotFound:
            if local is not None:
                host = orch.add_host(name, UP_CLUSTER, "libvirt", uri=local.uri, migration_address=local.address)
            else:
                host = orch.add_host(
                    name, UP_CLUSTER, "sim", SIM_HOST["cores"], SIM_HOST["cpu_mhz"], memory_mib=memory_mib
                )
        if host.memory_mib != memory_mib and (driver == "libvirt" or host_memory_mib is not None):
            set_host_memory(orch, name, memory_mib)
        names.append(name)
    _prepare_pools(orch, names)
    if driver == "libvirt":
        guest.build()  # once per machine; the first VM would otherwise wait for it
    return names


def _prepare_pools(orch: Orchestrator, hosts: list[str]) -> None:
    """A local pool on each host (`local-HOST`, its own folder) and one shared pool for the cluster."""
    existing = {p.name for p in orch.pools.rows()}
    for name in hosts:
        if local_pool_name(name) not in existing:
            orch.pools.create(local_pool_name(name), "local", host=name)
    if UP_SHARED_POOL not in existing and hosts:
        orch.pools.create(UP_SHARED_POOL, "shared", cluster=UP_CLUSTER)


def choose_driver(requested: str) -> tuple[str, str]:
    """(driver, why): libvirt when asked or when `auto` finds it usable here, else sim."""
    if requested == "sim":
        return "sim", "simulated hosts, as asked"
    reason = localhosts.available()
    if requested == "libvirt":
        if reason:
            raise Invalid(f"libvirt hosts can not run here: {reason}", field="driver")
        return "libvirt", "libvirtd hosts on this machine, as asked"
    if requested == "auto":
        if reason:
            return "sim", f"simulated hosts ({reason}; scripts/setup.sh installs libvirt as root)"
        return "libvirt", "libvirtd hosts on this machine (libvirt found)"
    raise Invalid(f"unknown driver {requested!r}; use auto, libvirt or sim", field="driver")


def lock_home() -> object:
    """One `vmplane up` per VMPLANE_HOME: a second one would fight the first over its hosts."""
    import fcntl

    home().mkdir(parents=True, exist_ok=True)
    handle = open(home() / "up.lock", "w")  # noqa: SIM115 - held open for the life of `vmplane up`
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise Invalid(
            f"another `vmplane up` is running with VMPLANE_HOME={home()}; stop it first or use another VMPLANE_HOME",
            field="VMPLANE_HOME",
        ) from None
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def stop_local_hosts() -> list[str]:
    return localhosts.stop_all(hosts_dir())


def _exit(signum, frame):
    raise SystemExit(0)


def exit_on_sigterm() -> None:
    """SIGTERM ends the process through `finally` blocks (so what was started is stopped)."""
    signal.signal(signal.SIGTERM, _exit)


def serve(app: FastAPI, host: str, port: int, forwarded_allow_ips: str | None = None) -> None:
    """Serve until SIGINT/SIGTERM. uvicorn shuts down gracefully, restores the previous handlers and
    raises the signal again: SIGTERM's handler then exits through the callers' `finally` blocks, so
    `vmplane up` stops what it started. `forwarded_allow_ips`: the proxies (comma-separated addresses or
    networks, `*` for any) whose X-Forwarded-Proto and X-Forwarded-For are believed (the request's
    scheme decides the console cookie's Secure flag); default 127.0.0.1, uvicorn's."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    faulthandler.enable()  # a crash in C (libvirt's client, a driver) leaves every thread's stack in the log
    exit_on_sigterm()
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        proxy_headers=True,
        forwarded_allow_ips=forwarded_allow_ips or DEFAULT_FORWARDED_ALLOW_IPS,
    )


def new_token() -> str:
    return secrets.token_urlsafe(32)
