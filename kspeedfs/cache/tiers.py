"""③–⑤′ One chunk from the nearest tier that has it: memory → disk → peers → source.

    chunk(k) / fill(k)                    the mount's reader / a cluster node
      memory tier holds it?               MemoryCache (mount) or the node's arena: done
      else single-flight load(k):         one load per key however many wait, run in the
                                          flight's nursery (a cancelled reader cancels
                                          nothing others wait for)
        disk tier, worker thread          chunk digest checked; a mismatch is discarded,
                                          logged ("failed its checksum"), counted
        the node on this host             ``HostReader`` (a library's grant) copies, verifies
        peers: vRDMA READ of a replica    ``PeerReader`` (a cluster's) verifies what it READs
        source, worker thread             origin.py verifies per extent (retried once)
      → memory tier, then ``landed``      and, on a mount, the disk tier in the background

The same chain serves both callers; they differ in three ways, all from ``node``: a
node READs other replicas only, never asks an owner to load (it *is* the loader), and
writes nothing back to its SSD tier (that tier takes the arena's evictions). Blocks and
small files' extents skip the disk tier but take the same peers and source steps
(``from_peers``, ``from_source``) and the same single-flight (``get``), so every source
read has one error contract. On a native-engine mount without a disk tier a chunk, or a
small file's extent (``extent``), whose replica's slot is known is READ by C instead
(``handoff.py``, ``NativeHandoff`` over a ``NativeLoader``): the caller waits for it,
then finds it in the memory tier or loads it as above; an extent or a block can also go
to C with the READ that wants it (``start_extent``, ``start_block``), and C answers that
READ.
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

import trio

from .. import checksum
from ..errors import ChunkUnavailable, SourceChanged
from ..manifest.index import ManifestIndex
from ..origin import Origin
from ..stats import Counters
from .disk import DiskCache
from .handoff import NativeHandoff, NativeLoader
from .singleflight import SingleFlight

if TYPE_CHECKING:
    from ..manifest.model import Extent

log = logging.getLogger(__name__)

#: verified bytes: ``bytes`` or a read-only ``memoryview`` (never written again)
Data = bytes | memoryview

R = TypeVar("R")


class Loaded(NamedTuple):
    """What one load produced: the verified bytes and the tier they came from —
    ``"disk"``, ``"peer"``, ``"source"``, or ``"chunk"`` for a block or extent cut from its
    chunk (which came from any of them)."""

    data: Data
    tier: str


class MemoryTier(Protocol):
    """The nearest tier: ``cache.memory.MemoryCache`` on a mount, the node's arena on a
    node. ``put`` of a verified chunk; a key is never stale (keys are digests)."""

    def __contains__(self, key: bytes) -> bool: ...

    def get(self, key: bytes) -> Data | None: ...

    def put(self, key: bytes, data: Data) -> object: ...     # (Arena's: whether it stored)


class PeerReader(Protocol):
    """The peers tier: READs a chunk (or a part of it) from a replica and verifies it;
    None when no replica has it. The cluster's, on a cluster mount or node."""

    async def read_chunk(self, dataset: str, version: int, chunk: int, key: bytes, length: int,
                         *, ask_owner: bool = True, exclude: str | None = None,
                         part: tuple[int, int, bytes] | None = None,
                         budgeted: bool = False) -> Data | None: ...


class HostReader(Protocol):
    """Chunks (or a part of one) copied from the node on this host: a granted arena
    (``cluster/granted.py``), consulted before the peers; verified bytes or None (go on
    to the peers). Never raises for the node's behaviour."""

    async def read(self, k: int, key: bytes, length: int,
                   part: tuple[int, int, bytes] | None = None) -> Data | None: ...


