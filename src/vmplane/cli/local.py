"""`vmplane up`, `down` and `serve`: a local cluster, or the API alone."""

from __future__ import annotations

import typer

from vmplane.cli.common import (
    app,
    mib,
    size_help,
)
from vmplane.cli.output import console
from vmplane.core.units import format_mib

INSECURE_COOKIES_HELP = (
    "let the web console's session cookie go over plain http to any client (it is Secure "
    "otherwise, except for a browser on this machine): only on a network you trust"
)
FORWARDED_HELP = (
    "proxies whose X-Forwarded-Proto/-For are believed (comma-separated addresses or networks, `*` "
    "for any; default 127.0.0.1): name the load balancer that ends TLS in front of the console"
)


# -- local cluster -----------------------------------------------------------------------------
@app.command()
def up(
    hosts: int = typer.Option(3, min=0, help="hosts to register"),
    driver: str = typer.Option("auto", help="auto, libvirt or sim"),
    db: str | None = typer.Option(None, help="SQLAlchemy URL (default: SQLite in $VMPLANE_HOME)"),
    bind: str = typer.Option("127.0.0.1", help="address to listen on"),
    port: int = typer.Option(8470, help="port to listen on"),
    token: str | None = typer.Option(
        None, envvar="VMPLANE_TOKEN", help="admin token to use (default: a new one, printed once)"
    ),
    keep_hosts: bool = typer.Option(False, help="leave libvirt hosts and their VMs running on exit"),
    lease: float = typer.Option(
        15.0, min=1.0, max=300.0, help="seconds this process's lease lasts unrenewed (see `vmplane serve`)"
    ),
    name: str | None = typer.Option(
        None, help="this process among the control planes of the store (default HOSTNAME:PORT)"
    ),
    insecure_cookies: bool = typer.Option(False, help=INSECURE_COOKIES_HELP),
    forwarded_allow_ips: str | None = typer.Option(None, help=FORWARDED_HELP),
    host_memory: str | None = typer.Option(
        None,
        metavar="SIZE",
        help=size_help(
            "each host's memory (libvirt hosts: default this machine's memory "
            "less 1 GiB or 10 % for the control plane, split evenly; at most "
            "that in all. Simulated hosts: default 64GiB)"
        ),
    ),
):
    """Run a local cluster: the API and HOSTS hosts on this machine (libvirtd daemons, or simulated)."""
    from vmplane import server
    from vmplane.core.errors import VmplaneError

    server.exit_on_sigterm()
    try:
        kind, why = server.choose_driver(driver)
    except VmplaneError as exc:
        raise typer.BadParameter(exc.message, param_hint="--driver") from None
    asked_memory = mib(host_memory, "--host-memory")
    try:
        each_mib = server.local_host_memory(hosts, kind, asked_memory)
    except VmplaneError as exc:
        raise typer.BadParameter(exc.message, param_hint="--host-memory") from None
    try:
        _lock = server.lock_home()
    except VmplaneError as exc:
        console.print(f"[red]error[/red] {exc.message}")
        raise typer.Exit(1) from None
    from vmplane.plane.membership import default_name

    plane = server.build(
        db,
        recover=False,
        name=name or default_name(port),
        lease_s=lease,
        api_url=f"http://{bind}:{port}",
        insecure_cookies=insecure_cookies,
    )
    try:
        names = server.prepare_local_cluster(plane.orchestrator, hosts, kind, asked_memory)
        # the hosts run now: recover in the background (what it finds is logged and in the event log)
        plane.orchestrator.recovery.run(background=True)
    except BaseException:
        plane.close()
        if kind == "libvirt" and not keep_hosts:
            server.stop_local_hosts()
        raise
    admin = token or server.new_token()
    try:
        plane.orchestrator.catalog.ensure_admin_token(server.UP_TOKEN_NAME, admin)
    except VmplaneError as exc:
        plane.close()
        raise typer.BadParameter(exc.message, param_hint="--token") from None
    url = f"http://{bind}:{port}"
    memory = f", {format_mib(each_mib)} of memory each" if names else ""
    say(f"vmplane up: {why}; {len(names)} host(s): {', '.join(names) or '-'}{memory}")
    say(f"database: {plane.db.url}")
    say(f"API: {url}   (REST under {url}/api/v1, docs {url}/docs)")
    say(f"web console: {url}/ui   (log in with the admin token)")
    if token:
        say("admin token: the one given with --token / VMPLANE_TOKEN")
        say(f"  export VMPLANE_API={url}")
    else:
        say(f"admin token (shown once): {admin}")
        say(f"  export VMPLANE_API={url} VMPLANE_TOKEN={admin}")
    try:
        server.serve(plane.app, bind, port, forwarded_allow_ips)
    finally:
        plane.close()
        if kind == "libvirt" and not keep_hosts:
            stopped = server.stop_local_hosts()
            console.print(f"vmplane up: stopped local hosts {', '.join(stopped) or '-'}")


def say(line: str) -> None:
    """A line for people, never wrapped: `export ...` must survive a copy and paste at any width."""
    console.print(line, soft_wrap=True, highlight=False)


@app.command()
def down():
    """Stop the local libvirt hosts of `vmplane up --keep-hosts` (and their VMs)."""
    from vmplane import server

    stopped = server.stop_local_hosts()
    console.print(f"stopped local hosts: {', '.join(stopped) or 'none running'}")


@app.command()
def serve(
    db: str | None = typer.Option(None, help="SQLAlchemy URL"),
    bind: str = typer.Option("127.0.0.1", help="address to listen on"),
    port: int = typer.Option(8470, help="port to listen on"),
    token: str | None = typer.Option(
        None, envvar="VMPLANE_TOKEN", help="make this the admin token (for a fresh database)"
    ),
    name: str | None = typer.Option(
        None,
        help="this process among the control planes of the store "
        "(default HOSTNAME:PORT); a restart under the same name "
        "takes over what the previous one left at once",
    ),
    lease: float = typer.Option(
        15.0,
        min=1.0,
        max=300.0,
        help="seconds this process's lease lasts unrenewed (renewed every third); "
        "its work is taken over by another process when it lapses",
    ),
    insecure_cookies: bool = typer.Option(False, help=INSECURE_COOKIES_HELP),
    forwarded_allow_ips: str | None = typer.Option(None, help=FORWARDED_HELP),
):
    """Run the API alone, on an existing database (several of them may share one PostgreSQL database)."""
    from vmplane import server
    from vmplane.core.errors import VmplaneError
    from vmplane.plane.membership import default_name

    plane = server.build(
        db,
        name=name or default_name(port),
        lease_s=lease,
        api_url=f"http://{bind}:{port}",
        insecure_cookies=insecure_cookies,
    )
    if token:
        try:
            plane.orchestrator.catalog.ensure_admin_token(server.UP_TOKEN_NAME, token)
        except VmplaneError as exc:
            plane.close()
            raise typer.BadParameter(exc.message, param_hint="--token") from None
    say(f"vmplane API on http://{bind}:{port} (database {plane.db.url})")
    try:
        server.serve(plane.app, bind, port, forwarded_allow_ips)
    finally:
        plane.close()
