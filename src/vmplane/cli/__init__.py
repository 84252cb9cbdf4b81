"""The `vmplane` command line (Typer + Rich), a thin client of the REST API."""

from __future__ import annotations

from . import catalog, events, infra, local, storage, vms  # noqa: F401  (each registers its commands)
from .common import app


def main() -> None:
    app(prog_name="vmplane")


if __name__ == "__main__":
    main()
