"""Several control-plane processes on one PostgreSQL store, for tests/test_multiprocess.py: the first is
`vmplane up --driver sim` (it makes the zone, cluster, sim hosts and template), the others `vmplane serve`,
all with a short lease and one sim-hosts file; optionally all through PgBouncer in transaction pooling
mode. Every process is stopped by its pid; PgBouncer too."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from .conftest import ADMIN_TOKEN, VMPLANE, free_port


class Process:
    def __init__(self, tmp: Path, index: int, db_url: str, lease_s: float, env: dict[str, str], hosts: int):
        self.index, self.db_url, self.lease_s, self.hosts = index, db_url, lease_s, hosts
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = f"plane-{index}"
        self.log = tmp / f"plane-{index}.log"
        self.env = env
        self.proc: subprocess.Popen | None = None

    def start(self) -> Process:
        common = ["--db", self.db_url, "--port", str(self.port), "--token", ADMIN_TOKEN, "--lease", str(self.lease_s)]
        if self.index == 0:
            cmd = [VMPLANE, "up", "--driver", "sim", "--hosts", str(self.hosts), "--name", self.name, *common]
        else:
            cmd = [VMPLANE, "serve", "--name", self.name, *common]
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "a"), stderr=subprocess.STDOUT, env=self.env)  # noqa: SIM115 (the child holds it)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log.read_text()}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} did not answer in 120 s: {self.log.read_text()}")

    def client(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(
            base_url=self.url + "/api/v1", timeout=timeout, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        )

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stopped_by_itself(self, timeout: float = 30.0) -> bool:
        """Wait until the process is stopped (state T: a failpoint's SIGSTOP) or gone."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return True
            try:
                state = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                return True
            if state in ("T", "t"):
                return True
            time.sleep(0.02)
        return False

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


class PgBouncer:
    """PgBouncer in transaction pooling mode in front of the test's PostgreSQL server, as its user."""

    def __init__(self, tmp: Path, postgres):
        self.binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        # a folder its user can reach (pytest's are private to root), removed by stop()
        self.dir = Path(tempfile.mkdtemp(prefix="vmplane-pgbouncer-"))
        self.port = free_port()
        self.postgres = postgres
        self.proc: subprocess.Popen | None = None

    @staticmethod
    def available() -> str | None:
        if not (shutil.which("pgbouncer") or os.path.exists("/usr/sbin/pgbouncer")):
            return "pgbouncer is not installed (scripts/setup.sh --test installs it)"
        return None

    def start(self) -> PgBouncer:
        user = self.postgres.user
        (self.dir / "users.txt").write_text(f'"{user}" ""\n')
        (self.dir / "pgbouncer.ini").write_text(f"""[databases]
* = host={self.postgres.sock} port={self.postgres.port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = trust
auth_file = {self.dir}/users.txt
pool_mode = transaction
max_client_conn = 1000
default_pool_size = 40
ignore_startup_parameters = extra_float_digits,options
logfile = {self.dir}/pgbouncer.log
""")
        os.chmod(self.dir, 0o755)
        if os.geteuid() == 0:
            shutil.chown(self.dir, user)
        cmd = [self.binary, str(self.dir / "pgbouncer.ini")]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", user, "--"] + cmd
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(self.dir / "stderr", "w"))  # noqa: SIM115 (the child holds it)
        deadline = time.monotonic() + 20
        import socket

        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pgbouncer exited: {(self.dir / 'stderr').read_text()}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.1)
        raise RuntimeError("pgbouncer did not listen in 20 s")

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://{self.postgres.user}@127.0.0.1:{self.port}/{database}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)


class Planes:
    """N control-plane processes on one store."""

    def __init__(
        self,
        tmp: Path,
        db_url: str,
        count: int = 4,
        lease_s: float = 3.0,
        hosts: int = 6,
        failpoints: dict[int, str] | None = None,
        extra_env: dict[str, str] | None = None,
    ):
        base = {
            **os.environ,
            "VMPLANE_HOME": str(tmp / "home"),
            "VMPLANE_SIM_HOSTS": str(tmp / "sim-hosts"),
            **(extra_env or {}),
        }
        base.pop("VMPLANE_FAILPOINTS", None)
        self.processes = []
        for i in range(count):
            env = dict(base)
            if failpoints and i in failpoints:
                env["VMPLANE_FAILPOINTS"] = failpoints[i]
            self.processes.append(Process(tmp, i, db_url, lease_s, env, hosts))
        self.lease_s = lease_s

    def start(self) -> Planes:
        self.processes[0].start()  # `up` makes the cluster; then the others join
        for p in self.processes[1:]:
            p.start()
        return self

    def __getitem__(self, i: int) -> Process:
        return self.processes[i]

    def alive(self) -> list[Process]:
        return [p for p in self.processes if p.proc is not None and p.proc.poll() is None]

    def controllers(self, via: Process | None = None) -> list[dict]:
        with (via or self.alive()[0]).client() as c:
            return c.get("/controllers").json()

    def logs(self, lines: int = 40) -> str:
        """The last lines of each process's log (for a failure's message)."""
        return "\n".join(
            f"--- {p.name}\n" + "\n".join(p.log.read_text(errors="replace").splitlines()[-lines:])
            for p in self.processes
            if p.log.exists()
        )

    def stop(self) -> None:
        for p in reversed(self.processes):
            p.stop()


STORM_STOPPED = 30  # stopped VMs per storm project, NAME-s0.., which the storm starts and scales


def storm_projects(
    c: httpx.Client, quotas: dict[str, tuple[int, int, int]], stopped_per_project: int = STORM_STOPPED
) -> None:
    """The storm's projects (quotas: vCPUs, MiB, VMs; q2 counts overhead), each with stopped VMs
    `NAME-s0..` of offering `one` to start or scale."""
    for name, (vcpus, memory, vms) in quotas.items():
        c.post(
            "/projects",
            json={"name": name, "vcpus": vcpus, "memory_mib": memory, "vms": vms, "count_overhead": name == "q2"},
        ).raise_for_status()
        for i in range(stopped_per_project):
            c.post("/vms", json={"name": f"{name}-s{i}", "project": name, "offering": "one", "template": "t"})


def storm_requests(count: int = 1000, stopped: int = STORM_STOPPED) -> list[tuple[str, str, dict | None]]:
    """The storm's mix over projects q1..q3: a quarter creates with start, a quarter starts of the stopped
    VMs, half live scale-ups to offering `two`."""
    requests: list[tuple[str, str, dict | None]] = []
    for i in range(count):
        project = ("q1", "q2", "q3")[i % 3]
        kind = i % 4
        if kind == 0:
            requests.append(
                (
                    "POST",
                    "/vms",
                    {"name": f"{project}-c{i}", "project": project, "offering": "one", "template": "t", "start": True},
                )
            )
        elif kind == 1:
            requests.append(("POST", f"/vms/{project}-s{i % stopped}/start", None))
        else:
            requests.append(("POST", f"/vms/{project}-s{(i * 7) % stopped}/scale", {"offering": "two"}))
    return requests
