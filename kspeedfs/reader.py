"""②–⑥ on one screen: from (file, offset, size) to verified bytes (the steps:
docs/design.md, "The steps of a read").

    read(entry, offset, size)
      → index.chunk_range()                 ② manifest lookup: which chunks
      → which unit: file, blocks, chunk     read_policy.py (no I/O: tested alone)
      → chunk(k) for each, concurrently     (a random read that misses: read_blocks.py,
                                             the same tiers for 128 KiB, not 4 MiB)
          memory tier hit?                  ③ local cache (verified, immutable)
          else single-flight load:          cache/tiers.py TierChain (a node's too)
            disk tier, verified             ③ (chunk digest; discard on mismatch)
            the node on this host           ④′ a library's grant: cluster/granted.py, copied
                                               out of its mapped segments and verified
            replicas by vRDMA READ          ④⑤ cluster/placement.py + cluster/fetch.py
            origin, verified per extent     ⑤′ last resort; SourceChanged → EIO
          → memory (and disk) tier
      → slice and join                      reply
      sequential stream?                    read_ahead.py: the next chunks, prefetched

Here: the read itself, small files read alone, whole chunks, and the hand-off of the
native engine's queued READs to C. Every load runs in the reader's nursery so a
cancelled FUSE request never cancels a load others wait for; blocking I/O and hashing
run in worker threads (limited by ``fuse.workers``) so the trio loop keeps answering
the kernel.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from .cache.disk import DiskCache
from .cache.memory import MemoryCache
from .cache.prefetch import Stream
from .cache.singleflight import SingleFlight
from .cache.tiers import Data, HostReader, Loaded, TierChain
from .errors import SourceChanged
from .fanout import each
from .manifest.index import ManifestIndex
from .manifest.model import Extent
from .origin import Origin
from .read_ahead import Push, ReadAhead
from .read_blocks import BlockReads, block_key
from .read_policy import ReadPolicy, is_random
from .stats import Counters, ReadStatistics

if TYPE_CHECKING:
    from .cluster.fetch import Peers

__all__ = ["Data", "Push", "Reader", "block_key"]


class Reader:
    """Bytes of a mounted dataset version's files, verified, from the nearest tier.

    ``read(entry, offset, size, stream)`` answers one FUSE read: it asks ``policy``
    which unit to load (the small file alone, blocks, or whole chunks), loads it through
    ``tiers`` (memory → disk → peers → source, single-flight, verified; blocks through
    ``blocks``) and slices the reply; for a sequential ``stream`` ``ahead`` starts
    prefetching the next chunks of the file (handing them to the kernel page cache when
    given a ``push``). ``hand_off`` gives the native engine's queued READs to C when C
    may answer them. Errors are those of :class:`TierChain`: ``ChunkUnavailable`` when no
    tier can produce a chunk, ``SourceChanged`` (raised to the readers of the changed file
    only) — both EIO at the FUSE boundary, never inside an ExceptionGroup. Loads run in
    ``nursery``; trio thread only.

    Attributes:
        index: the manifest (flat arrays).
        origin: the source, last resort.
        memory, disk: the local tiers (``disk`` may be None).
        peers: replicas over vRDMA, or None (no cluster).
        host: the node on this host's granted segments (asked before ``peers``), or None.
        dataset: ``(name, version)`` as peers know it.
        nursery: runs loads, prefetches and page-cache pushes.
        counters: read-path counters, shared with ``tiers``, ``blocks`` and ``ahead``
            (``statistics()``).
        served_elsewhere: ``() -> (reads, bytes, memory hits)`` answered without this
            object (the native engine's C threads, the library's calling threads serve
            memory-tier hits), added to ``statistics()``; None: none.
        policy: the read decisions (``read_policy.ReadPolicy``).
        tiers: the tier chain for chunks, and the single-flight for blocks and extents.
        blocks: reads of a chunk's blocks for small random reads (``read_blocks.py``).
        ahead: prefetch for sequential streams, and its budget (``read_ahead.py``).
    """

    def __init__(self, *, index: ManifestIndex, origin: Origin, memory: MemoryCache,
                 nursery: trio.Nursery, disk: DiskCache | None = None,
                 peers: Peers | None = None, dataset: tuple[str, int] = ("", 0),
                 workers: int = 16, prefetch_depth: int = 4, push: Push | None = None,
                 host: HostReader | None = None) -> None:
        self.index = index
        self.origin = origin
        self.memory = memory
        self.disk = disk
        self.peers = peers
        self.host = host
        self.dataset = dataset
        self.nursery = nursery
        self.counters = Counters()
        self.served_elsewhere: Callable[[], tuple[int, int, int]] | None = None
        self.policy = ReadPolicy(
            chunk_size=index.chunk_size, block_size=index.block_size, chunks=index.chunks,
            tier_bytes=memory.capacity + (disk.capacity if disk is not None else 0))
        self.tiers = TierChain(index=index, origin=origin, dataset=dataset, memory=memory,
                               disk=disk, peers=peers, host=host,
                               flights=SingleFlight(nursery),
                               limiter=trio.CapacityLimiter(workers), counters=self.counters,
                               landed=self._landed)
        self.blocks = BlockReads(index=index, origin=origin, memory=memory, disk=disk,
                                 tiers=self.tiers, policy=self.policy, counters=self.counters,
                                 chunk=self._chunk_for)
        self.ahead = ReadAhead(index=index, memory=memory, tiers=self.tiers, policy=self.policy,
                               counters=self.counters, nursery=nursery, depth=prefetch_depth,
                               chunk=self._chunk_for, push=push)

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
            self.ahead.advise(entry, stream, offset, size, chunks)
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

            await each(one, enumerate(chunks))
            self.counters.add("read_bytes", sum(len(p) for p in parts))
            return parts
        self.counters.add("read_bytes", len(out))
        return [out]

    async def _part(self, entry: int, k: int, lo: int, hi: int, random: bool) -> Data:
        """Bytes [lo, hi) of chunk ``k``: from its blocks for a small random read (a read
        across a chunk boundary too: the two ends are two small parts), else from the
        whole chunk."""
        if self.blocks.wanted(k, lo, hi, random):
            return await self.blocks.read(entry, k, lo, hi)
        data = memoryview(await self._chunk_for(entry, k))
        return data[lo:hi]                      # a view: pyfuse3 replies from any buffer

    # -- the native engine's queued READs -------------------------------------------------

    def hand_off(self, entry: int, read: tuple[Any, ...]) -> bool:
        """Whether the native fetch took ``read``, a READ of ``entry`` the native engine
        queued (fd, unique, offset, size, random, since): a small file read alone, or a
        random read inside one block (``read_parts``' rules), whose extent or block C
        READs, verifies and answers it from (``TierChain.start_extent``,
        ``BlockReads.hand``); or a sequential read, parked in C on its chunks' fetches
        (``TierChain.hand_chunks``). False: the caller answers it."""
        small = self._small_extent(entry)
        if small is not None:
            return self.tiers.start_extent(*small, read)
        if not read[4]:                 # sequential: its whole chunks, the READ parked on them
            chunks = self.index.chunk_range(entry, read[2], read[3])
            return bool(chunks) and self.tiers.hand_chunks(chunks, entry, read)
        return self.blocks.hand(entry, read)

    # -- a small file alone ----------------------------------------------------------------

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
        self.ahead.reached(k)
        return await self.tiers.chunk(k)

    def _landed(self, k: int, key: bytes, loaded: Loaded) -> None:
        """Chunk ``k`` is in the memory tier (``TierChain.landed``): its blocks go
        (``BlockReads.landed``)."""
        self.blocks.landed(k, key)

    # -- prefetch: read_ahead.py -----------------------------------------------------------

    def prefetch(self, entry: int, k: int) -> None:
        """Start loading chunk ``k`` ahead of a sequential reader of ``entry`` (a hint from
        the native engine, which tracks streams in C): ``ReadAhead.prefetch``."""
        self.ahead.prefetch(entry, k)

    def reached(self, k: int) -> None:
        """A read reached chunk ``k`` (the native engine's hint says so):
        ``ReadAhead.reached``."""
        self.ahead.reached(k)

    @property
    def ahead_max(self) -> int:
        """Chunks that may be prefetched and not read yet (``ReadAhead.ahead_max``)."""
        return self.ahead.ahead_max
