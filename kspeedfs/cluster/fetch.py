"""⑤ Fetch a chunk from a replica's arena with one-sided vRDMA READs; next replica on failure.

:class:`Peers` is the seam the read path (``TierChain``), a node (re-replication), the
native fetch (:mod:`.native.fetch`) and the stats use; the work is in its parts:

    connections.py   Connections   the vQP and RPC client to each node; unreachable nodes
                                   skipped a while, nodes back as a new incarnation last
    replicas.py      Replicas      the replica order of a chunk (placement, kept per member
                                   list); the route C may READ a chunk by itself
    failover.py      Failover      read_chunk: replicas in turn, the owner's "load" on a
                                   miss, the next on failure, a hedge when one is late
                     Race, Attempt one read's attempts and winner
    arena_read.py    ArenaRead     one replica: bucket READ (or a slot hint), slot READ,
                                   checksum; the whole index for the native routes
                     Staging       staging slots and read-in-progress tokens
    landing.py       Landing       the slots a whole chunk lands in and the memory tier keeps
    hints.py         SlotHints     where chunks sat in each node's arena
    hedge.py         Hedger        when to hedge, the byte budget, suspected peers
    peer_stats.py    PeerCounters, PeerStatistics: what the stats and the metrics read

A replica that fails (or misbehaves) is never the reader's error while another copy or
the source exists; the reasons and the order of a read: :mod:`.failover`.
"""
from __future__ import annotations

import trio

from rdma.vrdma import VQP, Endpoint
from rdma.vrdma.vqp import VQPStats

from ..tuning import NATIVE_READS
from .arena_read import ArenaRead, Staging
from .connections import Connections
from .failover import Failover
from .hedge import Hedger
from .hints import SlotHints
from .landing import Landing, Slot
from .membership import Membership, NodeRecord
from .peer_stats import PeerCounters, PeerStatistics, snapshot
from .replicas import Replicas

__all__ = ["NATIVE_READS", "PeerCounters", "PeerStatistics", "Peers"]


