"""The ledger's pure rules: overhead, charges, admission and quota changes."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vmplane.core.errors import Conflict, QuotaExceeded
from vmplane.core.model import Quota, Size, Usage, VmState
from vmplane.core.quota import (
    check_admission,
    check_quota_change,
    first_exceeded,
    overhead_mib,
    recompute_usage,
    running_charge,
    vm_charge,
)


def test_overhead_follows_the_kubevirt_like_model():
    # 220 fixed + 8 per vCPU + 8 iothread + 32 video + memory/512
    assert overhead_mib(Size(1, 1024)) == 220 + 8 + 8 + 32 + 2
    assert overhead_mib(Size(4, 16384)) == 220 + 32 + 8 + 32 + 32
    assert overhead_mib(Size(2, 1000)) == 220 + 16 + 8 + 32 + 2  # 1000/512 rounds up
    assert overhead_mib(Size(4, 16384), ratio=1.5) == 486  # Harvester's 1.5


def test_a_stopped_vm_counts_only_towards_vms():
    assert vm_charge(VmState.stopped, Size(4, 4096), 300, True) == Usage(0, 0, 1)
    for state in (VmState.starting, VmState.running, VmState.migrating, VmState.scaling):
        assert vm_charge(state, Size(4, 4096), 300, True) == Usage(4, 4396, 1)
        assert vm_charge(state, Size(4, 4096), 300, False) == Usage(4, 4096, 1)


@pytest.mark.parametrize(
    "resource,usage,delta",
    [
        ("vcpus", Usage(7, 0, 1), Usage(2, 10, 0)),
        ("memory_mib", Usage(1, 8000, 1), Usage(1, 500, 0)),
        ("vms", Usage(0, 0, 5), Usage(0, 0, 1)),
    ],
)
def test_admission_names_the_resource_used_asked_and_quota(resource, usage, delta):
    with pytest.raises(QuotaExceeded) as exc:
        check_admission("p", Quota(8, 8192, 5), usage, delta)
    assert exc.value.field == resource
    assert resource in exc.value.message and "used" in exc.value.message and "asked" in exc.value.message


def test_admission_up_to_exactly_the_quota_is_allowed():
    check_admission("p", Quota(8, 8192, 5), Usage(6, 8000, 4), Usage(2, 192, 1))


def test_lowering_a_quota_below_usage_names_resource_used_and_asked():
    with pytest.raises(Conflict) as exc:
        check_quota_change("p", Quota(8, 4096, 10), Usage(2, 6000, 3))
    assert exc.value.field == "memory_mib"
    assert "used 6000" in exc.value.message and "asked 4096" in exc.value.message
    check_quota_change("p", Quota(2, 6000, 3), Usage(2, 6000, 3))  # exactly at usage is fine


usages = st.builds(Usage, st.integers(0, 64), st.integers(0, 1 << 17), st.integers(0, 20))
quotas = st.builds(Quota, st.integers(0, 64), st.integers(0, 1 << 17), st.integers(0, 20))


@given(quotas, usages, usages)
def test_admission_admits_exactly_what_stays_within_quota(quota, usage, delta):
    after = usage + delta
    fits = all(getattr(after, r) <= getattr(quota, r) or getattr(delta, r) == 0 for r in ("vcpus", "memory_mib", "vms"))
    if fits:
        check_admission("p", quota, usage, delta)
        assert first_exceeded(quota, usage, delta) is None
    else:
        with pytest.raises(QuotaExceeded):
            check_admission("p", quota, usage, delta)


@given(
    st.lists(
        st.tuples(st.sampled_from(list(VmState)), st.integers(1, 16), st.integers(1, 65536), st.integers(0, 2000)),
        max_size=30,
    ),
    st.booleans(),
)
def test_recomputed_usage_is_the_sum_of_the_charges(vms, count_overhead):
    total = recompute_usage(((s, Size(c, m), o) for s, c, m, o in vms), count_overhead)
    assert total.vms == len(vms)
    charged = [(c, m, o) for s, c, m, o in vms if vm_charge(s, Size(c, m), o, count_overhead).vcpus]
    assert total.vcpus == sum(c for c, _, _ in charged)
    assert total.memory_mib == sum(running_charge(Size(c, m), o, count_overhead).memory_mib for c, m, o in charged)
