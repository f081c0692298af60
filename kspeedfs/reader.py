"""②–⑥ on one screen: from (file, offset, size) to verified bytes.

    read(entry, offset, size)
      → index.chunk_range()                 ② manifest lookup: which chunks
      → chunk(k) for each, concurrently     (a random read that misses: block(k, b),
                                             the same tiers for 128 KiB, not 4 MiB)
          memory tier hit?                  ③ local cache (verified, immutable)
          else single-flight load:
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
from functools import partial
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable, TypeVar

import trio

from . import checksum
from .cache.disk import DiskCache
from .cache.memory import MemoryCache
from .cache.prefetch import Prefetcher, Stream
from .cache.singleflight import SingleFlight
from .errors import ChunkUnavailable, KspeedfsError, SourceChanged
from .manifest.index import ManifestIndex
from .manifest.model import Extent
from .origin import Origin
from .stats import Counters, ReadStatistics

if TYPE_CHECKING:
    from .cluster.fetch import Peers

log = logging.getLogger(__name__)

#: verified chunk bytes: ``bytes`` or a read-only ``memoryview`` (never written again)
Data = bytes | memoryview

#: ``push(entry, chunk, data)``: hand a prefetched, verified chunk of an open file to the
#: kernel page cache (fuse/pagecache.py) so the reader finds it there; returns the bytes
#: stored, or None if the kernel refused
Push = Callable[[int, int, Data], Awaitable["int | None"]]

R = TypeVar("R")

#: files up to chunk_size / this are fetched alone from peers (one extent READ)
SMALL_FILE_DIVISOR = 8
#: blocks of one chunk loaded for random reads before the next miss loads it whole
#: (when the dataset fits the tiers; see _by_block)
PROMOTE_AFTER = 1
#: blocks a random read may load instead of its chunk: Python's buffered open() asks for
#: st_blksize (one block) at any offset, which the kernel rounds to pages (two blocks) and
#: sometimes merges with its readahead (150-250 KiB seen: three or four). A shard
#: reader's 1 MiB requests (8-9 blocks) load the chunk (see _by_block)
MAX_READ_BLOCKS = 4
#: chunks whose block loads are counted at once (the oldest count is dropped)
PROMOTE_TRACKED = 1 << 16


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
    def __init__(
        self,
        index: ManifestIndex,
        origin: Origin,
        memory: MemoryCache,
        disk: DiskCache | None,
        nursery: trio.Nursery,
        workers: int = 16,
        prefetch_depth: int = 4,
        peers: "Peers | None" = None,
        dataset: tuple[str, int] = ("", 0),
        push: Push | None = None,
    ) -> None:
        self.index = index
        self.origin = origin
        self.memory = memory
        self.disk = disk
        self.nursery = nursery
        self.counters = Counters()
        self.peers = peers
        self.dataset = dataset
        self.push = push
        self.prefetcher = Prefetcher(prefetch_depth)
        # Whether whole-chunk loads pay off: when the dataset fits in the tiers, a chunk
        # read once serves every file packed in it; when it does not, the chunk is evicted
        # before its neighbours are read and a 110 KB file costs a 4 MiB load (19x the
        # source bytes measured on a 2.2 GB ImageNet-like set with a 1 GiB memory tier)
        tiers = memory.capacity + (disk.capacity if disk is not None else 0)
        self.chunks_fit = index.chunks * index.chunk_size <= tiers
        self._flights: SingleFlight[Data] = SingleFlight(nursery)
        self._limiter = trio.CapacityLimiter(workers)
        # Prefetched chunks not read yet, all streams together, are held to half of what
        # the memory tier can take without evicting them (its resident part's room plus
        # its transient LRU): many sequential readers' windows in a small tier would evict
        # one another's chunks unread and fetch them again (1.7-2.0x the bytes read,
        # measured with 4 readers from peers and a 64 MiB tier)
        self._ahead: set[bytes] = set()
        self._block_loads: dict[int, int] = {}     # chunk → blocks loaded (_by_block)

    def statistics(self) -> ReadStatistics:
        return self.counters.snapshot(
            memory_bytes=self.memory.used, memory_resident_bytes=self.memory.resident_used,
            disk_bytes=self.disk.used if self.disk else 0
        )

    def peer_statistics(self) -> dict[str, object]:
        return self.peers.statistics() if self.peers is not None else {}

    async def read(self, entry: int, offset: int, size: int, stream: Stream | None = None) -> Data:
        ix = self.index
        chunks = ix.chunk_range(entry, offset, size)
        self.counters.add("reads")
        if not chunks:
            return b""
        if stream is not None:
            last = (ix.data[entry] + ix.size[entry] - 1) // ix.chunk_size   # the file's last chunk
            for k in self.prefetcher.advise(stream, offset, size, chunks, last):
                self._prefetch(entry, k)
        start = ix.data[entry] + offset
        end = ix.data[entry] + min(offset + size, ix.size[entry])
        c = ix.chunk_size
        random = stream is not None and stream.run == 0
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
            out = b"".join(parts)
        self.counters.add("read_bytes", len(out))
        return out

    async def _part(self, entry: int, k: int, lo: int, hi: int, random: bool) -> Data:
        """Bytes [lo, hi) of chunk ``k``: from its blocks for a small random read (a read
        across a chunk boundary too: the two ends are two small parts), else from the
        whole chunk."""
        if random and self._by_block(k, lo, hi):
            return await self._blocks(entry, k, lo, hi)
        data = memoryview(await self._chunk_for(entry, k))
        return data[lo:hi]                      # a view: pyfuse3 replies from any buffer

    def _small(self, entry: int, k: int) -> bool:
        """Whether to fetch this file alone rather than its whole chunk: a small file
        whose chunk is not in the memory tier, when peers can serve extents or the
        dataset is too big for whole-chunk loads to pay off."""
        ix = self.index
        return ((self.peers is not None or not self.chunks_fit)
                and ix.size[entry] <= ix.chunk_size // SMALL_FILE_DIVISOR
                and ix.chunk_digest(k) not in self.memory)

    async def _small_file(self, entry: int, k: int) -> Data:
        """The whole (small) file as one extent — READ from a replica, or read alone from
        the source when the dataset outgrows the tiers — verified against the extent's
        digest and kept in the memory tier under it; else via its chunk."""
        (ext,) = self.index.file_extents(entry)
        return await self._held_or_load(ext.digest, self._load_extent, entry, k, ext)

    async def _load_extent(self, entry: int, k: int, ext: Extent) -> Data:
        if self.peers is not None:
            key = self.index.chunk_digest(k)
            data = await self.peers.read_chunk(self.dataset[0], self.dataset[1], k, key,
                                               self.index.chunk_len[k],
                                               part=(ext.chunk_offset, ext.length, ext.digest))
            if data is not None:
                self.counters.add("peer_hits")
                self.counters.add("peer_bytes", len(data))
                self.memory.put(ext.digest, data)
                return data
        if self.chunks_fit:                      # no replica: the whole chunk, any tier
            chunk = await self._chunk_for(entry, k)
            return chunk[ext.chunk_offset:ext.chunk_offset + ext.length]
        data = await self._from_origin(k, self.origin.load_extent, ext)
        self.counters.add("source_extents")
        self.counters.add("source_bytes", len(data))
        self.memory.put(ext.digest, data)
        return data

    def _by_block(self, k: int, lo: int, hi: int) -> bool:
        """Whether a small random read of bytes [lo, hi) of chunk ``k`` loads blocks
        rather than the chunk: the read touches at most ``MAX_READ_BLOCKS`` blocks (a
        4 KiB read, or the st_blksize-sized reads of Python's buffered ``open()``), the
        manifest has blocks, and the chunk is in no local tier and not loading already
        (a sequential reader fetches it, or it is cheap to get whole). A larger request,
        like the 1 MiB ones the kernel sends for a shard reader's 1-8 MiB reads, loads the
        chunk: as 8 block loads it ran at 0.05x the cold source instead of 0.68x (medium
        ``shards``).

        Promotion: when the dataset fits the tiers, a chunk that random reads have
        already loaded ``PROMOTE_AFTER`` block(s) of is loaded whole on its next miss.
        Blocks answer sparse reads fast, but they warm a cache slowly: 128 KiB per
        ~0.6 ms against 4 MiB per ~6 ms. Measured on 4 GiB of files with room to hold
        them, 4 KiB random reads at j1 for 30 s: blocks alone 1,856-2,094 IOPS, whole
        chunks 3,249-5,462, promotion after one block 3,503-6,359 (after two 1,771-2,689,
        after four 2,094-2,758). Sparse readers, and datasets larger than the tiers, keep
        blocks."""
        B = self.index.block_size
        if not 0 < B < self.index.chunk_size or (hi - 1) // B - lo // B >= MAX_READ_BLOCKS:
            return False
        if self.chunks_fit and self._block_loads.get(k, 0) >= PROMOTE_AFTER:
            return False
        key = self.index.chunk_digest(k)
        return (key not in self.memory and not self._flights.in_flight(key)
                and (self.disk is None or key not in self.disk))

    async def _blocks(self, entry: int, k: int, lo: int, hi: int) -> Data:
        """Bytes [lo, hi) of chunk ``k`` from the blocks that hold them."""
        B = self.index.block_size
        first, last = lo // B, (hi - 1) // B
        self.counters.add("block_reads")
        if first == last:
            data = await self._block(entry, k, first)
            return memoryview(data)[lo - first * B:hi - first * B]
        parts: list[Data] = [b""] * (last - first + 1)

        async def one(b: int) -> None:
            data = await self._block(entry, k, b)
            parts[b - first] = memoryview(data)[max(lo, b * B) - b * B:min(hi, (b + 1) * B) - b * B]

        await _each(one, ((b,) for b in range(first, last + 1)))
        return b"".join(parts)

    async def _block(self, entry: int, k: int, b: int) -> Data:
        """Verified block ``b`` of chunk ``k``, kept in the memory tier (``block_key``)."""
        key = block_key(self.index.chunk_digest(k), b)
        return await self._held_or_load(key, self._load_block, entry, k, b, key)

    async def _load_block(self, entry: int, k: int, b: int, key: bytes) -> Data:
        ix = self.index
        B, length, digest = ix.block_size, ix.block_len(k, b), ix.block_digest(k, b)
        data: Data | None = None
        if self.peers is not None:
            data = await self.peers.read_chunk(self.dataset[0], self.dataset[1], k,
                                               ix.chunk_digest(k), ix.chunk_len[k],
                                               part=(b * B, length, digest))
            if data is not None:
                self.counters.add("peer_hits")
                self.counters.add("peer_bytes", len(data))
        if data is None:
            data = await self._from_origin(k, self.origin.load_block, k, b)
            if data is None:                   # the source changed: the chunk load says where
                self.counters.add("block_fallbacks")
                chunk = await self._chunk_for(entry, k)
                return chunk[b * B:b * B + length]
            self.counters.add("source_blocks")
            self.counters.add("source_bytes", len(data))
        self.memory.put(key, data)
        if len(self._block_loads) >= PROMOTE_TRACKED and k not in self._block_loads:
            del self._block_loads[next(iter(self._block_loads))]
        self._block_loads[k] = self._block_loads.get(k, 0) + 1
        return data

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
        key = self.index.chunk_digest(k)
        self._ahead.discard(key)
        return await self._held_or_load(key, self._load, k, key)

    async def _held_or_load(self, key: bytes, load: Callable[..., Awaitable[Data]],
                            *args: object) -> Data:
        """``key``'s bytes from the memory tier, else from ``load(*args)`` through the
        single-flight (one load however many readers wait for it)."""
        data = self.memory.get(key)
        if data is not None:
            self.counters.add("memory_hits")
            return data
        data, joined = await self._flights.run(key, load, *args)
        if joined:
            self.counters.add("waited_in_flight")
        return data

    def _prefetch(self, entry: int, k: int) -> None:
        """Start loading chunk ``k`` ahead of a sequential reader of ``entry``; with a
        page-cache push, hand it to the kernel once it is here."""
        key = self.index.chunk_digest(k)
        loading = key not in self.memory and not self._flights.in_flight(key)
        if loading and not self._room_ahead():
            self.counters.add("prefetch_skipped")
            return
        if loading:
            self.counters.add("prefetched")
            self._ahead.add(key)
        if self.push is not None:
            self.nursery.start_soon(self._push_ahead, entry, k)
        elif loading:
            self._flights.start(key, self._load, k, key)

    @property
    def ahead_max(self) -> int:
        """Chunks that may be prefetched and not read yet (see ``_ahead``)."""
        m = self.memory
        return max(1, (m.resident_room + m.transient_capacity) // 2 // self.index.chunk_size)

    def _room_ahead(self) -> bool:
        """Whether one more chunk may be prefetched: forget the ones evicted unread (or
        failed) first, so they do not hold the budget."""
        limit = self.ahead_max
        if len(self._ahead) >= limit:
            self._ahead = {key for key in self._ahead
                           if key in self.memory or self._flights.in_flight(key)}
        return len(self._ahead) < limit

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

    def _keep(self, k: int, key: bytes, data: Data) -> None:
        """Chunk ``k`` into the memory tier; blocks of it that random reads loaded go (the
        chunk serves them now, and a resident block would hold room for good)."""
        self.memory.put(key, data)
        if self._block_loads.pop(k, 0):
            for b in range(self.index.block_count(k)):
                self.memory.discard(block_key(key, b))

    async def _load(self, k: int, key: bytes) -> Data:
        if self.disk is not None:
            data = await trio.to_thread.run_sync(self._from_disk, key, limiter=self._limiter)
            if data is not None:
                self.counters.add("disk_hits")
                self._keep(k, key, data)
                return data
        if self.peers is not None:
            data = await self.peers.read_chunk(self.dataset[0], self.dataset[1], k, key,
                                               self.index.chunk_len[k])
            if data is not None:
                self.counters.add("peer_hits")
                self.counters.add("peer_bytes", len(data))
                self._keep(k, key, data)
                return data
        data, mismatches = await self._from_origin(k, self.origin.load, k)
        if mismatches:
            self.counters.add("source_mismatches", mismatches)
        self.counters.add("source_loads")
        self.counters.add("source_bytes", len(data))
        self._keep(k, key, data)
        if self.disk is not None:
            self.nursery.start_soon(
                partial(trio.to_thread.run_sync, self.disk.put, key, data, limiter=self._limiter))
        return data

    async def _from_origin(self, k: int, load: Callable[..., R], *args: object) -> R:
        """``load(*args)`` (an Origin method) in a worker thread: a changed source file is
        counted and logged, any other OSError is ChunkUnavailable for chunk ``k``."""
        try:
            return await trio.to_thread.run_sync(load, *args, limiter=self._limiter)
        except SourceChanged as e:
            self.counters.add("source_changed")
            log.error("%s", e)
            raise
        except OSError as e:
            raise ChunkUnavailable(f"chunk {k}: source read failed: {e}") from e

    def _from_disk(self, key: bytes) -> bytes | None:
        """Worker thread: a disk-tier chunk, or None if absent or failing its checksum."""
        assert self.disk is not None
        data = self.disk.get(key)
        if data is None:
            return None
        if checksum.chunk_matches(data, key):
            return data
        log.warning("disk tier chunk %s failed its checksum: discarded, loading from the next tier",
                    key.hex())
        self.counters.add("corrupt_discarded")   # int += from a thread: fine under the GIL
        self.disk.discard(key)
        return None
