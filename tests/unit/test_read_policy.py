"""The read policy (read_policy.py) alone: plain synchronous tests, no trio, no files."""
from __future__ import annotations

from kspeedfs.cache.prefetch import Stream
from kspeedfs.read_policy import (
    MAX_READ_BLOCKS,
    PROMOTE_AFTER,
    PROMOTE_TRACKED,
    SMALL_FILE_DIVISOR,
    ReadPolicy,
    is_random,
)

C = 4 << 20          # chunk
B = 128 << 10        # block


def policy(*, chunks: int = 10, tier_bytes: int = 100 * C, block_size: int = B) -> ReadPolicy:
    return ReadPolicy(chunk_size=C, block_size=block_size, chunks=chunks, tier_bytes=tier_bytes)


def test_chunks_fit_when_the_dataset_fits_the_tiers() -> None:
    assert policy(chunks=10, tier_bytes=10 * C).chunks_fit
    assert not policy(chunks=10, tier_bytes=10 * C - 1).chunks_fit


def test_small_files_alone_only_when_the_dataset_outgrows_the_tiers() -> None:
    small = C // SMALL_FILE_DIVISOR
    assert not policy().small_file(small)                       # fits: whole chunks
    assert policy(tier_bytes=C).small_file(small)               # (from peers as from the source)
    assert not policy(tier_bytes=C).small_file(small + 1)       # larger than chunk/8


def test_random_is_a_read_that_does_not_continue_the_last() -> None:
    assert not is_random(None)
    assert is_random(Stream(run=0))
    assert not is_random(Stream(run=1))


def test_block_span() -> None:
    p = policy()
    assert p.blocks(0, 1) == range(0, 1)
    assert p.blocks(B - 1, B + 1) == range(0, 2)
    assert p.blocks(3 * B, 5 * B) == range(3, 5)


def test_at_most_four_blocks_else_the_chunk() -> None:
    p = policy(tier_bytes=C)                                    # no promotion
    assert MAX_READ_BLOCKS == 4
    assert p.blocks_for(0, 100, 100 + 4096)                     # a 4 KiB read: one block
    assert p.blocks_for(0, B - 2048, B + 2048)                  # across a boundary: two
    assert p.blocks_for(0, 10, 4 * B - 10)                      # four blocks
    assert not p.blocks_for(0, 10, 4 * B + 10)                  # five: the chunk
    assert not p.blocks_for(0, 0, 1 << 20)                      # a shard reader's 1 MiB


def test_no_blocks_without_blocks_in_the_manifest() -> None:
    assert not policy(block_size=0).blocks_for(0, 0, 4096)
    assert not policy(block_size=C).blocks_for(0, 0, 4096)      # one block a chunk


def test_a_second_miss_promotes_the_chunk_when_the_dataset_fits() -> None:
    p = policy()
    assert p.chunks_fit and PROMOTE_AFTER == 1
    assert p.blocks_for(3, 0, 4096)
    p.block_loaded(3)
    assert not p.blocks_for(3, 5 * B, 5 * B + 4096)             # promoted: load it whole
    assert p.blocks_for(4, 0, 4096)                             # other chunks are not
    assert p.chunk_loaded(3)                                    # the chunk drops its blocks
    assert not p.chunk_loaded(3) and not p.chunk_loaded(4)      # ... once; none for chunk 4
    assert p.blocks_for(3, 0, 4096)


def test_no_promotion_when_the_dataset_outgrows_the_tiers() -> None:
    p = policy(tier_bytes=C)
    for _ in range(5):
        p.block_loaded(3)
    assert p.blocks_for(3, 0, 4096)


def test_block_counts_are_bounded_oldest_dropped() -> None:
    p = policy()
    for k in range(PROMOTE_TRACKED + 1):
        p.block_loaded(k)
    assert len(p.block_loads) == PROMOTE_TRACKED
    assert 0 not in p.block_loads and PROMOTE_TRACKED in p.block_loads
    p.block_loaded(1)                                            # known chunk: nothing dropped
    assert p.block_loads[1] == 2 and len(p.block_loads) == PROMOTE_TRACKED


def test_prefetch_budget_is_half_the_room() -> None:
    p = policy()
    assert p.ahead_max(4 * C) == 2
    assert p.ahead_max(C) == 1                                   # never below one
    assert p.ahead_max(0) == 1


def test_room_ahead_forgets_chunks_evicted_unread() -> None:
    p = policy()
    p.ahead = {b"a", b"b"}
    alive = {b"a", b"b"}
    assert not p.room_ahead(4 * C, alive.__contains__)         # two of two: full
    alive.discard(b"b")                                          # evicted unread
    assert p.room_ahead(4 * C, alive.__contains__)
    assert p.ahead == {b"a"}
    assert p.room_ahead(8 * C, lambda key: False) and p.ahead == {b"a"}   # not full: kept
