"""``SlotHints``: slots by node incarnation, the oldest hint dropped first, an index copy
read for slots (and dropped with a stale hint from its node), its READ asked for at most
once per INDEX_REFRESH; a copy that does not list a chunk says its node lacks it."""
from __future__ import annotations

import xxhash

from kspeedfs.cluster.arena import BUCKET_BYTES, ENTRY, WAYS, Arena, Geometry, buckets_of
from kspeedfs.cluster.hints import SlotHints
from kspeedfs.cluster.membership import NodeRecord
from kspeedfs.tuning import INDEX_REFRESH, INDEX_TRUST, SPILL
from tests.unit.test_arena import Mem

SLOT = 64 << 10


def _node(started: float, g: Geometry) -> NodeRecord:
    return NodeRecord("n1", "host1", ["198.18.0.1"], 1, 2, g.arena_bytes, g.nslots, SLOT,
                      g.nbuckets, started)


def test_hints_are_per_incarnation_and_the_oldest_goes_first() -> None:
    hints = SlotHints(limit=2)
    hints.learn("n1", 1.0, b"a", 5)
    assert hints.get("n1", 1.0, b"a") == 5 and hints.get("n1", 2.0, b"a") is None
    hints.learn("n1", 1.0, b"b", 6)
    hints.learn("n1", 1.0, b"c", 7)                  # full: "a" goes
    assert [hints.get("n1", 1.0, k) for k in (b"a", b"b", b"c")] == [None, 6, 7]
    hints.stale("n1", 1.0, b"b")
    assert hints.get("n1", 1.0, b"b") is None


def test_an_index_copy_gives_slots_until_a_stale_hint_drops_it() -> None:
    g = Geometry.for_memory(8 * SLOT, SLOT)
    data, index = Mem(g.arena_bytes), Mem(g.index_bytes)
    arena = Arena(g, data, index)
    chunk = b"x" * 1000
    key = xxhash.xxh3_128_digest(chunk)
    arena.put(key, chunk)
    rec, hints = _node(1.0, g), SlotHints()

    assert hints.in_index(rec, key, len(chunk)) is None          # no copy yet
    size = hints.index_due(rec, SLOT, now=10.0)
    assert size == g.index_bytes
    assert hints.index_due(rec, SLOT, now=10.0 + INDEX_REFRESH / 2) == 0   # asked already
    hints.keep_index(rec, index.read(size), now=10.0)
    slot = hints.in_index(rec, key, len(chunk))
    assert slot is not None and hints.get("n1", 1.0, key) == slot  # learned as a hint
    assert hints.in_index(rec, key, len(chunk) + 1) is None       # another length: not it
    assert hints.index_due(rec, SLOT, now=10.0 + INDEX_TRUST / 2) == 0   # a copy is held
    assert hints.in_index(_node(2.0, g), key, len(chunk)) is None  # a restarted node

    assert hints.index_due(rec, SLOT, now=10.0 + INDEX_TRUST) == size   # an old copy
    hints.stale("n1", 1.0, key)                                   # the slot was reused
    assert hints.in_index(rec, key, len(chunk)) is None
    assert hints.index_due(rec, SLOT, now=100.0) == size          # READ it again
    assert hints.index_due(rec, g.index_bytes - 1, now=200.0) == 0  # does not fit


def test_a_node_without_buckets_has_no_index_to_read() -> None:
    g = Geometry(0, SLOT, 0)
    assert SlotHints().index_due(_node(1.0, g), SLOT, now=5.0) == 0


def test_a_chunk_missing_from_a_recent_index_copy_is_lacking_there_and_nothing_else_is() -> None:
    g = Geometry.for_memory(8 * SLOT, SLOT)
    data, index = Mem(g.arena_bytes), Mem(g.index_bytes)
    arena = Arena(g, data, index)
    held, other = b"h" * 100, b"o" * 100
    arena.put(xxhash.xxh3_128_digest(held), held)
    rec, hints = _node(1.0, g), SlotHints()
    missing = xxhash.xxh3_128_digest(other)
    assert not hints.lacks(rec, missing, now=5.0)                 # no copy: not known
    hints.keep_index(rec, index.read(g.index_bytes), now=5.0)
    assert hints.lacks(rec, missing, now=5.0 + INDEX_TRUST / 2)
    assert not hints.lacks(rec, xxhash.xxh3_128_digest(held), now=6.0)
    assert not hints.lacks(_node(2.0, g), missing, now=6.0)       # another incarnation
    assert not hints.lacks(rec, missing, now=5.0 + INDEX_TRUST)   # too old to say


def test_an_index_copy_finds_a_chunk_in_its_second_bucket() -> None:
    """Past SPILL keys in its first bucket a key sits in its second (arena.py): the copy
    lists it there, so it neither lacks it nor misses its slot."""
    g = Geometry(nslots=SPILL + 2, slot_size=SLOT, nbuckets=2)
    data, index = Mem(g.arena_bytes), Mem(g.index_bytes)
    arena = Arena(g, data, index)
    keys: list[bytes] = []
    seed = 0
    while len(keys) < SPILL + 1:                 # chunks whose buckets are 0, then 1
        chunk = seed.to_bytes(4, "little") * 25
        seed += 1
        key = xxhash.xxh3_128_digest(chunk)
        if buckets_of(key, 2) == (0, 1):
            assert arena.put(key, chunk)
            keys.append(key)
    rec, hints = _node(1.0, g), SlotHints()
    hints.keep_index(rec, index.read(g.index_bytes), now=10.0)
    last = keys[-1]
    assert last not in [k for k, *_ in (ENTRY.unpack_from(index.read(BUCKET_BYTES), w * ENTRY.size)
                                         for w in range(WAYS))]       # not in its first
    assert not hints.lacks(rec, last, now=11.0)
    assert hints.in_index(rec, last, 100) is not None
