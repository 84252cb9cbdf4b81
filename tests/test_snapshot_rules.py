"""Disk snapshots' chain rules (core/snapshots.py): after any sequence of takes, reverts and deletes, every
snapshot still reads the data it was taken with, the active chain reads the data it should, and nothing a
chain needs is ever garbage; names and the charge."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from vmplane.core import snapshots as S


def fresh() -> S.Disks:
    return S.Disks({"root": "r0", "data": "d0"}, {"r0": None, "d0": None})


class Model:
    """The disks' content as a function of files: a file holds the writes made while it was active;
    reading a chain replays its files from the bottom."""

    def __init__(self):
        self.disks, self.snaps = fresh(), []
        self.writes: dict[str, list[int]] = {"r0": [], "d0": []}
        self.seen: dict[str, dict[str, list[int]]] = {}
        self.n = 0

    def read(self, file: str) -> list[int]:
        return [w for f in reversed(self.disks.chain(file)) for w in self.writes[f]]

    def new(self, volume: str) -> str:
        self.n += 1
        name = f"{volume[0]}{self.n}"
        self.writes[name] = []
        return name

    def write(self, volume: str, value: int) -> None:
        self.writes[self.disks.active[volume]].append(value)

    def take(self, name: str) -> None:
        snap, self.disks = S.take(self.disks, name, {v: self.new(v) for v in self.disks.active})
        self.snaps.append(snap)
        self.seen[name] = {v: self.read(f) for v, f in snap.bases.items()}

    def revert(self, name: str) -> None:
        snap = next(s for s in self.snaps if s.name == name)
        self.disks = S.revert(self.disks, snap, {v: self.new(v) for v in snap.bases})
        assert {v: self.read(f) for v, f in self.disks.active.items()} == self.seen[name]
        self.collect()

    def delete(self, name: str) -> None:
        self.snaps = [s for s in self.snaps if s.name != name]
        self.collect()

    def collect(self) -> None:
        for file in S.garbage(self.disks, self.snaps):
            del self.disks.parent[file]


steps = st.lists(
    st.tuples(
        st.sampled_from(["write", "take", "revert", "delete"]), st.integers(0, 5), st.sampled_from(["root", "data"])
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(steps)
def test_every_snapshot_keeps_its_data_and_no_needed_file_is_ever_garbage(plan):
    m = Model()
    for i, (op, k, volume) in enumerate(plan):
        names = [s.name for s in m.snaps]
        if op == "write":
            m.write(volume, i)
        elif op == "take" and len(names) < S.MAX_SNAPSHOTS:
            m.take(f"s{i}")
        elif op == "revert" and names:
            m.revert(names[k % len(names)])
        elif op == "delete" and names:
            m.delete(names[k % len(names)])
        for snap in m.snaps:  # every snapshot reads what it was taken with
            assert {v: m.read(f) for v, f in snap.bases.items()} == m.seen[snap.name]
        assert S.garbage(m.disks, m.snaps) == set()  # collected at once
        assert all(f in m.disks.parent for f in S.needed(m.disks, m.snaps))


def test_a_revert_puts_a_new_overlay_on_the_snapshots_base_and_drops_what_came_after():
    m = Model()
    m.write("root", 1)
    m.take("before")
    m.write("root", 2)  # the mistake
    assert m.read(m.disks.active["root"]) == [1, 2]
    m.revert("before")
    assert m.read(m.disks.active["root"]) == [1]
    assert m.disks.chain(m.disks.active["root"])[1] == "r0"  # on the snapshot's base
    assert "r1" not in m.disks.parent  # the overlay with the mistake is gone


def test_a_file_with_one_child_and_no_snapshot_on_it_may_be_merged_into_that_child():
    m = Model()
    m.take("a")
    m.take("b")
    m.delete("a")  # r0 is no snapshot's base any more; r1 (b's base) has one child
    pairs = S.mergeable(m.disks, m.snaps)
    assert ("r0", "r1") in pairs and all(p not in {s.bases["root"] for s in m.snaps} for p, _c in pairs)


def test_names_are_checked_before_anything_is_made():
    assert S.name_problem("before-upgrade", set()) is None
    assert "not a snapshot name" in S.name_problem("Before", set())
    assert "already has a snapshot named x" in S.name_problem("x", {"x"})
    assert "the most it may have" in S.name_problem("y", {f"s{i}" for i in range(S.MAX_SNAPSHOTS)})


def test_each_file_beyond_a_disks_first_is_charged_at_the_disks_size():
    assert S.charge_mib({"root": 10240, "data": 1024}, {"root": 1, "data": 1}) == 0
    assert S.charge_mib({"root": 10240, "data": 1024}, {"root": 3, "data": 2}) == 2 * 10240 + 1024


def test_a_vm_with_snapshots_on_a_local_pool_does_not_live_migrate_yet():
    assert S.migration_problem(local_pool=False, overlays=3) is None
    assert S.migration_problem(local_pool=True, overlays=0) is None
    assert "(1 file(s) beyond the disks)" in (S.migration_problem(local_pool=True, overlays=1) or "")
