"""Invariants of the ledger and the claims, checked against the store and the capacity index."""

from __future__ import annotations

from sqlalchemy import func, select

from .catalog import ledger_of, quota_of
from .model import CHARGED_STATES, VmState
from .placement import CapacityIndex
from .store import Database
from .store.schema import Claim, Host, Project, Vm


def audit(db: Database, recomputed_usage, index: CapacityIndex | None = None) -> list[str]:
    """Every broken invariant, in words (empty when all hold):
    ledger == usage recomputed from the VMs, and within quota; host usage == sum of its claims
    (== the index); a charged VM has exactly one claim and a host; an uncharged VM holds nothing."""
    problems = []
    with db.read() as s:
        for p in s.scalars(select(Project)):
            ledger, again = ledger_of(p), recomputed_usage(s, p)
            if ledger != again:
                problems.append(f"project {p.name}: ledger {ledger} != recomputed {again}")
            for r in ("vcpus", "memory_mib", "vms"):
                if getattr(ledger, r) > getattr(quota_of(p), r):
                    problems.append(f"project {p.name}: {r} {getattr(ledger, r)} above quota")
        sums = {hid: (c, m) for hid, c, m in s.execute(
            select(Claim.host_id, func.sum(Claim.vcpus), func.sum(Claim.memory_mib)).group_by(Claim.host_id))}
        for h in s.scalars(select(Host)).unique():
            c, m = sums.get(h.id, (0, 0))
            if (h.used_vcpus, h.used_memory_mib) != (c, m):
                problems.append(f"host {h.name}: used {h.used_vcpus}/{h.used_memory_mib} != claims {c}/{m}")
            if index is not None and h.name in index:
                ix = index.host(h.name)
                if (ix.used_vcpus, ix.used_memory_mib) != (h.used_vcpus, h.used_memory_mib):
                    problems.append(f"host {h.name}: index {ix.used_vcpus}/{ix.used_memory_mib} != store")
        claims = dict(s.execute(select(Claim.vm_id, func.count()).group_by(Claim.vm_id)).all())
        for vm_id, name, state, host_id, cv, cm in s.execute(
                select(Vm.id, Vm.name, Vm.state, Vm.host_id, Vm.charged_vcpus, Vm.charged_memory_mib)):
            n = claims.get(vm_id, 0)
            if VmState(state) in CHARGED_STATES:
                if host_id is None or n != 1:
                    problems.append(f"vm {name}: {state} with {n} claims on host {host_id}")
            elif n or cv or cm:
                problems.append(f"vm {name}: {state} still holds {n} claims / a charge")
    return problems
