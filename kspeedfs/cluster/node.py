"""``kspeedfs node``: one per machine — its memory arena is its share of the pooled cache.

Composition (each resource's teardown is the ``async with`` that opened it)::

    EtcdStore ─ Membership (watch nodes/) ─ PrefixView (watch preload/)
    Endpoint(NICs) ─ vMRs "arena" + "index" exported to authenticated peers ─ listen(port)
    Arena(geometry, vMRs, rank = my share by dataset priority: Reconciler.rank, lifecycle.py)
    DiskCache (optional SSD tier: owned chunks evicted from the arena, promoted on demand)
    Peers (to copy chunks from other replicas)
    Node ─┬─ Share          share.py: datasets, owns/has, load a chunk, the SSD spill queue
          ├─ PageCopy       page_copy.py: the host's copy of paged manifests' pages, from peers
          ├─ Reconciler     reconcile.py: what the share should hold, progress/
          └─ statistics     node_stats.py: counters, the snapshot the stats RPC answers
    nursery ─┬─ rpc.serve(rpc_port)          Node.handle: load-on-demand, have, page, stats
             ├─ Registration.run             lease keep-alive (nodes/, progress/)
             ├─ Reconciler.run               preload + re-replication + rejoin + unload, one loop
             ├─ release_forever              --unload-on-exit preloads no mount holds (lifecycle.py)
             ├─ SpillQueue.run               with an SSD tier: evicted owned chunks written to it
             ├─ PageAsks.serve               <page_copy>/.ask: mounts' page maps ask for pages
             ├─ GrantServer.serve            cluster.host_readers: local readers map their
             │                               datasets' arena segments (grant.py)
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

import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import trio

from rdma.vrdma import Endpoint

from .. import checksum
from ..cache.disk import DiskCache
from ..config import Config
from ..errors import ConfigError, KspeedfsError, StoreUnavailable
from ..manifest.store import page_store
from ..manifest.store.etcd import EtcdStore
from . import grant, node_stats, rpc
from .arena import Arena, Geometry
from .arena_files import ArenaFiles, cluster_tag
from .arena_segments import SegmentMemory
from .fetch import Peers
from .hedge import from_config as hedge_from_config
from .membership import Membership, NodeRecord, PrefixView, Registration
from .node_stats import NodeCounters, NodeStatistics
from .page_ask import PageAsks
from .page_copy import PageCopy
from .reconcile import Reconciler, release_forever
from .share import Share

log = logging.getLogger(__name__)


class Node:
    """One machine's share of the pooled cache, composed: what fills it, what it serves.

    Built by :func:`serve`, which runs the parts' loops in one nursery: ``share``
    (:class:`Share`: the datasets this node opened, which chunks it owns and holds,
    loading one into the arena, the SSD tier's spill queue), ``reconciler``
    (:class:`Reconciler`: the arena holds this node's owned chunks of every preloaded
    dataset; preload, re-replication and rejoin are that one loop). The node itself
    answers the RPCs (:meth:`handle`:
    ``load`` a chunk on a reader's demand, ``have``, a manifest ``page`` from ``pages``,
    ``stats``) and takes the snapshot of them all (:meth:`statistics`). Every method
    runs in the trio thread and never blocks it (the parts' contracts: etcd, source and
    SSD I/O go to worker threads).

    Attributes:
        cfg: the configuration; ``cluster.*`` sets replicas, workers and the arena.
        name: this node's name in ``nodes/`` and in placement.
        store: the etcd store (manifests, ``preload/``, ``progress/``).
        ep: the vRDMA endpoint exporting ``arena`` and ``index`` to peers.
        arena: the memory arena (slots + index), READ by peers one-sided.
        disk: the SSD tier for evicted owned chunks, or None.
        files: the files behind the arena and index (``arena_files.py``), or None
            (anonymous memory).
        membership: live nodes; placement's input.
        peers: reads from other replicas' arenas (re-replication, demand loads).
        registration: the lease keeping ``nodes/<name>`` alive; publishes progress.
        counters: what was loaded and spilled (:class:`NodeCounters`), counted by the parts.
        preload: the ``preload/`` requests (dataset → version to hold).
        share: the chunks (:class:`Share`).
        pages: the host's copy of manifest pages (:class:`PageCopy`), or None when
            ``cluster.page_copy`` is empty.
        reconciler: the preload loop (:class:`Reconciler`); its ``progress`` is
            ``"<ds>@<v>"`` → owned/cached/from_source/from_peer, as published.
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
        self.counters = NodeCounters()
        self.disk = disk
        self.files = files
        self.preload = PrefixView(store, "preload/")
        self.share = Share(cfg, name, store, arena, membership, peers, nursery, self.counters,
                           source_override, disk)
        self.pages = (PageCopy(cfg.cluster.page_copy, page_store(cfg.store, cfg.source), name, store,
                               membership, peers.connections, self.counters,
                               cfg.cluster.preload_workers)
                      if cfg.cluster.page_copy else None)
        self.reconciler = Reconciler(cfg, name, store, self.share, membership, self.preload,
                                     registration, self.counters, self.pages)

    async def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        """One RPC (``rpc.py``): ``load``, ``have``, ``page`` or ``stats``."""
        op = req.get("op")
        if op == "load":
            try:
                ds = await self.share.dataset(str(req["dataset"]), int(req["version"]))
            except StoreUnavailable:    # (no manifest: the reader's next replica or source)
                return {"ok": True, "source": "refused"}
            k = int(req["chunk"])
            if not 0 <= k < ds.index.chunks:
                raise KspeedfsError(f"chunk {k} out of range")
            self.counters.demand_loads += 1
            return {"ok": True, "source": await self.share.load_chunk(ds, k)}
        if op == "have":
            ds = await self.share.dataset(str(req["dataset"]), int(req["version"]))
            have = [k for k in range(ds.index.chunks) if self.share.has(ds.index.chunk_digest(k))]
            return {"chunks": have}
        if op == "page":
            if self.pages is None:
                return {"absent": True}
            return await self.pages.answer(req.get("hash"))
        if op == "stats":
            return asdict(self.statistics())
        raise KspeedfsError(f"unknown op {op!r}")

    def statistics(self) -> NodeStatistics:
        return NodeStatistics(node=self.name, time=time.time(), arena=self.arena.statistics(),
                              counters=replace(self.counters), reads=self.peers.statistics(),
                              endpoint=node_stats.endpoint_statistics(self.ep),
                              progress={tag: dict(p) for tag, p in self.reconciler.progress.items()},
                              disk={"capacity": self.disk.capacity if self.disk else 0,
                                    "used": self.disk.used if self.disk else 0},
                              files=self.files.usage() if self.files else {})


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


def _export_arena(ep: Endpoint, geometry: Geometry, files: ArenaFiles | None,
                  segmented: bool) -> tuple[Arena, SegmentMemory | None, bool]:
    """The arena and its index as vMRs exported to peers (in ``files`` when given, else
    in memfd segments when ``segmented``, else anonymous memory), the arena's segments,
    and whether the files kept a previous run's chunks (then :func:`_adopt` them)."""
    segments, arena_mem, index_mem, kept = None, None, None, False
    if files:
        arena_mem, index_mem, kept = files.open(geometry.arena_bytes, geometry.index_bytes,
                                                segment_bytes=geometry.segment_bytes)
        segments = files.segments
    elif segmented:
        # memfds only when something may be granted: shmem gets transparent huge pages
        # only where shmem_enabled allows, anonymous memory always (docs/operations.md)
        segments = SegmentMemory.anonymous(geometry, ep.node)
        arena_mem = segments.memory
    arena_mr = ep.alloc(geometry.arena_bytes, name="arena", remote_read=True, memory=arena_mem)
    index_mr = ep.alloc(geometry.index_bytes, name="index", remote_read=True, memory=index_mem)
    ep.export("arena", arena_mr)
    ep.export("index", index_mr)
    return Arena(geometry, arena_mr, index_mr), segments, kept


def _slot_ok(key: bytes, data: memoryview | bytes) -> bool:
    return checksum.chunk_matches(data, key)


async def _adopt(arena: Arena) -> None:
    """Keep what the last run left in the arena's files and still verifies."""
    t0 = time.monotonic()
    held, dropped = await trio.to_thread.run_sync(arena.adopt, _slot_ok)
    log.info("arena: %d chunks kept from the last run (%d dropped: failed their "
             "checksum, or in neither of their buckets), verified in %.2fs", held,
             dropped, time.monotonic() - t0)


def _warn_etcd(cfg: Config, store: EtcdStore, registration: Registration) -> None:
    """Say once, at start, what in the etcd set-up puts the cluster at risk."""
    if not store.authenticated:
        log.warning("etcd auth is off for this node (no store.etcd_user, or the server "
                    "has auth disabled): anyone who reaches etcd can delete the "
                    "cluster's records; production runs etcd with auth and TLS "
                    "(docs/security.md)")
    if cfg.store.etcd_attempt_timeout > registration.period:
        log.warning("store.etcd_attempt_timeout %gs exceeds the lease refresh period "
                    "%.2gs (cluster.lease_ttl/3): a cut rail can cost a refresh",
                    cfg.store.etcd_attempt_timeout, registration.period)


async def serve(cfg: Config, name: str, ready: Callable[[NodeRecord], None] | None = None,
                source_override: str | None = None) -> None:
    """Run a node until cancelled (SIGTERM/SIGINT in the CLI)."""
    if cfg.store.backend != "etcd":
        raise ConfigError("kspeedfs node needs the etcd store (--etcd URL)")
    secret = cfg.cluster.secret()
    store = EtcdStore(cfg.store, secret)      # signs our record, verifies everyone's
    geometry = Geometry.for_memory(cfg.cluster.memory, cfg.cluster.slot_size,
                                   cfg.cluster.segment_bytes)
    granting = bool(cfg.cluster.host_readers and cfg.cluster.grant_socket)
    async with Endpoint(secret, node=name, addrs=cfg.cluster.nics or None,
                        provider=cfg.cluster.provider or None, cfg=cfg.cluster.heartbeat()) as ep:
        files = _arena_files(cfg, name, secret)
        arena, segments, kept = _export_arena(ep, geometry, files, granting)
        port = await ep.listen(port=cfg.cluster.port)
        membership = Membership(store, leave_grace=cfg.cluster.leave_grace)
        registration = Registration(store, cfg.cluster.lease_ttl)
        async with trio.open_nursery() as nursery:
            peers = Peers(ep, membership, secret, cfg.cluster.replicas, cfg.cluster.slot_size,
                          nursery=nursery, local_node=name, hedge=hedge_from_config(cfg.cluster))
            if kept:                              # a restart: what the last run verified
                await _adopt(arena)
            # <disk_dir>/<node>: several nodes may share a host (and a disk) in tests
            disk = (DiskCache(os.path.join(cfg.cache.disk_dir, name), cfg.cache.disk)
                    if cfg.cache.disk else None)
            node = Node(cfg, name, store, ep, arena, membership, peers, registration, nursery,
                        source_override, disk, files)
            arena.rank = node.reconciler.rank
            arena.group = node.reconciler.group
            if granting and segments is not None:
                path = grant.socket_path(cfg.cluster.grant_socket,
                                         cluster_tag(secret, cfg.store.etcd_prefix), name)
                server = grant.GrantServer(arena, segments, cfg.cluster.host_readers,
                                           on_grant=files.mark_granted if files else None)
                await nursery.start(server.serve, path)
            if node.pages is not None:
                nursery.start_soon(PageAsks(node.pages).serve, name="page-asks")
            if node.share.spill is not None:
                arena.on_evict = node.share.evicted
                nursery.start_soon(node.share.spill.run, name="ssd-tier")
            await nursery.start(rpc.serve, secret, name, node.handle, cfg.cluster.rpc_port)
            await nursery.start(membership.run)
            await nursery.start(node.preload.run)
            record = NodeRecord(node=name, host=os.uname().nodename, nics=list(ep.nics), port=port,
                                rpc_port=cfg.cluster.rpc_port, capacity=geometry.arena_bytes,
                                nslots=geometry.nslots, slot_size=geometry.slot_size,
                                nbuckets=geometry.nbuckets,
                                disk_capacity=disk.capacity if disk is not None else 0)
            await trio.to_thread.run_sync(registration.put, NodeRecord.key(store, name),
                                          record.signed(store))
            nursery.start_soon(registration.run, name="lease")
            _warn_etcd(cfg, store, registration)
            nursery.start_soon(node.reconciler.run, name="reconcile")
            nursery.start_soon(release_forever, store, name, membership, node.preload,
                               cfg.cluster.lease_ttl, name="release")
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
