"""Applying a host's network plan and guest filter (core/hostnet.py, core/netfilter.py) on the host itself, and
reading back what it holds: libvirt has no call for a VXLAN device or an nftables table, so these steps run as
commands in the host's own network namespace (a local host: `ip netns exec`) or, for a remote host, over
the same ssh key as its `qemu+ssh` URI (`sh -es` there: docs/design/networks-probe.md).

What was asked is never taken as done: after the commands the host is read again, and a host that does not
hold the plan is an error naming what is missing (the record is the truth).
"""

from __future__ import annotations

import json
import shlex
import subprocess
from collections.abc import Callable, Iterable, Mapping
from ipaddress import ip_network
from urllib.parse import parse_qs, urlparse

from vmplane.core import hostnet as H
from vmplane.core.driver import DriverError
from vmplane.core.netfilter import Port, ruleset
from vmplane.core.networks import Rule
from vmplane.hosts import localhosts, localprovider

Runner = Callable[[list[str], str | None], str]  # (argv, stdin) -> stdout; DriverError when it fails
TIMEOUT_S = 30.0


REMOTE_STATE = "/run/vmplane/net"  # a remote host's DHCP files (a local host's: its folder's net/)


def host_runner(host: str, uri: str) -> tuple[Runner, str, Callable[[H.HostNetworks], None]]:
    """How to run commands on the host behind `uri`, where its DHCP files go, and what must be made outside
    the host before its plan (a local host's provider uplinks and this machine's gateway ports): a local
    host in its own network namespace, a remote one over ssh (qemu+ssh://; its provider uplink devices are
    the operator's). Any other host is a DriverError saying why."""
    local = localhosts.from_uri(uri)
    if local is not None:
        if local.netns is None:
            raise DriverError(
                host,
                "this local host shares the machine's network namespace: guest networks need hosts with a "
                "namespace of their own (vmplane up makes them when it runs as root)",
            )

        def prepare(want: H.HostNetworks) -> None:
            localprovider.ensure(local, localprovider.gateways(want))

        return netns_runner(host, local.netns), str(localhosts.net_dir(local)), prepare
    return ssh_runner(host, uri), REMOTE_STATE, lambda want: None


def netns_runner(host: str, netns: str) -> Runner:
    """Commands in a local host's network namespace (localhosts: `vmp<tag>-<name>`)."""

    def run(argv: list[str], stdin: str | None = None) -> str:
        return _run(host, ["ip", "netns", "exec", netns, *argv], stdin)

    return run


def ssh_runner(host: str, uri: str) -> Runner:
    """Commands on a remote host over the same ssh key (and ssh command) as its qemu+ssh:// URI: one ssh
    call each (about 320 ms here: the plan is applied in few calls)."""
    parsed = urlparse(uri)
    query = parse_qs(parsed.query)
    if parsed.scheme != "qemu+ssh" or not parsed.hostname:
        raise DriverError(host, f"commands on the host need a qemu+ssh:// URI or a local host, not {uri!r}")
    ssh = query.get("command", ["ssh"])[0]
    target = f"{parsed.username}@{parsed.hostname}" if parsed.username else parsed.hostname
    options = ["-p", str(parsed.port)] if parsed.port else []
    options += ["-i", query["keyfile"][0]] if "keyfile" in query else []

    def run(argv: list[str], stdin: str | None = None) -> str:
        return _run(host, [ssh, *options, target, "--", shlex.join(argv)], stdin)

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
    links = H.parse_links(json.loads(run(["ip", "-j", "-d", "addr", "show"], None) or "[]"))
    fdb = H.parse_fdb(json.loads(run(["bridge", "-j", "fdb", "show"], None) or "[]"))
    return links, fdb


def apply(
    host: str,
    run: Runner,
    plan: H.HostPlan,
    ports: Iterable[Port] = (),
    rules: Mapping[str, Iterable[Rule]] | None = None,
    members: Mapping[str, Iterable[str]] | None = None,
) -> H.Applied:
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
    return H.Applied(len(commands), len(ports))


# -- DHCP: one dnsmasq per network on each host, reservations only --------------------------------------------
DNSMASQ = "/usr/sbin/dnsmasq"
LEASE = "1h"


