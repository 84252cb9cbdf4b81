"""Settings keys, their types, defaults and scopes, and how a value resolves (pure).

A value set at cluster scope wins over zone, zone over global, global over the default. Each key
names the narrowest scope it may be set at; it can always be set at a wider one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .errors import Invalid, NotFound

SCOPES = ("global", "zone", "cluster")


def _bool(text: str) -> bool:
    lowered = str(text).strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not a boolean (true/false)")


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"{text!r} must be greater than 0")
    return value


def _int(text: str) -> int:
    return int(str(text).strip())


def _non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise ValueError(f"{text!r} must be 0 or more")
    return value


def _positive_int(text: str) -> int:
    value = _int(text)
    if value <= 0:
        raise ValueError(f"{text!r} must be greater than 0")
    return value


def _strategy(text: str) -> str:
    if text not in ("spread", "pack"):
        raise ValueError(f"{text!r} is not a placement strategy (spread or pack)")
    return text


@dataclass(frozen=True)
class SettingKey:
    key: str
    parse: Callable[[str], object]
    default: object
    narrowest_scope: str
    description: str

    def allows(self, scope: str) -> bool:
        return SCOPES.index(scope) <= SCOPES.index(self.narrowest_scope)


KEYS: dict[str, SettingKey] = {k.key: k for k in [
    SettingKey("enable.dynamic.scale.vm", _bool, False, "zone",
               "Prepare VMs for live scaling at start (with offering, template and VM flags)."),
    SettingKey("kvm.cpu.dynamic.scaling.capacity", _int, 0, "cluster",
               "vCPU ceiling of a VM prepared for live scaling; <= 0 means the host's cores."),
    SettingKey("kvm.memory.dynamic.scaling.capacity", _int, 0, "cluster",
               "Memory ceiling (MiB) of a VM prepared for live scaling; <= 0 means the host's memory."),
    SettingKey("auto.migrate.vm.on.live.scale.insufficient.capacity", _bool, True, "cluster",
               "Live-migrate a VM to a host with room when its host cannot take a live scale."),
    SettingKey("cpu.overprovisioning.factor", _positive_float, 1.0, "cluster",
               "Multiplier of host cores for placement (1.0 = no CPU overcommit)."),
    SettingKey("mem.overprovisioning.factor", _positive_float, 1.0, "cluster",
               "Multiplier of host memory for placement (1.0 = no memory overcommit)."),
    SettingKey("vmplane.overhead.ratio", _positive_float, 1.0, "cluster",
               "Multiplier of the per-VM QEMU memory overhead model (Harvester uses 1.5)."),
    SettingKey("vmplane.placement.strategy", _strategy, "spread", "cluster",
               "spread = least allocated host first, pack = most allocated host first."),
    SettingKey("vmplane.migration.max.per.cluster", _positive_int, 5, "cluster",
               "Live migrations copying at once in a cluster; more wait in a queue."),
    SettingKey("vmplane.migration.max.outbound.per.host", _positive_int, 2, "cluster",
               "Live migrations leaving one host at once."),
    SettingKey("vmplane.migration.max.inbound.per.host", _positive_int, 2, "cluster",
               "Live migrations arriving on one host at once."),
    SettingKey("vmplane.vm.shutdown.timeout", _non_negative_int, 30, "cluster",
               "Seconds a stop waits for the guest to power off (ACPI) before forcing it off."),
    SettingKey("vmplane.host.check.interval", _positive_float, 5.0, "global",
               "Seconds between checks that each libvirt host answers (a host that does not is marked down)."),
    SettingKey("vmplane.operation.history", _non_negative_int, 10000, "global",
               "Finished operations kept for `operations list`."),
]}


def setting_key(key: str) -> SettingKey:
    try:
        return KEYS[key]
    except KeyError:
        raise NotFound(f"unknown setting {key!r}; known: {', '.join(sorted(KEYS))}", field="key") from None


def parse_value(key: str, scope: str, raw: str) -> object:
    """Validate a value for a key at a scope; raises Invalid naming the field."""
    spec = setting_key(key)
    if scope not in SCOPES:
        raise Invalid(f"unknown scope {scope!r}; use global, zone or cluster", field="scope")
    if not spec.allows(scope):
        raise Invalid(f"{key} can be set at {', '.join(SCOPES[:SCOPES.index(spec.narrowest_scope) + 1])} "
                      f"scope, not {scope}", field="scope")
    try:
        return spec.parse(raw)
    except (TypeError, ValueError) as exc:
        raise Invalid(f"{key}: {exc}", field="value") from None


def resolve(key: str, values: dict[tuple[str, str | None], str], zone: str | None = None,
            cluster: str | None = None) -> object:
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
            return spec.parse(raw)
    return spec.default
