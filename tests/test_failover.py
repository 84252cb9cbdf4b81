"""Failover capacity (failover.py): the aggregate bound against brute force over every k-subset."""

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from vmplane.core.failover import Load, assess, breaking_mask, reserve_message, would_break
from vmplane.core.model import HostCapacity, HostState


def host(name, cores=8, memory=8192, used_vcpus=0, used_memory=0, state=HostState.enabled):
    return HostCapacity(name, "c1", state, cores, memory, used_vcpus=used_vcpus, used_memory_mib=used_memory)


def brute(hosts, ha, k):
    """Survives iff for every set of min(k, n) counted hosts, the HA load fits in the others' free room."""
    counted = [h for h in hosts if h.state not in (HostState.down, HostState.fencing, HostState.fenced)]

    def free(h, r):
        if h.state != HostState.enabled:
            return 0
        return max(0, (h.vcpus_capacity - h.used_vcpus) if r == 0 else (h.memory_capacity_mib - h.used_memory_mib))

    size = min(k, len(counted))
    short = [0, 0]
    for failed in itertools.combinations(counted, size):
        names = {h.name for h in failed}
        for r in (0, 1):
            need = sum(ha.get(h.name, Load())[r] for h in failed)
            room = sum(free(h, r) for h in counted if h.name not in names)
            short[r] = max(short[r], need - room)
    tolerated = 0
    for j in range(1, size + 1):
        ok = all(
            sum(ha.get(h.name, Load())[r] for h in failed) <= sum(free(h, r) for h in counted if h not in failed)
            for failed in itertools.combinations(counted, j)
            for r in (0, 1)
        )
        if not ok:
            break
        tolerated = j
    return short[0] <= 0 and short[1] <= 0, Load(max(short[0], 0), max(short[1], 0)), tolerated


STATES = st.sampled_from([HostState.enabled] * 6 + [HostState.maintenance, HostState.down, HostState.fenced])


