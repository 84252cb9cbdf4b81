"""Placement on hand-built clusters, and a brute-force check over generated ones."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vmplane.core.errors import InsufficientCapacity
from vmplane.core.model import HostCapacity, HostState, PlacementRequest, Size
from vmplane.core.placement import CapacityIndex, choose, explain, lower_bound_hosts
from vmplane.core.quota import overhead_mib


def host(
    name,
    cores=16,
    memory=65536,
    used_vcpus=0,
    used_memory=0,
    strategy="spread",
    state=HostState.enabled,
    cpu_factor=1.0,
    mem_factor=1.0,
    ratio=1.0,
    cluster="c1",
):
    return HostCapacity(
        name, cluster, state, cores, memory, cpu_factor, mem_factor, ratio, strategy, used_vcpus, used_memory
    )


def place_all(index, sizes):
    placed = []
    for size in sizes:
        p = choose(index, PlacementRequest(size))
        index.add_usage(p.host, size.vcpus, p.memory_mib)
        placed.append(p.host)
    return placed


def test_spread_puts_each_vm_on_the_least_allocated_host():
    index = CapacityIndex([host("h1"), host("h2"), host("h3")])
    assert place_all(index, [Size(1, 1024)] * 6) == ["h1", "h2", "h3", "h1", "h2", "h3"]


def test_pack_fills_one_host_before_the_next():
    index = CapacityIndex([host(f"h{i}", cores=4, memory=8192, strategy="pack") for i in range(1, 4)])
    placed = place_all(index, [Size(1, 1024)] * 8)
    # 4 vCPUs per host: the first four go to h1, the next four to one other host
    assert placed[:4] == ["h1"] * 4
    assert len(set(placed[4:])) == 1 and placed[4] != "h1"


def test_pack_prefers_the_fuller_host_and_spread_the_emptier():
    full = host("full", used_vcpus=12, used_memory=50000)
    empty = host("empty")
    assert choose(CapacityIndex([empty, full]), PlacementRequest(Size(1, 512))).host == "empty"
    packing = [host("empty", strategy="pack"), host("full", used_vcpus=12, used_memory=50000, strategy="pack")]
    assert choose(CapacityIndex(packing), PlacementRequest(Size(1, 512))).host == "full"


def test_a_host_without_room_for_memory_plus_overhead_is_refused_with_the_numbers():
    size = Size(4, 16384)
    need = 16384 + overhead_mib(size)
    tight = host("h2", used_memory=65536 - need + 1)
    index = CapacityIndex([tight])
    with pytest.raises(InsufficientCapacity) as exc:
        choose(index, PlacementRequest(size))
    assert f"h2: memory {65536 - need + 1} of 65536 MiB allocated, {need} MiB needed" in exc.value.message
    # exactly enough is fine
    assert choose(CapacityIndex([host("h2", used_memory=65536 - need)]), PlacementRequest(size)).host == "h2"


def test_cpu_overcommit_factor_multiplies_cores():
    index = CapacityIndex([host("h1", cores=4, memory=65536, cpu_factor=4.0)])
    assert place_all(index, [Size(1, 512)] * 16) == ["h1"] * 16  # 16 vCPUs on 4 cores at factor 4
    with pytest.raises(InsufficientCapacity, match="vcpus 16 of 16 allocated"):
        choose(index, PlacementRequest(Size(1, 512)))


def test_a_huge_overcommit_factor_is_capped_at_the_stores_integer_range():
    big = host("h1", cores=2**30, memory=2**30, cpu_factor=1e6, mem_factor=1e6)
    assert big.vcpus_capacity == big.memory_capacity_mib == 2**31 - 1
    index = CapacityIndex([big])
    assert index.capacity_of("h1") == (2**31 - 1, 2**31 - 1)


def test_memory_overcommit_factor_multiplies_memory():
    # 8192 MiB at factor 1.5 = 12288 MiB; each VM takes 512 + 269 overhead = 781 MiB: 15 fit, not 16
    index = CapacityIndex([host("h1", cores=64, memory=8192, mem_factor=1.5)])
    assert place_all(index, [Size(1, 512)] * 15) == ["h1"] * 15
    with pytest.raises(InsufficientCapacity, match="memory 11715 of 12288 MiB allocated, 781 MiB needed"):
        choose(index, PlacementRequest(Size(1, 512)))


def test_overhead_ratio_of_the_cluster_is_applied():
    p = choose(CapacityIndex([host("h1", ratio=1.5)]), PlacementRequest(Size(2, 2048)))
    assert p.overhead_mib == overhead_mib(Size(2, 2048), 1.5) and p.memory_mib == 2048 + p.overhead_mib


def test_hosts_not_enabled_and_excluded_hosts_are_skipped_with_reasons():
    index = CapacityIndex(
        [host("m", state=HostState.maintenance), host("d", state=HostState.down), host("x"), host("ok", used_vcpus=15)]
    )
    assert choose(index, PlacementRequest(Size(1, 512), exclude_hosts=frozenset({"x"}))).host == "ok"
    reasons = {r.host: r.reason for r in explain(index, PlacementRequest(Size(2, 512), frozenset({"x"})))}
    assert reasons == {
        "m": "state is maintenance, not enabled",
        "d": "state is down, not enabled",
        "x": "excluded by the request",
        "ok": "vcpus 15 of 16 allocated, 2 needed",
    }


def test_cluster_restriction():
    index = CapacityIndex([host("a", cluster="c1"), host("b", cluster="c2")])
    assert choose(index, PlacementRequest(Size(1, 512), cluster="c2")).host == "b"


def test_lower_bound():
    assert lower_bound_hosts(100, 1000, 16, 65536) == 7
    assert lower_bound_hosts(10, 200000, 16, 65536) == 4


hosts_st = st.lists(
    st.builds(
        host,
        name=st.just("?"),
        cores=st.integers(1, 64),
        memory=st.integers(512, 1 << 18),
        used_vcpus=st.integers(0, 80),
        used_memory=st.integers(0, 1 << 18),
        strategy=st.sampled_from(["spread", "pack"]),
        state=st.sampled_from(list(HostState)),
        cpu_factor=st.sampled_from([1.0, 2.0, 4.0]),
        mem_factor=st.sampled_from([1.0, 1.5]),
        ratio=st.sampled_from([1.0, 1.5]),
    ),
    min_size=0,
    max_size=25,
)


@settings(max_examples=300, deadline=None)
@given(hosts_st, st.integers(1, 32), st.integers(1, 1 << 17))
def test_chosen_host_always_fits_and_refusal_means_no_host_fits(hosts, vcpus, memory):
    hosts = [h.__class__(**{**h.__dict__, "name": f"h{i}"}) for i, h in enumerate(hosts)]
    index = CapacityIndex(hosts)
    size = Size(vcpus, memory)

    def fits(h):
        need = memory + overhead_mib(size, h.overhead_ratio)
        return (
            h.state == HostState.enabled
            and h.used_vcpus + vcpus <= h.vcpus_capacity
            and h.used_memory_mib + need <= h.memory_capacity_mib
        )

    fitting = {h.name for h in hosts if fits(h)}
    refused = {r.host for r in explain(index, PlacementRequest(size))}
    assert refused == {h.name for h in hosts} - fitting
    if fitting:
        assert choose(index, PlacementRequest(size)).host in fitting
    else:
        with pytest.raises(InsufficientCapacity):
            choose(index, PlacementRequest(size))
