"""Prefetch for the read path: the next chunks of a sequential reader's file, loaded
before it asks, within a budget of the memory tier.

    advise(entry, stream, offset, size, chunks)   a read of ``stream``: Prefetcher
                                                  (cache/prefetch.py) says which chunks
                                                  come next, ``prefetch`` starts each
    prefetch(entry, k)                            the same for one chunk (also a hint
                                                  from the native engine, which tracks
                                                  streams in C)
      room in the budget?                         ReadPolicy.room_ahead: prefetched
                                                  chunks not read yet, at most
                                                  ``ahead_max`` (else prefetch_skipped)
      → TierChain.start(k)                        the chunk's load, single-flight with
                                                  a demand read of it
      → page-cache push (with ``push``)           the chunk handed to the kernel once
                                                  it is here (fuse/pagecache.py)
    reached(k)                                    a read reached chunk k: it no longer
                                                  counts against the budget
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from .cache.memory import MemoryCache
from .cache.prefetch import Prefetcher, Stream
from .cache.tiers import Data, TierChain
from .errors import KspeedfsError
from .manifest.index import ManifestIndex
from .read_policy import ReadPolicy
from .stats import Counters

__all__ = ["Push", "ReadAhead"]

log = logging.getLogger(__name__)

#: scheduling rounds a prefetch waits before its load starts: one more than a READ's own
#: load takes to reach its worker thread (``ReadAhead._start_later``)
START_ROUNDS = 3

#: ``push(entry, chunk, data)``: hand a prefetched, verified chunk of an open file to the
#: kernel page cache (fuse/pagecache.py) so the reader finds it there; returns the bytes
#: stored, or None if the kernel refused
Push = Callable[[int, int, Data], Awaitable["int | None"]]


class ReadAhead:
    """Chunks loaded ahead of sequential readers, no more than the memory tier can hold
    without evicting them unread.

    A chunk it starts counts in ``policy.ahead`` until a read reaches it (``reached``),
    or, once loaded, until the memory tier has served it or lost it; past the budget a
    prefetch is skipped and counted. With ``push`` each chunk is handed to the kernel's
    page cache once loaded (in ``nursery``); a load ahead that fails is logged at debug
    level and left to the demand read of that chunk to report. Trio thread only.

    Attributes:
        index, memory, tiers: the manifest, the memory tier and the tier chain.
        policy: the read decisions (the budget: ``ahead``, ``room_ahead``, ``ahead_max``).
        counters: read-path counters it adds to: prefetched, prefetch_skipped,
            pushed_bytes, push_failures.
        prefetcher: per-stream sequential detection (``cache/prefetch.py``).
        nursery: runs page-cache pushes.
        push: the page-cache push, or None.
        chunk: ``chunk(entry, k)``, the whole chunk for a read of ``entry`` (pushed).
    """

    def __init__(self, *, index: ManifestIndex, memory: MemoryCache, tiers: TierChain,
                 policy: ReadPolicy, counters: Counters, nursery: trio.Nursery, depth: int,
                 chunk: Callable[[int, int], Awaitable[Data]], push: Push | None = None) -> None:
        self.index = index
        self.memory = memory
        self.tiers = tiers
        self.policy = policy
        self.counters = counters
        self.prefetcher = Prefetcher(depth)
        self.nursery = nursery
        self.push = push
        self.chunk = chunk
        self._starting: set[bytes] = set()     # prefetches not started yet (_start_later)

    def advise(self, entry: int, stream: Stream, offset: int, size: int, chunks: range) -> None:
        """Record a read of [offset, offset + size) of ``entry`` (over ``chunks``) by
        ``stream``, and prefetch the chunks ``Prefetcher.advise`` says come next."""
        ix = self.index
        last = (ix.data[entry] + ix.size[entry] - 1) // ix.chunk_size   # the file's last chunk
        ahead = self.prefetcher.advise(stream, offset, size, chunks, last)
        if ahead:
            self.nursery.start_soon(self._prefetch_after, entry, ahead)

    async def _prefetch_after(self, entry: int, ahead: range) -> None:
        """Prefetch ``ahead`` once the read that advised it has started its own loads:
        its caller goes on to them before this task runs. (Started first, the chunks
        ahead took the source's first GETs, and the reader waited behind them.)"""
        for k in ahead:
            self.prefetch(entry, k)

    def prefetch(self, entry: int, k: int) -> None:
        """Start loading chunk ``k`` ahead of a sequential reader of ``entry``, a few
        scheduling rounds from now (``_start_later``); with a page-cache push, hand it to
        the kernel once it is here. No-op past the budget."""
        key = self.index.chunk_digest(k)
        loading = key not in self.memory and not self.loading(key)
        if loading and not self.policy.room_ahead(self._room(), self._still_ahead):
            self.counters.add("prefetch_skipped")
            return
        if loading:
            self.counters.add("prefetched")
            self.policy.ahead.add(key)
        if self.push is not None:
            self.nursery.start_soon(self._push_ahead, entry, k)
        elif loading:
            self._starting.add(key)
            self.nursery.start_soon(self._start_later, k, key)

    async def _start_later(self, k: int, key: bytes) -> None:
        """Start chunk ``k``'s load after the READ that sent the native engine's hint has
        started its own. The hint is handled as it is taken off the queue, as that READ's
        task is started, and the READ's load asks for a worker thread three rounds later
        (its task, the single-flight's, the thread limiter's); started at once, the chunks
        ahead got the worker threads and the source's GETs first and the READ waited
        behind them (docs/design.md, "Object-store sources", "The cold cat")."""
        try:
            for _ in range(START_ROUNDS):
                await trio.lowlevel.checkpoint()
        finally:
            self._starting.discard(key)
        if key not in self.memory:
            self.tiers.start(k, key)

    def reached(self, k: int) -> None:
        """A read reached chunk ``k``: it no longer counts as prefetched ahead, even while
        it is still loading. (Counted until it was served, a chunk its reader waited for
        held the budget, and the next chunk's prefetch was skipped: each skip cost ~3
        READs answered in Python, the kernel's readahead sending a chunk's READs at
        once.)"""
        self.policy.ahead.discard(self.index.chunk_digest(k))

    @property
    def ahead_max(self) -> int:
        """Chunks that may be prefetched and not read yet (``ReadPolicy.ahead_max``)."""
        return self.policy.ahead_max(self._room())

    def _room(self) -> int:
        """Bytes the memory tier can take without evicting prefetched chunks."""
        return self.memory.resident_room + self.memory.transient_capacity

    def _still_ahead(self, key: bytes) -> bool:
        """A prefetched chunk still counts against the budget while it loads, or is held
        and no read reached it yet. (A chunk read only by the native engine's C threads
        never passes ``Reader.chunk``, which forgets it: held, it filled the budget, and
        79-98 % of a peer-reading mount's prefetches were skipped.)"""
        return self.loading(key) or (key in self.memory and not self.memory.served(key))

    def loading(self, key: bytes) -> bool:
        """Whether ``key``'s load is in flight, or is a prefetch about to start."""
        return key in self._starting or self.tiers.in_flight(key)

    async def _push_ahead(self, entry: int, k: int) -> None:
        assert self.push is not None
        try:
            data = await self.chunk(entry, k)
        except KspeedfsError as e:      # the demand read of this chunk reports it
            log.debug("prefetch of chunk %d: %s", k, e)
            return
        stored = await self.push(entry, k, data)
        if stored is None:
            self.counters.add("push_failures")
        else:
            self.counters.add("pushed_bytes", stored)
