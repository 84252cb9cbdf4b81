"""A throwaway PostgreSQL server for tests: initdb in a temporary folder, unix socket only, stopped by pid."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time


def _bin(name: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found[-1] if found else shutil.which(name)


def unavailable_reason() -> str | None:
    if _bin("initdb") is None or _bin("pg_ctl") is None:
        return "PostgreSQL server binaries (initdb, pg_ctl) are not installed; scripts/setup.sh --test installs them"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no 'postgres' user to run the server as"
    return None


class Postgres:
    """initdb + pg_ctl start on a private socket folder; `url` is a SQLAlchemy URL for psycopg 3."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="vmplane-pg-")
        os.chmod(self.dir, 0o755)
        self.data = os.path.join(self.dir, "data")
        self.sock = os.path.join(self.dir, "sock")
        self.port = 5544
        self.user = "postgres" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
        os.makedirs(self.sock)
        if os.geteuid() == 0:
            shutil.chown(self.dir, self.user)
            shutil.chown(self.sock, self.user)

    def _run(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        cmd = list(args)
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", self.user, "--"] + cmd
        return subprocess.run(cmd, check=True, capture_output=True, text=True, **kwargs)

    def start(self) -> Postgres:
        self._run(_bin("initdb"), "-D", self.data, "-A", "trust", "-U", self.user, "--no-sync")
        opts = (
            f"-k {self.sock} -c listen_addresses='' -p {self.port} -c fsync=off -c max_connections=200 "
            f"-c synchronous_commit=off"
        )
        self._run(
            _bin("pg_ctl"), "-D", self.data, "-o", opts, "-l", os.path.join(self.dir, "log"), "-w", "start", timeout=60
        )
        return self

    def create_database(self, name: str) -> str:
        self._run(_bin("createdb") or "createdb", "-h", self.sock, "-p", str(self.port), name)
        return f"postgresql+psycopg://{self.user}@/{name}?host={self.sock}&port={self.port}"

    def stop(self) -> None:
        pid_file = os.path.join(self.data, "postmaster.pid")
        if os.path.exists(pid_file):
            subprocess.run(
                (["runuser", "-u", self.user, "--"] if os.geteuid() == 0 else [])
                + [_bin("pg_ctl"), "-D", self.data, "-m", "fast", "-w", "stop"],
                capture_output=True,
                timeout=60,
            )
        for _ in range(50):
            if not os.path.exists(pid_file):
                break
            time.sleep(0.1)
        shutil.rmtree(self.dir, ignore_errors=True)
