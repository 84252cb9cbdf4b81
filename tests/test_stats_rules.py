"""The usage graphs' rules (core/stats.py, issue 33), pure and fast: rates from cumulative counters (a counter
that went backwards gives no rate, never a negative one), CPU as a share of the domain's vCPUs, a host's point
from its own counters or its guests', sums and means field by field, and the tiers' buckets and bounds."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from vmplane.core import stats as rules
from vmplane.core.stats import NS, DomainCounters, HostCounters, Point

counter = st.integers(min_value=0, max_value=2**62)
seconds = st.floats(min_value=0.001, max_value=1e6, allow_nan=False)
value = st.one_of(st.none(), st.floats(min_value=0, max_value=1e12, allow_nan=False))
points = st.builds(Point, *(value for _ in rules.FIELDS))


@given(counter, counter, seconds)
def test_a_rate_is_never_negative_and_is_none_when_the_counter_went_backwards(before, after, s):
    r = rules.rate(before, after, s)
    if after < before:
        assert r is None
    else:
        assert r is not None and r >= 0
        assert math.isclose(r * s, after - before, rel_tol=1e-9, abs_tol=1e-6)


@given(counter, counter)
def test_no_rate_without_time_between_the_readings_or_without_a_reading(before, after):
    assert rules.rate(before, after, 0) is None
    assert rules.rate(before, after, -1.0) is None
    assert rules.rate(None, after, 1.0) is None
    assert rules.rate(before, None, 1.0) is None


def domain(cpu_ns=0, vcpus=2, rd=0, wr=0, rx=0, tx=0, memory_kib=1024 * 1024, used_kib=None) -> DomainCounters:
    return DomainCounters("vmplane-a", vcpus, cpu_ns, memory_kib, used_kib, rd, wr, rx, tx)


def test_cpu_is_a_share_of_the_domains_vcpus_and_cores_what_it_kept_busy():
    p = rules.domain_point(domain(cpu_ns=10 * NS), domain(cpu_ns=70 * NS), 60.0)  # 1 core busy of 2 vCPUs
    assert p.cpu_cores == 1.0
    assert p.cpu_pct == 50.0


@given(st.integers(1, 64), counter, st.integers(0, 2**40), seconds)
def test_cpu_percent_stays_within_0_and_100(vcpus, start, grown, s):
    p = rules.domain_point(domain(cpu_ns=start, vcpus=vcpus), domain(cpu_ns=start + grown, vcpus=vcpus), s)
    assert p.cpu_pct is not None and 0.0 <= p.cpu_pct <= 100.0


def test_disk_and_network_rates_are_bytes_per_second():
    before = domain(rd=1000, wr=2000, rx=3000, tx=4000)
    after = domain(rd=1000 + 600, wr=2000 + 1200, rx=3000 + 60, tx=4000 + 6000)
    p = rules.domain_point(before, after, 60.0)
    assert (p.disk_rd_bps, p.disk_wr_bps, p.net_rx_bps, p.net_tx_bps) == (10.0, 20.0, 1.0, 100.0)


@given(counter, counter, counter, counter, counter, seconds)
def test_a_restarted_or_migrated_domain_gives_no_rate_for_the_counters_that_went_back(cpu, rd, wr, rx, tx, s):
    before = domain(cpu_ns=cpu + 1, rd=rd + 1, wr=wr + 1, rx=rx + 1, tx=tx + 1)
    after = domain(cpu_ns=cpu, rd=rd, wr=wr, rx=rx, tx=tx)  # a new QEMU: every counter from zero again
    p = rules.domain_point(before, after, s)
    assert (p.cpu_pct, p.cpu_cores, p.disk_rd_bps, p.disk_wr_bps, p.net_rx_bps, p.net_tx_bps) == (None,) * 6
    assert p.mem_total_mib == 1024.0  # a level is still known


def test_a_first_reading_has_levels_only():
    p = rules.domain_point(None, domain(cpu_ns=5 * NS, used_kib=512 * 1024), 0.0)
    assert p.cpu_pct is None and p.disk_wr_bps is None and p.net_rx_bps is None
    assert (p.mem_used_mib, p.mem_total_mib) == (512.0, 1024.0)


def test_memory_used_is_what_the_guest_says_else_what_the_domain_has():
    assert rules.domain_point(None, domain(used_kib=None), 0).mem_used_mib == 1024.0
    assert rules.domain_point(None, domain(used_kib=256 * 1024), 0).mem_used_mib == 256.0


def host(at, busy=None, total=None, cpus=8, memory_kib=8 * 1024 * 1024, free_kib=None) -> HostCounters:
    return HostCounters(at, cpus, memory_kib, free_kib, busy, total)


def test_a_hosts_cpu_and_memory_are_its_own_when_it_says_them():
    guests = [Point(cpu_cores=1.0, mem_used_mib=100.0, disk_wr_bps=5.0), Point(cpu_cores=0.5, disk_wr_bps=1.0)]
    p = rules.host_point(
        host(0, busy=0, total=0), host(60, busy=120 * NS, total=480 * NS, free_kib=6 * 1024 * 1024), guests
    )
    assert p.cpu_pct == 25.0 and p.cpu_cores == 2.0  # a quarter of 8 cores, its own count (not the guests' 1.5)
    assert (p.mem_used_mib, p.mem_total_mib) == (2048.0, 8192.0)
    assert p.disk_wr_bps == 6.0  # traffic is its guests' sum


def test_a_host_that_does_not_say_its_cpu_has_its_guests_sum():
    guests = [Point(cpu_cores=1.0, mem_used_mib=100.0), Point(cpu_cores=1.0, mem_used_mib=50.0)]
    p = rules.host_point(None, host(60), guests)
    assert p.cpu_cores == 2.0 and p.cpu_pct == 25.0
    assert p.mem_used_mib == 150.0


@given(st.lists(points, max_size=8))
def test_a_sum_adds_the_known_values_field_by_field_and_never_a_percentage(ps):
    s = rules.sum_points(ps)
    assert s.cpu_pct is None
    for name in rules.FIELDS[1:]:
        known = [getattr(p, name) for p in ps if getattr(p, name) is not None]
        got = getattr(s, name)
        assert got is None if not known else math.isclose(got, sum(known), rel_tol=1e-9)


@given(st.lists(points, max_size=12))
def test_a_mean_lies_between_the_smallest_and_the_largest_known_value(ps):
    m = rules.mean_point(ps)
    for name in rules.FIELDS:
        known = [getattr(p, name) for p in ps if getattr(p, name) is not None]
        got = getattr(m, name)
        if not known:
            assert got is None
        else:
            assert min(known) * (1 - 1e-9) <= got <= max(known) * (1 + 1e-9)


@given(st.floats(min_value=0, max_value=4e9, allow_nan=False))
def test_a_bucket_holds_its_time_and_starts_on_its_step(at):
    for tier in rules.TIERS:
        b = rules.bucket(at, tier)
        assert b % tier.step_s == 0 and b <= at < b + tier.step_s


@given(st.floats(min_value=1e9, max_value=4e9, allow_nan=False))
def test_a_tier_keeps_a_bounded_number_of_buckets_of_its_span(now):
    for tier in rules.TIERS:
        kept = (rules.bucket(now, tier) - rules.oldest_kept(now, tier)) // tier.step_s + 1
        assert kept == rules.max_points(tier)
    assert rules.max_points(rules.FINE) == 1440  # a minute's point for a day
    assert rules.max_points(rules.COARSE) == 4464  # ten minutes' for 31 days


@given(st.floats(min_value=1e9, max_value=4e9, allow_nan=False))
def test_the_folded_bucket_is_the_complete_one_before_nows(now):
    b = rules.folded_bucket(now)
    assert b + rules.COARSE.step_s <= now and now - b < 2 * rules.COARSE.step_s
    assert b % rules.COARSE.step_s == 0


def test_latest_is_the_newest_known_value():
    series = [(0, Point(cpu_pct=1.0)), (60, Point(cpu_pct=2.0)), (120, Point(cpu_pct=None))]
    assert rules.latest(series, "cpu_pct") == 2.0
    assert rules.latest([], "cpu_pct") is None
