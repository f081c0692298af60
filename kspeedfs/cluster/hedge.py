"""Hedged peer READs: when to ask a second replica, how often, and whom to ask first.

Plain synchronous bookkeeping (no trio, no I/O; ``tests/unit/test_hedge.py``); the race
itself is in :mod:`.fetch` (``Peers.read_chunk``)::

    Hedger.threshold(peer, nbytes)   how long a READ of nbytes from peer may take before
                                     the same bytes are READ from the next replica
    Hedger.may_hedge(nbytes)         the byte budget: at most ``budget`` × the bytes READ
                                     (token bucket, ``burst`` bytes deep)
    Hedger.done(peer, nbytes, s)     a READ completed: latency window, histogram, suspicion
    Hedger.overran(peer)             a READ of peer passed its threshold (hedge or not)
    Hedger.order(nodes, now)         replica order with suspected peers moved last

Threshold rule: ``clamp(p99 × factor, floor, cap)`` of the last ``HEDGE_WINDOW`` READ latencies
of that peer in the READ's size class (powers of 4 from 4 KiB: a 256 B bucket READ and a
4 MiB slot READ do not share a distribution). With fewer than ``HEDGE_MIN_SAMPLES`` samples the
same class over every peer is used, else ``cap``. A READ that lost a hedge is not a
sample (its fault-inflated latency would raise the threshold exactly when a peer hangs);
it still counts in the histogram and the longest wait.

Why these defaults: the 2 ms floor keeps scheduler noise alone from hedging (a READ's
p99 here is ~1 ms, its p99.9 end to end several ms); the budget (5 %, a 16 MiB burst) is
far above what hedging spends with no fault, so it only bounds the case of every peer
slow at once, while the burst covers every reader's first hedges when a peer hangs; the
100 ms cap (< ``peer_timeout``) is what a READ gets with no history in its class. The
measurements, and the limits found (a sample carries the trio thread's scheduling
delay): docs/design.md, "Hedging: the measurements".

Suspicion: ``SUSPECT_AFTER`` overruns of a peer with no in-time READ from it in between
make it suspected for ``suspect_time``: ``order`` tries it last (placement and membership
are unchanged; it still serves a read whose other replicas failed). An in-time READ from
it clears the suspicion at once; after ``suspect_time`` it is tried in its place again,
and one more overrun re-suspects it (the count is only reset by an in-time READ).
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..tuning import HEDGE_MIN_SAMPLES, HEDGE_RECOMPUTE, HEDGE_WINDOW, SUSPECT_AFTER

if TYPE_CHECKING:
    from ..config import ClusterConfig

#: histogram bucket upper bounds, ms (the last bucket is everything above)
BUCKETS_MS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0)
CLASSES = 7           # ≤4K, ≤16K, ≤64K, ≤256K, ≤1M, ≤4M, larger


def size_class(nbytes: int) -> int:
    return min(CLASSES - 1, max(0, ((max(nbytes, 1) - 1).bit_length() - 11) // 2))


class Window:
    """The last ``HEDGE_WINDOW`` latencies; ``quantile`` cached, recomputed every HEDGE_RECOMPUTE."""

    __slots__ = ("samples", "_since", "_q")

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=HEDGE_WINDOW)
        self._since = 0
        self._q: float | None = None

    def add(self, s: float) -> None:
        self.samples.append(s)
        self._since += 1
        if self._since >= HEDGE_RECOMPUTE:
            self._q = None

    def p99(self) -> float | None:
        if len(self.samples) < HEDGE_MIN_SAMPLES:
            return None
        if self._q is None:
            ordered = sorted(self.samples)
            self._q = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
            self._since = 0
        return self._q


@dataclass
class PeerHealth:
    """What the hedger knows of one peer."""

    windows: list[Window] = field(default_factory=lambda: [Window() for _ in range(CLASSES)])
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS_MS) + 1))
    reads: int = 0
    longest: float = 0.0             # s, longest READ (hedged-away ones included)
    overruns: int = 0                # since its last in-time READ
    hedged: int = 0                  # hedges fired because a READ of it overran
    won: int = 0                     # hedges it served first
    suspected_until: float = 0.0


@dataclass(frozen=True)
class PeerLatency:
    """One peer's READ latencies, in :class:`~.fetch.PeerStatistics` (``peer_latency``):
    ``counts[i]`` READs took ≤ ``BUCKETS_MS[i]`` (the last: more); ``threshold_ms`` is
    the hedge threshold of a 128 KiB READ (a block) now."""

    reads: int
    counts: tuple[int, ...]
    longest_ms: float
    threshold_ms: float
    hedged: int
    won: int
    suspected: bool


class Hedger:
    """Thresholds, the budget and suspicion for one :class:`~.fetch.Peers`."""

    def __init__(self, *, factor: float = 2.0, floor: float = 0.002, cap: float = 0.1,
                 budget: float = 0.05, burst: int = 16 << 20,
                 suspect_time: float = 1.0) -> None:
        self.factor, self.floor, self.cap = factor, floor, cap
        self.budget, self.burst = budget, burst
        self.suspect_time = suspect_time
        self.credit = float(burst)        # bytes a hedge may still cost
        self.peers: dict[str, PeerHealth] = {}
        self.all = [Window() for _ in range(CLASSES)]
        self.hedges = self.won = self.refused = 0
        self.hedge_bytes = 0
        self.read_bytes = 0

    def health(self, peer: str) -> PeerHealth:
        h = self.peers.get(peer)
        if h is None:
            h = self.peers[peer] = PeerHealth()
        return h

    # -- the threshold ---------------------------------------------------------------------

    def threshold(self, peer: str, nbytes: int) -> float:
        return self._limit(self.peers.get(peer), size_class(nbytes))

    def _limit(self, h: PeerHealth | None, c: int) -> float:
        q = h.windows[c].p99() if h is not None else None
        if q is None:
            q = self.all[c].p99()
        if q is None:
            return self.cap
        return min(self.cap, max(self.floor, q * self.factor))

    # -- outcomes --------------------------------------------------------------------------

    def done(self, peer: str, nbytes: int, seconds: float, *, sample: bool = True) -> None:
        """A READ of ``nbytes`` from ``peer`` completed after ``seconds``. ``sample``
        False: it lost a hedge (histogram and longest only)."""
        h = self.health(peer)
        h.reads += 1
        h.counts[bisect.bisect_left(BUCKETS_MS, seconds * 1e3)] += 1
        h.longest = max(h.longest, seconds)
        self.read_bytes += nbytes
        self.credit = min(float(self.burst), self.credit + nbytes * self.budget)
        if not sample:
            return
        c = size_class(nbytes)
        if (h.overruns or h.suspected_until) and seconds <= self._limit(h, c):
            h.overruns = 0
            h.suspected_until = 0.0
        h.windows[c].add(seconds)
        self.all[c].add(seconds)

    def overran(self, peer: str, now: float) -> None:
        """A READ of ``peer`` passed its threshold."""
        h = self.health(peer)
        h.overruns += 1
        if h.overruns >= SUSPECT_AFTER:
            h.suspected_until = now + self.suspect_time

    def may_hedge(self, nbytes: int) -> bool:
        """Take ``nbytes`` from the budget, or refuse (counted)."""
        if self.credit < nbytes:
            self.refused += 1
            return False
        self.credit -= nbytes
        self.hedges += 1
        self.hedge_bytes += nbytes
        return True

    def hedged(self, peer: str) -> None:
        self.health(peer).hedged += 1

    def hedge_won(self, peer: str) -> None:
        self.won += 1
        self.health(peer).won += 1

    # -- order -----------------------------------------------------------------------------

    def suspected(self, peer: str, now: float) -> bool:
        h = self.peers.get(peer)
        return h is not None and h.suspected_until > now

    def order(self, nodes: list[str], now: float) -> list[str]:
        """``nodes`` (placement order) with suspected peers moved last, order kept."""
        if not any(self.suspected(n, now) for n in nodes):
            return nodes
        return ([n for n in nodes if not self.suspected(n, now)]
                + [n for n in nodes if self.suspected(n, now)])

    def latency(self, peer: str, now: float) -> PeerLatency:
        h = self.health(peer)
        return PeerLatency(reads=h.reads, counts=tuple(h.counts),
                           longest_ms=round(h.longest * 1e3, 1),
                           threshold_ms=round(self.threshold(peer, 128 << 10) * 1e3, 2),
                           hedged=h.hedged, won=h.won, suspected=self.suspected(peer, now))


def from_config(cluster: ClusterConfig) -> Hedger | None:
    """A Hedger from a :class:`~kspeedfs.config.ClusterConfig` (``cluster.hedge_*``), or
    None when ``cluster.hedge`` is off."""
    c = cluster
    if not c.hedge:
        return None
    return Hedger(factor=c.hedge_factor, floor=c.hedge_floor,
                  cap=c.hedge_cap, budget=c.hedge_budget,
                  suspect_time=c.hedge_suspect_time)
