"""The node arena and its one-sided-readable index, against a dict model."""
from __future__ import annotations

import struct
from collections import Counter

import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kspeedfs.cluster.arena import (
    BUCKET_BYTES,
    ENTRY,
    SPILL,
    WAYS,
    Arena,
    Geometry,
    buckets_of,
    find_in_bucket,
)


class Mem:
    """A plain buffer with the vMR read/write interface."""

    def __init__(self, n: int) -> None:
        self.length = n
        self.b = bytearray(n)

    def write(self, data, offset: int = 0) -> None:
        self.b[offset:offset + len(data)] = data

    def read(self, length: int, offset: int = 0) -> bytes:
        return bytes(self.b[offset:offset + length])


def find_anywhere(g: Geometry, index: Mem, key: bytes) -> tuple[int, int] | None:
    """(slot, length) of ``key`` in either of its buckets, as a peer's READs find it."""
    for b in buckets_of(key, g.nbuckets):
        found = find_in_bucket(index.read(BUCKET_BYTES, b * BUCKET_BYTES), key)
        if found is not None:
            return found
    return None


def bucket_keys(index: Mem, b: int) -> list[bytes]:
    """The keys bucket ``b`` of an index holds."""
    entries = (ENTRY.unpack_from(index.read(BUCKET_BYTES, b * BUCKET_BYTES), w * ENTRY.size)
               for w in range(WAYS))
    return [k for k, _, length, _ in entries if length]


def remote_lookup(g: Geometry, index: Mem, data: Mem, key: bytes) -> bytes | None:
    """What a peer does with one-sided READs (fetch.py), here on local buffers."""
    found = find_anywhere(g, index, key)
    if found is None:
        return None
    slot, length = found
    got = data.read(length, slot * g.slot_size)
    return got if xxhash.xxh3_128_digest(got) == key else None


class ArenaModel(RuleBasedStateMachine):
    """Random puts of chunks of random ranks (-1: outside the share, 0..2: priorities)
    and drops: the index always agrees with the arena, a put is refused only when
    every possible victim outranks it or ranks the same (>= 0), a refused put evicts
    nothing, and ``takes`` foretells every put."""

    geometry = Geometry.for_memory(6 * 64, 64)              # 6 slots of 64 bytes, 2 buckets
    ssd = False                                             # an SSD tier takes the evicted

    def __init__(self) -> None:
        super().__init__()
        self.g = self.geometry
        self.data, self.index = Mem(self.g.arena_bytes), Mem(self.g.index_bytes)
        self.ranks: dict[bytes, int] = {}
        self.arena = Arena(self.g, self.data, self.index, rank=lambda k: self.ranks.get(k, -1),
                           on_evict=(lambda k, d: None) if self.ssd else None)
        self.blobs: dict[bytes, bytes] = {}

    @rule(seed=st.integers(0, 30), size=st.integers(1, 64), rank=st.integers(-1, 2))
    def put(self, seed: int, size: int, rank: int) -> None:
        blob = bytes([seed]) * size
        key = xxhash.xxh3_128_digest(blob)
        self.blobs[key] = blob
        if key not in self.arena:
            self.ranks[key] = rank
        before = set(self.arena.keys())
        foretold = self.arena.takes(key)
        stored = self.arena.put(key, blob)
        assert stored == foretold
        if stored:
            assert key in self.arena
        else:
            assert set(self.arena.keys()) == before, "a refused put evicted something"
            # refused: the key's buckets, or else the arena, are full of higher ranks, or of
            # its own (>= 0; in a full arena only without an SSD tier)
            held = [bucket_keys(self.index, b) for b in buckets_of(key, self.g.nbuckets)]
            full = all(len(h) == WAYS for h in held)
            bucket = [k for h in held for k in h]
            others = bucket if full else list(before) if len(before) == self.g.nslots else []
            low, mine = min(self.ranks.get(k, -1) for k in others), self.ranks[key]
            assert others and (low > mine or (low == mine >= 0 and (full or not self.ssd)))

    @rule(seed=st.integers(0, 30), size=st.integers(1, 64))
    def drop(self, seed: int, size: int) -> None:
        key = xxhash.xxh3_128_digest(bytes([seed]) * size)
        was = key in self.arena
        assert self.arena.drop(key) == (size if was else 0)
        assert key not in self.arena

    @invariant()
    def index_agrees(self) -> None:
        assert len(self.arena) <= self.g.nslots
        for key, blob in self.blobs.items():
            got = remote_lookup(self.g, self.index, self.data, key)
            if key in self.arena:
                assert got == blob and self.arena.get(key) == blob
            else:
                assert got is None                          # evicted: invisible remotely too


