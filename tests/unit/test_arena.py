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
