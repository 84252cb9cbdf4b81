"""Shared fixtures: an orchestrator on a fresh SQLite file, an in-process API, a live `vmplane up`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from vmplane.api.app import create_app
from vmplane.model import Offering, OfferingKind
from vmplane.orchestrator import InlineExecutor, Orchestrator
from vmplane.store import Database

ADMIN_TOKEN = "test-admin-token"
VMPLANE = str(Path(sys.executable).with_name("vmplane"))


@pytest.fixture
def db(tmp_path):
    database = Database(f"sqlite:///{tmp_path / 'vmplane.db'}")
    database.migrate()
    yield database
    database.dispose()


@pytest.fixture
def orch(db):
    o = Orchestrator(db, InlineExecutor())
    o.load()
    o.catalog.create_zone("z1")
    o.catalog.create_cluster("c1", "z1")
    yield o
    o.close()


def add_sim_hosts(o: Orchestrator, count: int, cores: int = 16, memory_mib: int = 65536, cluster: str = "c1",
                  prefix: str = "h") -> list[str]:
    names = [f"{prefix}{i}" for i in range(1, count + 1)]
    for name in names:
        o.add_host(name, cluster, "sim", cores, 2400, memory_mib)
    return names


def add_basics(o: Orchestrator) -> None:
    """Offerings and a template used across tests."""
    o.catalog.create_offering(Offering("small", OfferingKind.fixed, vcpus=1, memory_mib=1024))
    o.catalog.create_offering(Offering("large", OfferingKind.fixed, vcpus=4, memory_mib=16384))
    o.catalog.create_offering(Offering("ranged", OfferingKind.custom_constrained, min_vcpus=1, max_vcpus=4,
                                       min_memory_mib=256, max_memory_mib=8192))
    o.catalog.create_offering(Offering("any", OfferingKind.custom_unconstrained))
    o.catalog.create_template("tiny", "tiny-linux")


def ledger_usage(o: Orchestrator, project: str):
    """A project's ledger, after checking that it equals the usage recomputed from its VMs."""
    u = o.project_usage(project)
    assert u["ledger"] == u["recomputed"]
    return u["ledger"]


@pytest.fixture
def api(orch):
    """An in-process API client with the admin token, on the `orch` fixture."""
    orch.catalog.ensure_admin_token("admin", ADMIN_TOKEN)
    with TestClient(create_app(orch), headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as client:
        yield client


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """`vmplane up --driver sim` in its own process, stopped by its pid."""

    def __init__(self, tmp_path: Path, hosts: int = 3, db_url: str | None = None, driver: str = "sim"):
        self.db_url = db_url or f"sqlite:///{tmp_path / 'live.db'}"
        self.hosts = hosts
        self.driver = driver
        self.home = tmp_path / "home"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / "server.log"
        self.proc: subprocess.Popen | None = None
        self.extra_env: dict[str, str] = {}        # for the server only (e.g. VMPLANE_FAILPOINTS)

    @property
    def env(self) -> dict:
        return {**os.environ, "VMPLANE_API": self.url, "VMPLANE_TOKEN": ADMIN_TOKEN, "VMPLANE_HOME": str(self.home),
                "COLUMNS": "80"}          # the CLI as an 80-column terminal shows it (tables must fit, ids whole)

    def start(self, *extra: str, wait_recovered: bool = True) -> "LiveServer":
        """Start `vmplane up` and wait until it answers /healthz (and, with `wait_recovered`, until its
        start-up recovery, which runs in the background, is done)."""
        self.proc = subprocess.Popen(
            [VMPLANE, "up", "--driver", self.driver, "--hosts", str(self.hosts), "--db", self.db_url,
             "--port", str(self.port), "--token", ADMIN_TOKEN, *extra],
            stdout=open(self.log, "a"), stderr=subprocess.STDOUT, env={**self.env, **self.extra_env})
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vmplane up exited: {self.log.read_text()}")
            try:
                r = httpx.get(self.url + "/healthz", timeout=1)
                if r.status_code == 200 and (not wait_recovered or r.json().get("recovery", {}).get("done", True)):
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"vmplane up did not answer in 180 s: {self.log.read_text()}")

    def stop(self, sig: str = "term") -> None:
        if self.proc is None or self.proc.poll() is not None:
            if self.driver == "libvirt" and sig == "term":
                self.cli("down")       # `up` died without its cleanup (a crash test): stop its hosts
            return
        if sig == "kill":
            self.proc.kill()
        else:
            self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def client(self, timeout: float = 30.0) -> httpx.Client:
        return httpx.Client(base_url=self.url + "/api/v1", timeout=timeout,
                            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})

    def cli(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        return subprocess.run([VMPLANE, *args], env=self.env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def live(tmp_path):
    server = LiveServer(tmp_path).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL server for the session, or a skip that says why there is none."""
    from .pg import Postgres, unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    server = Postgres().start()
    yield server
    server.stop()


_pg_databases = iter(range(1, 10**6))


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """The same test on SQLite and on PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'vmplane.db'}"
    return request.getfixturevalue("postgres").create_database(f"t{next(_pg_databases)}")
