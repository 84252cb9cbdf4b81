"""The NoCloud seed image: an ISO 9660 image with Joliet and Rock Ridge names, labelled `cidata` (the label
cloud-init's NoCloud looks for), holding the seed's files at its root; built in memory with pycdlib.

Equal files give equal bytes (every date is SEED_DATE, in UTC), so a seed rebuilt on another host or after a
restart is the same image (core/cloudinit.seed_id names it).
"""

from __future__ import annotations

import io
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pycdlib
import pycdlib.dates
import pycdlib.headervd
import pycdlib.pycdlib

VOLUME_ID = "cidata"
SEED_DATE = 1_577_836_800.0  # 2020-01-01T00:00:00Z: any fixed date; cloud-init never reads it
FILE_MODE = 0o100444  # a regular file, read-only for all
_ISO_NAME_MAX = 8  # ISO 9660 level 1: 8.3 names of A-Z, 0-9 and _
_JOLIET_NAME_MAX = 64

# pycdlib stamps records with time.time() in local time and has no option for a fixed date: while building,
# its modules see a clock stopped at SEED_DATE in UTC. Module globals, so one build at a time.
_FIXED_CLOCK = SimpleNamespace(
    time=lambda: SEED_DATE, localtime=time.gmtime, gmtime=time.gmtime, strftime=time.strftime
)
_CLOCKED_MODULES = (pycdlib.pycdlib, pycdlib.headervd, pycdlib.dates)
_CLOCK_NAME = "time"
_BUILD_LOCK = threading.Lock()


def build_iso(files: dict[str, bytes]) -> bytes:
    """The seed image holding `files` (name -> content) at its root, under their exact names for Rock Ridge
    and Joliet readers (Linux mounts with Rock Ridge) and 8.3 upper-case names for plain ISO 9660 ones."""
    iso_names = _iso_names(sorted(files))
    with _BUILD_LOCK, _fixed_clock():
        iso = pycdlib.PyCdlib()
        iso.new(interchange_level=1, vol_ident=VOLUME_ID, joliet=3, rock_ridge="1.09")
        for name in sorted(files):
            content = files[name]
            iso.add_fp(
                io.BytesIO(content),
                len(content),
                iso_path=f"/{iso_names[name]};1",
                rr_name=name,
                joliet_path=f"/{name}",
                file_mode=FILE_MODE,
            )
        out = io.BytesIO()
        iso.write_fp(out)
        iso.close()
    return out.getvalue()


def _iso_names(names: list[str]) -> dict[str, str]:
    """Each name's ISO 9660 level 1 name (`META_DAT.`; `METADATA.` for `meta-data`), made unique in order."""
    taken: set[str] = set()
    result: dict[str, str] = {}
    for name in names:
        if not name or "/" in name or name in (".", "..") or len(name) > _JOLIET_NAME_MAX or not name.isprintable():
            raise ValueError(f"seed file name {name!r} is not a plain file name of 1 to {_JOLIET_NAME_MAX} characters")
        stem = re.sub(r"[^A-Z0-9_]", "", name.upper())[:_ISO_NAME_MAX] or "FILE"
        candidate, counter = stem, 1
        while candidate in taken:
            suffix = str(counter)
            candidate, counter = stem[: _ISO_NAME_MAX - len(suffix)] + suffix, counter + 1
        taken.add(candidate)
        result[name] = f"{candidate}."
    return result


@contextmanager
def _fixed_clock() -> Iterator[None]:
    # by name: pycdlib's modules do not export their `time` import
    saved = [getattr(module, _CLOCK_NAME) for module in _CLOCKED_MODULES]
    for module in _CLOCKED_MODULES:
        setattr(module, _CLOCK_NAME, _FIXED_CLOCK)
    try:
        yield
    finally:
        for module, original in zip(_CLOCKED_MODULES, saved):
            setattr(module, _CLOCK_NAME, original)
