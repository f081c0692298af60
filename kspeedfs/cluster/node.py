"""``kspeedfs node``: one per machine — its memory arena is its share of the pooled cache.

Composition (each resource's teardown is the ``async with`` that opened it)::

    EtcdStore ─ Membership (watch nodes/) ─ PrefixView (watch preload/)
    Endpoint(NICs) ─ vMRs "arena" + "index" exported to authenticated peers ─ listen(port)
    Arena(geometry, vMRs, rank = my share by dataset priority, lifecycle.py)
    DiskCache (optional SSD tier: owned chunks evicted from the arena, promoted on demand)
    Peers (to copy chunks from other replicas)
    nursery ─┬─ rpc.serve(rpc_port)          load-on-demand, have, stats
             ├─ Registration.run             lease keep-alive (nodes/, progress/, stats/)
             ├─ reconcile                    preload + re-replication + rejoin + unload, one loop
             ├─ release                      --unload-on-exit preloads no mount holds (lifecycle.py)
             ├─ publish_stats                every 2 s, for ``kspeedfs status``
             └─ metrics exporter             metrics.node_listen (metrics.py)

Reconcile is the one mechanism behind preload, re-replication and a node taking its
share back: for every dataset version the cluster should hold (``preload/``), compute
the chunks this node owns under the *current* membership and load the missing ones —
from another replica if one has it (vRDMA READ, verified), else from the source
(verified per extent). It runs when a preload is requested and whenever membership
changes (a node's lease expired, a node joined), so after a node dies the survivors
that inherited its chunks copy them from the remaining replica; R copies again.
Progress goes to ``progress/<ds>@<v>/<node>`` so ``kspeedfs preload`` can show a
global view and resume: an interrupted preload is just a reconcile that finds fewer
chunks missing. The source is read at most once per chunk per replica.
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import trio

from rdma.vrdma import Endpoint

from .. import checksum
from ..cache.disk import DiskCache
from ..cache.singleflight import SingleFlight
from ..cache.tiers import Loaded, TierChain
from ..config import Config, SourceConfig
from ..errors import (
    ChunkUnavailable,
    ConfigError,
    KspeedfsError,
    SourceChanged,
    StoreUnavailable,
)
from ..manifest.index import ManifestIndex
from ..manifest.store.base import DatasetInfo
from ..manifest.store.etcd import EtcdStore
from ..origin import open_origin
from . import lifecycle, rpc
from .arena import Arena, ArenaStatistics, Geometry
from .arena_files import ArenaFiles, cluster_tag
from .fetch import Peers, PeerStatistics
from .hedge import from_config as hedge_from_config
from .lifecycle import PreloadRequest
from .membership import Membership, NodeRecord, PrefixView, Registration
from .placement import Member, owners

log = logging.getLogger(__name__)


class Dataset:
    """One dataset version as a node needs it: manifest index and source."""

    def __init__(self, info: DatasetInfo, index: ManifestIndex, source: str,
                 source_config: SourceConfig | None = None) -> None:
        self.info = info
        self.index = index
        self.origin = open_origin(source, index, info.name, config=source_config)


@dataclass
class NodeCounters:
    """Chunks one node has loaded and spilled since it started (trio thread only)."""

    source_loads: int = 0
    source_bytes: int = 0
    peer_loads: int = 0
    peer_bytes: int = 0
    demand_loads: int = 0            # "load" RPCs from readers
    rereplicated: int = 0            # chunks copied because membership changed
    disk_loads: int = 0              # chunks promoted from the SSD tier back to the arena
    spilled: int = 0                 # evicted owned chunks written to the SSD tier
    spills_inline: int = 0           # ... written in the loop because the SSD queue was full
    unloaded: int = 0                # chunks dropped because their dataset was unloaded


@dataclass(frozen=True)
class LinkStatistics:
    """One vQP of a node's endpoint, as ``kspeedfs status`` prints it."""

    state: str
    reads_failed_over: int
    paths: dict[str, str]            # "local NIC->remote NIC" → path state


@dataclass(frozen=True)
class EndpointStatistics:
    nics: list[str]
    peers: dict[str, LinkStatistics]  # peer (node or mount) → its vQP


