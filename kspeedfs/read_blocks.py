"""③–⑥ for a small random read: bytes of a chunk from its 128 KiB blocks, not the whole
chunk (the rule: ``read_policy.ReadPolicy.blocks_for``; the measurements:
docs/design.md, "Whole chunks or blocks").

    wanted(k, lo, hi, random)          the policy's rule, and the chunk is in no local
                                       tier and not loading
    read(entry, k, lo, hi)             the blocks under [lo, hi), concurrently:
      memory tier hit?                 under block_key(chunk key, b)
      else single-flight load:         TierChain.get
        a replica's block              TierChain.from_peers(part=…): one vRDMA READ,
                                       checked against the block's xxh3-64
        else the source's              Origin.load_block, verified; a mismatch falls
                                       back to the whole chunk, whose load names the file
      → memory tier, counted toward promotion (ReadPolicy.block_loaded)
    hand(entry, read)                  a random READ inside one block, handed to C with
                                       it (TierChain.start_block)
    landed(k, key)                     the chunk arrived whole: its blocks go
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from .cache.disk import DiskCache
from .cache.memory import MemoryCache
from .cache.tiers import Data, Loaded, TierChain
from .fanout import each
from .manifest.index import ManifestIndex
from .manifest.model import block_key
from .origin import Origin
from .read_policy import ReadPolicy
from .stats import Counters

__all__ = ["BlockReads", "block_key"]


class BlockReads:
    """Bytes of a chunk from its blocks, for the small random reads ``wanted`` says.

    Every block it returns is verified (by the peer READ or the source read that loaded
    it) and kept in the memory tier under ``block_key``; it owns those entries, and drops
    a chunk's once the chunk is held whole (``landed``). Loads run through ``tiers`` (its
    single-flight, peers and source steps), so errors are TierChain's; a block whose
    source bytes no longer match is cut from ``chunk(entry, k)`` instead (the reader's
    whole-chunk read, which names the changed file, or serves this file's bytes if
    another file changed). Trio thread only.

    Attributes:
        index, origin: the dataset version's manifest and source.
        memory, disk: the local tiers (``disk`` may be None).
        tiers: the tier chain the loads run through.
        policy: the read decisions (``blocks_for``, promotion).
        counters: read-path counters it adds to: block_reads, block_fallbacks,
            source_blocks, source_bytes.
        chunk: ``chunk(entry, k)``, the whole chunk for a read of ``entry``.
    """

    def __init__(self, *, index: ManifestIndex, origin: Origin, memory: MemoryCache,
                 disk: DiskCache | None, tiers: TierChain, policy: ReadPolicy,
                 counters: Counters, chunk: Callable[[int, int], Awaitable[Data]]) -> None:
        self.index = index
        self.origin = origin
        self.memory = memory
        self.disk = disk
        self.tiers = tiers
        self.policy = policy
        self.counters = counters
        self.chunk = chunk

    def wanted(self, k: int, lo: int, hi: int, random: bool) -> bool:
        """Whether bytes [lo, hi) of chunk ``k`` come from its blocks: a small random read
        (``ReadPolicy.blocks_for``) of a chunk in no local tier and not loading."""
        return random and self.policy.blocks_for(k, lo, hi) and not self._near(k)

    def _near(self, k: int) -> bool:
        """Whether chunk ``k`` is in a local tier or loading already."""
        key = self.index.chunk_digest(k)
        return (key in self.memory or self.tiers.in_flight(key)
                or (self.disk is not None and key in self.disk))

    async def read(self, entry: int, k: int, lo: int, hi: int) -> Data:
        """Bytes [lo, hi) of chunk ``k`` (for a read of ``entry``) from the blocks that
        hold them."""
        B = self.index.block_size
        span = self.policy.blocks(lo, hi)
        self.counters.add("block_reads")
        if len(span) == 1:
            data = await self._block(entry, k, span[0])
            return memoryview(data)[lo - span[0] * B:hi - span[0] * B]
        parts: list[Data] = [b""] * len(span)

        async def one(b: int) -> None:
            data = await self._block(entry, k, b)
            parts[b - span[0]] = memoryview(data)[max(lo, b * B) - b * B:min(hi, (b + 1) * B) - b * B]

        await each(one, ((b,) for b in span))
        return b"".join(parts)

    def hand(self, entry: int, read: tuple[Any, ...]) -> bool:
        """Whether the native fetch took ``read`` (the native engine's queued READ of
        ``entry``: fd, unique, offset, size, random, since) with the one block it falls
        in (``TierChain.start_block``), C answering it; False: not a random read inside
        one block that ``wanted`` picks, or C did not take it."""
        block = self._single(entry, read[2], read[3], read[4])
        if block is None:
            return False
        k, b = block
        if not self.tiers.start_block(k, b, block_key(self.index.chunk_digest(k), b), entry,
                                      read):
            return False
        self.counters.add("block_reads")        # (as read counts one)
        self.policy.block_loaded(k)
        return True

    def _single(self, entry: int, offset: int, size: int, random: int) -> tuple[int, int] | None:
        """(chunk, block) when a random read of [offset, offset + size) of ``entry`` is
        answered from one block (``wanted``), else None."""
        ix = self.index
        chunks = ix.chunk_range(entry, offset, size)
        if not random or len(chunks) != 1:
            return None
        k, c = chunks[0], ix.chunk_size
        lo = ix.data[entry] + offset - k * c
        hi = ix.data[entry] + min(offset + size, ix.size[entry]) - k * c
        if hi <= lo or not self.wanted(k, lo, hi, True):
            return None
        span = self.policy.blocks(lo, hi)
        return (k, span[0]) if len(span) == 1 else None

    def landed(self, k: int, key: bytes) -> None:
        """Chunk ``k`` (digest ``key``) is in the memory tier: blocks of it that random
        reads loaded go (the chunk serves them now, and a resident block would hold room
        for good)."""
        if self.policy.chunk_loaded(k):
            for b in range(self.index.block_count(k)):
                self.memory.discard(block_key(key, b))

    async def _block(self, entry: int, k: int, b: int) -> Data:
        """Verified block ``b`` of chunk ``k``, kept in the memory tier (``block_key``)."""
        key = block_key(self.index.chunk_digest(k), b)
        return await self.tiers.get(key, self._load_block, entry, k, b, key)

    async def _load_block(self, entry: int, k: int, b: int, key: bytes) -> Loaded:
        ix = self.index
        B, length, digest = ix.block_size, ix.block_len(k, b), ix.block_digest(k, b)
        data = await self.tiers.from_peers(k, ix.chunk_digest(k), part=(b * B, length, digest))
        tier = "peer"
        if data is None:
            data = await self.tiers.from_source(k, self.origin.load_block, k, b)
            if data is None:                   # the source changed: the chunk load says where
                self.counters.add("block_fallbacks")
                chunk = await self.chunk(entry, k)
                return Loaded(chunk[b * B:b * B + length], "chunk")
            self.counters.add("source_blocks")
            self.counters.add("source_bytes", len(data))
            tier = "source"
        self.memory.put(key, data)
        self.policy.block_loaded(k)
        return Loaded(data, tier)
