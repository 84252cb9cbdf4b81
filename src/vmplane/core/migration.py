"""Live migration rules (docs/design/migration.md): the state machine, the concurrency limits, the policy (pure).

A migration is a persisted object (as in KubeVirt): the orchestrator looks up (state, event) here,
persists the new state, then performs the actions. The ledger is never among the actions: a
migration does not change project usage; only host claims move.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vmplane.core.driver import DomainInfo, MigrationParams
from vmplane.core.errors import Conflict


class MigrationState(str, enum.Enum):
    queued = "queued"  # admitted, target claimed, waiting for a slot under the limits
    copying = "copying"  # libvirt is copying memory to the target
    checking = "checking"  # switched over: the guest is asked whether it is healthy on the target
    succeeded = "succeeded"
    failed = "failed"  # the VM keeps running on the source; the target claim is released
    # the VM moved (it runs on the target, the claims followed it) but its guest did not answer the check
    # there: never `failed`, which says the VM stayed where it was
    moved_unhealthy = "moved-unhealthy"
    cancelled = "cancelled"
    # switched over, then the copy broke: the guest is paused on one or both hosts (libvirt's
    # PAUSED_POSTCOPY_FAILED); both claims are kept, the VM stays `migrating`, resume is retried
    postcopy_failed = "postcopy-failed"


ACTIVE = frozenset(
    {MigrationState.queued, MigrationState.copying, MigrationState.checking, MigrationState.postcopy_failed}
)
COPYING = frozenset({MigrationState.copying, MigrationState.checking})  # they hold a slot under the limits
SETTLING = frozenset({MigrationState.copying, MigrationState.checking, MigrationState.postcopy_failed})


class Action(str, enum.Enum):
    start_copy = "start-copy"
    abort_copy = "abort-copy"
    check_guest = "check-guest"
    move_claims = "move-claims"  # VM.host = target; the source claim is released
    release_target = "release-target"  # the target claim is released; the VM stays on the source


# (state, event) -> (new state, actions)
TRANSITIONS: dict[tuple[MigrationState, str], tuple[MigrationState, tuple[Action, ...]]] = {
    (MigrationState.queued, "slot-free"): (MigrationState.copying, (Action.start_copy,)),
    (MigrationState.queued, "cancel"): (MigrationState.cancelled, (Action.release_target,)),
    (MigrationState.queued, "host-lost"): (MigrationState.failed, (Action.release_target,)),
    (MigrationState.copying, "cancel"): (MigrationState.copying, (Action.abort_copy,)),
    (MigrationState.copying, "copied"): (MigrationState.checking, (Action.check_guest,)),
    (MigrationState.copying, "copy-failed"): (MigrationState.failed, (Action.release_target,)),
    (MigrationState.copying, "copy-cancelled"): (MigrationState.cancelled, (Action.release_target,)),
    (MigrationState.checking, "guest-healthy"): (MigrationState.succeeded, (Action.move_claims,)),
    # the domain runs on the target (libvirt undefined the source): claims follow it, the outcome says so
    (MigrationState.checking, "guest-unhealthy"): (MigrationState.moved_unhealthy, (Action.move_claims,)),
    # settled by asking both hosts (settle_outcome/settle_event below)
    (MigrationState.copying, "postcopy-failed"): (MigrationState.postcopy_failed, ()),
    (MigrationState.checking, "postcopy-failed"): (MigrationState.postcopy_failed, ()),
    (MigrationState.postcopy_failed, "resumed"): (MigrationState.checking, (Action.check_guest,)),
    (MigrationState.checking, "stayed"): (MigrationState.failed, (Action.release_target,)),
    (MigrationState.postcopy_failed, "stayed"): (MigrationState.failed, (Action.release_target,)),
    # on neither host: the target claim goes; a migrating VM is recorded stopped in the same transaction
    # (unknown on a fenced source, for its recovery: Migrator._settle_gone), a scaling one is left to its scale
    (MigrationState.copying, "gone"): (MigrationState.failed, (Action.release_target,)),
    (MigrationState.checking, "gone"): (MigrationState.failed, (Action.release_target,)),
    (MigrationState.postcopy_failed, "gone"): (MigrationState.failed, (Action.release_target,)),
}


def transition(state: MigrationState, event: str) -> tuple[MigrationState, tuple[Action, ...]]:
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise Conflict(f"a migration that is {state.value} can not take {event!r}", field="state") from None


class Outcome(str, enum.Enum):
    """Where a migration's domain is, from what both hosts say (settle_outcome)."""

    moved = "moved"  # a QEMU holds it on the target only
    stayed = "stayed"  # a QEMU holds it on the source only
    postcopy_failed = "postcopy-failed"  # either side reports a failed post-copy
    gone = "gone"  # no QEMU holds it on either host
    unclear = "unclear"  # both hold it (libvirt still copies or cleans up): ask again


