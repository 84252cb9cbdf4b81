"""The serial console's keystroke echo latency (issue 31): one character sent, timed until the guest's echo
of it comes back, through vmplane's websocket (the CLI's own path: a ticket, then the websocket) and, in the
same run on the same guest, through `virsh console` in a pseudo-terminal (after the websocket session closed:
a console has one holder). A real tiny-linux guest (busybox shell on its serial console) on a local libvirt
host, TCG; its console shell's echo turned on (`stty echo`: the test guest keeps it off for `vm exec`). Each
sample's character is erased (DEL) and the output left to settle before the next one.

usage: .venv/bin/python bench/console.py [--samples 200]
"""

from __future__ import annotations

import argparse
import json
import os
import pty
import select
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import LocalCluster, percentile, table, write_section
from vmplane.cli.client import Client
from vmplane.cli.console import open_console

# lowercase letters that no ANSI sequence of busybox's line editing ends with (m, h, l do)
CHARS = "abcdefgijknopqrstuvwxyz"
SETTLE_S = 0.1  # after each sample: the DEL's echo comes and goes quiet (spacing, not measured)
DEADLINE_S = 10.0


def wait_operation(c, op_id: str) -> dict:
    while True:
        op = c.get(f"/operations/{op_id}").json()
        if op["state"] in ("succeeded", "failed"):
            return op
        time.sleep(0.05)


def sample(send: Callable[[bytes], None], recv: Callable[[float], bytes], n: int) -> list[float]:
    """`n` echo latencies in ms: send one character, read until it comes back; erase it, let it settle."""
    out: list[float] = []
    for i in range(n):
        ch = CHARS[i % len(CHARS)].encode()
        t0 = time.perf_counter()
        send(ch)
        seen = b""
        while ch not in seen:
            if time.perf_counter() - t0 > DEADLINE_S:
                raise RuntimeError(f"no echo of {ch!r} in {DEADLINE_S} s: {seen!r}")
            seen += recv(DEADLINE_S)
        out.append((time.perf_counter() - t0) * 1000)
        send(b"\x7f")
        drain(recv, SETTLE_S)
    return out


def drain(recv: Callable[[float], bytes], quiet_s: float) -> bytes:
    """What comes until nothing came for `quiet_s`."""
    seen = b""
    while data := recv(quiet_s):
        seen += data
    return seen


def echo_on(send: Callable[[bytes], None], recv: Callable[[float], bytes]) -> None:
    """The test guest's console shell runs with `stty -echo` and no prompt (made for `vm exec`): turn the
    terminal's echo on (this guest only; its next shell turns it off again), and wait until the shell answers."""
    send(b"stty echo\r")
    send(b"echo RE''ADY\r")  # the quotes: the echoed command line is not the answer
    seen, deadline = b"", time.monotonic() + 60
    while b"READY" not in seen:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the console's shell did not answer: {seen!r}")
        seen += recv(1.0)
    drain(recv, 0.5)


def through_websocket(cluster: LocalCluster, vm: str, n: int) -> list[float]:
    ws = open_console(Client(cluster.url, cluster.token), vm, cluster.token, read_only=False)
    with ws:
        while True:  # the server's notices first: `attached`, with the keyboard
            message = ws.recv(30)
            if isinstance(message, str) and json.loads(message).get("type") == "attached":
                assert json.loads(message)["mode"] == "write", message
                break

        def recv(timeout: float) -> bytes:
            try:
                message = ws.recv(timeout)
            except TimeoutError:
                return b""
            return message if isinstance(message, bytes) else b""

        echo_on(ws.send, recv)
        return sample(ws.send, recv, n)


def through_virsh(uri: str, domain: str, n: int) -> list[float]:
    pid, fd = pty.fork()
    if pid == 0:
        os.execvp("virsh", ["virsh", "-c", uri, "console", domain])

    def recv(timeout: float) -> bytes:
        ready, _, _ = select.select([fd], [], [], timeout)
        return os.read(fd, 65536) if ready else b""

    def send(data: bytes) -> None:
        os.write(fd, data)

    try:
        deadline = time.monotonic() + 30
        seen = b""
        while b"Escape character" not in seen:
            if time.monotonic() > deadline:
                raise RuntimeError(f"virsh console did not connect: {seen!r}")
            seen += recv(1.0)
        echo_on(send, recv)
        return sample(send, recv, n)
    finally:
        send(b"\x1d")
        os.waitpid(pid, 0)
        os.close(fd)


