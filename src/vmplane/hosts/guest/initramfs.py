"""Writes a gzip'd "newc" cpio archive with the standard library (no cpio binary needed)."""

from __future__ import annotations

import gzip
from collections.abc import Sequence
from pathlib import Path

DIRS = [
    "bin",
    "sbin",
    "dev",
    "proc",
    "sys",
    "tmp",
    "run",
    "lib",
    "lib/modules",
    "usr",
    "usr/bin",
    "usr/sbin",
    "etc",
    "root",
    "mnt",
    "data",
]


def _entry(name: str, mode: int, data: bytes = b"", ino: int = 1, rdev: tuple[int, int] = (0, 0)) -> bytes:
    namez = name.encode() + b"\0"
    fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(namez), 0]
    header = b"070701" + b"".join(b"%08X" % f for f in fields) + namez
    header += b"\0" * (-len(header) % 4)
    return header + data + b"\0" * (-len(data) % 4)


def write_initramfs(
    out: Path, busybox: Path, init_script: Path, modules: list[Path], extra: Sequence[tuple[str, int, bytes]] = ()
) -> None:
    """`extra`: more files as (path, mode, data); their folders are added (the kernel's unpacker makes none)."""
    parts = []
    ino = 1
    dirs = list(DIRS)
    for name, _mode, _data in extra:
        parents = Path(name).parents
        dirs += [str(d) for d in reversed(parents) if str(d) != "." and str(d) not in dirs]
    for d in dirs:
        parts.append(_entry(d, 0o040755, ino=ino))
        ino += 1
    parts.append(_entry("dev/console", 0o020600, ino=ino, rdev=(5, 1)))
    files = [
        ("bin/busybox", 0o100755, busybox.read_bytes()),
        ("bin/sh", 0o120777, b"busybox"),
        ("init", 0o100755, init_script.read_bytes()),
    ]
    files += [(f"lib/modules/{m.name}", 0o100644, m.read_bytes()) for m in modules]
    # the order init loads them in: dependencies first
    files.append(("lib/modules/load-order", 0o100644, "".join(f"{m.stem}\n" for m in modules).encode()))
    files += extra
    for name, mode, data in files:
        ino += 1
        parts.append(_entry(name, mode, data, ino=ino))
    parts.append(_entry("TRAILER!!!", 0, ino=0))
    tmp = out.with_suffix(".tmp")
    with gzip.open(tmp, "wb", compresslevel=6) as f:
        f.write(b"".join(parts))
    tmp.replace(out)
