"""Arena segments and group-strict placement (``cluster/arena.py``, "Segments and groups"):
a segment owned by a group only ever holds keys put for it, ``locate`` answers only the
owning group, and with no groups the arena behaves as one segment does."""
from __future__ import annotations

import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kspeedfs.cluster.arena import Arena, Geometry

from .test_arena import Mem, remote_lookup

GROUPS = (None, "a", "b")


def _key(seed: int, size: int) -> tuple[bytes, bytes]:
    blob = bytes([seed]) * size
    return xxhash.xxh3_128_digest(blob), blob


class SegmentModel(RuleBasedStateMachine):
    """Random puts of keys of random groups and ranks into 3 segments of 4 slots (and a
    short last one), drops and evictions: the invariants of the class docstring."""

    geometry = Geometry(nslots=14, slot_size=64, nbuckets=4, segment_slots=4)
    ssd = False

    def __init__(self) -> None:
        super().__init__()
        self.g = self.geometry
        self.data, self.index = Mem(self.g.arena_bytes), Mem(self.g.index_bytes)
        self.ranks: dict[bytes, int] = {}
        self.groups: dict[bytes, str | None] = {}
        self.put_for: dict[bytes, str | None] = {}           # the group a held key was put for
        self.arena = Arena(self.g, self.data, self.index, rank=lambda k: self.ranks.get(k, -1),
                           on_evict=(lambda k, d: None) if self.ssd else None,
                           group=lambda k: self.groups.get(k))
        self.blobs: dict[bytes, bytes] = {}
        self.pinned: dict[int, str] = {}

    @rule(seed=st.integers(0, 40), size=st.integers(1, 64), rank=st.integers(-1, 2),
          group=st.sampled_from(GROUPS))
    def put(self, seed: int, size: int, rank: int, group: str | None) -> None:
        key, blob = _key(seed, size)
        self.blobs[key] = blob
        if key not in self.arena:
            self.ranks[key], self.groups[key] = rank, group
        before = set(self.arena.keys())
        foretold = self.arena.takes(key)
        stored = self.arena.put(key, blob)
        assert stored == foretold
        if not stored:
            assert set(self.arena.keys()) == before, "a refused put evicted something"
        elif key not in before:
            self.put_for[key] = self.groups[key]
            for gone in before - set(self.arena.keys()):  # nothing evicted outranks the key
                assert self.ranks[gone] <= rank

    @rule(seed=st.integers(0, 40), size=st.integers(1, 64))
    def drop(self, seed: int, size: int) -> None:
        key, _ = _key(seed, size)
        self.arena.drop(key)

    @rule(group=st.sampled_from(("a", "b")))
    def pin(self, group: str) -> None:
        """A reader is handed ``group``'s first segment: it stays ``group``'s."""
        segs = self.arena.segments(group)
        if segs:
            self.arena.pin(segs[0])
            self.pinned[segs[0]] = group

    @rule(group=st.sampled_from(GROUPS))
    def regroup(self, group: str | None) -> None:
        """The group function changes (a grant added, a share moved): held keys stay."""
        for k in list(self.groups)[:3]:
            self.groups[k] = group

    @invariant()
    def segments_hold_one_group(self) -> None:
        per = self.g.per_segment
        holding: dict[int, set[str | None]] = {}
        for key in self.arena.keys():
            slot, length = remote_lookup_slot(self, key)
            holding.setdefault(slot // per, set()).add(self.put_for[key])
            assert remote_lookup(self.g, self.index, self.data, key) == self.blobs[key]
            for g in GROUPS:
                want = (slot, length) if g is not None and g == self.put_for[key] else None
                assert self.arena.locate(key, g) == want
        assert all(len(gs) == 1 for gs in holding.values()), holding
        for seg, g in self.pinned.items():
            assert holding.get(seg, {g}) == {g} and seg in self.arena.segments(g)
        for g in GROUPS:
            held = {s for s, gs in holding.items() if g in gs}
            assert self.arena.segments(g) == sorted(held | {s for s, p in self.pinned.items()
                                                            if p == g})


def remote_lookup_slot(m: SegmentModel, key: bytes) -> tuple[int, int]:
    from .test_arena import find_anywhere

    found = find_anywhere(m.g, m.index, key)
    assert found is not None
    return found


TestSegmentModel = SegmentModel.TestCase
TestSegmentModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class SegmentModelWithSsd(SegmentModel):
    ssd = True


TestSegmentModelWithSsd = SegmentModelWithSsd.TestCase
TestSegmentModelWithSsd.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 40), st.integers(1, 64),
                              st.integers(-1, 2)), max_size=60),
       ssd=st.booleans())
