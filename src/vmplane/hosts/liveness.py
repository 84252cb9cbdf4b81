"""The second liveness signal of high availability: is a host alive, asked without its libvirtd.

A host whose libvirt connection is lost may be dead, or only out of reach (a network blip, a hung
daemon); restarting its VMs elsewhere is safe only in the first case, and only after fencing. So the
host monitor also asks a path that does not go through libvirt:
  local hosts   their own processes (libvirtd, any QEMU they ran, the heartbeat writer): one of them
                alive means the host is not dead, whatever libvirt says;
  remote hosts  the heartbeat the host writes onto shared storage (vmplane.heartbeat), as VMware's
                datastore heartbeat and CloudStack's NFS heartbeat: a fresh one means alive.
`alive` is None when the signal can not tell (no heartbeat was ever written): unknown is not dead.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from vmplane.hosts import localhosts


@dataclass(frozen=True)
class Signal:
    alive: bool | None
    detail: str


def local_signal(uri: str | None) -> Signal | None:
    """The liveness of a local host read from its processes; None when `uri` is not a local host."""
    host = localhosts.from_uri(uri)
    if host is None:
        return None
    procs = localhosts.processes(host)
    running = [
        f"{role} {','.join(map(str, pids))}"
        for role, pids in procs.items()
        if pids and role in ("libvirtd", "qemu", "heartbeat")
    ]
    if running:
        return Signal(True, f"host {host.name} processes alive: {'; '.join(running)}")
    return Signal(False, f"host {host.name}: no libvirtd, QEMU or heartbeat process left")


def heartbeat_signal(path: str | Path, max_age_s: float) -> Signal:
    """Alive when the heartbeat file was written within max_age_s (its modification time, the storage's
    clock as the control plane sees it); unknown when it was never written."""
    path = Path(path)
    try:
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return Signal(None, f"no heartbeat at {path}")
    except OSError as exc:
        return Signal(None, f"heartbeat at {path} unreadable: {exc}")
    try:
        counter = json.loads(path.read_text()).get("counter")
    except (OSError, ValueError, AttributeError):
        counter = None
    beat = f"heartbeat {counter}" if counter is not None else "heartbeat"
    if age <= max_age_s:
        return Signal(True, f"{beat} written {age:.1f} s ago")
    return Signal(False, f"{beat} is {age:.1f} s old (more than {max_age_s:g} s)")
