"""Settings keys, their types, defaults and scopes, and how a value resolves (pure).

A value set at cluster scope wins over zone, zone over global, global over the default. Each key
names the narrowest scope it may be set at; it can always be set at a wider one.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from vmplane.core.errors import Invalid, NotFound
from vmplane.core.model import STORE_INT_MAX

SCOPES = ("global", "zone", "cluster")

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


@dataclass(frozen=True)
class SettingKey:
    """A key, its type (bool, int, float or choice) and, for numbers, its documented range.

    `low_open` makes the lower bound exclusive (factors must be greater than 0)."""

    key: str
    kind: str
    default: bool | int | float | str
    narrowest_scope: str
    description: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    choices: tuple[str, ...] = ()

    def allows(self, scope: str) -> bool:
        return SCOPES.index(scope) <= SCOPES.index(self.narrowest_scope)

    @property
    def range(self) -> str:
        """The accepted values, as docs/operations/settings.md and error messages show them."""
        if self.kind == "bool":
            return "true or false"
        if self.kind == "choice":
            return " or ".join(self.choices)
        if self.kind == "int":
            return f"{int(self.low)}..{int(self.high)}"  # type: ignore[arg-type]
        return f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"

    def parse(self, raw: object) -> object:
        """The typed value of `raw` (a stored string, or a JSON string, number or boolean);
        ValueError with a message people can act on when it is not a value of this key."""
        if self.kind == "bool":
            if isinstance(raw, bool):
                return raw
            lowered = str(raw).strip().lower() if isinstance(raw, str) else None
            if lowered in _TRUE or lowered in _FALSE:
                return lowered in _TRUE
            raise ValueError(f"must be true or false, got {raw!r}")
        if self.kind == "choice":
            if isinstance(raw, str) and raw.strip() in self.choices:
                return raw.strip()
            raise ValueError(f"must be {self.range}, got {raw!r}")
        value = self._number(raw)
        if value != value or value in (math.inf, -math.inf):
            raise ValueError(f"must be a finite number, got {raw!r}")
        below = value <= self.low if self.low_open else value < self.low  # type: ignore[operator]
        if below or value > self.high:  # type: ignore[operator]
            raise ValueError(f"must be in {self.range}, got {raw!r}")
        return value

    def _number(self, raw: object) -> int | float:
        if isinstance(raw, bool):
            raise ValueError(f"must be {'an integer' if self.kind == 'int' else 'a number'}, got {raw!r}")
        if self.kind == "int":
            if isinstance(raw, int):
                return raw
            if isinstance(raw, float) and raw.is_integer():
                return int(raw)
            if isinstance(raw, str) and _INT.match(raw.strip()):
                return int(raw.strip())
            raise ValueError(f"must be an integer, got {raw!r}")
        if isinstance(raw, (int, float)):
            return float(raw)
        if isinstance(raw, str) and _FLOAT.match(raw.strip()):
            return float(raw.strip())
        if isinstance(raw, str) and raw.strip().lower().lstrip("+-") in ("inf", "infinity", "nan"):
            raise ValueError(f"must be a finite number, got {raw!r}")
        raise ValueError(f"must be a number, got {raw!r}")

    def text(self, value: object) -> str:
        """How a typed value is stored."""
        return ("true" if value else "false") if isinstance(value, bool) else str(value)


_INT = re.compile(r"^[+-]?[0-9]{1,30}$")
_FLOAT = re.compile(r"^[+-]?([0-9]{1,20}(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]{1,3})?$")


def _bool(key: str, default: bool, scope: str, text: str) -> SettingKey:
    return SettingKey(key, "bool", default, scope, text)


def _int(key: str, default: int, scope: str, text: str, low: int, high: int) -> SettingKey:
    return SettingKey(key, "int", default, scope, text, low, high)


def _float(
    key: str, default: float, scope: str, text: str, low: float, high: float, low_open: bool = False
) -> SettingKey:
    return SettingKey(key, "float", default, scope, text, low, high, low_open)


KEYS: dict[str, SettingKey] = {
    k.key: k
    for k in [
        _bool(
            "enable.dynamic.scale.vm",
            False,
            "zone",
            "Prepare VMs for live scaling at start (with offering, template and VM flags).",
        ),
        _int(
            "kvm.cpu.dynamic.scaling.capacity",
            0,
            "cluster",
            "vCPU ceiling of a VM prepared for live scaling; 0 or -1 means the host's cores.",
            -1,
            STORE_INT_MAX,
        ),
        _int(
            "kvm.memory.dynamic.scaling.capacity",
            0,
            "cluster",
            "Memory ceiling (MiB) of a VM prepared for live scaling; 0 or -1 means the host's memory.",
            -1,
            STORE_INT_MAX,
        ),
        _bool(
            "auto.migrate.vm.on.live.scale.insufficient.capacity",
            True,
            "cluster",
            "Live-migrate a VM to a host with room when its host cannot take a live scale.",
        ),
        _float(
            "cpu.overprovisioning.factor",
            1.0,
            "cluster",
            "Multiplier of host cores for placement (1.0 = no CPU overcommit).",
            0,
            100,
            low_open=True,
        ),
        _float(
            "mem.overprovisioning.factor",
            1.0,
            "cluster",
            "Multiplier of host memory for placement (1.0 = no memory overcommit).",
            0,
            100,
            low_open=True,
        ),
        _float(
            "vmplane.overhead.ratio",
            1.0,
            "cluster",
            "Multiplier of the per-VM QEMU memory overhead model (Harvester uses 1.5).",
            0.5,
            10,
        ),
        SettingKey(
            "vmplane.placement.strategy",
            "choice",
            "spread",
            "cluster",
            "spread = least allocated host first, pack = most allocated host first.",
            choices=("spread", "pack"),
        ),
        _int(
            "vmplane.migration.max.per.cluster",
            5,
            "cluster",
            "Live migrations copying at once in a cluster; more wait in a queue.",
            1,
            1000,
        ),
        _int(
            "vmplane.migration.max.outbound.per.host",
            2,
            "cluster",
            "Live migrations leaving one host at once.",
            1,
            1000,
        ),
        _int(
            "vmplane.migration.max.inbound.per.host",
            2,
            "cluster",
            "Live migrations arriving on one host at once.",
            1,
            1000,
        ),
        _int(
            "vmplane.migration.timeout",
            600,
            "cluster",
            "Seconds a live migration may copy; at the deadline a copy still in pre-copy is aborted (KVM: switched "
            "to post-copy) and settled by asking both hosts.",
            1,
            86400,
        ),
        _int(
            "vmplane.migration.guest.timeout",
            60,
            "cluster",
            "Seconds the check after a live migration waits for the guest to answer on the target, when it "
            "answered on the source before the move.",
            1,
            86400,
        ),
        _int(
            "vmplane.migration.guest.boot.timeout",
            300,
            "cluster",
            "Seconds that check waits for a guest that had not answered on the source yet (still booting).",
            1,
            86400,
        ),
        _int(
            "vmplane.vm.shutdown.timeout",
            30,
            "cluster",
            "Seconds a stop waits for the guest to power off (asked through its guest agent, else ACPI) before "
            "forcing it off.",
            0,
            86400,
        ),
        _int(
            "vmplane.console.idle.timeout",
            900,
            "global",
            "Seconds a serial console session may stay without a keystroke or output before it is closed.",
            10,
            86400,
        ),
        _int(
            "vmplane.console.session.max",
            28800,
            "global",
            "Seconds a serial console session may last at most, busy or not.",
            10,
            604800,
        ),
        _float(
            "vmplane.host.check.interval",
            5.0,
            "global",
            "Seconds between checks that each libvirt host answers (a host that does not is marked down).",
            0.1,
            3600,
        ),
        _int(
            "vmplane.host.sync.interval",
            30,
            "global",
            "Seconds between full syncs of every host's domains with the record (the safety net for missed "
            "libvirt events).",
            1,
            3600,
        ),
        _float(
            "vmplane.unknown.settle.interval",
            10.0,
            "global",
            "Seconds between passes of the host monitor that settle every unknown VM of a host that answers from "
            "what the hosts run (running, or stopped with its charge given back).",
            0.1,
            3600,
        ),
        _float(
            "vmplane.ha.grace",
            10.0,
            "cluster",
            "Seconds a host may fail to answer before it is declared failed and fenced (a shorter blip restarts "
            "nothing).",
            0,
            3600,
        ),
        _int(
            "vmplane.ha.max.parallel",
            4,
            "cluster",
            "HA restarts run at once after a host failure (by priority, highest first).",
            1,
            1000,
        ),
        _int(
            "vmplane.ha.max.restart",
            3,
            "cluster",
            "Attempts to restart an HA VM elsewhere before it is put in the terminal error state.",
            1,
            100,
        ),
        _int(
            "vmplane.ha.lock.release.window",
            180,
            "cluster",
            "Seconds an HA restart refused on a disk lock (the failed host's lock outlives its power-off on shared "
            "storage, as an NFS lease does) is retried with backoff without spending its attempts.",
            0,
            3600,
        ),
        _int(
            "vmplane.ha.host.failures.tolerated",
            0,
            "cluster",
            "Host failures the cluster keeps room for: placement refuses a start, scale or migration that would "
            "leave too little room to restart the HA VMs of any that many hosts.",
            0,
            100,
        ),
        _int(
            "vmplane.migration.postcopy.min.bandwidth",
            64,
            "global",
            "MiB/s: the lowest post-copy bandwidth an admin may ask for a migration (a post-copy can not be "
            "aborted; at a few MiB/s it holds both hosts' slots and claims for hours).",
            1,
            1_000_000,
        ),
        _int(
            "vmplane.operation.deadline",
            1800,
            "global",
            "Seconds an operation in flight may go without a change to its record while no thread of its process "
            "carries it; past that, its process settles it through its failure path (retried with backoff) and "
            "`audit` reports it.",
            1,
            86400,
        ),
        _int(
            "vmplane.operation.history",
            10000,
            "global",
            "Finished operations kept for `operation list`.",
            0,
            10_000_000,
        ),
        _int(
            "vmplane.event.history",
            100_000,
            "global",
            "Events kept for `vmplane events` (the oldest go, in batches, once there are more).",
            0,
            10_000_000,
        ),
    ]
}


def setting_key(key: str) -> SettingKey:
    try:
        return KEYS[key]
    except KeyError:
        raise NotFound(f"unknown setting {key!r}; known: {', '.join(sorted(KEYS))}", field="key") from None


def parse_value(key: str, scope: str, raw: object) -> object:
    """Validate a value for a key at a scope; raises Invalid naming the field."""
    spec = setting_key(key)
    if scope not in SCOPES:
        raise Invalid(f"unknown scope {scope!r}; use global, zone or cluster", field="scope")
    if not spec.allows(scope):
        raise Invalid(
            f"{key} can be set at {', '.join(SCOPES[: SCOPES.index(spec.narrowest_scope) + 1])} scope, not {scope}",
            field="scope",
        )
    try:
        return spec.parse(raw)
    except ValueError as exc:
        said = str(exc) if spec.range in str(exc) else f"{exc}; accepted: {spec.range}"
        raise Invalid(f"{key} {said}", field="value") from None


def typed(key: str, raw: str) -> object:
    """A stored value as its type; a value stored before it was checked (and now refused) stays text."""
    try:
        return KEYS[key].parse(raw)
    except (KeyError, ValueError):
        return raw


def resolve(
    key: str, values: dict[tuple[str, str | None], str], zone: str | None = None, cluster: str | None = None
) -> object:
    """The effective value of `key` for a cluster in a zone.

    `values` maps (scope, scope_name) to the raw stored value, e.g. {("cluster", "c1"): "1.5",
    ("global", None): "1.0"} for this one key.
    """
    spec = setting_key(key)
    for scope, name in (("cluster", cluster), ("zone", zone), ("global", None)):
        if scope != "global" and name is None:
            continue
        raw = values.get((scope, name))
        if raw is not None:
            try:
                return spec.parse(raw)
            except ValueError:  # stored before values were checked: as if it were not set
                continue
    return spec.default
