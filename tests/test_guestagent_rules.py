"""The guest agent's pure rules (core/guestagent.py): how often a VM's agent is asked, what of its answer
`vm show` lists, and what the audit calls drift."""

from hypothesis import given
from hypothesis import strategies as st

from vmplane.core import guestagent as R
from vmplane.core.driver import GuestInterface as G

MAC = "02:76:70:00:00:01"
LO = G("lo", "00:00:00:00:00:00", ["127.0.0.1/8", "::1/128"])


def test_a_booting_guest_is_asked_every_second_then_less_and_less_often():
    assert [R.next_check_s("none", n, False) for n in (1, 5, R.FAST_CHECKS)] == [1.0, 1.0, 1.0]
    later = [R.next_check_s("none", R.FAST_CHECKS + n, False) for n in range(1, 9)]
    assert later == sorted(later) and later[0] == 2.0 and later[-1] == R.NONE_EVERY_MAX_S
    # an agent that answers without the NIC's address yet (DHCP under way) is asked as often
    assert R.next_check_s("connected", 3, False) == 1.0
    assert R.next_check_s("connected", 0, True) == R.CONNECTED_EVERY_S


@given(st.integers(min_value=0, max_value=10_000), st.sampled_from(R.STATES), st.booleans())
def test_every_wait_is_between_a_second_and_the_longest(misses, state, whole):
    assert 1.0 <= R.next_check_s(state, misses, whole) <= max(R.NONE_EVERY_MAX_S, R.CONNECTED_EVERY_S)


def test_a_guest_holding_its_recorded_address_is_no_drift():
    eth0 = G("eth0", MAC, ["10.0.0.5/24", "fe80::76:70ff:fe00:1/64"])
    assert R.drift({MAC: "10.0.0.5"}, [LO, eth0]) == []
    assert R.complete({MAC: "10.0.0.5"}, [LO, eth0])
    assert R.shown([LO, eth0]) == ["eth0 10.0.0.5/24"]  # loopback and link-local left out


def test_an_address_set_by_hand_a_missing_one_or_a_missing_nic_is_drift():
    assert R.drift({MAC: "10.0.0.5"}, [G("eth0", MAC, ["10.0.0.5/24", "10.0.0.99/24"])]) == [
        f"NIC {MAC}: the guest's eth0 also holds 10.0.0.99, not recorded"
    ]
    assert R.drift({MAC: "10.0.0.5"}, [G("eth0", MAC.upper(), ["10.0.0.7/24"])]) == [
        f"NIC {MAC}: the guest's eth0 lacks 10.0.0.5 (it holds 10.0.0.7)"
    ]
    assert R.drift({MAC: "10.0.0.5"}, [LO]) == [f"NIC {MAC} (10.0.0.5) is not among the guest's interfaces"]
    assert not R.complete({MAC: "10.0.0.5"}, [G("eth0", MAC, [])])  # up, no lease yet


def test_interfaces_survive_the_store_and_bad_text_is_none():
    found = [LO, G("eth0", MAC, ["10.0.0.5/24"])]
    assert R.from_json(R.to_json(found)) == found
    assert R.from_json("not json") == [] and R.from_json("") == []