def test_with_one_group_segments_change_nothing(ops: list[tuple[bool, int, int, int]],
                                               ssd: bool) -> None:
    """No grants: every key in group None, and an arena of segments keeps, refuses and
    evicts exactly what the same arena as one segment does."""
    ranks: dict[bytes, int] = {}
    arenas = []
    for segment_slots in (0, 4, 1):
        g = Geometry(nslots=14, slot_size=64, nbuckets=4, segment_slots=segment_slots)
        arenas.append(Arena(g, Mem(g.arena_bytes), Mem(g.index_bytes),
                            rank=lambda k: ranks.get(k, -1),
                            on_evict=(lambda k, d: None) if ssd else None))
    for is_put, seed, size, rank in ops:
        key, blob = _key(seed, size)
        ranks.setdefault(key, rank)
        results = [a.put(key, blob) if is_put else a.drop(key) for a in arenas]
        assert len(set(results)) == 1
        assert len({tuple(a.keys()) for a in arenas}) == 1
    assert len({(a.refused, a.evictions) for a in arenas}) == 1


def _arena(nslots: int = 8, per: int = 4, ssd: bool = False
           ) -> tuple[Arena, dict[bytes, int], dict[bytes, str | None]]:
    ranks: dict[bytes, int] = {}
    groups: dict[bytes, str | None] = {}
    g = Geometry(nslots=nslots, slot_size=64, nbuckets=8, segment_slots=per)
    arena = Arena(g, Mem(g.arena_bytes), Mem(g.index_bytes), rank=lambda k: ranks.get(k, -1),
                  on_evict=(lambda k, d: None) if ssd else None, group=lambda k: groups.get(k))
    return arena, ranks, groups


def _put(arena: Arena, ranks: dict[bytes, int], groups: dict[bytes, str | None], seed: int,
         rank: int, group: str | None) -> bytes:
    key, blob = _key(seed, 8)
    ranks[key], groups[key] = rank, group
    arena.put(key, blob)
    return key


def test_a_group_takes_an_empty_segment_and_fills_its_own_first() -> None:
    arena, ranks, groups = _arena()
    a1 = _put(arena, ranks, groups, 1, 0, "a")
    n1 = _put(arena, ranks, groups, 2, 0, None)
    assert arena.segments("a") == [0] and arena.segments(None) == [1]
    a2 = _put(arena, ranks, groups, 3, 0, "a")
    assert arena.locate(a2, "a") is not None and arena.locate(a2, "a")[0] < 4
    assert arena.locate(n1, None) is None and arena.locate(a1, "b") is None
    arena.drop(a1)
    arena.drop(a2)
    assert arena.segments("a") == []                      # empty: owned by nobody again


def test_a_group_with_no_room_empties_a_segment_of_chunks_outside_the_share() -> None:
    """Arena full of chunks outside the share (rank -1, group None): a granted dataset's
    first chunk frees a whole segment; once its segment is full, with no SSD tier, its
    own share chunks are not evicted for one another, but the next None segment is."""
    arena, ranks, groups = _arena()
    old = [_put(arena, ranks, groups, 10 + i, -1, None) for i in range(8)]
    a = [_put(arena, ranks, groups, 20 + i, 0, "a") for i in range(4)]
    assert all(k in arena for k in a) and arena.segments("a") == [0]
    assert sum(k in arena for k in old) == 4
    a5 = _put(arena, ranks, groups, 30, 0, "a")
    assert a5 in arena and arena.segments("a") == [0, 1] and arena.segments(None) == []
    assert not any(k in arena for k in old)


