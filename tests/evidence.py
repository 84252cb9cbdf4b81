"""What a failing test leaves behind, so that its failure can be diagnosed from CI's output alone.

A failing harness or real-guest test copies, into a folder of its own under `test-artifacts/evidence/`
(VMPLANE_EVIDENCE overrides the root), whatever it has of:
  store.db / store.sql   the store (SQLite: a consistent copy that opens with `sqlite3`; PostgreSQL: pg_dump)
  events.txt             the event log, oldest first, one line per event (read from that store)
  seed.txt, faults.txt   a harness's seed and fault log (harnesses write them through `write`)
  server.log             the control plane's log
  hosts/NAME/            each local host's libvirtd, virtlockd and QEMU logs (the guests' serial consoles
                         included) and its domains' live XML
and names the folder in the failure message (conftest's report hook, or the harness's own assertion).
`.ci/run` prints the folder and the last lines of its logs when a pass fails.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sqlite3
import subprocess
from pathlib import Path

from sqlalchemy.engine import make_url

ROOT = Path(
    os.environ.get("VMPLANE_EVIDENCE") or Path(__file__).resolve().parent.parent / "test-artifacts" / "evidence"
)


def folder(name: str) -> Path:
    """A new, empty evidence folder for `name` (a test's node id or a harness run)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")[:150] or "test"
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    path = ROOT / (f"{safe}.{worker}" if worker else safe)
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def write(dest: Path, name: str, text: str) -> None:
    (dest / name).write_text(text)


def keep_store(url: str, dest: Path, sim_hosts: Path | None = None) -> None:
    """A copy of the store at `url` and its event log as text, in `dest`; and of the sim hosts' file: the one
    beside a SQLite store, or `sim_hosts` (on PostgreSQL, the file VMPLANE_SIM_HOSTS names)."""
    try:
        if url.startswith("sqlite"):
            source = Path(make_url(url).database)
            _backup(source, dest / "store.db")
            sim_hosts = sim_hosts or source.with_name(source.name + ".sim-hosts")
        else:
            _pg_dump(url, dest / "store.sql")
        if sim_hosts is not None and sim_hosts.exists():
            _backup(sim_hosts, dest / sim_hosts.name)
    except Exception as e:  # noqa: BLE001 (evidence is best effort: say what could not be kept)
        write(dest, "store.error.txt", f"the store at {url} could not be copied: {e!r}\n")
        return
    write(dest, "events.txt", _events(url))


def _backup(source: Path, target: Path) -> None:
    """A consistent copy of a SQLite file (its WAL included) that opens by itself."""
    with (
        contextlib.closing(sqlite3.connect(source, timeout=30)) as src,
        contextlib.closing(sqlite3.connect(target)) as out,
    ):
        src.backup(out)


def _pg_dump(url: str, out: Path) -> None:
    u = make_url(url)
    subprocess.run(
        ["pg_dump", "-h", u.query["host"], "-p", u.query["port"], "-U", u.username, "-f", str(out), u.database],
        check=True,
        capture_output=True,
        timeout=120,
    )


def _events(url: str) -> str:
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT * FROM events ORDER BY id")).mappings().all()
        return "".join(" ".join(f"{k}={v}" for k, v in row.items()) + "\n" for row in rows)
    except Exception as e:  # noqa: BLE001
        return f"(the event log could not be read: {e!r})\n"
    finally:
        engine.dispose()


def keep_hosts(hosts_dir: Path, dest: Path) -> None:
    """Each local host's logs and its domains' live XML (asked with `virsh`, killed after 10 s)."""
    if not hosts_dir.is_dir():
        return
    for host in sorted(p for p in hosts_dir.iterdir() if (p / "host.json").exists()):
        out = dest / "hosts" / host.name
        out.mkdir(parents=True, exist_ok=True)
        for log in ("log/libvirtd.log", "log/virtlockd.log", "daemon.out"):
            if (host / log).exists():
                shutil.copy2(host / log, out / Path(log).name)
        for qemu_log in (host / "log" / "qemu").glob("*.log"):
            shutil.copy2(qemu_log, out / qemu_log.name)
        sock = host / "run" / "libvirt-sock"  # (localhosts.LocalHost.socket)
        if not sock.exists():
            continue
        uri = f"qemu+unix:///system?socket={sock}"
        try:
            names = subprocess.run(
                ["virsh", "-c", uri, "list", "--all", "--name"], capture_output=True, text=True, timeout=10
            ).stdout.split()
            for name in names:
                xml = subprocess.run(
                    ["virsh", "-c", uri, "dumpxml", name], capture_output=True, text=True, timeout=10
                ).stdout
                write(out, f"{name}.xml", xml)
        except (subprocess.TimeoutExpired, OSError) as e:
            write(out, "domains.error.txt", f"virsh did not answer: {e!r}\n")


def keep_live(live, dest: Path) -> None:
    """Everything of a `vmplane up` of the tests (conftest.LiveServer)."""
    sim_hosts = live.extra_env.get("VMPLANE_SIM_HOSTS")
    keep_store(live.db_url, dest, Path(sim_hosts) if sim_hosts else None)
    if live.log.exists():
        shutil.copy2(live.log, dest / "server.log")
    keep_hosts(live.home / "hosts", dest)