@dataclass(frozen=True)
class NodeStatistics:
    """A snapshot of one node, from :meth:`Node.statistics`.

    ``asdict`` of it is the JSON of the ``stats`` RPC and of the ``stats/<node>`` etcd
    key that ``kspeedfs status`` reads: field names are those JSON keys.
    """

    node: str
    time: float                      # wall clock of the snapshot, s since the epoch
    arena: ArenaStatistics
    counters: NodeCounters           # a copy
    reads: PeerStatistics            # this node's own peer reads (re-replication)
    endpoint: EndpointStatistics
    progress: dict[str, dict[str, int]]  # "<ds>@<v>" → owned/cached/... (reconcile)
    disk: dict[str, int]             # the SSD tier: capacity, used (bytes); zeros if none
    files: dict[str, int] = field(default_factory=dict)   # arena/index file → RAM it holds


class Node:
    """One machine's share of the pooled cache: its arena, what fills it, what it serves.

    Built by :func:`serve`, which also runs its loops in one nursery: ``handle`` answers
    the RPCs (``load`` a chunk on a reader's demand, ``have``, ``stats``),
    ``reconcile_forever`` makes the arena hold this node's owned chunks of every
    preloaded dataset (preload, re-replication and rejoin are that one loop),
    ``publish_stats_forever`` and, with an SSD tier, ``spill_forever``. Every method runs
    in the trio thread and never blocks it: etcd, source and SSD I/O go to worker
    threads (source and SSD under one limiter of ``max(2, cluster.preload_workers)``).
    A chunk and a manifest are each loaded once however many ask (single-flight), and a
    chunk enters the arena only verified.

    Attributes:
        cfg: the configuration; ``cluster.*`` sets replicas, workers and the arena.
        name: this node's name in ``nodes/`` and in placement.
        store: the etcd store (manifests, ``preload/``, ``progress/``, ``stats/``).
        ep: the vRDMA endpoint exporting ``arena`` and ``index`` to peers.
        arena: the memory arena (slots + index), READ by peers one-sided.
        disk: the SSD tier for evicted owned chunks, or None.
        files: the files behind the arena and index (``arena_files.py``), or None
            (anonymous memory).
        membership: live nodes; placement's input.
        peers: reads from other replicas' arenas (re-replication, demand loads).
        registration: the lease keeping ``nodes/<name>`` alive; publishes progress/stats.
        source_override: a source directory used instead of the one each dataset records.
        counters: what was loaded and spilled (:class:`NodeCounters`).
        datasets: (name, version) → :class:`Dataset`, each manifest fetched once.
        preload: the ``preload/`` requests (dataset → version to hold).
        progress: ``"<ds>@<v>"`` → owned/cached/from_source/from_peer, as published.
    """

    def __init__(self, cfg: Config, name: str, store: EtcdStore, ep: Endpoint, arena: Arena,
                 membership: Membership, peers: Peers, registration: Registration,
                 nursery: trio.Nursery, source_override: str | None = None,
                 disk: DiskCache | None = None, files: ArenaFiles | None = None) -> None:
        self.cfg = cfg
        self.name = name
        self.store = store
        self.ep = ep
        self.arena = arena
        self.membership = membership
        self.peers = peers
        self.registration = registration
        self.source_override = source_override
        self.counters = NodeCounters()
        self.disk = disk
        self.files = files
        self._spill_send, self._spill_recv = trio.open_memory_channel[tuple[bytes, bytes]](64)
        self._spilling: set[bytes] = set()      # evicted, queued for the SSD tier
        self.datasets: dict[tuple[str, int], Dataset] = {}
        self._manifests: SingleFlight[Dataset] = SingleFlight(nursery)   # (name, version)
        self._flights: SingleFlight[Loaded] = SingleFlight(nursery)
        self._io = trio.CapacityLimiter(max(2, cfg.cluster.preload_workers))
        self.preload = PrefixView(store, "preload/")
        self.progress: dict[str, dict[str, int]] = {}
        self._last_members: list[str] = []
        self._rank: dict[bytes, int] = {}    # my share: key -> priority of its dataset
        self._held: dict[str, int] = {}      # dataset -> version reconcile last filled

    # -- datasets --------------------------------------------------------------------------

    async def dataset(self, name: str, version: int) -> Dataset:
        """``name`` v``version``, its manifest fetched from etcd once (single-flight).
        StoreUnavailable at once while etcd is known unreachable (its last request went
        unanswered; the lease refresh, every ttl/3, finds it back): before, every READ
        from a mount waited the store's whole budget (``store.etcd_timeout``, 5 s) per
        owner before its source read, chunk after chunk of a dataset no node had opened
        yet (``handle`` answers "refused" instead)."""
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
            index = ManifestIndex.from_blob(self.store.manifest(name, version), info.inflated_size)
            if index.chunk_size > self.arena.g.slot_size:
                raise ConfigError(f"dataset {name} has {index.chunk_size}-byte chunks; this "
                                  f"node's cluster.slot_size is {self.arena.g.slot_size}")
            return Dataset(info, index, self.source_override or info.source, self.cfg.source)

        ds = self.datasets[(name, version)] = await trio.to_thread.run_sync(fetch)
        log.info("dataset %s v%d: %d chunks, %d bytes", name, version, ds.index.chunks, ds.info.bytes)
        return ds

    def has(self, key: bytes) -> bool:
        """Cached on this node: in the arena (READable by peers) or on its SSD tier,
        including a chunk evicted and still queued for the SSD (else a fill pass that
        checks right after its load would count a chunk another load just spilled as not
        held: CI, 221 of 222 in the SSD test)."""
        return key in self.arena or key in self._spilling or (
            self.disk is not None and key in self.disk)

    def owns(self, key: bytes, members: list[Member] | None = None) -> bool:
        """Placement gives ``key`` to this node (under ``members``; default: now)."""
        members = self.membership.members if members is None else members
        return self.name in owners(key, members, self.cfg.cluster.replicas)

    def rank(self, key: bytes) -> int:
        """The arena's eviction class of ``key``: the highest priority of the preloaded
        datasets in my share that hold it; -1 outside my share (evicted first)."""
        return self._rank.get(key, -1)

    # -- loading one chunk --------------------------------------------------------------------

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

    # -- the SSD tier: chunks evicted from the arena, promoted back on demand ----------------

    def spill(self, key: bytes, data: bytes) -> None:
        """Arena eviction hook (trio thread, must not block): queue the chunk for the SSD."""
        if self.disk is not None and self.owns(key):
            try:
                self._spill_send.send_nowait((key, data))
                self._spilling.add(key)
            except trio.WouldBlock:             # the SSD is behind: write now, never drop
                self.counters.spills_inline += 1
                self.disk.put(key, data)
                self.counters.spilled += 1

    async def spill_forever(self) -> None:
        assert self.disk is not None
        async for key, data in self._spill_recv:
            try:
                await trio.to_thread.run_sync(self.disk.put, key, data, limiter=self._io)
            except OSError as e:
                log.warning("SSD tier: cannot write chunk %s: %s", key.hex()[:12], e)
                continue
            finally:
                self._spilling.discard(key)
            self.counters.spilled += 1

    # -- RPC -----------------------------------------------------------------------------------

    async def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        if op == "load":
            try:
                ds = await self.dataset(str(req["dataset"]), int(req["version"]))
            except StoreUnavailable:    # (no manifest: the reader's next replica or source)
                return {"ok": True, "source": "refused"}
            k = int(req["chunk"])
            if not 0 <= k < ds.index.chunks:
                raise KspeedfsError(f"chunk {k} out of range")
            self.counters.demand_loads += 1
            return {"ok": True, "source": await self.load_chunk(ds, k)}
        if op == "have":
            ds = await self.dataset(str(req["dataset"]), int(req["version"]))
            have = [k for k in range(ds.index.chunks) if self.has(ds.index.chunk_digest(k))]
            return {"chunks": have}
        if op == "stats":
            return asdict(self.statistics())
        raise KspeedfsError(f"unknown op {op!r}")

    def statistics(self) -> NodeStatistics:
        return NodeStatistics(node=self.name, time=time.time(), arena=self.arena.statistics(),
                              counters=replace(self.counters), reads=self.peers.statistics(),
                              endpoint=_endpoint_statistics(self.ep),
                              progress={tag: dict(p) for tag, p in self.progress.items()},
                              disk={"capacity": self.disk.capacity if self.disk else 0,
                                    "used": self.disk.used if self.disk else 0},
                              files=self.files.usage() if self.files else {})

    # -- reconcile: preload, re-replication, rejoin ----------------------------------------

    async def reconcile_forever(self) -> None:
        while True:
            preload_changed = self.preload.changed
            members_changed = self.membership.changed
            try:
                await self.reconcile()
            except KspeedfsError as e:
                log.error("reconcile: %s; retrying in 2 s", e)
                with trio.move_on_after(2):
                    await preload_changed.wait()
                continue
            async with trio.open_nursery() as n:
                async def wait(ev: trio.Event) -> None:
                    await ev.wait()
                    n.cancel_scope.cancel()
                n.start_soon(wait, preload_changed)
                n.start_soon(wait, members_changed)
            await trio.sleep(0.2)                    # debounce a burst of changes

    async def reconcile(self) -> None:
        wanted: dict[str, PreloadRequest] = {}
        for name, raw in self.preload.values.items():
            try:
                wanted[name] = PreloadRequest.from_json(raw)
            except ValueError as e:
                log.warning("ignoring malformed preload request for %s: %s", name, e)
        members = [m.node for m in self.membership.members]
        rereplicating = bool(set(self._last_members) - set(members))
        if members != self._last_members and self._last_members:
            log.info("membership changed (%s → %s): re-checking my share",
                     ",".join(self._last_members), ",".join(members))
        self._last_members = members
        if self.name not in members:
            return                                   # not registered (yet): own nothing
        rank: dict[bytes, int] = {}
        datasets, shares = {}, {}
        member_list = list(self.membership.members)     # one placement for the whole pass
        for name, req in wanted.items():
            ds = datasets[name] = await self.dataset(name, req.version)
            ix = ds.index
            mine = shares[name] = await trio.to_thread.run_sync(self._share, ix, member_list)
            for k in mine:
                key = ix.chunk_digest(k)
                rank[key] = max(rank.get(key, req.priority), req.priority)
        self._rank = rank
        self._drop_unloaded({n: r.version for n, r in wanted.items()})
        # highest priority first: when memory is short, what matters most is loaded first
        for name, req in sorted(wanted.items(), key=lambda nr: (-nr[1].priority, nr[0])):
            await self._fill(datasets[name], shares[name], rereplicating)
            self._held[name] = req.version

    def _share(self, ix: ManifestIndex, members: list[Member]) -> list[int]:
        """The chunks of ``ix`` placement gives this node under ``members``. In a worker
        thread: a hash per chunk and member, seconds for a million chunks, which the
        trio thread (RPCs, leases) must not spend."""
        return [k for k in range(ix.chunks) if self.owns(ix.chunk_digest(k), members)]

    def _drop_unloaded(self, wanted: dict[str, int]) -> None:
        """Forget the chunks of every version reconcile filled before and no preload
        names now (``kspeedfs unload``/``rm``, or a new version preloaded), except
        chunks a wanted version shares; from the arena and the SSD tier."""
        for name, version in list(self._held.items()):
            if wanted.get(name) == version:
                continue
            del self._held[name]
            tag = f"{name}@{version}"
            self.progress.pop(tag, None)
            self.registration.forget(f"{self.store.prefix}progress/{tag}/{self.name}")
            ds = self.datasets.pop((name, version), None)
            if ds is None:
                continue
            chunks = nbytes = 0
            for k in range(ds.index.chunks):
                key = ds.index.chunk_digest(k)
                if key in self._rank:
                    continue                     # a wanted version has it too
                length = self.arena.drop(key)
                if self.disk is not None and key in self.disk:
                    self.disk.discard(key)
                    length = length or ds.index.chunk_len[k]
                if length:
                    chunks, nbytes = chunks + 1, nbytes + length
            self.counters.unloaded += chunks
            log.info("%s unloaded: dropped %d chunks (%d bytes) from the arena and SSD tier",
                     tag, chunks, nbytes)

    async def release_forever(self) -> None:
        """The first live node releases an ``--unload-on-exit`` preload once no mount has
        held it for ``RELEASE_GRACE_TTLS`` lease TTLs (a crashed mount's hold went with
        its lease; a supervisor's resumed daemon holds it again well within that)."""
        grace = lifecycle.RELEASE_GRACE_TTLS * self.cfg.cluster.lease_ttl
        unheld: dict[str, float] = {}            # dataset -> when first seen with no hold
        while True:
            await trio.sleep(max(1.0, self.cfg.cluster.lease_ttl / 2))
            members = [m.node for m in self.membership.members]
            if not members or min(members) != self.name:
                unheld.clear()
                continue
            for name, raw in list(self.preload.values.items()):
                try:
                    req = PreloadRequest.from_json(raw)
                    if req.release != "last-mount":
                        continue
                    held = await trio.to_thread.run_sync(lifecycle.mounts, self.store, name)
                    if held.get(f"{name}@{req.version}"):
                        unheld.pop(name, None)
                        continue
                    since = unheld.setdefault(name, time.monotonic())
                    if time.monotonic() - since >= grace:
                        await trio.to_thread.run_sync(lifecycle.release_if_unheld, self.store,
                                                      name, grace)
                        unheld.pop(name, None)
                except ValueError:
                    continue
                except KspeedfsError as e:
                    log.warning("cannot check the mounts of %s: %s", name, e)

    async def _fill(self, ds: Dataset, mine: list[int], rereplicating: bool) -> None:
        """Load the chunks of ``ds`` this node owns (``mine``) that it does not hold."""
        ix = ds.index
        missing = [k for k in mine if not self.has(ix.chunk_digest(k))]
        tag = f"{ds.info.name}@{ds.info.version}"
        prog = self.progress[tag] = {"owned": len(mine), "cached": len(mine) - len(missing),
                                     "owned_bytes": sum(ix.chunk_len[k] for k in mine),
                                     "from_source": 0, "from_peer": 0, "refused": 0}
        if not missing:
            await self._publish_progress(tag, [ix.chunk_digest(k) for k in mine])
            return
        log.info("%s: %d of my %d chunks missing; loading (%s)", tag, len(missing), len(mine),
                 "re-replication" if rereplicating else "preload")
        t0 = time.monotonic()
        todo = iter(missing)
        last_pub = 0.0
        failed: list[KspeedfsError] = []

        async def worker() -> None:
            nonlocal last_pub
            for k in todo:
                # a chunk the source cannot give now (an object store timing out) is one
                # failure, not the node's: the pass goes on, and reconcile retries the rest
                try:
                    where = await self.load_chunk(ds, k)
                except (ChunkUnavailable, SourceChanged) as e:
                    failed.append(e)
                    continue
                if not self.has(ix.chunk_digest(k)):
                    prog["refused"] += 1             # Arena.put refused it (``_room``)
                    continue
                prog["cached"] += 1
                if where == "source":
                    prog["from_source"] += 1
                elif where == "peer":
                    prog["from_peer"] += 1
                if rereplicating:
                    self.counters.rereplicated += 1
                if time.monotonic() - last_pub > 1.0:
                    last_pub = time.monotonic()
                    await self._publish_progress(tag)

        async with trio.open_nursery() as n:
            for _ in range(self.cfg.cluster.preload_workers):
                n.start_soon(worker)
        await self._publish_progress(tag, [ix.chunk_digest(k) for k in mine])
        if failed:
            raise ChunkUnavailable(f"{tag}: {len(failed)} of my {len(missing)} missing chunks "
                                   f"could not be loaded; the first: {failed[0]}")
        dt = time.monotonic() - t0
        if prog["refused"]:
            log.warning("%s: %d of my %d chunks are not held here: room for them would evict "
                        "chunks of a dataset of higher or equal priority (preloaded with "
                        "--force? a lost peer's share?), or both their index buckets are full; "
                        "their other replicas, or the source, serve them", tag, prog["refused"],
                        len(mine))
        else:
            log.info("%s: my share is cached: %d chunks (%d from peers, %d from the source) "
                     "in %.1fs", tag, len(mine), prog["from_peer"], prog["from_source"], dt)

    async def _publish_progress(self, tag: str, mine: list[bytes] | None = None) -> None:
        """Publish ``progress/<tag>/<node>``; with ``mine`` (the keys of my share, once a
        fill pass ended) also how many of them are in memory and on the SSD tier."""
        key = f"{self.store.prefix}progress/{tag}/{self.name}"
        prog = self.progress[tag]
        if mine is not None:
            prog["in_memory"] = sum(1 for k in mine if k in self.arena)
            prog["on_disk"] = sum(1 for k in mine if k not in self.arena
                                  and self.disk is not None and k in self.disk)
        value = json.dumps(prog).encode()
        try:
            await trio.to_thread.run_sync(self.registration.put, key, value)
        except KspeedfsError as e:
            log.warning("cannot publish progress: %s", e)

    async def publish_stats_forever(self, interval: float = 2.0) -> None:
        key = f"{self.store.prefix}stats/{self.name}"
        while True:
            try:
                await trio.to_thread.run_sync(self.registration.put, key,
                                              json.dumps(asdict(self.statistics())).encode())
            except KspeedfsError as e:
                log.debug("cannot publish stats: %s", e)
            except Exception:                   # statistics are never worth the node
                log.exception("publishing statistics failed")
            await trio.sleep(interval)


