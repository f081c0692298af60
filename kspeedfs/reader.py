"""②–⑥ on one screen: from (file, offset, size) to verified bytes (the steps:
docs/design.md, "The steps of a read").

    read(entry, offset, size)
      → index.chunk_range()                 ② manifest lookup: which chunks
      → which unit: file, blocks, chunk     read_policy.py (no I/O: tested alone)
      → chunk(k) for each, concurrently     (a random read that misses: block(k, b),
                                             the same tiers for 128 KiB, not 4 MiB)
          memory tier hit?                  ③ local cache (verified, immutable)
          else single-flight load:          cache/tiers.py TierChain (a node's too)
            disk tier, verified             ③ (chunk digest; discard on mismatch)
            replicas by vRDMA READ          ④⑤ cluster/placement.py + cluster/fetch.py
            origin, verified per extent     ⑤′ last resort; SourceChanged → EIO
          → memory (and disk) tier
      → slice and join                      reply

Every load runs in the reader's nursery so a cancelled FUSE request never cancels
a load others wait for; blocking I/O and hashing run in worker threads (limited by
``fuse.workers``) so the trio loop keeps answering the kernel.
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

import trio

from .cache.disk import DiskCache
from .cache.memory import MemoryCache
from .cache.prefetch import Prefetcher, Stream
from .cache.singleflight import SingleFlight
from .cache.tiers import Data, Loaded, TierChain
from .errors import KspeedfsError, SourceChanged
from .manifest.index import ManifestIndex
from .manifest.model import Extent
from .origin import Origin
from .read_policy import ReadPolicy, is_random
from .stats import Counters, ReadStatistics

if TYPE_CHECKING:
    from .cluster.fetch import Peers

__all__ = ["Data", "Push", "Reader", "block_key"]

log = logging.getLogger(__name__)

#: ``push(entry, chunk, data)``: hand a prefetched, verified chunk of an open file to the
#: kernel page cache (fuse/pagecache.py) so the reader finds it there; returns the bytes
#: stored, or None if the kernel refused
Push = Callable[[int, int, Data], Awaitable["int | None"]]


def block_key(chunk_key: bytes, block: int) -> bytes:
    """Memory-tier key of a block: the chunk's key plus the block number (a chunk key is
    16 bytes, so the two never meet)."""
    return chunk_key + block.to_bytes(4, "little")


async def _each(fn: Callable[..., Awaitable[None]], args: Iterable[tuple[Any, ...]]) -> None:
    """``fn(*a)`` for every ``a``, concurrently. A kspeedfs error is raised as itself,
    not inside the nursery's ExceptionGroup, so the FUSE boundary maps it to its errno
    (a changed source file is EIO with its name logged, not an "unexpected error")."""
    try:
        async with trio.open_nursery() as n:
            for a in args:
                n.start_soon(fn, *a)
    except BaseExceptionGroup as group:
        mine, rest = group.split(KspeedfsError)
        if mine is not None and rest is None:
            first = mine.exceptions[0]
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first from None
        raise


class Reader:
    """Bytes of a mounted dataset version's files, verified, from the nearest tier.

    ``read(entry, offset, size, stream)`` answers one FUSE read: it asks ``policy``
    which unit to load (the small file alone, blocks, or whole chunks), loads it through
    ``tiers`` (memory → disk → peers → source, single-flight, verified) and slices the
    reply; for a sequential ``stream`` it starts prefetching the next chunks of the file
    (handing them to the kernel page cache when ``push`` is set). Errors are those of
    :class:`TierChain`: ``ChunkUnavailable`` when no tier can produce a chunk,
    ``SourceChanged`` (raised to the readers of the changed file only) — both EIO at the
    FUSE boundary, never inside an ExceptionGroup. Loads run in ``nursery``; trio thread
    only.

    Attributes:
        index: the manifest (flat arrays).
        origin: the source, last resort.
        memory, disk: the local tiers (``disk`` may be None).
        peers: replicas over vRDMA, or None (no cluster).
        dataset: ``(name, version)`` as peers know it.
        nursery: runs loads, prefetches and page-cache pushes.
        push: the page-cache push, or None.
        counters: read-path counters, shared with ``tiers`` (``statistics()``).
        policy: the read decisions (``read_policy.ReadPolicy``).
        prefetcher: per-stream sequential detection (``cache/prefetch.py``).
        tiers: the tier chain for chunks, and the single-flight for blocks and extents.
    """

    def __init__(self, *, index: ManifestIndex, origin: Origin, memory: MemoryCache,
                 nursery: trio.Nursery, disk: DiskCache | None = None,
                 peers: Peers | None = None, dataset: tuple[str, int] = ("", 0),
                 workers: int = 16, prefetch_depth: int = 4, push: Push | None = None) -> None:
        self.index = index
        self.origin = origin
        self.memory = memory
        self.disk = disk
        self.peers = peers
        self.dataset = dataset
        self.nursery = nursery
        self.push = push
        self.counters = Counters()
        #: ``() -> (reads, bytes, memory hits)`` answered without this object (the native
        #: engine's C threads serve memory-tier hits), added to ``statistics()``
        self.served_elsewhere: Callable[[], tuple[int, int, int]] | None = None
        self.policy = ReadPolicy(
            chunk_size=index.chunk_size, block_size=index.block_size, chunks=index.chunks,
            tier_bytes=memory.capacity + (disk.capacity if disk is not None else 0))
        self.prefetcher = Prefetcher(prefetch_depth)
        self.tiers = TierChain(index=index, origin=origin, dataset=dataset, memory=memory,
                               disk=disk, peers=peers, flights=SingleFlight(nursery),
                               limiter=trio.CapacityLimiter(workers), counters=self.counters,
                               landed=self._landed)

    def statistics(self) -> ReadStatistics:
        gauges = dict(memory_bytes=self.memory.used, memory_resident_bytes=self.memory.resident_used,
                      disk_bytes=self.disk.used if self.disk else 0, python_reads=self.counters.reads)
        if self.served_elsewhere is not None:     # reads the native engine answered in C
            reads, nbytes, hits = self.served_elsewhere()
            c = self.counters
            gauges.update(reads=c.reads + reads, read_bytes=c.read_bytes + nbytes,
                          memory_hits=c.memory_hits + hits)
        return self.counters.snapshot(**gauges)

    async def read(self, entry: int, offset: int, size: int, stream: Stream | None = None) -> Data:
        """Up to ``size`` bytes of file ``entry`` at ``offset`` (fewer at its end), in one
        buffer (pyfuse3 replies from one)."""
        parts = await self.read_parts(entry, offset, size, stream)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def read_parts(self, entry: int, offset: int, size: int,
                         stream: Stream | None = None) -> list[Data]:
        """The bytes of :meth:`read` as views of the chunks they come from, in order: the
        native engine replies with one writev of them. (A read across a chunk boundary
        joined into fresh bytes cost a peer-reading mount's trio thread ~10 % of its
        CPU in page faults, zeroing and copying: perf, 1 MiB reads of 4 MiB chunks.)"""
        ix = self.index
        chunks = ix.chunk_range(entry, offset, size)
        self.counters.add("reads")
        if not chunks:
            return [b""]
        if stream is not None:
            last = (ix.data[entry] + ix.size[entry] - 1) // ix.chunk_size   # the file's last chunk
            for k in self.prefetcher.advise(stream, offset, size, chunks, last):
                self.prefetch(entry, k)
        start = ix.data[entry] + offset
        end = ix.data[entry] + min(offset + size, ix.size[entry])
        c = ix.chunk_size
        random = is_random(stream)
        if len(chunks) == 1 and self._small(entry, chunks[0]):
            data = await self._small_file(entry, chunks[0])
            out = data[offset:offset + (end - start)]
        elif len(chunks) == 1:
            out = await self._part(entry, chunks[0], start - chunks[0] * c,
                                   end - chunks[0] * c, random)
        else:
            parts: list[Data] = [b""] * len(chunks)

            async def one(i: int, k: int) -> None:
                lo = max(start, k * c) - k * c
                parts[i] = await self._part(entry, k, lo, min(end, (k + 1) * c) - k * c, random)

            await _each(one, enumerate(chunks))
            self.counters.add("read_bytes", sum(len(p) for p in parts))
            return parts
        self.counters.add("read_bytes", len(out))
        return [out]

    async def _part(self, entry: int, k: int, lo: int, hi: int, random: bool) -> Data:
        """Bytes [lo, hi) of chunk ``k``: from its blocks for a small random read (a read
        across a chunk boundary too: the two ends are two small parts), else from the
        whole chunk."""
        if self._by_blocks(k, lo, hi, random):
            return await self._blocks(entry, k, lo, hi)
        data = memoryview(await self._chunk_for(entry, k))
        return data[lo:hi]                      # a view: pyfuse3 replies from any buffer

    def _by_blocks(self, k: int, lo: int, hi: int, random: bool) -> bool:
        """Whether bytes [lo, hi) of chunk ``k`` come from its blocks: a small random read
        (``ReadPolicy.blocks_for``) of a chunk in no local tier and not loading."""
        return random and self.policy.blocks_for(k, lo, hi) and not self._near(k)

    def _near(self, k: int) -> bool:
        """Whether chunk ``k`` is in a local tier or loading already."""
        key = self.index.chunk_digest(k)
        return (key in self.memory or self.tiers.in_flight(key)
                or (self.disk is not None and key in self.disk))

    # -- a small file alone ----------------------------------------------------------------

    def hand_off(self, entry: int, read: tuple[Any, ...]) -> bool:
        """Whether the native fetch took ``read``, a READ of ``entry`` the native engine
        queued (fd, unique, offset, size, random, since): a small file read alone, or a
        random read inside one block (``read_parts``' rules), whose extent or block C
        READs, verifies and answers it from (``TierChain.start_extent``,
        ``start_block``); or a sequential read, parked in C on its chunks' fetches
        (``TierChain.hand_chunks``). False: the caller answers it."""
        small = self._small_extent(entry)
        if small is not None:
            return self.tiers.start_extent(*small, read)
        if not read[4]:                 # sequential: its whole chunks, the READ parked on them
            chunks = self.index.chunk_range(entry, read[2], read[3])
            return bool(chunks) and self.tiers.hand_chunks(chunks, entry, read)
        block = self._random_block(entry, read[2], read[3], read[4])
        if block is None:
            return False
        k, b = block
        if not self.tiers.start_block(k, b, block_key(self.index.chunk_digest(k), b), entry,
                                      read):
            return False
        self.counters.add("block_reads")        # (as _blocks counts one)
        self.policy.block_loaded(k)
        return True

    def _random_block(self, entry: int, offset: int, size: int,
                      random: int) -> tuple[int, int] | None:
        """(chunk, block) when a random read of [offset, offset + size) of ``entry`` is
        answered from one block (``_part``'s rule), else None."""
        ix = self.index
        chunks = ix.chunk_range(entry, offset, size)
        if not random or len(chunks) != 1:
            return None
        k, c = chunks[0], ix.chunk_size
        lo = ix.data[entry] + offset - k * c
        hi = ix.data[entry] + min(offset + size, ix.size[entry]) - k * c
        if hi <= lo or not self._by_blocks(k, lo, hi, True):
            return None
        span = self.policy.blocks(lo, hi)
        return (k, span[0]) if len(span) == 1 else None

    def _small_extent(self, entry: int) -> tuple[int, Extent] | None:
        """(chunk, extent) when a read of ``entry`` loads the small file's one extent
        alone (``read_parts``' rule), else None."""
        ix = self.index
        if not ix.size[entry]:
            return None
        chunks = ix.chunk_range(entry, 0, ix.size[entry])
        if len(chunks) != 1 or not self._small(entry, chunks[0]):
            return None
        (ext,) = ix.file_extents(entry)
        return chunks[0], ext

    def _small(self, entry: int, k: int) -> bool:
        return (self.policy.small_file(self.index.size[entry])
                and self.index.chunk_digest(k) not in self.memory)

    async def _small_file(self, entry: int, k: int) -> Data:
        """The whole (small) file as one extent (the dataset outgrows the tiers: its
        chunk would be evicted before its neighbours are read) — READ from a replica,
        else read alone from the source — verified against the extent's digest and kept
        in the memory tier under it."""
        (ext,) = self.index.file_extents(entry)
        await self.tiers.extent(k, ext)         # the native fetch's, when it may READ it
        return await self.tiers.get(ext.digest, self._load_extent, entry, k, ext)

    async def _load_extent(self, entry: int, k: int, ext: Extent) -> Loaded:
        data = await self.tiers.from_peers(k, self.index.chunk_digest(k),
                                           part=(ext.chunk_offset, ext.length, ext.digest))
        if data is not None:
            self.memory.put(ext.digest, data)
            return Loaded(data, "peer")
        data = await self.tiers.from_source(k, self.origin.load_extent, ext)
        self.counters.add("source_extents")
        self.counters.add("source_bytes", len(data))
        self.memory.put(ext.digest, data)
        return Loaded(data, "source")

    # -- blocks of a chunk -----------------------------------------------------------------

    async def _blocks(self, entry: int, k: int, lo: int, hi: int) -> Data:
        """Bytes [lo, hi) of chunk ``k`` from the blocks that hold them."""
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

        await _each(one, ((b,) for b in span))
        return b"".join(parts)

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
                chunk = await self._chunk_for(entry, k)
                return Loaded(chunk[b * B:b * B + length], "chunk")
            self.counters.add("source_blocks")
            self.counters.add("source_bytes", len(data))
            tier = "source"
        self.memory.put(key, data)
        self.policy.block_loaded(k)
        return Loaded(data, tier)

    # -- whole chunks ----------------------------------------------------------------------

    async def _chunk_for(self, entry: int, k: int) -> Data:
        """Chunk ``k`` for a read of file ``entry``. If some *other* file packed in the
        chunk changed at the source, this file's verified bytes are still served (from
        the uncached partial chunk); only readers of a changed file get EIO."""
        try:
            return await self.chunk(k)
        except SourceChanged as e:
            if e.partial is None or entry in e.entries:
                raise
            self.counters.add("source_partial_reads")
            return e.partial

    async def chunk(self, k: int) -> Data:
        """Verified bytes of chunk ``k`` from the nearest tier that has them."""
        self.policy.ahead.discard(self.index.chunk_digest(k))
        return await self.tiers.chunk(k)

    def reached(self, k: int) -> None:
        """A read reached chunk ``k`` (the native engine's hint says so): it no longer
        counts as prefetched ahead, even while it is still loading. (Counted until it
        was served, a chunk its reader waited for held the budget, and the next chunk's
        prefetch was skipped: each skip cost ~3 READs answered in Python, the kernel's
        readahead sending a chunk's READs at once.)"""
        self.policy.ahead.discard(self.index.chunk_digest(k))

    def _landed(self, k: int, key: bytes, loaded: Loaded) -> None:
        """Chunk ``k`` is in the memory tier: blocks of it that random reads loaded go (the
        chunk serves them now, and a resident block would hold room for good)."""
        if self.policy.chunk_loaded(k):
            for b in range(self.index.block_count(k)):
                self.memory.discard(block_key(key, b))

    # -- prefetch --------------------------------------------------------------------------

    def prefetch(self, entry: int, k: int) -> None:
        """Start loading chunk ``k`` ahead of a sequential reader of ``entry`` (``read``'s
        prefetcher, or a hint from the native engine, which tracks streams in C); with a
        page-cache push, hand it to the kernel once it is here. No-op past the budget."""
        key = self.index.chunk_digest(k)
        loading = key not in self.memory and not self.tiers.in_flight(key)
        if loading and not self.policy.room_ahead(self._room(), self._still_ahead):
            self.counters.add("prefetch_skipped")
            return
        if loading:
            self.counters.add("prefetched")
            self.policy.ahead.add(key)
        if self.push is not None:
            self.nursery.start_soon(self._push_ahead, entry, k)
        elif loading:
            self.tiers.start(k, key)

    def _room(self) -> int:
        """Bytes the memory tier can take without evicting prefetched chunks."""
        return self.memory.resident_room + self.memory.transient_capacity

    def _still_ahead(self, key: bytes) -> bool:
        """A prefetched chunk still counts against the budget while it loads, or is held
        and no read reached it yet. (A chunk read only by the native engine's C threads
        never passes ``chunk()``, which forgets it: held, it filled the budget, and
        79-98 % of a peer-reading mount's prefetches were skipped.)"""
        return self.tiers.in_flight(key) or (key in self.memory and not self.memory.served(key))

    @property
    def ahead_max(self) -> int:
        """Chunks that may be prefetched and not read yet (``ReadPolicy.ahead_max``)."""
        return self.policy.ahead_max(self._room())

    async def _push_ahead(self, entry: int, k: int) -> None:
        assert self.push is not None
        try:
            data = await self._chunk_for(entry, k)
        except KspeedfsError as e:      # the demand read of this chunk reports it
            log.debug("prefetch of chunk %d: %s", k, e)
            return
        stored = await self.push(entry, k, data)
        if stored is None:
            self.counters.add("push_failures")
        else:
            self.counters.add("pushed_bytes", stored)
