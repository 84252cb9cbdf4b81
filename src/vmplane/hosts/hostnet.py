"""Applying a host's network plan and guest filter (core/hostnet.py, core/netfilter.py) on the host itself, and
reading back what it holds: libvirt has no call for a VXLAN device or an nftables table, so these steps run as
commands in the host's own network namespace (a local host: `ip netns exec`) or, for a remote host, over
the same ssh key as its `qemu+ssh` URI (`sh -es` there: docs/design/networks-probe.md).

What was asked is never taken as done: after the commands the host is read again, and a host that does not
hold the plan is an error naming what is missing (the record is the truth).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from vmplane.core import hostnet as H
from vmplane.core.driver import DriverError
from vmplane.core.netfilter import Port, ruleset
from vmplane.core.networks import Rule

Runner = Callable[[list[str], str | None], str]  # (argv, stdin) -> stdout; DriverError when it fails
TIMEOUT_S = 30.0


def netns_runner(host: str, netns: str) -> Runner:
    """Commands in a local host's network namespace (localhosts: `vmp<tag>-<name>`)."""

    def run(argv: list[str], stdin: str | None = None) -> str:
        return _run(host, ["ip", "netns", "exec", netns, *argv], stdin)

    return run


def _run(host: str, argv: list[str], stdin: str | None) -> str:
    try:
        done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DriverError(host, f"{' '.join(argv[-8:])}: {exc}") from None
    if done.returncode != 0:
        raise DriverError(host, f"{' '.join(argv[-8:])}: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done.stdout


def held(run: Runner) -> tuple[list[H.Link], dict[str, list[str]]]:
    """The host's links and each VXLAN device's flood destinations, as it reports them now."""
    links = H.parse_links(json.loads(run(["ip", "-j", "-d", "link", "show"], None) or "[]"))
    fdb = H.parse_fdb(json.loads(run(["bridge", "-j", "fdb", "show"], None) or "[]"))
    return links, fdb


@dataclass(frozen=True)
class Applied:
    commands: int  # link and FDB commands run to reach the plan (0: the host held it already)
    filtered: int  # NICs in the filter loaded


def apply(
    host: str,
    run: Runner,
    plan: H.HostPlan,
    ports: Iterable[Port] = (),
    rules: Mapping[str, Iterable[Rule]] | None = None,
    members: Mapping[str, Iterable[str]] | None = None,
) -> Applied:
    """Bring the host to `plan`, load its guests' filter (one transaction: both tables whole), and read the
    host back: DriverError when it does not hold the plan afterwards."""
    commands = H.converge(plan, *held(run))
    for argv in commands:
        run(argv, None)
    ports = list(ports)
    run(["nft", "-f", "-"], ruleset(ports, rules or {}, members or {}))
    left = H.converge(plan, *held(run))
    if left:
        raise DriverError(host, f"the host does not hold its networks after applying them: {' '.join(left[0])} "
                                f"is still needed ({len(left)} step(s))")  # fmt: skip
    return Applied(len(commands), len(ports))