def dhcp_script(state_dir: str, nets: Iterable[H.Dhcp]) -> str:
    """A POSIX sh script (run with `sh -es` on the host) that gives every network of `nets` a running
    dnsmasq holding exactly its reservations, and stops those of networks no longer there. A server is
    re-read (SIGHUP) when its reservations change, restarted when its bridge was made again (its socket is
    bound to the old one), and each server answers only on its bridge. Last, one line per network:
    `BRIDGE PID` of the server that runs now (read back by the caller)."""
    nets = sorted(nets, key=lambda n: n.bridge)
    want = " ".join(n.bridge for n in nets)
    out = [
        f"d={_q(state_dir)}",
        'mkdir -p "$d"',
        'alive() { [ -n "$2" ] && tr "\\0" "\\n" < "/proc/$2/cmdline" 2>/dev/null | grep -qx -- "--interface=$1"; }',
        f"want=' {want} '",
        'for f in "$d"/vmpn*.pid; do',
        '  [ -e "$f" ] || continue',
        '  b=$(basename "$f" .pid)',
        '  case "$want" in *" $b "*) continue ;; esac',
        '  p=$(cat "$f" 2>/dev/null || true)',
        '  if alive "$b" "$p"; then kill "$p" || true; fi',
        '  rm -f "$d/$b".*',
        "done",
    ]
    for n in nets:
        net = ip_network(n.cidr)
        hosts = "".join(f"{mac},{ip}\\n" for mac, ip in n.reservations)
        router = f"option:router,{n.router}" if n.router else "option:router"
        out += [
            f"b={n.bridge}",
            f"printf '{hosts}' > \"$d/$b.hosts.new\"",
            'i=$(ip -o link show dev "$b" | cut -d: -f1)',  # (not /sys: a remote shell's may be another netns')
            'p=$(cat "$d/$b.pid" 2>/dev/null || true)',
            'if alive "$b" "$p" && [ "$(cat "$d/$b.ifindex" 2>/dev/null || true)" = "$i" ]; then',
            '  if cmp -s "$d/$b.hosts.new" "$d/$b.hosts"; then rm -f "$d/$b.hosts.new"',
            '  else mv "$d/$b.hosts.new" "$d/$b.hosts"; kill -HUP "$p"; fi',
            "else",
            '  if alive "$b" "$p"; then kill "$p"; n=0; while kill -0 "$p" 2>/dev/null && [ $n -lt 50 ]; do'
            " sleep 0.1; n=$((n+1)); done; fi",
            '  mv "$d/$b.hosts.new" "$d/$b.hosts"; echo "$i" > "$d/$b.ifindex"; rm -f "$d/$b.pid"',
            # --user=root: dnsmasq would run as nobody, who can not read a host's private folder
            f"  {DNSMASQ} --conf-file=/dev/null --port=0 --interface=$b --bind-interfaces"
            f" --dhcp-range={net.network_address},static,{net.netmask},{LEASE}"
            ' --dhcp-hostsfile="$d/$b.hosts" --dhcp-leasefile="$d/$b.leases"'
            f" --dhcp-option={router} --dhcp-authoritative --user=root"
            ' --pid-file="$d/$b.pid" --log-facility="$d/$b.log"',
            "fi",
        ]
    out += [
        f"for b in {want}; do" if want else "for b in; do",
        '  echo "$b $(cat "$d/$b.pid" 2>/dev/null || true)"',
        "done",
    ]
    return "\n".join(out) + "\n"


def _q(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def apply_dhcp(host: str, run: Runner, state_dir: str, nets: Iterable[H.Dhcp]) -> dict[str, int]:
    """Run dhcp_script on the host; each network's server pid. DriverError naming a network whose server
    does not run afterwards."""
    nets = list(nets)
    report = run(["sh", "-es"], dhcp_script(state_dir, nets))
    running: dict[str, int] = {}
    for line in report.splitlines():
        bridge, _, pid = line.partition(" ")
        if pid.strip().isdigit():
            running[bridge] = int(pid)
    missing = [n.bridge for n in nets if n.bridge not in running]
    if missing:
        raise DriverError(host, f"no DHCP server runs on {', '.join(missing)} after starting it (see {state_dir})")
    return running


def apply_all(host: str, run: Runner, state_dir: str, want: H.HostNetworks) -> H.Applied:
    """The whole of a host's networking (the driver's apply_networks): devices, filter, DHCP, read back."""
    applied = apply(host, run, want.plan, want.ports, want.rules, want.members)
    apply_dhcp(host, run, state_dir, want.dhcp)
    return applied