def _postcopy_failed(info: DomainInfo | None) -> bool:
    return info is not None and info.reason == "postcopy-failed"


INCOMING_REASONS = frozenset({"migration", "starting-up"})


def incoming(info: DomainInfo | None) -> bool:
    """A target's domain that an incoming migration created and never resumed (libvirt's
    VIR_DOMAIN_PAUSED_MIGRATION / _STARTING_UP): a QEMU that waits for the guest's memory. It has never
    run the guest; libvirt destroys it when the source's job fails, or when its keepalive notices a
    source that lost its power (about 30 s, never with keepalive off)."""
    return info is not None and info.state == "paused" and info.reason in INCOMING_REASONS


def settle_outcome(on_source: DomainInfo | None, on_target: DomainInfo | None, source_off: bool = False) -> Outcome:
    """Where the domain is, from both hosts' answers (None: the host confirmed it has no such domain;
    a host that can not be asked never gets here; `source_off`: the source is fenced and does not
    answer, known off). `active` (a QEMU exists: running or paused) decides, not `running`: a paused
    target holds the guest and its memory after the switch-over. Before it, a target paused as an
    incoming domain (incoming()) holds nothing of the guest: with the source running it, the VM stayed;
    with the source off, the guest is lost (gone: it is restarted from the source's disks); with a
    source that answers without it, libvirt is still cleaning up: asked again."""
    if _postcopy_failed(on_source) or _postcopy_failed(on_target):
        return Outcome.postcopy_failed
    source = on_source is not None and on_source.active
    if incoming(on_target):
        if source:
            return Outcome.stayed
        return Outcome.gone if source_off else Outcome.unclear
    target = on_target is not None and on_target.active
    if target and not source:
        return Outcome.moved
    if source and not target:
        return Outcome.stayed
    if not source and not target:
        return Outcome.gone
    return Outcome.unclear


_SETTLE_EVENTS: dict[tuple[MigrationState, Outcome], str] = {
    (MigrationState.copying, Outcome.moved): "copied",
    (MigrationState.copying, Outcome.stayed): "copy-failed",
    (MigrationState.copying, Outcome.postcopy_failed): "postcopy-failed",
    (MigrationState.copying, Outcome.gone): "gone",
    (MigrationState.checking, Outcome.stayed): "stayed",
    (MigrationState.checking, Outcome.postcopy_failed): "postcopy-failed",
    (MigrationState.checking, Outcome.gone): "gone",
    (MigrationState.postcopy_failed, Outcome.moved): "resumed",
    (MigrationState.postcopy_failed, Outcome.stayed): "stayed",
    (MigrationState.postcopy_failed, Outcome.gone): "gone",
}


def settle_event(state: MigrationState, outcome: Outcome, cancelled: bool = False) -> str | None:
    """The event a migration found in `state` (read under the lock) takes for `outcome`; None: no
    change (unclear; a checking migration whose domain moved goes on to the guest check; a
    post-copy failure that persists; a migration that is not being settled)."""
    event = _SETTLE_EVENTS.get((state, outcome))
    if event == "copy-failed" and cancelled:
        return "copy-cancelled"
    return event


# N11: tuning a migration's copy is an operator's call. A member picks a named policy only; a post-copy
# pulls the guest's memory at no less than the floor (a post-copy can not be aborted: at 1 MiB/s a 16 GiB
# guest holds both hosts' slots and claims for hours). The floor is `vmplane.migration.postcopy.min.bandwidth`.
TUNING_FIELDS = ("bandwidth_mib_s", "postcopy", "max_downtime_ms", "postcopy_bandwidth_mib_s")
POSTCOPY_BANDWIDTH_FLOOR_MIB_S = 64  # the setting's default
POSTCOPY_FLOOR_KEY = "vmplane.migration.postcopy.min.bandwidth"


def tuning_refusal(
    asked: dict[str, Any], admin: bool, floor_mib_s: int = POSTCOPY_BANDWIDTH_FLOOR_MIB_S
) -> tuple[str, str, str] | None:
    """Why a migration request's tuning is refused, or None: (kind "forbidden"|"invalid", field, message).
    `asked`: the tuning fields the request sets (None values left out); `floor_mib_s`: the post-copy floor."""
    given = [f for f in TUNING_FIELDS if asked.get(f) is not None]
    if given and not admin:
        return (
            "forbidden",
            given[0],
            f"tuning a migration ({given[0]}) needs an admin token; choose a named "
            f"policy (`policy`: vmplane or hypervisor-default)",
        )
    bandwidth = asked.get("postcopy_bandwidth_mib_s")
    if bandwidth is not None and bandwidth < floor_mib_s:
        return (
            "invalid",
            "postcopy_bandwidth_mib_s",
            f"a post-copy bandwidth of {bandwidth} MiB/s is below the floor of {floor_mib_s} MiB/s "
            f"({POSTCOPY_FLOOR_KEY}): a post-copy can not be aborted, and would hold both hosts for hours",
        )
    return None