TestArenaModel = ArenaModel.TestCase


class CrowdedArenaModel(ArenaModel):
    """The same with one bucket of WAYS entries for 12 slots: full buckets are common."""

    geometry = Geometry(nslots=12, slot_size=64, nbuckets=1)


TestCrowdedArenaModel = CrowdedArenaModel.TestCase


class TwoBucketArenaModel(ArenaModel):
    """The same with two buckets of WAYS entries for 20 slots: both of a key's buckets
    full is common."""

    geometry = Geometry(nslots=20, slot_size=64, nbuckets=2)


TestTwoBucketArenaModel = TwoBucketArenaModel.TestCase


class SsdArenaModel(ArenaModel):
    """The same on a node with an SSD tier: a full arena evicts the oldest of a rank."""

    ssd = True


TestSsdArenaModel = SsdArenaModel.TestCase


def test_a_full_bucket_of_its_own_rank_refuses_a_share_chunk_and_keeps_what_it_holds() -> None:
    """Two chunks of one share that fall in a full bucket no longer take turns evicting
    each other (each loaded again when a reader missed it); a higher rank still evicts,
    and outside the share the oldest still goes."""
    g = Geometry(nslots=WAYS + 4, slot_size=16, nbuckets=1)
    ranks: dict[bytes, int] = {}
    a = Arena(g, Mem(g.arena_bytes), Mem(g.index_bytes), rank=lambda k: ranks.get(k, -1))
    keys = [xxhash.xxh3_128_digest(bytes([i])) for i in range(WAYS + 3)]
    for i, k in enumerate(keys[:WAYS]):
        ranks[k] = 0
        assert a.put(k, bytes([i]) * 16)
    ranks[keys[WAYS]] = 0
    assert a.takes(keys[0]) and not a.takes(keys[WAYS])
    assert not a.put(keys[WAYS], b"x" * 16)
    assert all(k in a for k in keys[:WAYS]) and a.statistics().refused == 1
    ranks[keys[WAYS + 1]] = 1
    assert a.put(keys[WAYS + 1], b"y" * 16) and keys[0] not in a   # a higher rank: oldest out
    for k in keys[1:WAYS]:
        ranks[k] = -1                                       # their dataset was unloaded
    assert a.put(keys[WAYS + 2], b"z" * 16)                 # outside the share: LRU
    assert keys[1] not in a


def test_chunks_outside_the_share_are_evicted_first() -> None:
    g = Geometry.for_memory(4 * 16, 16)
    ranks: dict[bytes, int] = {}
    a = Arena(g, Mem(g.arena_bytes), Mem(g.index_bytes), rank=lambda k: ranks.get(k, -1))
    keys = [xxhash.xxh3_128_digest(bytes([i])) for i in range(5)]
    for i, k in enumerate(keys[:4]):
        if i != 1:
            ranks[k] = 0
        a.put(k, bytes([i]) * 16)
    assert a.put(keys[4], b"x" * 16)                        # full: evict the one outside
    assert keys[1] not in a and all(k in a for k in keys[:1] + keys[2:])
    assert a.statistics().evictions == 1


def test_lower_priority_goes_first_and_never_evicts_a_higher_one() -> None:
    g = Geometry.for_memory(4 * 16, 16)
    ranks: dict[bytes, int] = {}
    spilled: list[bytes] = []
    a = Arena(g, Mem(g.arena_bytes), Mem(g.index_bytes), rank=lambda k: ranks.get(k, -1),
              on_evict=lambda k, d: spilled.append(k))
    keys = [xxhash.xxh3_128_digest(bytes([i])) for i in range(6)]
    for i, k in enumerate(keys[:4]):
        ranks[k] = 5 if i % 2 else 1                        # 0, 2: priority 1; 1, 3: priority 5
        a.put(k, bytes([i]) * 16)
    ranks[keys[4]] = 5
    assert a.put(keys[4], b"x" * 16)                        # evicts the oldest priority-1 one
    assert keys[0] not in a and spilled == [keys[0]]
    ranks[keys[5]] = 1
    assert a.put(keys[5], b"y" * 16)                        # a priority-1 one is still there
    assert keys[2] not in a and spilled[-1] == keys[2]      # (to the SSD tier: still held)
    ranks[keys[0]] = 0
    assert not a.put(keys[0], b"z" * 16), "a priority-0 chunk evicted a higher one"
    assert keys[0] not in a and a.statistics().refused == 1
    assert spilled[-1] == keys[0], "a refused chunk goes to the SSD tier as if evicted"


