"""The pure rules of who does which background work (leases.py)."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vmplane.core import leases

names = st.lists(st.text("abcdefgh:0123456789", min_size=1, max_size=8), min_size=1, max_size=6, unique=True)
hosts = st.lists(st.text("hxyz0123456789-", min_size=1, max_size=10), max_size=60, unique=True)
# no wall-clock limit on an example or on drawing it (Hypothesis' default: 200 ms each, a race on a loaded machine)
unhurried = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@unhurried
@given(hosts, names)
def test_every_host_has_exactly_one_listener_among_the_live_controllers(hs, cs):
    assignment = leases.assign(hs, cs)
    assert set(assignment) == set(hs)
    assert set(assignment.values()) <= set(cs)
    assert leases.assign(hs, list(reversed(cs))) == assignment  # every process computes the same


@unhurried
@given(hosts, names, st.data())
def test_a_controller_that_leaves_moves_only_its_own_hosts(hs, cs, data):
    gone = data.draw(st.sampled_from(cs))
    before = leases.assign(hs, cs)
    after = leases.assign(hs, [c for c in cs if c != gone])
    moved = {h for h in hs if before[h] != after.get(h)}
    assert moved == {h for h in hs if before[h] == gone}


@unhurried
@given(hosts, names, st.text("pqrs", min_size=1, max_size=4))
def test_a_controller_that_joins_takes_hosts_only_for_itself(hs, cs, new):
    before = leases.assign(hs, cs)
    after = leases.assign(hs, cs + [new] if new not in cs else cs)
    assert all(after[h] == before[h] or after[h] == new for h in hs)


def test_no_live_controller_assigns_nothing():
    assert leases.assign(["h1", "h2"], []) == {}


@unhurried
@given(hosts, names, st.data())
def test_what_a_controller_releases_and_acquires_makes_it_hold_exactly_its_share(hs, cs, data):
    me = data.draw(st.sampled_from(cs))
    held = set(data.draw(st.lists(st.sampled_from([leases.host_lease(h) for h in hs] or ["host:x"]), unique=True)))
    held.add(leases.COORDINATOR)
    assignment = leases.assign(hs, cs)
    after = (held - set(leases.to_release(held, assignment, me))) | set(leases.to_acquire(held, assignment, me))
    assert {leases.host_of(n) for n in after if leases.host_of(n)} == {h for h, c in assignment.items() if c == me}
    assert leases.COORDINATOR in after  # host balancing never gives the coordinator lease away


def test_lease_timing_rules():
    assert leases.expired(10.0, 10.0) and not leases.expired(10.5, 10.0)


def test_a_controller_lapses_only_when_its_renewal_stops_for_its_lease_by_the_observers_clock():
    seen, lapsed = leases.observe({}, [(1, 100.0, 15.0), (2, 100.0, 15.0)], me=1, now=0.0)
    assert lapsed == [] and set(seen) == {2}  # never judges itself
    seen, lapsed = leases.observe(seen, [(1, 100.0, 15.0), (2, 100.0, 15.0)], me=1, now=14.9)
    assert lapsed == []  # a first sighting needs a whole lease period
    assert leases.observe(seen, [(2, 100.0, 15.0)], me=1, now=15.0)[1] == [2]
    # renewed meanwhile: watched afresh, whatever its wall-clock value says (here, a step back of an hour)
    seen, lapsed = leases.observe(seen, [(2, 100.0 - 3600, 15.0)], me=1, now=15.0)
    assert lapsed == [] and seen[2] == leases.Sighting(100.0 - 3600, 15.0)
    assert leases.observe(seen, [], me=1, now=99.0) == ({}, [])  # gone from the live rows: forgotten


@unhurried
@given(
    st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=30),
    st.lists(st.floats(0.01, 5.0), min_size=30, max_size=30),
)
def test_renewals_that_keep_coming_never_lapse_whatever_their_wall_clock_values(values, gaps):
    """A renewal every < lease period of the observer's clock, its wall-clock values stepping anywhere."""
    seen, now, previous = {}, 0.0, None
    for value, gap in zip(values, gaps):
        if value == previous:
            value += 1.0
        now += gap
        seen, lapsed = leases.observe(seen, [(7, value, 5.0 + 1e-6)], me=1, now=now)
        assert lapsed == []
        previous = value
