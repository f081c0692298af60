"""A node's share of the pooled cache, chunk by chunk: what it owns, holds and loads.

    Dataset      one dataset version as a node needs it: manifest index and source
    Share        the datasets a node opened (each manifest fetched once); which chunks
                 placement gives it (``owns``) and which it holds (``has``: arena, SSD
                 tier); loading one into the arena through the tier chain
                 (``cache/tiers.py``); dropping an unloaded dataset's chunks
    SpillQueue   the SSD tier's writer: owned chunks the arena evicted, queued from the
                 trio thread and written in a worker thread

Which chunks the share *should* hold, and when to load them, is ``reconcile.py``'s; the
RPCs that ask for one are answered by ``Node.handle`` (``node.py``).
"""
from __future__ import annotations

import logging

import trio

from ..cache.disk import DiskCache
from ..cache.singleflight import SingleFlight
from ..cache.tiers import Loaded, TierChain
from ..config import Config, SourceConfig
from ..errors import ConfigError, StoreUnavailable
from ..manifest.index import ManifestIndex
from ..manifest.load import load_index, page_dirs
from ..manifest.store.base import DatasetInfo
from ..manifest.store.etcd import EtcdStore
from ..origin import open_origin
from .arena import Arena
from .fetch import Peers
from .membership import Membership
from .node_stats import NodeCounters
from .placement import Member, owners

log = logging.getLogger(__name__)


class Dataset:
    """One dataset version as a node needs it: manifest index and source."""

    def __init__(self, info: DatasetInfo, index: ManifestIndex, source: str,
                 source_config: SourceConfig | None = None) -> None:
        self.info = info
        self.index = index
        self.origin = open_origin(source, index, info.name, config=source_config)


class SpillQueue:
    """Owned chunks the arena evicted, on their way to the SSD tier.

    :meth:`offer` runs in the trio thread (the arena's eviction hook) and never blocks:
    a chunk is queued, or, when the queue is full, written at once (never dropped).
    :meth:`run` writes the queue in worker threads under ``limiter``. A queued chunk is
    ``in`` the queue until its write ended, so the node still counts it as held."""

    def __init__(self, disk: DiskCache, limiter: trio.CapacityLimiter,
                 counters: NodeCounters) -> None:
        self.disk = disk
        self.limiter = limiter
        self.counters = counters
        self._send, self._recv = trio.open_memory_channel[tuple[bytes, bytes]](64)
        self._queued: set[bytes] = set()

    def __contains__(self, key: bytes) -> bool:
        return key in self._queued

    def offer(self, key: bytes, data: bytes) -> None:
        try:
            self._send.send_nowait((key, data))
            self._queued.add(key)
        except trio.WouldBlock:             # the SSD is behind: write now, never drop
            self.counters.spills_inline += 1
            self.disk.put(key, data)
            self.counters.spilled += 1

    async def run(self) -> None:
        async for key, data in self._recv:
            try:
                await trio.to_thread.run_sync(self.disk.put, key, data, limiter=self.limiter)
            except OSError as e:
                log.warning("SSD tier: cannot write chunk %s: %s", key.hex()[:12], e)
                continue
            finally:
                self._queued.discard(key)
            self.counters.spilled += 1