def _endpoint_statistics(ep: Endpoint) -> EndpointStatistics:
    peers = {}
    for v in list(ep.vqps):
        s = v.statistics()
        peers[s.peer] = LinkStatistics(s.state, s.reads_failed_over,
                                       {f"{p.local_nic}->{p.remote_nic}": p.state for p in s.paths})
    return EndpointStatistics(list(ep.nics), peers)


async def _export_metrics(cfg: Config, node: Node) -> None:
    """Serve this node's metrics (``metrics.py``) at ``metrics.node_listen`` until cancelled."""
    from .. import metrics

    def snapshot() -> dict[str, object]:
        return {"node": node.statistics(), "members": len(node.membership.nodes),
                "disk_bytes": node.disk.used if node.disk is not None else None,
                "links": [v.statistics() for v in list(node.ep.vqps)],
                "etcd_reachable": node.store.reachable}

    with metrics.serve("metrics.node_listen", cfg.metrics.node_listen, snapshot,
                       metrics.node_families, {"node": node.name}):
        await trio.sleep_forever()


def _arena_files(cfg: Config, name: str, secret: bytes) -> ArenaFiles | None:
    """The files that keep this node's arena across its restarts, or None when
    ``cluster.arena_dir`` is empty (anonymous memory, lost at exit)."""
    if not cfg.cluster.arena_dir:
        return None
    legacy = f"/dev/shm/kspeedfs-{name}.arena"
    if os.path.lexists(legacy):
        log.warning("%s (and .index) from an older kspeedfs still holds RAM; this node keeps "
                    "its arena in %s now: rm /dev/shm/kspeedfs-%s.arena /dev/shm/kspeedfs-%s.index",
                    legacy, cfg.cluster.arena_dir, name, name)
    return ArenaFiles(cfg.cluster.arena_dir, cluster_tag(secret, cfg.store.etcd_prefix), name)


