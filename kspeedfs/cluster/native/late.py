"""⑤ Hedging the native fetch (:mod:`.native_fetch`, with ``cluster.hedge``; the rule:
:mod:`.hedge`): a fetch past its deadline READ again from another replica.

    LateFetches.deadline(f)    a fetch posted: the hedger's threshold for its peer and
                               size, as a deadline
    LateFetches.run(nursery)   one task sleeps until the earliest deadline
    LateFetches.overdue(f)     past it (or C reported it LATE): noted against its peer
                               (tried last once suspected; off in C while late) and, within
                               the byte budget, READ through ``Peers.read_chunk`` from
                               another replica; when that lands, the READs parked in C on
                               the chunk are answered from the tier (``fetch_unpark``) and
                               the C READ, whenever it completes, finds the chunk there
                               (FETCH_EXISTS)

Why: without it, a SIGSTOPped replica held READs parked in C for the vQP's peer timeout
(tests/cluster/test_cluster_tail.py). While a fetch from a node is past its deadline, no
new one goes to that node through C (``read_chunk`` takes those, hedging each): with many
in flight, a stopped replica would otherwise catch more fetches than the hedge budget
covers.
"""
from __future__ import annotations

import heapq
import logging
import time
from typing import TYPE_CHECKING, Any

import trio

from .inflight import Fetch, InFlight

if TYPE_CHECKING:
    from ...cache.memory import MemoryCache
    from ...cache.tiers import TierChain
    from ...manifest.index import ManifestIndex
    from ..fetch import Peers
    from .routes import Routes

log = logging.getLogger(__name__)


class LateFetches:
    """The hedging deadlines of one mount's native fetches, and their hedges.

    Contract: with hedging on (``peers.hedge``), each fetch ``deadline`` was given is
    ``overdue`` at most once, if it is still in ``inflight`` past its deadline (trio's
    clock); an overdue fetch is hedged once, within the budget, in the nursery ``run``
    was given (none before ``run``). A hedge that wins puts the bytes into the memory
    tier, unparks C's READs and wakes the fetch's waiters; one that fails leaves the C
    READ to finish. Trio thread only.
    """

    def __init__(self, engine: Any, peers: Peers, tiers: TierChain, memory: MemoryCache,
                 index: ManifestIndex, inflight: InFlight, routes: Routes) -> None:
        self.engine, self.peers, self.tiers = engine, peers, tiers
        self.memory, self.index = memory, index
        self.inflight, self.routes = inflight, routes
        self._deadlines: list[tuple[float, int]] = []    # (deadline, cookie)
        self._wake = trio.Event()
        self._nursery: trio.Nursery | None = None

    def deadline(self, f: Fetch) -> None:
        """``f`` was posted: with hedging on, its deadline is its peer's threshold for
        its size from now (in trio's clock, not monotonic)."""
        if self.peers.hedge is None:
            return
        limit = trio.current_time() + self.peers.hedger.threshold(f.node, f.length)
        if not self._deadlines or limit < self._deadlines[0][0]:
            self._wake.set()
        heapq.heappush(self._deadlines, (limit, f.cookie))

    async def run(self, nursery: trio.Nursery) -> None:
        """Hedge fetches past their deadline (module docstring), until cancelled; the
        hedges run in ``nursery`` (so do those of C-started fetches C reports late)."""
        self._nursery = nursery
        while True:
            # Fetches back in time leave their deadline in the heap: drop them from its
            # head first, or this task woke once per fetch for nothing.
            while self._deadlines and self._deadlines[0][1] not in self.inflight.by_cookie:
                heapq.heappop(self._deadlines)
            if not self._deadlines:
                await self._wake.wait()
                self._wake = trio.Event()
                continue
            with trio.move_on_at(self._deadlines[0][0]):
                await self._wake.wait()
            if self._wake.is_set():
                self._wake = trio.Event()
            clock = trio.current_time()
            while self._deadlines and self._deadlines[0][0] <= clock:
                _, cookie = heapq.heappop(self._deadlines)
                f = self.inflight.by_cookie.get(cookie)
                if f is None:
                    continue                        # landed (or failed) in time
                self.overdue(f)                     # (one deadline per fetch)
                self.routes.retell(f.node, f.started)   # its node off in C while late

    def overdue(self, f: Fetch) -> None:
        """``f`` passed its hedging deadline (once): noted against its peer, and READ from
        another replica within the hedge budget."""
        self.inflight.overdue(f)
        hedger = self.peers.hedger
        hedger.overran(f.node, time.monotonic())
        if self._nursery is not None and hedger.may_hedge(f.length):
            f.hedged = True
            hedger.hedged(f.node)
            self._nursery.start_soon(self._hedge, f)

    async def _hedge(self, f: Fetch) -> None:
        """READ ``f``'s chunk from another replica; once it is in the memory tier, answer
        the READs parked on it in C and wake the waiters."""
        part = (f.offset, f.length, f.want) if f.extent else None
        try:
            data = await self.peers.read_chunk(self.tiers.dataset[0], self.tiers.dataset[1],
                                               f.k, f.chunk_key, self.index.chunk_len[f.k],
                                               exclude=f.node, part=part, budgeted=True)
        except Exception as e:          # noqa: BLE001 - the C READ is still there
            log.info("hedge of chunk %d (native READ from %s late): %s", f.k, f.node, e)
            return
        if data is None or f.landed:
            return                      # no other replica had it, or C's READ landed first
        self.peers.hedger.hedge_won(f.node)
        if f.key not in self.memory:    # (else a load of Python's put it meanwhile)
            self.tiers.arrived(f.k, f.key, data, "peer", whole=not f.extent)
        self.engine.fetch_unpark(f.cookie)
        f.delivered = True
        if f.event is not None:
            f.event.set()
