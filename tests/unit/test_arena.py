"""The node arena and its one-sided-readable index, against a dict model."""
from __future__ import annotations

import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kspeedfs.cluster.arena import (BUCKET_BYTES, ENTRY, WAYS, Arena, Geometry, bucket_of,
                                    find_in_bucket)


class Mem:
    """A plain buffer with the vMR read/write interface."""

    def __init__(self, n: int) -> None:
        self.length = n
        self.b = bytearray(n)

    def write(self, data, offset: int = 0) -> None:
        self.b[offset:offset + len(data)] = data

    def read(self, length: int, offset: int = 0) -> bytes:
        return bytes(self.b[offset:offset + length])


def remote_lookup(g: Geometry, index: Mem, data: Mem, key: bytes) -> bytes | None:
    """What a peer does with two one-sided READs (fetch.py), here on local buffers."""
    b = bucket_of(key, g.nbuckets)
    found = find_in_bucket(index.read(BUCKET_BYTES, b * BUCKET_BYTES), key)
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
            b = bucket_of(key, self.g.nbuckets)
            # refused: the key's bucket, or else the arena, is full of higher ranks, or of
            # its own (>= 0; in a full arena only without an SSD tier)
            bucket = [k for k in before if bucket_of(k, self.g.nbuckets) == b]
            full = len(bucket) == WAYS
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
    b = bucket_of(victim, g.nbuckets)
    slot, _ = find_in_bucket(index.read(BUCKET_BYTES, b * BUCKET_BYTES), victim)
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


def test_adopt_clears_an_entry_outside_its_keys_bucket() -> None:
    """An entry a reader would never find (its key's bucket is another: files laid out
    with another bucket count) is cleared, and its slot freed: eviction would clear the
    wrong way."""
    g = Geometry(nslots=4, slot_size=64, nbuckets=2)
    data, index = Mem(g.arena_bytes), Mem(g.index_bytes)
    blob = b"chunk"
    key = xxhash.xxh3_128_digest(blob)
    wrong = 1 - bucket_of(key, g.nbuckets)
    data.write(blob, 0)
    index.write(ENTRY.pack(key, 0, len(blob), 0), wrong * BUCKET_BYTES)
    arena = Arena(g, data, index)
    assert arena.adopt(_verify) == (0, 1)
    assert index.b == bytearray(g.index_bytes)
    assert arena.put(key, blob) and remote_lookup(g, index, data, key) == blob


def test_bucket_count_is_spread_by_the_node_name() -> None:
    """Each node's bucket count is its own (a hash of its name), from a quarter of its
    slots up to half that again; without a name it is the quarter."""
    plain = Geometry.for_memory(4096 * 64, 64)
    assert plain.nbuckets == 4096 * 2 // WAYS
    counts = {Geometry.for_memory(4096 * 64, 64, f"n{i}").nbuckets for i in range(40)}
    assert all(plain.nbuckets <= n <= plain.nbuckets * 3 // 2 for n in counts)
    assert len(counts) >= 38
    assert Geometry.for_memory(4096 * 64, 64, "n1") == Geometry.for_memory(4096 * 64, 64, "n1")


def test_replicas_holding_one_share_refuse_different_chunks() -> None:
    """Two nodes of equal memory, each asked to hold the same full share (R of R nodes):
    full buckets refuse some chunks on each, but a chunk refused by both — one that only
    the source then serves — is rare once the bucket counts differ (before, both refused
    exactly the same chunks)."""
    import random

    rnd = random.Random(7)
    keys = [rnd.randbytes(16) for _ in range(2048)]

    def refused(g: Geometry) -> set[bytes]:
        arena = Arena(g, Mem(g.arena_bytes), Mem(g.index_bytes))
        return {k for k in keys if not arena.put(k, b"x")}

    same = [refused(Geometry.for_memory(2048 * 16, 16)) for _ in ("a", "b")]
    assert same[0] and same[0] == same[1]
    a, b = (refused(Geometry.for_memory(2048 * 16, 16, n)) for n in ("n1", "n2"))
    assert Geometry.for_memory(2048 * 16, 16, "n1") != Geometry.for_memory(2048 * 16, 16, "n2")
    assert len(a & b) * 10 <= len(same[0]), (len(a), len(b), len(a & b), len(same[0]))


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


def test_a_node_keeps_an_arena_laid_out_without_the_spread(tmp_path) -> None:
    """A node upgraded over arena files of the unspread bucket count keeps them (and
    what they hold) rather than reloading its share; without files, or with files of
    its own geometry, it takes the spread one."""
    import dataclasses
    import os

    from kspeedfs.cluster.node import _geometry
    from kspeedfs.config import Config

    base = Config()
    cfg = dataclasses.replace(base, cluster=dataclasses.replace(
        base.cluster, memory=4096 * 4096, slot_size=4096, arena_dir=str(tmp_path)))
    plain = Geometry.for_memory(4096 * 4096, 4096)
    spread = Geometry.for_memory(4096 * 4096, 4096, "n1")
    assert plain != spread
    assert _geometry(cfg, "n1") == spread                       # no files yet
    for suffix, size in ((".arena", plain.arena_bytes), (".index", plain.index_bytes)):
        with open(os.path.join(tmp_path, "kspeedfs-n1" + suffix), "wb") as f:
            f.truncate(size)
    assert _geometry(cfg, "n1") == plain
    os.truncate(os.path.join(tmp_path, "kspeedfs-n1.index"), spread.index_bytes)
    assert _geometry(cfg, "n1") == spread
    assert _geometry(dataclasses.replace(cfg, cluster=dataclasses.replace(
        cfg.cluster, arena_dir="")), "n1") == spread