def past_deadline(elapsed_s: float, timeout_s: float) -> bool:
    """Whether a copy running for `elapsed_s` is past `vmplane.migration.timeout`."""
    return elapsed_s >= timeout_s


@dataclass(frozen=True)
class Limits:
    per_cluster: int = 5
    outbound_per_host: int = 2
    inbound_per_host: int = 2
    per_project: int | None = None  # None = unlimited


@dataclass(frozen=True)
class MigrationSlot:
    """What the limits need to know of a migration."""

    id: str
    cluster: str
    source: str
    target: str
    project: str


def _count(n: int) -> str:
    return f"{n} migration" if n == 1 else f"{n} migrations"


def host_lost(source: str, target: str, states: dict[str, str]) -> str | None:
    """Why a migration must not copy now, or None: its source or target is recorded down, fencing or
    fenced (`states`: host name -> state, for such hosts). A fenced host may be powered on again (repaired)
    while its recovery still runs: a copy into it would run the VM there while the recovery, which takes
    everything on it for off, restarts it elsewhere."""
    for role, host in (("target", target), ("source", source)):
        if host in states:
            return (
                f"not copied: its {role} {host} is {states[host]} (it failed; vmplane copies nothing into or "
                f"out of it until it is back)"
            )
    return None


def blocking_limit(candidate: MigrationSlot, copying: list[MigrationSlot], limits: Limits) -> str | None:
    """The limit that keeps `candidate` queued while `copying` migrations run, or None if it may start."""
    in_cluster = sum(m.cluster == candidate.cluster for m in copying)
    if in_cluster >= limits.per_cluster:
        return (
            f"{_count(in_cluster)} copying in cluster {candidate.cluster} (limit {limits.per_cluster}, "
            f"vmplane.migration.max.per.cluster)"
        )
    outbound = sum(m.source == candidate.source for m in copying)
    if outbound >= limits.outbound_per_host:
        return (
            f"{_count(outbound)} leaving {candidate.source} (limit {limits.outbound_per_host}, "
            f"vmplane.migration.max.outbound.per.host in cluster {candidate.cluster})"
        )
    inbound = sum(m.target == candidate.target for m in copying)
    if inbound >= limits.inbound_per_host:
        return (
            f"{_count(inbound)} arriving on {candidate.target} (limit {limits.inbound_per_host}, "
            f"vmplane.migration.max.inbound.per.host in cluster {candidate.cluster})"
        )
    if limits.per_project is not None:
        mine = sum(m.project == candidate.project for m in copying)
        if mine >= limits.per_project:
            return f"{_count(mine)} of project {candidate.project} copying (limit {limits.per_project})"
    return None


def startable(
    queued: list[MigrationSlot], copying: list[MigrationSlot], limits_of: Callable[[MigrationSlot], Limits]
) -> list[MigrationSlot]:
    """Queued migrations that may start now, in queue order, each counted against the limits as it starts."""
    running = list(copying)
    chosen = []
    for m in queued:
        if blocking_limit(m, running, limits_of(m)) is None:
            chosen.append(m)
            running.append(m)
    return chosen


def policy(accel: str) -> MigrationParams:
    """Migration parameters by accelerator, from measurements on these machines (docs/design/migration.md,
    "Policy per accelerator").

    TCG: pre-copy of a guest that writes memory corrupted it in some runs; post-copy switched on during
    the first pass was healthy 13/13 (switched later: 2/8). So: a capped pre-copy bandwidth so that the
    first pass is still running after 1 s, then post-copy at full speed.
    KVM: pre-copy with a 500 ms downtime limit and auto-converge (QEMU throttles a guest that dirties
    memory faster than the link); post-copy is allowed but only switched to at the deadline
    (`vmplane.migration.timeout`), so that a copy that never converges still ends.
    Under either, a copy still in pre-copy at the deadline is aborted (on KVM: switched to post-copy)."""
    if accel == "kvm":
        return MigrationParams(
            bandwidth_mib_s=None, max_downtime_ms=500, postcopy=True, auto_converge=True, timeout_action="postcopy"
        )
    return MigrationParams(
        bandwidth_mib_s=64,
        max_downtime_ms=None,
        postcopy=True,
        postcopy_after_s=1.0,
        postcopy_bandwidth_mib_s=10000,
        timeout_action="abort",
    )