def test_a_group_never_empties_a_segment_that_outranks_it() -> None:
    arena, ranks, groups = _arena()
    [_put(arena, ranks, groups, 10 + i, 2, None) for i in range(8)]
    key = _put(arena, ranks, groups, 30, 1, "a")
    assert key not in arena and arena.refused == 1 and len(arena) == 8


def test_a_group_evicts_its_own_lowest_rank_before_another_segment() -> None:
    arena, ranks, groups = _arena()
    low = _put(arena, ranks, groups, 1, 0, "a")
    [_put(arena, ranks, groups, 2 + i, 1, "a") for i in range(3)]
    others = [_put(arena, ranks, groups, 10 + i, 1, "b") for i in range(4)]
    key = _put(arena, ranks, groups, 30, 1, "a")
    assert key in arena and low not in arena and all(k in arena for k in others)


def test_adopted_chunks_are_in_segments_of_group_none() -> None:
    arena, ranks, groups = _arena()
    a = _put(arena, ranks, groups, 1, 0, "a")
    b = _put(arena, ranks, groups, 2, 0, "b")
    again = Arena(arena.g, arena.data, arena.index, rank=lambda k: ranks.get(k, -1),
                  group=lambda k: groups.get(k))
    assert again.adopt(lambda k, d: xxhash.xxh3_128_digest(d) == k) == (2, 0)
    assert again.segments("a") == again.segments("b") == [] and again.segments(None) == [0, 1]
    assert again.locate(a, "a") is None and again.locate(b, "b") is None
    c = _put(again, ranks, groups, 3, 1, "c")          # no empty segment: a None one is emptied
    assert c in again and len(again.segments("c")) == 1 and len(again) == 2


def test_adopted_segments_holding_one_datasets_chunks_are_regrouped() -> None:
    arena, ranks, groups = _arena(nslots=12)
    a1 = _put(arena, ranks, groups, 1, 0, "a")
    a2 = _put(arena, ranks, groups, 2, 0, "a")
    b = _put(arena, ranks, groups, 3, 0, "b")
    none = _put(arena, ranks, groups, 4, 0, None)
    (sa,), (sb,), (sn,) = arena.segments("a"), arena.segments("b"), arena.segments(None)
    seg = {a1: sa, a2: sa, b: sb, none: sn}
    again = Arena(arena.g, arena.data, arena.index, rank=lambda k: ranks.get(k, -1),
                  group=lambda k: groups.get(k))
    assert again.adopt(lambda k, d: xxhash.xxh3_128_digest(d) == k) == (4, 0)
    assert again.locate(a1, "a") is None
    groups[b] = "a"                          # b is now also an "a" chunk: its segment goes
    groups[none] = None
    assert again.regroup() == 2              # to "a"; the one holding a group-None key stays
    assert again.segments("a") == sorted({seg[a1], seg[b]}) and again.segments("b") == []
    assert again.segments(None) == [seg[none]]
    assert again.locate(a1, "a") is not None and again.locate(b, "a") is not None
    assert again.regroup() == 0


def test_geometry_of_segments() -> None:
    g = Geometry.for_memory(10 * 64, 64, segment_bytes=4 * 64)
    assert (g.nslots, g.per_segment, g.nsegments) == (10, 4, 3)
    assert [g.segment_span(i) for i in range(3)] == [(0, 256), (256, 256), (512, 128)]
    one = Geometry.for_memory(10 * 64, 64)
    assert (one.nsegments, one.segment_span(0)) == (1, (0, 640))


def test_a_pinned_segment_stays_its_groups_when_empty() -> None:
    """Handed to a reader, segment 0 of "a" is never another group's, even emptied."""
    arena, ranks, groups = _arena()
    a = _put(arena, ranks, groups, 1, 0, "a")
    arena.pin(0)
    arena.drop(a)
    assert arena.segments("a") == [0]
    b = [_put(arena, ranks, groups, 10 + i, 0, "b") for i in range(5)]
    assert arena.segments("b") == [1] and sum(k in arena for k in b) == 4
    a2 = _put(arena, ranks, groups, 2, 0, "a")
    assert arena.locate(a2, "a") is not None and arena.locate(a2, "a")[0] < 4