def test_without_an_ssd_tier_a_share_chunk_never_evicts_one_of_its_own_rank() -> None:
    """A share larger than the arena (a forced preload, a lost peer's share) keeps what
    it got first: a chunk of the same priority is refused, not stored by evicting an
    earlier one (which the next pass or reader's miss would load again, evicting
    another); a lower rank still goes for it."""
    g = Geometry.for_memory(4 * 16, 16)
    ranks: dict[bytes, int] = {}
    a = Arena(g, Mem(g.arena_bytes), Mem(g.index_bytes), rank=lambda k: ranks.get(k, -1))
    keys = [xxhash.xxh3_128_digest(bytes([i])) for i in range(7)]
    for i, k in enumerate(keys[:4]):
        ranks[k] = 1
        assert a.put(k, bytes([i]) * 16)
    ranks[keys[4]] = 1
    assert not a.takes(keys[4]) and not a.put(keys[4], b"x" * 16)
    assert all(k in a for k in keys[:4]) and a.statistics().refused == 1
    ranks[keys[5]] = 2
    assert a.put(keys[5], b"y" * 16) and keys[0] not in a    # a higher rank: the oldest goes
    ranks[keys[6]] = -1
    assert not a.put(keys[6], b"z" * 16)                     # outside the share: all outrank it


def _verify(key: bytes, data: bytes) -> bool:
    return xxhash.xxh3_128_digest(data) == key


def test_adopt_keeps_what_verifies_and_drops_the_rest() -> None:
    """A restarted node's arena (the same memory, a new Arena) keeps every chunk whose
    slot still hashes to its key; a changed slot, a torn entry and a slot claimed twice
    are cleared, and the adopted arena then behaves like the old one."""
    g = Geometry.for_memory(8 * 64, 64)
    data, index = Mem(g.arena_bytes), Mem(g.index_bytes)
    old = Arena(g, data, index)
    chunks = {xxhash.xxh3_128_digest(bytes([i]) * (10 + i)): bytes([i]) * (10 + i) for i in range(6)}
    for key, value in chunks.items():
        old.put(key, value)
    victim = next(iter(chunks))
    slot, _ = find_anywhere(g, index, victim)
    data.b[slot * g.slot_size] ^= 0xFF                  # changed while the node was down
    new = Arena(g, data, index)
    kept, dropped = new.adopt(_verify)
    assert (kept, dropped) == (5, 1)
    assert victim not in new and remote_lookup(g, index, data, victim) is None
    for key, value in chunks.items():
        if key != victim:
            assert new.get(key) == value and remote_lookup(g, index, data, key) == value
    assert new.used_bytes == sum(len(v) for k, v in chunks.items() if k != victim)
    new.put(victim, chunks[victim])                     # reloaded into a free slot
    assert remote_lookup(g, index, data, victim) == chunks[victim]
    assert new.statistics().used_slots == 6
    new.put(xxhash.xxh3_128_digest(b"x"), b"x")         # two free slots left, no reuse
    new.put(xxhash.xxh3_128_digest(b"y"), b"y")
    assert all(new.get(k) == v for k, v in chunks.items())


def test_adopt_of_garbage_keeps_nothing() -> None:
    import random

    g = Geometry.for_memory(8 * 64, 64)
    rnd = random.Random(1)
    data = Mem(g.arena_bytes)
    index = Mem(g.index_bytes)
    index.b[:] = rnd.randbytes(g.index_bytes)
    data.b[:] = rnd.randbytes(g.arena_bytes)
    kept, dropped = Arena(g, data, index).adopt(_verify)
    assert kept == 0 and dropped > 0
    assert index.b == bytearray(g.index_bytes)          # every entry cleared


@settings(max_examples=500, deadline=None)
@given(bucket=st.binary(min_size=BUCKET_BYTES, max_size=BUCKET_BYTES),
       key=st.binary(min_size=16, max_size=16), plant=st.booleans())
