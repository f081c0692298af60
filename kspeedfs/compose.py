"""The read path's composition, shared by its two hosts: the mount daemon (``daemon.py``)
and the Python library (``client.py``). Both read through one :class:`Reader` built
here the same way, so tiers, replicas, hedging and checksums are the same code for a
FUSE request and for ``Dataset.read``.

    fetch_manifest(cfg, name, version)   store → DatasetInfo, manifest blob (blocking)
    local_tiers(cfg, info, index)        origin (source) · memory tier · disk tier?
    cluster(cfg, index)                  peers over vRDMA + the etcd store, or (None, None)
    host_grant(cfg, info, index, peers)  the grant of the node on this host (HostGrant), or
                                         None (the library's; asked before the peers)
    new_reader(..., nursery, peers)      the Reader (loads and prefetches run in ``nursery``)

What stays in each host: the daemon's engines, page-cache pushes, supervisor and holds;
the library's trio thread and its sync API.
"""
from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, NamedTuple

import trio

from .cache.disk import DiskCache
from .cache.memory import MemoryCache
from .cache.tiers import HostReader
from .config import Config
from .manifest.index import ManifestIndex
from .manifest.store import open_configured
from .manifest.store.base import DatasetInfo
from .origin import Origin, open_origin
from .reader import Push, Reader
from .tuning import RESUME_FIRST_WAIT

if TYPE_CHECKING:
    from .cluster.fetch import Peers
    from .cluster.granted import HostGrant
    from .manifest.store.etcd import EtcdStore

log = logging.getLogger(__name__)


class LocalTiers(NamedTuple):
    origin: Origin              # the source, last resort
    memory: MemoryCache
    disk: DiskCache | None      # only with cache.disk and cache.disk_dir


def fetch_manifest(cfg: Config, name: str, version: int | None) -> tuple[DatasetInfo, bytes]:
    """Blocking: the dataset's info record and manifest blob from the configured store
    (etcd: records verified with the cluster secret). ``version`` None: the newest."""
    with open_configured(cfg) as store:
        return store.fetch(name, version)


def local_tiers(cfg: Config, info: DatasetInfo, index: ManifestIndex,
                source: str | None = None) -> LocalTiers:
    """The origin and this process's tiers. ``source`` overrides the one recorded at
    import (a mount's ``--source``); a cluster reader may lack the source (its replicas
    hold the chunks), a single-node one may not."""
    clustered = cfg.store.backend == "etcd" and bool(cfg.cluster.peers)
    origin = open_origin(source or info.source, index, info.name, required=not clustered,
                         config=cfg.source)
    disk = DiskCache(cfg.cache.disk_dir, cfg.cache.disk) if cfg.cache.disk else None
    return LocalTiers(origin, MemoryCache(cfg.cache.memory), disk)


def new_reader(cfg: Config, info: DatasetInfo, index: ManifestIndex, tiers: LocalTiers,
               nursery: trio.Nursery, peers: Peers | None, push: Push | None = None,
               host: HostReader | None = None) -> Reader:
    """The Reader of one dataset version over ``tiers``, ``host`` and ``peers``; trio
    thread only."""
    return Reader(index=index, origin=tiers.origin, memory=tiers.memory, disk=tiers.disk,
                  nursery=nursery, peers=peers, dataset=(info.name, info.version),
                  workers=cfg.fuse.workers, prefetch_depth=cfg.fuse.prefetch_chunks, push=push,
                  host=host)


@asynccontextmanager
async def host_grant(cfg: Config, info: DatasetInfo, index: ManifestIndex,
                     peers: Peers | None) -> AsyncIterator[HostGrant | None]:
    """The grant of ``info``'s dataset by the node on this host (``cluster/granted.py``
    ``HostGrant``: looked for now, and again on membership changes while there is none;
    without one, reads go to the peers as before), or None: not in a cluster, or
    ``cluster.grant_socket`` is empty. Its search runs in a nursery of its own.

    Which node: the live members whose ``cluster.grant_socket`` exists here, in this
    order: the member with one of this endpoint's NICs, those whose record names this
    host, the rest (by name). In production only the local node's socket exists; in
    the test bed every node's does, and any of them is "on this host"."""
    if peers is None or not cfg.cluster.grant_socket:
        yield None
        return
    from .cluster.arena_files import cluster_tag
    from .cluster.granted import HostGrant

    here = os.uname().nodename

    def order() -> list[str]:
        nodes, local = peers.membership.nodes, peers.local_member()
        return sorted(nodes, key=lambda n: (n != local, nodes[n].host != here, n))

    host = HostGrant(cfg.cluster.grant_socket,
                     cluster_tag(cfg.cluster.secret(), cfg.store.etcd_prefix), info.name,
                     index, peers.membership, order)
    async with trio.open_nursery() as nursery:
        await nursery.start(host.run)
        try:
            yield host
        finally:
            nursery.cancel_scope.cancel()
            host.close()


@asynccontextmanager
async def cluster(cfg: Config, index: ManifestIndex, resume: bool = False,
                  keep: str | None = None, taking_over: bool = False,
                  ) -> AsyncIterator[tuple[Peers | None, EtcdStore | None]]:
    """Peers to read chunks from, when this reader belongs to a cluster (etcd store and
    ``cluster.peers``); None otherwise. The reader talks to the nodes directly — its own
    vRDMA endpoint and one-sided READs into its own buffers — so a read from a peer
    crosses the network once and the local node's CPU is never on the path. ``resume``:
    readers wait on this daemon, so the node list is waited for ``RESUME_FIRST_WAIT`` s
    at most (etcd lists it in milliseconds; during an outage the usual wait, one
    ``etcd_timeout`` and a second, found nothing and cost a resume 6 s). ``keep``: the
    file the node list is kept in (``PrefixView``); ``taking_over`` (a resume or an
    upgrade): with no listing in time, start from the list kept there by the daemon
    before, so reads go to its peers, not to the source, until etcd is back."""
    if cfg.store.backend != "etcd" or not cfg.cluster.peers:
        yield None, None
        return
    from rdma.vrdma import Endpoint

    from .cluster.fetch import Peers
    from .cluster.hedge import from_config as hedge_from_config
    from .cluster.membership import Membership
    from .manifest.store.etcd import EtcdStore

    secret = cfg.cluster.secret()
    store = EtcdStore(cfg.store, secret)      # verifies node records (membership)
    me = f"mount:{os.uname().nodename}:{os.getpid()}"
    async with Endpoint(secret, node=me, addrs=cfg.cluster.nics or None,
                        provider=cfg.cluster.provider or None, cfg=cfg.cluster.heartbeat()) as ep, \
            trio.open_nursery() as nursery:
        membership = Membership(store, leave_grace=cfg.cluster.leave_grace,
                                first_wait=RESUME_FIRST_WAIT if resume else None,
                                keep=keep, seed=taking_over)
        await nursery.start(membership.run)
        slot = max(cfg.cluster.slot_size, index.chunk_size)
        peers = Peers(ep, membership, secret, cfg.cluster.replicas, slot, nursery=nursery,
                      find_local=True, nbuf=max(8, cfg.fuse.prefetch_chunks * 2),
                      landing_slots=cfg.cache.memory // slot,
                      hedge=hedge_from_config(cfg.cluster))
        log.info("cluster: %d nodes (%s), local node %s, R=%d", len(membership.nodes),
                 ", ".join(sorted(membership.nodes)), peers.local_member(),
                 cfg.cluster.replicas)
        try:
            yield peers, store
        finally:
            with trio.CancelScope(shield=True):
                await peers.aclose()
            nursery.cancel_scope.cancel()
            store.close()