def _slot_ok(key: bytes, data: memoryview | bytes) -> bool:
    return checksum.chunk_matches(data, key)


async def serve(cfg: Config, name: str, ready: Callable[[NodeRecord], None] | None = None,
                source_override: str | None = None) -> None:
    """Run a node until cancelled (SIGTERM/SIGINT in the CLI)."""
    if cfg.store.backend != "etcd":
        raise ConfigError("kspeedfs node needs the etcd store (--etcd URL)")
    secret = cfg.cluster.secret()
    store = EtcdStore(cfg.store, secret)      # signs our record, verifies everyone's
    geometry = Geometry.for_memory(cfg.cluster.memory, cfg.cluster.slot_size)
    async with Endpoint(secret, node=name, addrs=cfg.cluster.nics or None,
                        provider=cfg.cluster.provider or None, cfg=cfg.cluster.heartbeat()) as ep:
        files = _arena_files(cfg, name, secret)
        arena_mem, index_mem, kept = (files.open(geometry.arena_bytes, geometry.index_bytes)
                                      if files else (None, None, False))
        arena_mr = ep.alloc(geometry.arena_bytes, name="arena", remote_read=True, memory=arena_mem)
        index_mr = ep.alloc(geometry.index_bytes, name="index", remote_read=True, memory=index_mem)
        ep.export("arena", arena_mr)
        ep.export("index", index_mr)
        port = await ep.listen(port=cfg.cluster.port)
        membership = Membership(store, leave_grace=cfg.cluster.leave_grace)
        registration = Registration(store, cfg.cluster.lease_ttl)
        async with trio.open_nursery() as nursery:
            peers = Peers(ep, membership, secret, cfg.cluster.replicas, cfg.cluster.slot_size,
                          nursery=nursery, local_node=name, hedge=hedge_from_config(cfg.cluster))
            arena = Arena(geometry, arena_mr, index_mr)
            if kept:                              # a restart: what the last run verified
                t0 = time.monotonic()
                held, dropped = await trio.to_thread.run_sync(arena.adopt, _slot_ok)
                log.info("arena: %d chunks kept from the last run (%d dropped: failed their "
                         "checksum, or in neither of their buckets), verified in %.2fs", held,
                         dropped, time.monotonic() - t0)
            # <disk_dir>/<node>: several nodes may share a host (and a disk) in tests
            disk = (DiskCache(os.path.join(cfg.cache.disk_dir, name), cfg.cache.disk)
                    if cfg.cache.disk else None)
            node = Node(cfg, name, store, ep, arena, membership, peers, registration, nursery,
                        source_override, disk, files)
            arena.rank = node.rank
            if disk is not None:
                arena.on_evict = node.spill
                nursery.start_soon(node.spill_forever, name="ssd-tier")
            await nursery.start(rpc.serve, secret, name, node.handle, cfg.cluster.rpc_port)
            await nursery.start(membership.run)
            await nursery.start(node.preload.run)
            record = NodeRecord(node=name, host=os.uname().nodename, nics=list(ep.nics), port=port,
                                rpc_port=cfg.cluster.rpc_port, capacity=geometry.arena_bytes,
                                nslots=geometry.nslots, slot_size=geometry.slot_size,
                                nbuckets=geometry.nbuckets)
            await trio.to_thread.run_sync(registration.put, NodeRecord.key(store, name),
                                          record.signed(store))
            nursery.start_soon(registration.run, name="lease")
            if not store.authenticated:
                log.warning("etcd auth is off for this node (no store.etcd_user, or the server "
                            "has auth disabled): anyone who reaches etcd can delete the "
                            "cluster's records; production runs etcd with auth and TLS "
                            "(docs/security.md)")
            if cfg.store.etcd_attempt_timeout > registration.period:
                log.warning("store.etcd_attempt_timeout %gs exceeds the lease refresh period "
                            "%.2gs (cluster.lease_ttl/3): a cut rail can cost a refresh",
                            cfg.store.etcd_attempt_timeout, registration.period)
            nursery.start_soon(node.reconcile_forever, name="reconcile")
            nursery.start_soon(node.release_forever, name="release")
            nursery.start_soon(node.publish_stats_forever, name="stats")
            if cfg.metrics.node_listen:
                nursery.start_soon(_export_metrics, cfg, node, name="metrics")
            log.info("node %s up: NICs %s, port %d, rpc %d, arena %d slots of %d bytes",
                     name, ",".join(ep.nics), port, cfg.cluster.rpc_port, geometry.nslots,
                     geometry.slot_size)
            if ready:
                ready(record)
            try:
                await trio.sleep_forever()
            finally:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(registration.revoke)
                    await peers.aclose()
                    store.close()
