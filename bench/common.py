"""Helpers for benchmarks: a results table printed and written into bench/RESULTS.md under a heading."""

from __future__ import annotations

import datetime as dt
import platform
import re
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def table(headers: list[str], rows: list[list]) -> str:
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def fmt(r):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"

    return "\n".join([fmt(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [fmt(r) for r in cells[1:]])


def write_section(name: str, body: str) -> None:
    """Replace (or add) the section `## name` of RESULTS.md with `body`."""
    stamp = f"_{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {platform.node()}, Python {platform.python_version()}_"
    section = f"## {name}\n\n{stamp}\n\n{body.strip()}\n"
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n\nWritten by the scripts in bench/.\n"
    pattern = re.compile(rf"^## {re.escape(name)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = pattern.sub(section + "\n", text) if pattern.search(text) else text.rstrip() + "\n\n" + section
    RESULTS.write_text(text)
    print(body)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


class LocalCluster:
    """`vmplane up` in its own process and home folder, for benchmarks; stopped by its pid."""

    def __init__(self, driver: str = "libvirt", hosts: int = 1):
        import os
        import socket
        import subprocess
        import sys
        import tempfile

        self.tmp = tempfile.TemporaryDirectory(prefix="vmplane-bench-")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.token = "bench-token"
        self.env = {**os.environ, "VMPLANE_HOME": self.tmp.name, "VMPLANE_API": self.url, "VMPLANE_TOKEN": self.token}
        vmplane = str(Path(sys.executable).with_name("vmplane"))
        self.proc = subprocess.Popen(
            [vmplane, "up", "--driver", driver, "--hosts", str(hosts), "--port", str(port)],
            env=self.env,
            stdout=open(Path(self.tmp.name) / "up.log", "w"),  # noqa: SIM115 (the server writes it for its whole life)
            stderr=subprocess.STDOUT,
        )

    def client(self):
        import httpx

        return httpx.Client(
            base_url=self.url + "/api/v1", headers={"Authorization": f"Bearer {self.token}"}, timeout=300
        )

    def wait_ready(self, timeout_s: float = 180) -> None:
        import time

        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        raise RuntimeError("vmplane up did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(120)
        self.tmp.cleanup()
