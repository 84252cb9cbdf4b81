"""Backups' pure rules (issue 32): full or incremental, the charge, deletes and retention."""

from __future__ import annotations

import datetime as dt

from hypothesis import given
from hypothesis import strategies as st

from vmplane.core import backups as R

T0 = dt.datetime(2026, 12, 1, 3, 0)


def test_a_backup_is_incremental_only_while_the_last_ones_checkpoint_describes_the_disk():
    last = R.Last(4, "vmp-1-4", {"web-root": "vmp-web-root.a.qcow2"})
    now = {"web-root": "vmp-web-root.a.qcow2"}
    assert R.choose_kind(False, last, now)[:3] == ("incremental", 4, {"web-root": "incremental"})
    assert R.choose_kind(True, last, now)[:3] == ("full", None, {"web-root": "full"})
    assert R.choose_kind(False, None, now)[:3] == ("full", None, {"web-root": "full"})
    kind, parent, modes, why = R.choose_kind(False, last, {"web-root": "vmp-web-root.a.s9-1.qcow2"})
    assert (kind, parent, modes) == ("full", None, {"web-root": "full"}) and "snapshot" in why


def test_each_disk_is_incremental_on_its_own_file_and_a_disk_new_since_is_copied_whole():
    last = R.Last(4, "vmp-1-4", {"web-root": "r.qcow2", "data": "d.qcow2"})
    kind, parent, modes, why = R.choose_kind(
        False, last, {"web-root": "r.s1.qcow2", "data": "d.qcow2", "logs": "l.qcow2"}
    )
    assert (kind, parent) == ("incremental", 4)
    assert modes == {"web-root": "full", "data": "incremental", "logs": "full"}
    assert "logs, web-root whole" in why


@given(
    st.dictionaries(st.sampled_from("abcd"), st.sampled_from(["f1", "f2"]), min_size=1),
    st.dictionaries(st.sampled_from("abcd"), st.sampled_from(["f1", "f2"])),
    st.booleans(),
)
def test_a_disk_is_incremental_exactly_when_the_last_backup_saw_its_active_file(now, then, full):
    kind, parent, modes, _ = R.choose_kind(full, R.Last(9, "c", then), now)
    assert set(modes) == set(now)
    for volume, mode in modes.items():
        assert (mode == "incremental") == (not full and then.get(volume) == now[volume])
    assert (kind == "incremental") == ("incremental" in modes.values()) == (parent == 9)


def test_charges_and_deletes():
    assert R.charge_before_mib([256, 1024]) == 1280
    assert R.charge_after_mib([1]) == 1 and R.charge_after_mib([17 << 20]) == 17
    assert R.charge_after_mib([(17 << 20) + 1, 1]) == 19
    assert R.delete_problem(3, []) is None
    assert "delete 5, 7 first" in (R.delete_problem(3, [7, 5]) or "")


def test_retention_keeps_the_newest_and_one_a_day():
    backups = [(i, T0 + dt.timedelta(hours=8 * i)) for i in range(1, 10)]  # 11:00, 19:00, 03:00 the next day...
    assert R.kept(backups, None, None) == set(range(1, 10))
    assert R.kept(backups, 2, None) == {8, 9}
    assert R.kept(backups, None, 2) == {9, 8}  # the newest of each of the last two days (Dec 4: 9, Dec 3: 8)
    assert R.kept(backups, 1, 3) == {9, 8, 5}


@given(
    st.lists(st.integers(min_value=0, max_value=200), min_size=1, max_size=30, unique=True),
    st.lists(st.booleans(), min_size=30, max_size=30),
    st.one_of(st.none(), st.integers(0, 10)),
    st.one_of(st.none(), st.integers(0, 10)),
)
def test_pruning_in_its_order_never_leaves_a_kept_backup_on_a_missing_file(hours, fulls, keep_last, keep_daily):
    """Backups in time order, each full or incremental on the one before: after the plan (children made whole
    first, newest first), every kept backup's chain exists."""
    ids = list(range(1, len(hours) + 1))
    at = {i: T0 + dt.timedelta(hours=h) for i, h in zip(ids, sorted(hours), strict=True)}
    parent = {i: (None if i == 1 or fulls[i - 1] else i - 1) for i in ids}
    keep = R.kept(list(at.items()), keep_last, keep_daily)
    pruned = set(ids) - keep
    files = set(ids)
    for b, kids in R.prune_order(pruned, parent):
        for k in kids:
            parent[k] = None  # made whole: a full copy of its chain
        assert all(parent[c] != b for c in files if c != b), "a backup still built on a pruned one"
        files.discard(b)
    assert files == keep
    for b in keep:
        p = parent[b]
        while p is not None:
            assert p in files
            p = parent[p]
