"""The storage rules, pure: pool choice, root disk size, devices, disk moves of a migration, storage quota."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vmplane.core import storagerules as R
from vmplane.core.errors import Conflict, InsufficientCapacity, Invalid, QuotaExceeded
from vmplane.core.model import Quota, Usage
from vmplane.core.quota import check_admission, check_quota_change, storage_usage


def pool(name, kind="local", host="h1", cluster="c1", capacity=1000, used=0, state="running", path=None):
    return R.PoolView(
        name,
        kind,
        cluster,
        host if kind == "local" else None,
        path or R.default_pool_path(kind, name),
        state,
        capacity,
        used,
    )


def test_a_shared_pool_is_preferred_then_the_local_pool_with_most_room():
    pools = [pool("l1", used=100), pool("l2", host="h2", used=10), pool("s", kind="shared", used=900)]
    assert R.choose_pool(pools, 50).name == "s"
    assert R.choose_pool(pools, 200).name == "l2"  # the shared one has 100 free
    assert R.choose_pool(pools, 200, host="h1").name == "l1"  # placed on h1: its own local pool


def test_a_refusal_names_every_pool_and_why():
    pools = [pool("l1", used=990), pool("s", kind="shared", state="inactive"), pool("x", cluster="c2")]
    with pytest.raises(InsufficientCapacity) as e:
        R.choose_pool(pools, 50, cluster="c1")
    text = str(e.value)
    assert "l1: 10 MiB free of 1000 MiB, 50 MiB asked" in text
    assert "s: is inactive" in text and "x: is in cluster c2, not c1" in text


def test_a_named_pool_is_taken_or_refused_naming_it():
    pools = [pool("l1"), pool("l2", host="h2")]
    assert R.choose_pool(pools, 10, name="l2").name == "l2"
    with pytest.raises(InsufficientCapacity, match="pool l2: is local to h2, the VM runs on h1"):
        R.choose_pool(pools, 10, name="l2", host="h1")
    with pytest.raises(Invalid, match="pool 'nope' does not exist"):
        R.choose_pool(pools, 10, name="nope")


def test_root_disk_size_follows_offering_and_image():
    assert R.root_disk_size(256, None, None, None, "o") == 256
    assert R.root_disk_size(256, 1024, None, None, "o") == 1024
    assert R.root_disk_size(256, None, 4096, 2048, "o") == 2048
    with pytest.raises(Invalid, match="fixed at a 1 GiB root disk"):
        R.root_disk_size(256, 1024, None, 2048, "o")
    with pytest.raises(Invalid, match="above offering o's maximum 4 GiB"):
        R.root_disk_size(256, None, 4096, 8192, "o")
    with pytest.raises(Invalid, match="smaller than the template image"):
        R.root_disk_size(256, None, 4096, 128, "o")


def test_devices_after_the_root_disk():
    assert R.next_device([]) == "vdb"
    assert R.next_device(["vda", "vdb", "vdd"]) == "vdc"
    with pytest.raises(Conflict):
        R.next_device(["vd" + chr(ord("a") + i) for i in range(R.MAX_DATA_VOLUMES + 1)])


def test_pool_requests_are_checked():
    with pytest.raises(Invalid, match="--host"):
        R.check_pool_request("local", None, "c1", None)
    with pytest.raises(Invalid, match="--cluster"):
        R.check_pool_request("shared", None, None, None)
    with pytest.raises(Invalid, match="kind must be"):
        R.check_pool_request("nfs", None, "c1", None)
    with pytest.raises(Invalid, match="absolute"):
        R.check_pool_request("local", "h1", None, "../etc")


def test_a_migration_copies_local_disks_and_leaves_shared_ones():
    pools = [pool("l1"), pool("l2", host="h2"), pool("s", kind="shared")]
    moves = R.plan_disk_moves([("root", "vda", 300, "l1"), ("data", "vdb", 100, "s")], pools, "h2", "c1")
    assert [(m.volume, m.how, m.target_pool) for m in moves] == [("root", "copy", "l2"), ("data", "shared", "s")]


def test_a_migration_is_refused_when_a_disk_can_not_follow():
    pools = [
        pool("l1"),
        pool("l2", host="h2", used=900),
        pool("l3", host="h3", path="/elsewhere"),
        pool("s", kind="shared", cluster="c1"),
    ]
    with pytest.raises(
        InsufficientCapacity,
        match="volume root is on l1, local to h1: h2 has no running local pool "
        "at /var/lib/vmplane/local with 300 MiB free",
    ):
        R.plan_disk_moves([("root", "vda", 300, "l1")], pools, "h2", "c1")
    with pytest.raises(InsufficientCapacity, match="h3 has no running local pool"):
        R.plan_disk_moves([("root", "vda", 10, "l1")], pools, "h3", "c1")  # another path
    with pytest.raises(Conflict, match="cluster c1; h9 is in cluster c2"):
        R.plan_disk_moves([("d", "vdb", 10, "s")], pools, "h9", "c2")


def test_two_disks_to_one_pool_need_room_for_both():
    pools = [pool("l1"), pool("l2", host="h2", used=700)]
    with pytest.raises(InsufficientCapacity):
        R.plan_disk_moves([("a", "vda", 200, "l1"), ("b", "vdb", 200, "l1")], pools, "h2", "c1")
    assert len(R.plan_disk_moves([("a", "vda", 150, "l1"), ("b", "vdb", 150, "l1")], pools, "h2", "c1")) == 2


@given(st.lists(st.integers(1, 500), max_size=20), st.integers(0, 5000), st.integers(1, 2000))
def test_storage_admission_never_passes_the_quota(sizes, quota, ask):
    used = storage_usage(sizes)
    q = Quota(100, 100, 100, quota)
    try:
        check_admission("p", q, used, Usage(storage_mib=ask))
    except QuotaExceeded as exc:
        assert used.storage_mib + ask > quota and "of storage" in str(exc) and exc.field == "storage_mib"
    else:
        assert used.storage_mib + ask <= quota


def test_lowering_the_storage_quota_below_use_is_refused_naming_the_numbers():
    with pytest.raises(Conflict, match=r"storage_mib quota to 1 GiB of storage: 2 GiB of storage in use"):
        check_quota_change("p", Quota(1, 1, 1, 1024), Usage(storage_mib=2048))