def host_uri(cluster: LocalCluster, c, vm: str) -> str:
    from vmplane.hosts import localhosts

    host = c.get(f"/vms/{vm}").json()["host"]
    hosts = Path(cluster.tmp.name) / "hosts"
    saved = json.loads((hosts / host / "host.json").read_text())
    return localhosts.describe(hosts, host, saved["index"], saved["netns"]).uri


def row(name: str, ms: list[float], base: list[float]) -> list:
    p50, p95 = percentile(ms, 50), percentile(ms, 95)
    return [
        name,
        len(ms),
        f"{p50:.1f}",
        f"{p95:.1f}",
        f"{max(ms):.1f}",
        f"{p50 / percentile(base, 50):.2f}",
        f"{p95 / percentile(base, 95):.2f}",
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=200)
    args = ap.parse_args()
    cluster = LocalCluster("libvirt", hosts=1)
    try:
        cluster.wait_ready()
        with cluster.client() as c:
            c.post("/projects", json={"name": "b", "vcpus": 4, "memory_mib": 4096}).raise_for_status()
            c.post("/offerings", json={"name": "o", "kind": "fixed", "vcpus": 1, "memory_mib": 512}).raise_for_status()
            r = c.post(
                "/vms", json={"name": "c1", "project": "b", "offering": "o", "template": "tiny-linux", "start": True}
            )
            r.raise_for_status()
            assert wait_operation(c, r.json()["operation"]["id"])["state"] == "succeeded"
            c.post("/vms/c1/exec", json={"command": "true", "timeout_s": 180}).raise_for_status()  # booted
            uri = host_uri(cluster, c, "c1")
        ws_ms = through_websocket(cluster, "c1", args.samples)
        print(f"websocket: p50 {percentile(ws_ms, 50):.1f} ms, p95 {percentile(ws_ms, 95):.1f} ms", flush=True)
        # the session closed: vmplane's link lets the console go once its last session left
        time.sleep(1.0)
        virsh_ms = through_virsh(uri, "vmplane-c1", args.samples)
        print(
            f"virsh console: p50 {percentile(virsh_ms, 50):.1f} ms, p95 {percentile(virsh_ms, 95):.1f} ms", flush=True
        )
    finally:
        cluster.stop()
    body = table(
        ["path", "samples", "p50 ms", "p95 ms", "max ms", "p50 / virsh", "p95 / virsh"],
        [row("vmplane websocket (vm console)", ws_ms, virsh_ms), row("virsh console (pty)", virsh_ms, virsh_ms)],
    )
    p95 = percentile(ws_ms, 95)
    body += (
        f"\n\nGoal (issue 31): the websocket's p95 <= 300 ms on a TCG guest: {'met' if p95 <= 300 else 'NOT met'} "
        f"({p95:.0f} ms). One character sent, timed until the guest's echo of it comes back (its console's "
        f"shell, echo turned on with `stty echo`); then DEL and {SETTLE_S * 1000:.0f} ms of quiet before the next. "
        "The websocket: the CLI's own client "
        "(`vmplane.cli.console.open_console`: a ticket, then `ws://.../console`, websockets sync client) against "
        "`vmplane up --driver libvirt --hosts 1`; through the API process, its console controller's link (a "
        "non-blocking libvirt stream polled every 10 ms) and the websocket. `virsh console` in a pseudo-terminal "
        "(pty.fork) on the same guest, after the websocket session closed. tiny-linux guest, 1 vCPU / 512 MiB, TCG, "
        "on this 2-core machine shared with other work."
    )
    write_section("Serial console: keystroke echo latency (bench/console.py)", body)


if __name__ == "__main__":
    main()
