"""The node arena and its one-sided-readable index, against a dict model."""
from __future__ import annotations

import xxhash
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kspeedfs.cluster.arena import BUCKET_BYTES, Arena, Geometry, bucket_of, find_in_bucket


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
    def __init__(self) -> None:
        super().__init__()
        self.g = Geometry.for_memory(6 * 64, 64)            # 6 slots of 64 bytes
        self.data, self.index = Mem(self.g.arena_bytes), Mem(self.g.index_bytes)
        self.pinned: set[bytes] = set()
        self.arena = Arena(self.g, self.data, self.index, owned=lambda k: k in self.pinned)
        self.blobs: dict[bytes, bytes] = {}

    @rule(seed=st.integers(0, 30), size=st.integers(1, 64), pin=st.booleans())
    def put(self, seed: int, size: int, pin: bool) -> None:
        blob = bytes([seed]) * size
        key = xxhash.xxh3_128_digest(blob)
        self.blobs[key] = blob
        if pin:
            self.pinned.add(key)
        self.arena.put(key, blob)
        assert key in self.arena

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


def test_unowned_chunks_are_evicted_first() -> None:
    g = Geometry.for_memory(4 * 16, 16)
    owned: set[bytes] = set()
    a = Arena(g, Mem(g.arena_bytes), Mem(g.index_bytes), owned=lambda k: k in owned)
    keys = [xxhash.xxh3_128_digest(bytes([i])) for i in range(5)]
    for i, k in enumerate(keys[:4]):
        if i != 1:
            owned.add(k)
        a.put(k, bytes([i]) * 16)
    a.put(keys[4], b"x" * 16)                               # full: evict the unowned one
    assert keys[1] not in a and all(k in a for k in keys[:1] + keys[2:])
    assert a.statistics().evictions == 1


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
