"""The `vmplane` command line (Typer + Rich), a thin client of the REST API."""

from __future__ import annotations

import faulthandler

from vmplane.cli import (  # noqa: F401  (each registers its commands)
    backups,
    catalog,
    console,
    events,
    groups,
    images,
    infra,
    local,
    networks,
    projectkeys,
    snapshots,
    storage,
    vms,
)
from vmplane.cli.common import app


def main() -> None:
    faulthandler.enable()  # a crash in a C library (libvirt) leaves its thread's stack in the log
    app(prog_name="vmplane")


if __name__ == "__main__":
    main()
