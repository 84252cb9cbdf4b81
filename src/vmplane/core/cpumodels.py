"""Guest CPU models (issue 33): which model a VM's domain gets, and which hosts can run it (pure rules).

A cluster runs its VMs on one named CPU model so that a live migration between any two of its hosts keeps the
guest's CPU: by default the baseline of its hosts (the newest model all of them run; a libvirt driver asks
libvirt's baselineHypervisorCPU, the sim takes the oldest family of FAMILIES), or a model the admin names on
the cluster (refused unless every host runs it). An offering may name another model, or `host-model` (the host's
own CPU, as libvirt describes it: fast, but a migration to a host with another CPU may be refused).

A VM's effective model is its offering's, else its cluster's, else DEFAULT; it is fixed when the domain starts
(a migration carries the domain's XML, so a running VM keeps its model when the cluster's changes).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

DEFAULT = "qemu64"  # what every x86 QEMU runs, under KVM or TCG: the model when nothing else is known
HOST_MODEL = "host-model"
GENERIC = ("qemu64", "kvm64")  # no host feature needed: treated as runnable everywhere by the sim
# Intel's named models, oldest first: a host of one family runs every model before it (the sim's table;
# libvirt hosts report their own usable models instead)
FAMILIES = (
    "Conroe",
    "Penryn",
    "Nehalem",
    "Westmere",
    "SandyBridge",
    "IvyBridge",
    "Haswell",
    "Broadwell",
    "Skylake-Client",
    "Skylake-Server",
    "Cascadelake-Server",
    "Icelake-Server",
    "SapphireRapids",
)
SIM_FAMILY = "Broadwell"  # a sim host's family when none is given
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")


def check_name(model: str, field: str = "cpu_model") -> str | None:
    """Why `model` is not a CPU model's name (None: it is one). libvirt's names are letters, digits, `_.-`."""
    if not _NAME.fullmatch(model):
        return f"{field} must be a CPU model name (letters, digits, _ . -; at most 63), not {model!r}"
    return None


def check_offering_model(model: str | None) -> str | None:
    """Why an offering's `cpu_model` is refused: null (the cluster's), `host-model` or a named model."""
    return None if model is None or model == HOST_MODEL else check_name(model)


def check_cluster_model(model: str | None) -> str | None:
    """Why a cluster's `cpu_model` is refused: null (its hosts' baseline) or a named model; never host-model
    (a cluster's model exists so that its VMs can move between its hosts)."""
    if model == HOST_MODEL:
        return (
            "a cluster's cpu_model is a named model (or null: its hosts' baseline); host-model is for an "
            "offering: it would tie each VM to its host's CPU"
        )
    return None if model is None else check_name(model)


def runnable(family: str) -> tuple[str, ...]:
    """What a (sim) host of `family` runs: the generic models, its family and every older one."""
    if family in FAMILIES:
        return GENERIC + FAMILIES[: FAMILIES.index(family) + 1]
    return GENERIC + (family,)


def family_baseline(families: Iterable[str]) -> str:
    """The newest model every host of `families` runs by the family table (the sim's baseline): the oldest
    family; DEFAULT when a family is not in the table (or there is no host)."""
    known = list(families)
    if not known or any(f not in FAMILIES for f in known):
        return DEFAULT
    return min(known, key=FAMILIES.index)


def common_usable(usable: Mapping[str, Iterable[str]]) -> set[str]:
    """The models every host runs ({host: its usable models})."""
    sets = [set(models) for models in usable.values()]
    return set.intersection(*sets) if sets else set()


def choose_baseline(baseline: str, usable: Mapping[str, Iterable[str]]) -> tuple[str, str]:
    """(model, why) of a cluster's baseline: the hypervisor's `baseline` when every host runs it as a plain named
    model, else the newest model of FAMILIES they all run (a baseline may need feature changes a named model does
    not carry: libvirt's baseline under TCG), else DEFAULT. `why` is "" when the baseline is used as it is."""
    if not usable:
        return DEFAULT, "the cluster has no host: the default model"
    common = common_usable(usable)
    if baseline in common:
        return baseline, ""
    older = [m for m in FAMILIES if m in common]
    model = older[-1] if older else DEFAULT
    short = [host for host, models in sorted(usable.items()) if baseline not in set(models)]
    return model, (
        f"the hosts' baseline {baseline} is not usable as a named model on {', '.join(short)} (it needs feature "
        f"changes, as under TCG, software emulation, where the baseline is QEMU's own CPU); {model} is the newest "
        f"model every host runs"
    )


def cannot_run(model: str, usable: Mapping[str, Iterable[str] | None]) -> list[str]:
    """The hosts that can not run `model` ({host: usable models, None when the host did not say: not
    counted}), in name order. host-model runs anywhere (as each host's own CPU)."""
    if model == HOST_MODEL:
        return []
    return [host for host, models in sorted(usable.items()) if models is not None and model not in set(models)]


def effective(offering_model: str | None, cluster_model: str | None, cluster_baseline: str | None) -> str:
    """A VM's CPU model at its start: its offering's, else its cluster's (the admin's, else the baseline)."""
    return offering_model or cluster_model or cluster_baseline or DEFAULT


def split(models: str | None) -> tuple[str, ...] | None:
    """A host's stored usable models ("a b c") as a tuple; None when it never said (a host of before)."""
    return None if models is None else tuple(models.split())


def migration_problem(
    vm: str, model: str | None, source: tuple[str, str | None], target: tuple[str, str | None, tuple[str, ...] | None]
) -> str | None:
    """Why a VM running CPU `model` can not live-migrate from `source` (name, its own model) to `target` (name,
    its own model, its usable models), or None. A host that never described its CPU, or a VM started before
    models were recorded, is not checked. A host-model guest has its source host's CPU: the target must have the
    same model, or run it as a named model."""
    if model is None:
        return None
    target_name, target_model, usable = target
    if model == HOST_MODEL:
        need = source[1]
        if need is None or target_model is None or need == target_model or (usable and need in usable):
            return None
        return (
            f"vm {vm} runs with host-model, the CPU of {source[0]} ({need}); {target_name} has {target_model} and "
            f"can not run it: migrate it to a host with the same CPU, or start it again with a named model"
        )
    if usable is None or model in usable:
        return None
    return f"{target_name} can not run CPU model {model}, which vm {vm} runs ({target_name} runs {', '.join(usable)})"
