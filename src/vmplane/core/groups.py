"""Placement groups (Nova server groups, CloudStack affinity groups): pure rules.

A group of one project's VMs has a policy, `affinity` (its VMs together on one host) or
`anti-affinity` (each on a different host), hard (a placement that breaks it is refused) or soft (a
placement that keeps it is preferred; one that breaks it is still made when nothing else fits).
The rule for one placement is a GroupRule: the group and where its OTHER members are placed (the
VM being placed is left out, so a migration or restart does not count its own old host). An
affinity group with no member placed yet allows any host; the first member then sets the host.
"""

from __future__ import annotations

from dataclasses import dataclass

AFFINITY, ANTI_AFFINITY = "affinity", "anti-affinity"
POLICIES = (AFFINITY, ANTI_AFFINITY)


@dataclass(frozen=True)
class GroupRule:
    """One group's policy and its other members' hosts: `placed` is (vm name, host name) pairs."""

    name: str
    policy: str
    hard: bool = True
    placed: tuple[tuple[str, str], ...] = ()

    def on(self, host: str) -> list[str]:
        """Names of the members on `host`."""
        return sorted(vm for vm, h in self.placed if h == host)

    @property
    def hosts(self) -> frozenset[str]:
        return frozenset(h for _, h in self.placed)


def _listed(names: list[str]) -> str:
    return ", ".join(names)


def breaks(rule: GroupRule, host: str) -> str | None:
    """Why placing a member on `host` breaks the group's policy (whatever hard says), or None."""
    if rule.policy == ANTI_AFFINITY:
        here = rule.on(host)
        if here:
            return f"anti-affinity group {rule.name} already has {_listed(here)} on {host}"
        return None
    if rule.policy == AFFINITY:
        hosts = rule.hosts
        if hosts and host not in hosts:
            where = "; ".join(f"{_listed(rule.on(h))} on {h}" for h in sorted(hosts))
            return f"affinity group {rule.name} has its VMs elsewhere ({where})"
        return None
    raise ValueError(f"unknown group policy {rule.policy!r}")


def refusal(rule: GroupRule | None, host: str) -> str | None:
    """Why a hard group refuses `host`, or None (no group, a soft group, or a host that keeps it)."""
    if rule is None or not rule.hard:
        return None
    return breaks(rule, host)


def preference(rule: GroupRule | None, host: str) -> float:
    """How well `host` keeps a soft group, in [0, 1] (1: keeps it; hard groups and no group: 1, their
    filter already decided). Soft anti-affinity: 1 / (1 + members on the host), so the host with the
    fewest members wins when every host has some; soft affinity: the share of placed members on the
    host (1 when none is placed yet)."""
    if rule is None or rule.hard:
        return 1.0
    here = len(rule.on(host))
    if rule.policy == ANTI_AFFINITY:
        return 1.0 / (1 + here)
    if rule.policy == AFFINITY:
        return 1.0 if not rule.placed else here / len(rule.placed)
    raise ValueError(f"unknown group policy {rule.policy!r}")


def describe(policy: str, hard: bool) -> str:
    return f"{policy} ({'hard' if hard else 'soft'})"
