"""The rules of `volume move` and cold migration (core/volumemoves.py), over thousands of generated cases: a plan
never moves a volume into a pool without room, never live into a pool its VM's host does not see, never a chain
or a volume in a step, never an HA VM's disk onto a local pool; a refusal always names a field; a cold
migration's disks all end on pools the target host opens, never overfilled."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from vmplane.core import volumemoves as M
from vmplane.core.storagerules import PoolView

HOSTS = ("h1", "h2", "h3")


def pool(name: str, kind: str, host: str | None, free: int, state: str = "running", cluster: str = "c1") -> PoolView:
    return PoolView(name, kind, cluster, host if kind == "local" else None, f"/p/{name}", state, 1000, 1000 - free)


def hosts_of(p: PoolView) -> frozenset[str]:
    return frozenset({p.host}) if p.kind == "local" else frozenset(HOSTS if p.cluster == "c1" else ("x1",))


pools = st.builds(
    pool,
    name=st.sampled_from(["a", "b", "c"]),
    kind=st.sampled_from(["local", "shared"]),
    host=st.sampled_from(HOSTS),
    free=st.integers(-10, 600),
    state=st.sampled_from(["running", "running", "inactive"]),
    cluster=st.sampled_from(["c1", "c1", "c2"]),
)


@st.composite
def requests(draw) -> M.MoveRequest:
    source, target = draw(pools), draw(pools)
    vm = draw(st.sampled_from([None, "web"]))
    vm_state = draw(st.sampled_from(["running", "stopped", "migrating", "starting"])) if vm else None
    return M.MoveRequest(
        volume="v",
        state=draw(st.sampled_from(["attached" if vm else "available", "moving", "creating", "resizing"])),
        size_mib=draw(st.integers(1, 500)),
        source=source,
        target=target,
        source_hosts=hosts_of(source),
        target_hosts=hosts_of(target),
        overlays=draw(st.sampled_from([0, 0, 0, 2])),
        copying=draw(st.sampled_from([None, None, "x"])),
        vm=vm,
        vm_state=vm_state,
        vm_host=draw(st.sampled_from(HOSTS)) if vm_state == "running" else None,
        ha=draw(st.booleans()) if vm else False,
        others_reach=draw(st.sampled_from([None, frozenset(HOSTS), frozenset({"h1"}), frozenset()])) if vm else None,
        across_hosts=draw(st.booleans()),
    )


@settings(max_examples=400, deadline=None)
@given(requests())
def test_a_plan_is_only_made_when_every_rule_holds_and_a_refusal_names_a_field(r):
    plan = M.plan_move(r)
    if isinstance(plan, M.Refusal):
        assert plan.field in ("pool", "volume", "vm") and plan.kind in ("invalid", "conflict", "capacity")
        assert plan.message
        return
    assert r.target.name != r.source.name and r.target.state == "running"
    assert r.state in ("attached", "available") and r.copying is None and r.overlays == 0
    assert r.target.free_mib >= r.size_mib  # a pool is never overfilled
    assert not (r.ha and r.target.kind == "local")
    assert r.others_reach is None or r.others_reach & r.target_hosts  # its VM can still start somewhere
    if r.vm_state == "running":
        assert plan.how == M.LIVE and plan.hosts == (r.vm_host,) and r.vm_host in r.target_hosts
    elif plan.how == M.COLD:
        assert set(plan.hosts) and set(plan.hosts) <= r.source_hosts & r.target_hosts
    else:
        assert plan.how == M.ACROSS and r.across_hosts and not (r.source_hosts & r.target_hosts)
        assert plan.hosts[0] in r.source_hosts and plan.hosts[1] in r.target_hosts


def test_the_refusals_a_user_meets_say_why():
    shared, local1 = pool("s", "shared", None, 500), pool("l1", "local", "h1", 500)
    local2 = pool("l2", "local", "h2", 9)
    base = M.MoveRequest("v", "attached", 100, shared, local1, hosts_of(shared), hosts_of(local1), vm="web")
    running = replace(base, vm_state="running", vm_host="h2")
    assert "runs on h2, which does not see pool l1" in M.plan_move(running).message
    same = M.plan_move(replace(running, target=shared))
    assert (same.kind, same.field) == ("invalid", "pool")
    full = M.plan_move(replace(running, target=local2, target_hosts=hosts_of(local2)))
    assert (full.kind, full.field) == ("capacity", "pool") and "9 MiB free" in full.message
    cold = M.plan_move(M.MoveRequest("v", "available", 100, local2, local1, hosts_of(local2), hosts_of(local1)))
    assert (cold.field, "no host sees both" in cold.message) == ("pool", True)
    assert M.plan_move(replace(running, target_hosts=frozenset(HOSTS))) == M.MovePlan(M.LIVE, ("h2",))


disks = st.lists(st.tuples(st.integers(1, 400), st.sampled_from(["s", "l1", "l2", "o"])), min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(disks, st.integers(0, 900), st.integers(0, 900), st.sampled_from(["h1", "h2"]))
def test_a_cold_migrations_disks_all_end_where_the_target_opens_them_and_no_pool_is_overfilled(ds, free2, free3, to):
    pools_ = [
        pool("s", "shared", None, 1000),
        pool("o", "shared", None, 1000, cluster="c2"),
        pool("l1", "local", "h1", 1000),
        pool("l2", "local", "h2", free2),
        pool("l2b", "local", "h2", free3),
        pool("l1b", "local", "h1", free3),
    ]
    by = {p.name: p for p in pools_}
    named = [(f"d{i}", size, by[p]) for i, (size, p) in enumerate(ds)]
    plan = M.plan_cold_migration("web", named, pools_, to, "c1")
    if isinstance(plan, M.Refusal):
        assert plan.field == "to" and plan.message
        return
    taken: dict[str, int] = {}
    for follow, (name, size, src) in zip(plan, named, strict=True):
        assert follow.volume == name and follow.source == src.name
        end = by[follow.target or follow.source]
        assert end.reaches(to, "c1")
        if follow.target is not None:
            assert src.kind == "local" and src.host != to and end.kind == "local"
            taken[end.name] = taken.get(end.name, 0) + size
        else:
            assert src.reaches(to, "c1")
    assert all(taken[p] <= by[p].free_mib for p in taken)