def test_find_in_bucket_takes_any_bytes_a_peer_sends(bucket: bytes, key: bytes,
                                                     plant: bool) -> None:
    """A bucket as READ from a peer (or sliced from its whole index, READ for the native
    fetch's routes) is arbitrary bytes: the answer is None or a (slot, length) with a
    length, never an exception."""
    if plant:                                   # the key in its last way
        bucket = bucket[:BUCKET_BYTES - 32] + key + bucket[BUCKET_BYTES - 16:]
    found = find_in_bucket(bucket, key)
    assert found is None or (0 <= found[0] < 1 << 32 and 0 < found[1] < 1 << 32)


def _key(first: int, second: int) -> bytes:
    """A key whose first and second bucket are ``first`` and ``second`` mod nbuckets."""
    return struct.pack("<QQ", first, second)


def test_a_key_goes_to_its_second_bucket_only_past_spill_then_to_the_emptier() -> None:
    g = Geometry(nslots=3 * WAYS, slot_size=16, nbuckets=4)
    index = Mem(g.index_bytes)
    a = Arena(g, Mem(g.arena_bytes), index, rank=lambda k: 0)
    keys = [_key(4 * i, 4 * i + 1) for i in range(2 * WAYS + 1)]     # buckets 0, then 1
    for k in keys[:SPILL]:
        assert a.put(k, b"x")
    assert len(bucket_keys(index, 0)) == SPILL and not bucket_keys(index, 1)
    loads = []
    for k in keys[SPILL:2 * WAYS]:
        assert a.put(k, b"x")
        loads.append(tuple(len(bucket_keys(index, b)) for b in (0, 1)))
    # past SPILL the emptier of the two, the first on a tie, until both are full
    assert loads == [(6, 1), (6, 2), (6, 3), (6, 4), (6, 5), (6, 6), (7, 6), (7, 7), (8, 7),
                     (8, 8)]
    assert all(find_anywhere(g, index, k) is not None for k in keys[:2 * WAYS])
    assert not a.takes(keys[-1]) and not a.put(keys[-1], b"x")        # both full: refused
    a.evict(keys[0])                                                  # a way in bucket 0
    assert a.put(keys[-1], b"x") and keys[-1] in bucket_keys(index, 0)


def test_two_buckets_a_key_leave_no_chunk_refused_at_a_full_arena() -> None:
    """20 arenas of 128 slots, each given 128 random chunks of one share: with one
    bucket a key some of these refused a chunk (the first bucket asked for more than
    WAYS keys); with two, none."""
    import random

    rnd = random.Random(5)
    refused = overflowing = 0
    for _ in range(20):
        g = Geometry.for_memory(128 * 16, 16)
        a = Arena(g, Mem(g.arena_bytes), Mem(g.index_bytes), rank=lambda k: 0)
        keys = [rnd.randbytes(16) for _ in range(g.nslots)]
        refused += sum(not a.put(k, b"x") for k in keys)
        first = Counter(buckets_of(k, g.nbuckets)[0] for k in keys)
        overflowing += sum(max(0, n - WAYS) for n in first.values())
    assert overflowing > 0 and refused == 0, (overflowing, refused)


def test_adopt_keeps_a_key_in_its_second_bucket_and_clears_one_outside_both() -> None:
    g = Geometry(nslots=4, slot_size=64, nbuckets=4)
    data, index = Mem(g.arena_bytes), Mem(g.index_bytes)
    second, stray = b"in its second", b"in neither"
    k2, k3 = xxhash.xxh3_128_digest(second), xxhash.xxh3_128_digest(stray)
    b2 = buckets_of(k2, g.nbuckets)[-1]
    other = next(b for b in range(g.nbuckets) if b not in buckets_of(k3, g.nbuckets))
    data.write(second, 0)
    data.write(stray, 64)
    index.write(ENTRY.pack(k2, 0, len(second), 0), b2 * BUCKET_BYTES)
    index.write(ENTRY.pack(k3, 1, len(stray), 0), other * BUCKET_BYTES + ENTRY.size)
    a = Arena(g, data, index)
    assert a.adopt(_verify) == (1, 1)
    assert remote_lookup(g, index, data, k2) == second and k3 not in a
    assert k3 not in bucket_keys(index, other)
    assert a.put(k3, stray) and remote_lookup(g, index, data, k3) == stray