class Share:
    """This node's chunks: the datasets it opened, what it owns and holds, and loads.

    Promises: :meth:`dataset` fetches a version's manifest once however many ask
    (single-flight) and refuses a dataset whose chunks exceed the arena's slots;
    :meth:`load_chunk` loads a chunk once however many ask, and a chunk enters the arena
    only verified. Owns the arena's fill (``arena``), the SSD tier (``disk``, with its
    ``spill`` queue; None without one) and the limiter of their I/O: source and SSD
    work share ``max(2, cluster.preload_workers)`` worker threads. Every method runs in
    the trio thread and never blocks it: etcd, source and SSD I/O go to worker threads.
    Loads are counted in ``counters``, which the node's statistics report.

    Attributes:
        datasets: (name, version) → :class:`Dataset`, each manifest fetched once.
        spill: the SSD tier's write queue, or None without an SSD tier.
    """

    def __init__(self, cfg: Config, name: str, store: EtcdStore, arena: Arena,
                 membership: Membership, peers: Peers, nursery: trio.Nursery,
                 counters: NodeCounters, source_override: str | None = None,
                 disk: DiskCache | None = None) -> None:
        self.cfg = cfg
        self.name = name
        self.store = store
        self.arena = arena
        self.membership = membership
        self.peers = peers
        self.counters = counters
        self.source_override = source_override
        self.disk = disk
        self.datasets: dict[tuple[str, int], Dataset] = {}
        self._manifests: SingleFlight[Dataset] = SingleFlight(nursery)   # (name, version)
        self._flights: SingleFlight[Loaded] = SingleFlight(nursery)
        self._io = trio.CapacityLimiter(max(2, cfg.cluster.preload_workers))
        self.spill = SpillQueue(disk, self._io, counters) if disk is not None else None

    # -- datasets --------------------------------------------------------------------------

    async def dataset(self, name: str, version: int) -> Dataset:
        """``name`` v``version``, its manifest fetched from etcd once (single-flight).
        StoreUnavailable at once while etcd is known unreachable (its last request went
        unanswered; the lease refresh, every ttl/3, finds it back): before, every READ
        from a mount waited the store's whole budget (``store.etcd_timeout``, 5 s) per
        owner before its source read, chunk after chunk of a dataset no node had opened
        yet (``Node.handle`` answers "refused" instead)."""
        ds = self.datasets.get((name, version))
        if ds is None:
            if self.store.reachable is False:
                raise StoreUnavailable(f"the manifest of {name} v{version}: etcd did not "
                                       "answer this node's last request")
            ds, _ = await self._manifests.run((name, version), self._open_dataset, name, version)
        return ds

    async def _open_dataset(self, name: str, version: int) -> Dataset:
        def fetch() -> Dataset:
            info = self.store.dataset(name, version)
            index = load_index(self.store, info, self.cfg.store.page_cache, page_dirs(self.cfg))
            if index.chunk_size > self.arena.g.slot_size:
                raise ConfigError(f"dataset {name} has {index.chunk_size}-byte chunks; this "
                                  f"node's cluster.slot_size is {self.arena.g.slot_size}")
            return Dataset(info, index, self.source_override or info.source, self.cfg.source)

        ds = self.datasets[(name, version)] = await trio.to_thread.run_sync(fetch)
        log.info("dataset %s v%d: %d chunks, %d bytes", name, version, ds.index.chunks, ds.info.bytes)
        return ds

    def forget(self, name: str, version: int) -> Dataset | None:
        """Close ``name`` v``version`` (it was unloaded); the dataset, if it was open."""
        return self.datasets.pop((name, version), None)

    # -- which chunks ------------------------------------------------------------------------

    def has(self, key: bytes) -> bool:
        """Cached on this node: in the arena (READable by peers) or on its SSD tier,
        including a chunk evicted and still queued for the SSD (else a fill pass that
        checks right after its load would count a chunk another load just spilled as not
        held: CI, 221 of 222 in the SSD test)."""
        return key in self.arena or (self.spill is not None and key in self.spill) or (
            self.disk is not None and key in self.disk)

    def owns(self, key: bytes, members: list[Member] | None = None) -> bool:
        """Placement gives ``key`` to this node (under ``members``; default: now)."""
        members = self.membership.members if members is None else members
        return self.name in owners(key, members, self.cfg.cluster.replicas)

    def held(self, keys: list[bytes]) -> tuple[int, int]:
        """How many of ``keys`` are in the arena, and how many only on the SSD tier."""
        in_memory = sum(1 for k in keys if k in self.arena)
        on_disk = sum(1 for k in keys if k not in self.arena
                      and self.disk is not None and k in self.disk)
        return in_memory, on_disk

    # -- loading, spilling and dropping one chunk ---------------------------------------------

    async def load_chunk(self, ds: Dataset, k: int) -> str:
        """Make chunk ``k`` present in the arena; returns where it came from ("cache",
        "disk", "peer" or "source"), or "refused" when the arena would not keep it and
        there is no SSD tier to take it instead (``Arena.takes``: then it is not read at
        all). Raises ``ChunkUnavailable`` or ``SourceChanged`` (``TierChain``'s
        contract), an ``error`` reply over RPC."""
        if self.disk is None and not self.arena.takes(ds.index.chunk_digest(k)):
            return "refused"
        return await self._tiers(ds).fill(k)

    def _tiers(self, ds: Dataset) -> TierChain:
        """``ds``'s tier chain: arena → SSD tier → other replicas (never asked to load:
        this node is the loader) → source. One single-flight for every dataset: a chunk
        two versions share is one load."""
        return TierChain(index=ds.index, origin=ds.origin, dataset=(ds.info.name, ds.info.version),
                         memory=self.arena, disk=self.disk, peers=self.peers,
                         flights=self._flights, limiter=self._io, node=self.name,
                         landed=self._landed)

    def _landed(self, k: int, key: bytes, loaded: Loaded) -> None:
        """Count a chunk the arena took from a farther tier."""
        if loaded.tier == "disk":
            self.counters.disk_loads += 1
        elif loaded.tier == "peer":
            self.counters.peer_loads += 1
            self.counters.peer_bytes += len(loaded.data)
        else:
            self.counters.source_loads += 1
            self.counters.source_bytes += len(loaded.data)

    def evicted(self, key: bytes, data: bytes) -> None:
        """Arena eviction hook (trio thread, must not block): an owned chunk goes to the
        SSD tier's queue; others are let go."""
        if self.spill is not None and self.owns(key):
            self.spill.offer(key, data)

    def drop(self, key: bytes) -> bool:
        """Forget ``key`` from the arena and the SSD tier without spilling it (its
        dataset was unloaded); whether this node held it."""
        held = self.arena.drop(key) > 0
        if self.disk is not None and key in self.disk:
            self.disk.discard(key)
            held = True
        return held