class TierChain:
    """Verified bytes of chunk ``k`` of one dataset version from the nearest tier.

    Order: memory, then disk (read in a worker thread, checked against the chunk digest,
    discarded on mismatch), then the node on this host (``host``: a granted arena,
    which verifies), then peers (``Peers.read_chunk``, which verifies), then the
    source (``Origin``, in a worker thread, verified per extent and retried once). A chunk
    from a farther tier is put into the memory tier before ``landed`` is called and any
    waiter returns; one from the source is also written to the disk tier in the
    background (mount only).

    Single-flight: concurrent requests for one key share one load (``flights``, whose
    nursery runs it), so a cancelled caller never cancels a load that others wait for.
    ``flights`` may be shared by several chains (a node's datasets share chunks).

    Errors: a total failure — no tier had the chunk and the source could not be read —
    raises :class:`ChunkUnavailable` naming the chunk and the dataset (EIO at the FUSE
    boundary, an ``error`` reply over RPC). A source file that no longer matches the
    snapshot raises :class:`SourceChanged` as itself, after counting and logging it: it
    names the file, and carries the chunk's verified rest (``partial``) for files packed
    beside it. A corrupt disk-tier copy is not an error: it is discarded and the next tier
    asked. Every waiter of a flight gets the same exception.

    Attributes:
        index, origin: the dataset version's manifest and source.
        dataset: ``(name, version)`` as peers know it.
        memory, disk, host, peers: the tiers (``disk``, ``host`` and ``peers`` may be None).
        native: the hand-offs to C (``attach_native``: ``handoff.NativeHandoff``), or None.
        flights: the single-flight of chunk (and block, extent) loads.
        limiter: bounds the worker threads doing disk and source I/O and hashing.
        counters: read-path counters (``stats.ReadStatistics`` names) this chain adds to:
            memory_hits, waited_in_flight, disk_hits, corrupt_discarded, host_hits,
            host_bytes, peer_hits, peer_bytes, source_loads, source_bytes,
            source_mismatches, source_changed.
        node: the cluster node this chain runs in, or None on a mount.
        landed: ``landed(k, key, loaded)``, called once per load from a farther tier,
            after the memory tier has the chunk.
    """

    def __init__(self, *, index: ManifestIndex, origin: Origin, memory: MemoryTier,
                 flights: SingleFlight[Loaded], limiter: trio.CapacityLimiter,
                 disk: DiskCache | None = None, peers: PeerReader | None = None,
                 host: HostReader | None = None,
                 dataset: tuple[str, int] = ("", 0), counters: Counters | None = None,
                 node: str | None = None,
                 landed: Callable[[int, bytes, Loaded], None] | None = None) -> None:
        self.index = index
        self.origin = origin
        self.dataset = dataset
        self.memory = memory
        self.disk = disk
        self.peers = peers
        self.host = host
        self.flights = flights
        self.limiter = limiter
        self.counters = counters if counters is not None else Counters()
        self.node = node
        self.landed = landed
        self.native: NativeHandoff | None = None

    def attach_native(self, native: NativeLoader) -> None:
        """Hand loads to ``native`` from now on (``handoff.NativeHandoff`` decides which).
        Not a constructor argument: the native fetch needs the mounted engine, which
        exists only after this chain serves the mount's first requests."""
        self.native = NativeHandoff(native, index=self.index, memory=self.memory,
                                    flights=self.flights, disk=self.disk is not None)

    # -- the memory tier and the single-flight -------------------------------------------

    async def get(self, key: bytes, load: Callable[..., Awaitable[Loaded]], *args: object) -> Data:
        """``key``'s bytes from the memory tier, else from ``load(*args)`` through the
        single-flight (one load however many callers wait for it)."""
        data = self.memory.get(key)
        if data is not None:
            self.counters.add("memory_hits")
            return data
        loaded, joined = await self.flights.run(key, load, *args)
        if joined:
            self.counters.add("waited_in_flight")
        return loaded.data

    async def chunk(self, k: int) -> Data:
        """Verified bytes of chunk ``k`` from the nearest tier that has them."""
        key = self.index.chunk_digest(k)
        if self.native is not None:     # landed (a memory hit below) or not (a load)
            await self.native.chunk(k, key)
        return await self.get(key, self.load, k)

    async def fill(self, k: int) -> str:
        """Make chunk ``k`` present in the memory tier without reading it back; returns
        where it came from (``"cache"``: it was there)."""
        key = self.index.chunk_digest(k)
        if key in self.memory:
            return "cache"
        loaded, _ = await self.flights.run(key, self.load, k)
        return loaded.tier

    def start(self, k: int, key: bytes | None = None) -> None:
        """Start (or join) the load of chunk ``k`` (digest ``key``, when the caller has
        it) without waiting for it (prefetch)."""
        if key is None:
            key = self.index.chunk_digest(k)
        if self.native is not None and self.native.start(k, key):
            return
        self.flights.start(key, self.load, k)

    def in_flight(self, key: bytes) -> bool:
        return self.flights.in_flight(key) or (self.native is not None
                                               and self.native.in_flight(key))

    # -- hand-offs to the native fetch (handoff.py); False: nothing was handed -----------

    async def extent(self, k: int, ext: Extent) -> None:
        """Hand small file ``ext.entry``'s one extent (in chunk ``k``) to the native fetch
        when it may READ it, as ``chunk`` does a chunk, and wait until that is over; the
        caller then finds it in the memory tier, or loads it the usual way."""
        if self.native is not None:
            await self.native.extent(k, ext)

    def start_extent(self, k: int, ext: Extent, read: tuple[Any, ...]) -> bool:
        """Hand ``ext`` and ``read``, a READ of it the native engine queued, to C, which
        answers the READ (``NativeHandoff.start_extent``)."""
        return self.native is not None and self.native.start_extent(k, ext, read)

    def start_block(self, k: int, b: int, key: bytes, entry: int, read: tuple[Any, ...]) -> bool:
        """The same for block ``b`` of chunk ``k`` (``NativeHandoff.start_block``)."""
        return self.native is not None and self.native.start_block(k, b, key, entry, read)

    def hand_chunks(self, ks: Sequence[int], entry: int, read: tuple[Any, ...]) -> bool:
        """Park ``read``, a sequential READ over chunks ``ks``, in C on their native
        fetches (``NativeHandoff.hand_chunks``)."""
        return self.native is not None and self.native.hand_chunks(ks, entry, read)

    # -- one load past the memory tier ----------------------------------------------------

    async def load(self, k: int) -> Loaded:
        """Chunk ``k`` from the disk tier, a peer or the source, into the memory tier.
        Run it through ``flights`` (``chunk``, ``fill``, ``start``), not directly."""
        key = self.index.chunk_digest(k)
        loaded = await self._farther(k, key)
        self._put(k, key, loaded)
        return loaded

    def arrived(self, k: int, key: bytes, data: Data, tier: str, *, whole: bool = True) -> None:
        """Chunk ``k`` (``whole`` False: a small file's extent in it, under its digest
        ``key``), verified, loaded elsewhere (the native fetch): into the memory tier as
        a load's would be (``Reader._load_extent``'s for an extent), and counted."""
        self.counters.add(f"{tier}_hits")
        self.counters.add(f"{tier}_bytes", len(data))
        if whole:
            self._put(k, key, Loaded(data, tier))
        else:
            self.memory.put(key, data)

    def _put(self, k: int, key: bytes, loaded: Loaded) -> None:
        self.memory.put(key, loaded.data)
        if self.landed is not None:
            self.landed(k, key, loaded)

    async def _farther(self, k: int, key: bytes) -> Loaded:
        if self.disk is not None:
            cached = await trio.to_thread.run_sync(self.from_disk, key, limiter=self.limiter)
            if cached is not None:
                self.counters.add("disk_hits")
                self.counters.add("disk_hit_bytes", len(cached))
                return Loaded(cached, "disk")
        from_peer = await self.from_peers(k, key)
        if from_peer is not None:
            return Loaded(from_peer, "peer")
        data, mismatches = await self.from_source(k, self.origin.load, k)
        if mismatches:
            self.counters.add("source_mismatches", mismatches)
        self.counters.add("source_loads")
        self.counters.add("source_bytes", len(data))
        if self.disk is not None and self.node is None:
            self.flights.nursery.start_soon(
                partial(trio.to_thread.run_sync, self.disk.put, key, data, limiter=self.limiter))
        return Loaded(data, "source")

    def from_disk(self, key: bytes) -> memoryview | None:
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

    async def from_peers(self, k: int, key: bytes,
                         part: tuple[int, int, bytes] | None = None) -> Data | None:
        """Chunk ``k`` (or ``part = (offset, length, digest)`` of it) copied from the node
        on this host, else READ from a replica, verified; or None: no replica has it (or
        there are no peers)."""
        if self.host is not None:
            data = await self.host.read(k, key, self.index.chunk_len[k], part)
            if data is not None:
                self.counters.add("host_hits")
                self.counters.add("host_bytes", len(data))
                return data
        if self.peers is None:
            return None
        data = await self.peers.read_chunk(self.dataset[0], self.dataset[1], k, key,
                                           self.index.chunk_len[k], ask_owner=self.node is None,
                                           exclude=self.node, part=part)
        if data is not None:
            self.counters.add("peer_hits")
            self.counters.add("peer_bytes", len(data))
        return data

    async def from_source(self, k: int, load: Callable[..., R], *args: object) -> R:
        """``load(*args)`` (an ``Origin`` method) in a worker thread: a changed source file
        is counted, logged and raised; any other OSError is ChunkUnavailable for ``k``."""
        try:
            return await trio.to_thread.run_sync(load, *args, limiter=self.limiter)
        except SourceChanged as e:
            self.counters.add("source_changed")
            log.error("%s", e)
            raise
        except OSError as e:
            raise ChunkUnavailable(
                f"chunk {k} of {self.origin.dataset}: source read failed: {e}") from e
