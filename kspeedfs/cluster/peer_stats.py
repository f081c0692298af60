"""⑤ The statistics of one process's peer reads (:class:`~.fetch.Peers`).

    PeerCounters       what the parts of Peers count as they read (one shared record)
    PeerStatistics     a snapshot: the JSON of the stats xattr and of a node's stats key
    snapshot(...)      one, from the counters, the hedger, the landing pool and the vQPs
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from rdma.vrdma.vqp import VQPStats

from .hedge import BUCKETS_MS, Hedger, PeerLatency
from .landing import LandingStatistics


@dataclass
class PeerCounters:
    """Per-tier and per-peer counters of one process's peer reads."""

    hits: int = 0                    # chunks READ from a peer arena and verified
    bytes: int = 0
    loads_requested: int = 0         # misses the owner was asked to fill
    misses: int = 0                  # no replica could provide the chunk → source
    checksum_retries: int = 0        # bytes that failed verification (raced an eviction)
    hinted: int = 0                  # READs that went straight to a remembered slot
    stale_hints: int = 0             # ... and found another chunk there (then the bucket)
    unreachable: int = 0             # PeerUnreachable / RpcUnavailable seen
    longest_stall: float = 0.0       # longest time one chunk spent on failed replicas, s
    longest_wait: float = 0.0        # longest read_chunk that returned bytes, s
    connect_waits: int = 0           # reads (not hedges) that waited for a connect
    per_peer: Counter[str] = field(default_factory=Counter)   # node → bytes served


@dataclass(frozen=True)
class PeerStatistics:
    """A snapshot of one :class:`~.fetch.Peers`, from :meth:`~.fetch.Peers.statistics`.

    ``asdict`` of it is the JSON a mount's ``user.kspeedfs.stats`` xattr merges in and a
    node's ``stats/`` key holds under ``reads``: field names are those JSON keys.
    """

    peer_hits: int                   # PeerCounters.hits ...
    peer_bytes: int
    peer_loads_requested: int
    peer_misses: int
    peer_checksum_retries: int
    peer_hinted_reads: int           # PeerCounters.hinted
    peer_stale_hints: int
    peer_unreachable: int
    peer_longest_stall_ms: float     # PeerCounters.longest_stall, in ms to 0.1
    per_peer_bytes: dict[str, int]   # node → bytes served
    landing_slots: int               # LandingStatistics: slots, free now, kept by
    landing_free: int                # the memory tier, takes that found none free
    landing_kept: int
    landing_exhausted: int
    vqps: dict[str, str]             # node → its vQP's state
    peer_heartbeats: int             # heartbeats answered, over every path of every vQP
    peer_longest_wait_ms: float      # PeerCounters.longest_wait, in ms to 0.1
    peer_connect_waits: int          # PeerCounters.connect_waits
    peer_hedges: int                 # Hedger: second-replica READs issued
    peer_hedges_won: int             # ... that verified first
    peer_hedges_refused: int         # overruns the byte budget did not allow a hedge for
    peer_hedge_bytes: int            # bytes the hedges asked for
    peer_read_bytes: int             # bytes every completed READ carried (the budget's base)
    peer_latency_buckets_ms: tuple[float, ...]   # hedge.BUCKETS_MS (the last bucket: more)
    peer_latency: dict[str, PeerLatency]          # node → its READ latency summary


def snapshot(c: PeerCounters, h: Hedger, land: LandingStatistics,
             vqps: dict[str, VQPStats]) -> PeerStatistics:
    """The statistics now, from ``c``, the hedger ``h``, the landing pool's ``land`` and
    each node's vQP statistics."""
    now = time.monotonic()
    return PeerStatistics(
        peer_hits=c.hits, peer_bytes=c.bytes, peer_loads_requested=c.loads_requested,
        peer_misses=c.misses, peer_checksum_retries=c.checksum_retries,
        peer_hinted_reads=c.hinted, peer_stale_hints=c.stale_hints,
        peer_unreachable=c.unreachable,
        peer_longest_stall_ms=round(c.longest_stall * 1e3, 1),
        per_peer_bytes=dict(c.per_peer), landing_slots=land.slots, landing_free=land.free,
        landing_kept=land.kept, landing_exhausted=land.exhausted,
        vqps={n: st.state for n, st in vqps.items()},
        peer_heartbeats=sum(p.heartbeats_ok for st in vqps.values() for p in st.paths),
        peer_longest_wait_ms=round(c.longest_wait * 1e3, 1),
        peer_connect_waits=c.connect_waits,
        peer_hedges=h.hedges, peer_hedges_won=h.won, peer_hedges_refused=h.refused,
        peer_hedge_bytes=h.hedge_bytes, peer_read_bytes=h.read_bytes,
        peer_latency_buckets_ms=BUCKETS_MS,
        peer_latency={n: h.latency(n, now) for n in sorted(h.peers)})