@st.composite
def clusters(draw):
    n = draw(st.integers(1, 6))
    hosts, ha = [], {}
    for i in range(n):
        cores, memory = draw(st.integers(1, 16)), draw(st.integers(1, 64)) * 256
        used_v, used_m = draw(st.integers(0, cores + 2)), draw(st.integers(0, memory // 256 + 4)) * 256
        hosts.append(host(f"h{i}", cores, memory, used_v, used_m, draw(STATES)))
        ha[f"h{i}"] = Load(draw(st.integers(0, used_v)), draw(st.integers(0, used_m // 256)) * 256)
    return hosts, ha, draw(st.integers(0, 4))


@settings(max_examples=400, deadline=None)
@given(clusters())
def test_assess_matches_brute_force_over_every_k_subset(c):
    hosts, ha, k = c
    a = assess(hosts, ha, k)
    survives, short, tolerated = brute(hosts, ha, k)
    assert a.survives == survives
    assert a.shortfall == (short if k else Load())
    assert a.tolerated == (tolerated if k else 0)
    if k and survives:
        assert a.tolerated == min(k, a.tolerated) and a.tolerated <= k
    if k:  # the worst sets are real sets of hosts that can fail, of size min(k, counted)
        counted = [h.name for h in hosts if h.state not in (HostState.down, HostState.fenced)]
        assert len(a.worst_vcpus) == len(a.worst_memory) == min(k, len(counted))
        assert set(a.worst_vcpus) <= set(counted)


@settings(max_examples=300, deadline=None)
@given(clusters(), st.integers(0, 6), st.integers(0, 12), st.booleans())
def test_would_break_is_the_assessment_after_the_placement_and_the_mask_agrees(c, which, dv, is_ha):
    hosts, ha, k = c
    dm = np.array([dv * 512 + 128 * (i % 2) for i in range(len(hosts))])
    expected = []
    for i, h in enumerate(hosts):
        after = would_break(hosts, ha, k, h.name, Load(dv, int(dm[i])), is_ha)
        moved = [
            host(
                x.name,
                x.cores,
                x.memory_mib,
                x.used_vcpus + (dv if x is h else 0),
                x.used_memory_mib + (int(dm[i]) if x is h else 0),
                x.state,
            )
            for x in hosts
        ]
        load = dict(ha)
        if is_ha:
            load[h.name] = Load(ha[h.name].vcpus + dv, ha[h.name].memory_mib + int(dm[i]))
        survives, _, _ = brute(moved, load, k)
        assert (after is None) == (survives or k == 0)
        expected.append(after is not None)
    arr = lambda f: np.array([f(h) for h in hosts], dtype=float)  # noqa: E731
    mask = breaking_mask(
        arr(lambda h: h.vcpus_capacity),
        arr(lambda h: h.memory_capacity_mib),
        arr(lambda h: h.used_vcpus),
        arr(lambda h: h.used_memory_mib),
        np.array([h.state == HostState.enabled for h in hosts]),
        np.array([h.state not in (HostState.down, HostState.fencing, HostState.fenced) for h in hosts]),
        arr(lambda h: ha[h.name].vcpus),
        arr(lambda h: ha[h.name].memory_mib),
        dv,
        dm.astype(float),
        is_ha,
        k,
    )
    assert list(mask) == expected


def test_k_zero_costs_nothing_and_never_breaks():
    hosts = [host("h1", used_vcpus=8, used_memory=8192)]
    assert would_break(hosts, {"h1": Load(8, 8192)}, 0, "h1", Load(100, 100), True) is None
    assert assess(hosts, {"h1": Load(8, 8192)}, 0).survives


def test_three_hosts_k1_the_start_that_breaks_the_reserve_is_named():
    # each host 8 vCPU / 8192 MiB; h2 runs 4 vCPU / 2048 MiB of HA VMs
    hosts = [host("h1"), host("h2", used_vcpus=4, used_memory=2048), host("h3")]
    ha = {"h2": Load(4, 2048)}
    a = assess(hosts, ha, 1)
    assert a.survives and a.reserve.vcpus == 4 and a.tolerated == 1
    # a non-HA VM of 8 vCPUs on h1 leaves h3 alone: still fine (h3 has 8 free for h2's 4)
    assert would_break(hosts, ha, 1, "h1", Load(8, 1024), False) is None
    # ... but filling h1 and h3 with 6 vCPUs each leaves 2 + 2 for h2's 4: on the edge
    full = [host("h1", used_vcpus=6), hosts[1], host("h3")]
    after = would_break(full, ha, 1, "h3", Load(6, 1024), False)
    assert after is None
    after = would_break(full, ha, 1, "h3", Load(7, 1024), False)
    assert after is not None and after.worst == ("h2",) and after.shortfall == Load(1, 0)
    msg = reserve_message(after, "starting web-3 on h3", "c1")
    assert msg == (
        "starting web-3 on h3 would leave room for the HA VMs of 0 of the 1 host failure(s) cluster c1 "
        "tolerates (vmplane.ha.host.failures.tolerated=1): the worst case, h2 failing, needs 1 vCPU "
        "more than the other hosts have free"
    )


def test_an_ha_vm_moving_between_hosts_is_released_from_its_source():
    hosts = [host("h1", used_vcpus=4), host("h2", used_vcpus=4)]
    ha = {"h1": Load(4, 0), "h2": Load(4, 0)}
    # not released: 8 of 16 used, worst case a host with 4 free + 4 HA = 8 > 4 free elsewhere... fits exactly
    assert would_break(hosts, ha, 1, "h2", Load(4, 0), True) is not None
    assert would_break(hosts, ha, 1, "h2", Load(4, 0), True, release=("h1", Load(4, 0))) is None


def test_already_failed_hosts_neither_fail_again_nor_give_room():
    hosts = [host("h1", used_vcpus=2), host("h2", state=HostState.down), host("h3", state=HostState.maintenance)]
    a = assess(hosts, {"h1": Load(2, 0), "h3": Load(3, 0)}, 1)
    assert "h2" not in a.worst_vcpus + a.worst_memory
    assert a.free.vcpus == 6  # h1 only: h3 takes no placements
    assert not a.survives and a.worst_vcpus == ("h1",)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(2, 8), st.integers(1, 16)), min_size=2, max_size=6),
    st.integers(1, 2),
    st.lists(st.tuples(st.integers(1, 4), st.integers(1, 8), st.booleans()), max_size=25),
)
def test_placement_with_the_reserve_never_breaks_it(shapes, k, vms):
    """Random starts through choose(): every placement made keeps the cluster surviving k failures."""
    from vmplane.core.errors import InsufficientCapacity
    from vmplane.core.failover import Reserve
    from vmplane.core.model import PlacementRequest, Size
    from vmplane.core.placement import CapacityIndex, choose

    index = CapacityIndex([host(f"h{i}", cores, mem * 1024) for i, (cores, mem) in enumerate(shapes)])
    ha: dict[str, Load] = {}
    for vcpus, gib, is_ha in vms:
        request = PlacementRequest(Size(vcpus, gib * 256), reserve=Reserve({"c1": k}, dict(ha), is_ha))
        try:
            p = choose(index, request)
        except InsufficientCapacity:
            continue
        index.add_usage(p.host, vcpus, p.memory_mib)
        if is_ha:
            old = ha.get(p.host, Load())
            ha[p.host] = Load(old.vcpus + vcpus, old.memory_mib + p.memory_mib)
        assert assess(index.hosts(), ha, k).survives
