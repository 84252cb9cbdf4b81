"""Size parsing and formatting: the one place that turns `16GiB` / `512MiB` / `2048` into MiB."""

from __future__ import annotations

import re

_UNITS_MIB = {"": 1, "mi": 1, "mib": 1, "gi": 1024, "gib": 1024, "ti": 1024 * 1024, "tib": 1024 * 1024}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_mib(text: str | int) -> int:
    """`512MiB` -> 512, `16GiB` -> 16384, `2048` -> 2048 (plain numbers are MiB).

    Decimal units (MB, GB) are refused rather than guessed: 16GB is not 16GiB and an operator
    should not find that out from a VM's MemTotal.
    """
    m = None
    if isinstance(text, int):
        value, unit = float(text), ""
    else:
        m = _SIZE.match(text)
        if not m:
            raise ValueError(f"{text!r} is not a size; use e.g. 512MiB, 16GiB or a plain number of MiB")
        value, unit = float(m.group(1)), m.group(2).lower()
    if unit not in _UNITS_MIB:
        if unit in ("m", "g", "t", "mb", "gb", "tb"):  # decimal or ambiguous: 16G is 10^9 to Kubernetes
            raise ValueError(
                f"{text!r}: {m.group(2) if m else unit} is ambiguous (decimal or binary?); use MiB, GiB or TiB"
            )
        raise ValueError(f"{text!r}: unknown unit {unit!r}; use MiB, GiB or TiB (binary units)")
    mib = value * _UNITS_MIB[unit]
    if mib != int(mib):
        raise ValueError(f"{text!r} is not a whole number of MiB")
    if mib <= 0:
        raise ValueError(f"{text!r} must be greater than zero")
    return int(mib)


def format_mib(mib: int | float) -> str:
    """2048 -> '2 GiB', 1536 -> '1536 MiB' (exact, never rounded)."""
    mib = int(mib)
    if mib and mib % (1024 * 1024) == 0:
        return f"{mib // (1024 * 1024)} TiB"
    if mib and mib % 1024 == 0:
        return f"{mib // 1024} GiB"
    return f"{mib} MiB"