class Peers:
    """Chunk reads from the cluster for one process (a mount, or a node re-replicating).

    Contract: ``read_chunk`` returns verified bytes of a chunk from some replica, or None
    (go to the source); a failed replica is never the caller's error. The native fetch's
    side (``native_route``, ``staging_nowait``/``give_staging``, ``landed_native``,
    ``stale_hint``) shares the same hints, slots and counters. Owns its parts (module
    docstring); ``aclose`` closes their vQPs and RPC clients. Trio thread only; connects
    and hedges run in ``nursery``.

    Attributes:
        ep, membership, slot_size: as given.
        hedge: the Hedger when hedging is on, else None; ``hedger`` is always one (READ
            latencies are summarised either way).
        landing: the landing pool a chunk READ lands in.
        hints: where chunks sat in each node's arena (SlotHints).
        counters: what the parts count (PeerCounters).
        connections, staging, arena_read, replicas, failover: the parts.
    """

    def __init__(self, endpoint: Endpoint, membership: Membership, secret: bytes, replicas: int,
                 slot_size: int, *, nursery: trio.Nursery, me: str | None = None,
                 local_node: str | None = None, find_local: bool = False, nbuf: int = 8,
                 landing_slots: int = 0, rpc_timeout: float = 30.0,
                 hedge: Hedger | None = None) -> None:
        """``landing_slots``: chunks that may stay in landing slots at once (the memory
        tier's capacity in chunks, for a mount; NATIVE_READS more are for the native
        fetch); ``nbuf`` READs are in flight at most; ``find_local`` (a mount): the local
        node is the member with one of this endpoint's NICs, looked up again whenever the
        member list changes (found once at the start, a mount made before its host's node
        registered, or during an etcd outage, never tried its own host's node first);
        ``nursery`` runs the connects to nodes (one per node at a time, single-flight) and,
        with ``hedge``, the hedges (None: one replica at a time, in the caller's task);
        ``me``: this process as named in RPC handshakes (default: the endpoint's node)."""
        self.ep = endpoint
        self.membership = membership
        self.slot_size = slot_size
        self.hedge = hedge
        self.hedger = hedge if hedge is not None else Hedger()
        self.counters = PeerCounters()
        self.connections = Connections(endpoint, secret, me or endpoint.node, rpc_timeout,
                                       nursery)
        self.staging = Staging(endpoint, slot_size, nbuf)
        self.landing = Landing(endpoint, slot_size, landing_slots + nbuf + NATIVE_READS)
        self.hints = SlotHints()
        self.arena_read = ArenaRead(self.connections, self.staging, self.landing, self.hints,
                                    self.hedger, self.counters, hedging=hedge is not None)
        self.replicas = Replicas(membership, replicas, self.connections, self.hints,
                                 self.arena_read, nursery, slot_size=slot_size, hedge=hedge,
                                 local_node=local_node, find_local=find_local)
        self.failover = Failover(self.replicas, self.connections, self.arena_read,
                                 self.hedger, self.counters, nursery, slot_size=slot_size)

    # -- reads ----------------------------------------------------------------------------

    async def read_chunk(self, dataset: str, version: int, chunk: int, key: bytes, length: int,
                         *, ask_owner: bool = True, exclude: str | None = None,
                         part: tuple[int, int, bytes] | None = None,
                         budgeted: bool = False) -> bytes | memoryview | None:
        """Verified bytes of the chunk from some replica, or None (go to the source).

        ``part = (offset, length, digest)`` READs only that extent (or block) of the
        chunk and verifies it against its own digest: a small file, or a random read's
        block, costs a READ of its bytes, not of the 4 MiB chunk that holds it.

        Replicas in turn (``exclude``: not that node), each in this task; with hedging,
        a late READ starts the next replica as a hedge (:mod:`.failover`).
        ``ask_owner``: a replica that lacks the chunk is asked to load it.

        ``budgeted``: this read is itself a hedge, charged to the byte budget already
        (``NativeFetch``'s, of a C READ past its deadline): its attempts take no
        read-in-progress token and wait for no staging slot (:mod:`.arena_read`)."""
        return await self.failover.read_chunk(dataset, version, chunk, key, length,
                                              ask_owner=ask_owner, exclude=exclude, part=part,
                                              budgeted=budgeted)

    def order(self, key: bytes, exclude: str | None = None) -> list[NodeRecord]:
        """The replicas of ``key`` in the order a read tries them (``Replicas.order``)."""
        return self.replicas.order(key, exclude)

    def local_member(self) -> str | None:
        """The member on this host: one of this endpoint's NICs is among its NICs."""
        return self.replicas.local_member()

    # -- the native fetch's side (native/fetch.py) --------------------------------------

    def native_route(self, key: bytes, length: int) -> tuple[NodeRecord, int, VQP] | None:
        """Where C may READ chunk ``key`` itself — ``(record, slot, vqp)`` — or None:
        ``read_chunk`` (``Replicas.native_route``)."""
        return self.replicas.native_route(key, length)

    def staging_nowait(self) -> Slot | None:
        """A staging slot now for the native fetch's extents, or None
        (``Staging.take_nowait``); back through ``give_staging``."""
        return self.staging.take_nowait()

    def give_staging(self, staging: Slot) -> None:
        """A staging slot back, once no READ writes into it."""
        self.staging.give(staging)

    def landed_native(self, node: str, nbytes: int, reads: int = 1) -> None:
        """``reads`` READs C made from ``node`` (a chunk, an extent, a block; the library's
        too) landed verified, ``nbytes`` in all: counted as hinted peer hits (C READs a
        slot its route named, never a bucket)."""
        c = self.counters
        c.hits += reads
        c.hinted += reads
        c.bytes += nbytes
        c.per_peer[node] += nbytes

    def stale_hint(self, node: str, started: float, key: bytes) -> None:
        """C found another chunk in the slot a hint named: forget the hint, and the copy
        of that node's index it may have come from."""
        self.counters.stale_hints += 1
        self.hints.stale(node, started, key)

    # -- statistics, and the end ------------------------------------------------------------

    def links(self) -> list[VQPStats]:
        """Every vQP's statistics (``rdma.vrdma`` VQPStats, with its paths): metrics."""
        return list(self.connections.statistics().values())

    def statistics(self) -> PeerStatistics:
        return snapshot(self.counters, self.hedger, self.landing.statistics(),
                        self.connections.statistics())

    async def aclose(self) -> None:
        await self.connections.aclose()
