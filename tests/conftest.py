"""Shared fixtures: an orchestrator on a fresh store, an in-process API, a live `vmplane up`.

`pytest --db postgresql` runs the tests on PostgreSQL: every store a fixture or helper makes (tests/stores.py,
`store_url`) is then a fresh database on a PostgreSQL server of the pytest process (of each xdist worker)."""

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
from hypothesis import HealthCheck, settings

from vmplane.core.model import Offering, OfferingKind
from vmplane.orchestrator import InlineExecutor, Orchestrator
from vmplane.server import create_app
from vmplane.store import Database

from . import evidence, stores
from .stores import store_url

# Hypothesis: no per-example deadline (200 ms by default: a wall-clock race on a loaded 2-core machine) and no
# "too slow" health check; a test's own @settings still applies on top
settings.register_profile("vmplane", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("vmplane")

ADMIN_TOKEN = "test-admin-token"
VMPLANE = str(Path(sys.executable).with_name("vmplane"))


def pytest_addoption(parser):
    parser.addoption(
        "--store-suite",
        action="store_true",
        help="only the files that exercise the store hardest (STORE_SUITE): the PostgreSQL pass",
    )
    parser.addoption(
        "--no-guests",
        action="store_true",
        help="leave out the tests that boot real QEMU guests (tests/*_real.py, test_real_guests.py)",
    )
    parser.addoption(
        "--only-guests",
        action="store_true",
        help="only the tests that boot real QEMU guests (the others: --no-guests); with -n 2 --dist "
        "loadfile, two modules at once, each on its own cluster",
    )
    parser.addoption(
        "--seed",
        type=int,
        default=None,
        help="the seed of the fault harnesses (crash, truth, HA): the same seed replays the same fault "
        "schedule and workload; default: each harness's own fixed seed",
    )
    parser.addoption(
        "--db",
        choices=stores.KINDS,
        default="sqlite",
        help="the store every test runs on: sqlite (a file per test, the default) or postgresql "
        "(a fresh database per store on a PostgreSQL server the session starts; the tests that reach "
        "PostgreSQL in every pass run in the default one only)",
    )


def pytest_configure(config):
    stores.kind = config.getoption("--db")


def pytest_unconfigure(config):
    stores.stop()


def pytest_sessionfinish(session, exitstatus):
    """A pass in which some collected test never reported a result fails. With `--dist loadgroup`, xdist
    ran 880 of 1,030 tests and called the pass green: it keys its work by node id, which schemathesis's 152
    cases share (2 ids). So results are counted, one per test: its call, or a setup that did not pass."""
    if hasattr(session.config, "workerinput") or exitstatus != 0 or session.config.option.collectonly:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or not session.testscollected:
        return
    results = sum(
        1
        for reports in reporter.stats.values()
        for r in reports
        if getattr(r, "when", None) == "call" or (getattr(r, "when", None) == "setup" and not r.passed)
    )
    if results < session.testscollected:
        reporter.write_line(
            f"only {results} of the {session.testscollected} tests collected reported a result: "
            f"the others never ran; this pass fails",
            red=True,
            bold=True,
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# What `--store-suite` keeps: the files that exercise the store hardest (admission races, the ledger and
# storage state machines, lifecycle and tokens across processes, events, restarts and recovery, settling,
# HA, listing, the API's errors and authorization, leases): a quick check on PostgreSQL. The README's test
# command runs `--no-guests` there (every test without real guests); `pytest --db postgresql` alone runs
# everything.
STORE_SUITE = {
    "test_concurrency.py",
    "test_ledger.py",
    "test_storage_ledger.py",
    "test_lifecycle.py",
    "test_tokens.py",
    "test_events.py",
    "test_restart.py",
    "test_reconcile.py",
    "test_migration_settle.py",
    "test_ha_sim.py",
    "test_lists.py",
    "test_history.py",
    "test_api_errors.py",
    "test_authorization.py",
    "test_delete_asks_host.py",
    "test_controllers.py",
    "test_admission_batch.py",
    "test_leases.py",
    "test_groups.py",
    "test_storage_sim.py",
    "test_snapshots_sim.py",
    "test_backups_sim.py",
    "test_volume_moves_sim.py",
}


# The fast tier (`pytest -m "not slow" -n 2`, under 5 minutes) leaves out the tests that boot real guests, the
# fault harnesses (those taking `harness_seed`), those marked @pytest.mark.slow in their files, and these (node
# ids up to "::" or "[", or whole files): several processes, PostgreSQL races, browsers, hypothesis state
# machines, `vmplane up` restarts.
SLOW = (
    "test_multiprocess.py",
    "test_review_pg_frozen.py",
    "test_review_migration_multiprocess.py",
    "test_ui_browser.py",
    "test_ledger.py::TestLedgerMachine",
    "test_storage_ledger.py::TestStorageLedgerMachine",
    "test_concurrency.py::test_1000_concurrent_creates_starts_and_scales_never_overrun_tight_quotas",
    "test_concurrency.py::test_200_concurrent_starts_against_a_quota_for_50_start_exactly_50",
    "test_review_sizes_and_hosts.py::test_up_on_libvirt_shares_the_memory_and_host_memory_overrides_it",
    "test_restart.py",
)


def is_slow(item) -> bool:
    node = item.nodeid.split("/")[-1]
    if boots_guests(item) or "harness_seed" in item.fixturenames or item.get_closest_marker("slow") is not None:
        return True
    return any(node == s or node.startswith(s + "::") or node.startswith(s + "[") for s in SLOW)


def on_postgres_anyway(item) -> bool:
    """A test that reaches PostgreSQL in every pass (its `db_url` case, or the `postgres` / `pg_orch` fixtures):
    the default pass runs it already, so the --db postgresql pass leaves it out."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return params.get("db_url") == "postgresql" or bool({"postgres", "pg_orch"} & set(item.fixturenames))


def boots_guests(item) -> bool:
    name = Path(str(item.fspath)).name
    return name.endswith("_real.py") or name == "test_real_guests.py"


def pytest_collection_modifyitems(config, items):
    """With --db postgresql, a test parametrised over both stores (`db_url`) runs its PostgreSQL case only
    (the default pass runs both); with --store-suite, only the files of STORE_SUITE run; with --no-guests,
    none of the tests that boot real guests; with --only-guests, only those."""
    for item in items:
        if is_slow(item) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)
    suite, no_guests, only_guests = (config.getoption(o) for o in ("--store-suite", "--no-guests", "--only-guests"))
    if no_guests and only_guests:
        raise pytest.UsageError("--no-guests and --only-guests exclude each other")
    if not stores.is_postgres() and not no_guests and not only_guests:
        return
    kept, dropped = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        outside = (
            (suite and Path(str(item.fspath)).name not in STORE_SUITE)
            or (no_guests and boots_guests(item))
            or (only_guests and not boots_guests(item))
        )
        other_store = stores.is_postgres() and (params.get("db_url") == "sqlite" or on_postgres_anyway(item))
        (dropped if other_store or outside else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


_running: list[LiveServer] = []  # every `vmplane up` a test started and did not stop yet
# those the running test stopped (in its `finally`, before its report): their files are still on disk
_stopped: list[LiveServer] = []


def pytest_runtest_setup(item):
    _stopped.clear()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test that has a `vmplane up` running (its own, or its module's), or that it stopped in its
    `finally`, keeps its evidence (store, event log, server log, the hosts' logs and domains:
    tests/evidence.py) and names the folder in its failure message."""
    report = yield
    servers = _running + [s for s in _stopped if s not in _running]
    if report.failed and call.when in ("setup", "call") and servers:
        dest = evidence.folder(item.nodeid)
        for index, server in enumerate(servers):
            sub = dest if len(servers) == 1 else dest / f"server{index}"
            sub.mkdir(exist_ok=True)
            try:
                evidence.keep_live(server, sub)
            except Exception as e:  # noqa: BLE001 (say what could not be kept; the failure stays the test's)
                evidence.write(sub, "evidence.error.txt", repr(e))
        if hasattr(report.longrepr, "addsection"):
            report.longrepr.addsection("evidence", f"evidence kept in {dest}")
        else:
            report.longrepr = f"{report.longrepr}\n\nevidence kept in {dest}"
    return report


@pytest.fixture
def harness_seed(request):
    """`--seed N`, or None (the harness's own default)."""
    return request.config.getoption("--seed")


@pytest.fixture(autouse=True)
def _drop_test_databases():
    """On PostgreSQL, the databases a test made (not those of wider fixtures) are dropped after it."""
    mark = stores.mark()
    yield
    stores.drop_since(mark)


@pytest.fixture
def db(tmp_path):
    database = Database(store_url(tmp_path, migrated=True))
    database.migrate()
    yield database
    database.dispose()


@pytest.fixture
def orch(db):
    yield from _orchestrator(db)


@pytest.fixture
def pg_orch(postgres):
    """`orch` on PostgreSQL whatever the pass's store (for row-lock checks: SQLite has none); its URL is
    `pg_orch.db.url`."""
    database = Database(stores.postgres_url(migrated=True))
    yield from _orchestrator(database)
    database.dispose()


def _orchestrator(db):
    o = Orchestrator(db, InlineExecutor())
    o.load()
    o.catalog.create_zone("z1")
    o.catalog.create_cluster("c1", "z1")
    yield o
    o.close()


def add_sim_hosts(
    o: Orchestrator, count: int, cores: int = 16, memory_mib: int = 65536, cluster: str = "c1", prefix: str = "h"
) -> list[str]:
    names = [f"{prefix}{i}" for i in range(1, count + 1)]
    for name in names:
        o.add_host(name, cluster, "sim", cores, 2400, memory_mib)
    return names


def add_basics(o: Orchestrator) -> None:
    """Offerings and a template used across tests."""
    o.catalog.create_offering(Offering("small", OfferingKind.fixed, vcpus=1, memory_mib=1024))
    o.catalog.create_offering(Offering("large", OfferingKind.fixed, vcpus=4, memory_mib=16384))
    o.catalog.create_offering(
        Offering(
            "ranged", OfferingKind.custom_constrained, min_vcpus=1, max_vcpus=4, min_memory_mib=256, max_memory_mib=8192
        )
    )
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
        self.db_url = db_url or store_url(tmp_path, "live.db")
        self.hosts = hosts
        self.driver = driver
        self.home = tmp_path / "home"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / "server.log"
        self.proc: subprocess.Popen | None = None
        self.extra_env: dict[str, str] = {}  # for the server only (e.g. VMPLANE_FAILPOINTS)
        if not self.db_url.startswith("sqlite"):
            # on PostgreSQL the sim hosts are kept in the server's memory: a file instead, so that they
            # survive a restart of the server (and the test process can read them, as beside a SQLite store)
            self.extra_env["VMPLANE_SIM_HOSTS"] = os.environ.get("VMPLANE_SIM_HOSTS") or str(
                tmp_path / "live.db.sim-hosts"
            )

    @property
    def env(self) -> dict:
        return {
            **os.environ,
            "VMPLANE_API": self.url,
            "VMPLANE_TOKEN": ADMIN_TOKEN,
            "VMPLANE_HOME": str(self.home),
            "COLUMNS": "80",
        }  # the CLI as an 80-column terminal shows it (tables must fit, ids whole)

    def start(self, *extra: str, wait_recovered: bool = True) -> LiveServer:
        """Start `vmplane up` and wait until it answers /healthz (and, with `wait_recovered`, until its
        start-up recovery, which runs in the background, is done)."""
        self.proc = subprocess.Popen(
            [
                VMPLANE,
                "up",
                "--driver",
                self.driver,
                "--hosts",
                str(self.hosts),
                "--db",
                self.db_url,
                "--port",
                str(self.port),
                "--token",
                ADMIN_TOKEN,
                *extra,
            ],
            stdout=open(self.log, "a"),  # noqa: SIM115 - the server process keeps it
            stderr=subprocess.STDOUT,
            env={**self.env, **self.extra_env},
        )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vmplane up exited: {self.log.read_text()}")
            try:
                r = httpx.get(self.url + "/healthz", timeout=1)
                if r.status_code == 200 and (not wait_recovered or r.json().get("recovery", {}).get("done", True)):
                    if self not in _running:
                        _running.append(self)
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"vmplane up did not answer in 180 s: {self.log.read_text()}")

    def stop(self, sig: str = "term") -> None:
        if sig == "term" and self in _running:
            _running.remove(self)
            _stopped.append(self)
        if self.proc is None or self.proc.poll() is not None:
            if self.driver == "libvirt" and sig == "term":
                self.cli("down")  # `up` died without its cleanup (a crash test): stop its hosts
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

    def sim_fabric(self):
        """The server's sim hosts, as this process sees them (on PostgreSQL: through its sim hosts file)."""
        from vmplane.hosts.drivers.simfabric import SimFabric

        with stores.env("VMPLANE_SIM_HOSTS", self.extra_env.get("VMPLANE_SIM_HOSTS")):
            return SimFabric.for_store(self.db_url)

    def client(self, timeout: float = 30.0) -> httpx.Client:
        return httpx.Client(
            base_url=self.url + "/api/v1", timeout=timeout, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        )

    def cli(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        r = subprocess.run([VMPLANE, *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0 and '"unreachable"' in r.stdout and self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(
                f"`vmplane {' '.join(args)}`: the server exited ({self.proc.returncode}); the end "
                f"of its log:\n{self.log.read_text(errors='replace')[-6000:]}"
            )
        return r


@pytest.fixture
def live(tmp_path):
    server = LiveServer(tmp_path).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def postgres():
    """The PostgreSQL server of this pytest process (tests/stores.py), or a skip that says why there is none."""
    return stores.server()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """The same test on SQLite and on PostgreSQL (with --db postgresql: its PostgreSQL case only)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'vmplane.db'}"
    request.getfixturevalue("postgres")
    return stores.postgres_url()


def in_process_cli(api, monkeypatch):
    """`run(*args) -> (exit code, output)`: the CLI against the in-process API `api` (a TestClient), with the
    caller's token or the admin's, in a 200-column terminal."""
    from typer.testing import CliRunner

    import vmplane.cli.common as common
    from vmplane.cli import app
    from vmplane.cli.client import Client

    def in_process(base: str, token: str | None, timeout: float = 30.0) -> Client:
        client = Client(base, token, timeout)
        client.http = TestClient(
            api.app, base_url="http://testserver/api/v1", headers={"Authorization": f"Bearer {token or ADMIN_TOKEN}"}
        )
        return client

    monkeypatch.setattr(common, "Client", in_process)

    def run(*args: str):
        result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
        return result.exit_code, result.output

    return run
