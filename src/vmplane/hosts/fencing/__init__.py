"""Fence agents: building them from a host's configuration (base.py says what an agent is).

One module per agent (local, ipmi, redfish, and sim for simulated hosts), each with
`from_config(config, uri, name) -> FenceAgent`, imported only when used: an ipmi-only cluster does
not need sushy, a real one never loads the sim fabric. `validate` checks a host's agent list when
the API takes it, so that a typo ("passwd") is refused then, not found when the host has died.
"""

from __future__ import annotations

import importlib

from vmplane.hosts.fencing.base import FenceAgent, Fenced, FenceError

__all__ = ["FenceAgent", "FenceError", "Fenced", "agent_for", "default_agents", "validate"]

# agent -> {field: (type, default)}; a default of ... means the field is required
_FIELDS: dict[str, dict[str, tuple[type, object]]] = {
    "local": {},
    "sim": {},
    "ipmi": {
        "address": (str, ...),
        "port": (int, 623),
        "username": (str, ...),
        "password": (str, ...),
        "cipher": (int, 3),
    },
    "redfish": {
        "address": (str, ...),
        "system": (str, ""),
        "username": (str, ...),
        "password": (str, ...),
        "verify": (bool, True),
    },
}


def _normalise(config: dict, where: str) -> dict:
    if not isinstance(config, dict):
        raise ValueError(f'{where}: a fence agent is an object with an "agent" field')
    agent = config.get("agent")
    if agent not in _FIELDS:
        raise ValueError(f"{where}.agent: must be one of {', '.join(sorted(_FIELDS))}, not {agent!r}")
    fields = _FIELDS[agent]
    unknown = sorted(set(config) - set(fields) - {"agent"})
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: not a field of the {agent} agent")
    out: dict = {"agent": agent}
    for field, (kind, default) in fields.items():
        value = config.get(field, default)
        if value is ...:
            raise ValueError(f"{where}.{field}: required by the {agent} agent")
        # bool is an int in Python: a port of `true` is a mistake, not 1
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"{where}.{field}: must be a {kind.__name__}")
        out[field] = value
    if agent in ("ipmi", "redfish") and not out["address"].strip():
        raise ValueError(f"{where}.address: must not be empty")
    if agent == "ipmi" and not 0 < out["port"] < 65536:
        raise ValueError(f"{where}.port: must be 1..65535")
    if agent == "redfish" and not out["address"].startswith(("http://", "https://")):
        raise ValueError(f"{where}.address: must start with http:// or https://")
    return out


def validate(configs: list[dict]) -> list[dict]:
    """The host's fence agents, normalised (defaults filled in); ValueError naming the bad field."""
    if not isinstance(configs, list):
        raise ValueError("fence_agents: must be a list")
    return [_normalise(c, f"fence_agents[{i}]") for i, c in enumerate(configs)]


def agent_for(config: dict, uri: str | None, name: str) -> FenceAgent:
    """The agent a config describes, for host `name` reached at libvirt `uri`."""
    config = _normalise(config, "fence_agent")
    module = importlib.import_module(f"{__name__}.{config['agent']}")
    return module.from_config(config, uri, name)


def default_agents(driver: str, uri: str | None) -> list[dict] | None:
    """A new host's fence agents: a sim host's is the sim fabric, a local host's its own processes;
    a remote host has none until an operator configures its BMC (`vmplane host fence-agents`)."""
    if driver == "sim":
        return [{"agent": "sim"}]
    from vmplane.hosts.localhosts import from_uri

    return [{"agent": "local"}] if uri and from_uri(uri) is not None else None
