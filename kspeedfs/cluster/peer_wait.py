"""⑤ The library's native fetch: a small file's extent READ from a peer by the reading
thread itself, in C (native/peer_wait.h), with no trio thread and no GIL.

    PeerWait.read(k, ext)     any thread: the extent's verified bytes, READ on the route
                              the trio thread gave C for chunk k; None: no route, no
                              staging slot, a late or failed READ, a digest mismatch —
                              the caller takes the Python read path (failover, hedging,
                              the source), so the read path stays one
    PeerWait.route(k)         the trio thread: chunk k's route (``Peers.native_route``:
                              its first replica's slot, a connected vQP) and that peer's
                              UP paths, given to C
    PeerWait.run()            the trio thread, every LIB_TICK: what C's READs came back
                              with, per peer and path, fed to the vQP monitors (a path
                              carrying only C's READs must not look silent), the hedger
                              and the peer counters; the peers' paths told again

Why: the library's Python per small file (the hand-over to the trio thread, a task, the
READ's event, the CQ consumer's wake, the read path's layers) cost more CPU than the
mount's whole C path (docs/design.md, "The library's native fetch").
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import trio

from ..tuning import LIB_STAGING, LIB_TICK, LIB_WAIT
from .native.fetch import soft_capi
from .native.peer_table import PeerTable, stage

if TYPE_CHECKING:
    from ..manifest.index import ManifestIndex
    from ..manifest.model import Extent
    from .fetch import Peers

log = logging.getLogger(__name__)


def available() -> bool:
    """Whether the soft provider's C API and this fetch are built."""
    try:
        from . import _peerwait  # type: ignore[attr-defined]  # noqa: F401  # no stubs
    except ImportError:
        return False
    return soft_capi() is not None


class PeerWait:
    """Small files' extents READ from peers by the calling thread, through C.

    Contract: ``read`` returns bytes only when they match the extent's digest; any other
    outcome is None, and the caller reads the file the usual way (so a failed replica is
    never the reader's error). ``read`` may be called from any thread; ``route``,
    ``tick``, ``run`` and ``aclose`` are the trio thread's. Every route and peer given to
    C comes from ``Peers.native_route`` and the vQP's UP paths now: C never picks a peer,
    and a failed or late READ clears its chunk's route in C. A staging slot is C's for
    good (one vMR of this fetch's own), reused once its READ completed.

    Attributes:
        reads, misses: extents answered here; reads that went to the loop (any thread,
            approximate: plain increments).
    """

    def __init__(self, peers: Peers, index: ManifestIndex, part_size: int) -> None:
        from . import _peerwait  # type: ignore[attr-defined]  # the C extension: no stubs
        self.peers = peers
        self.index = index
        self.c = _peerwait.PeerWait(soft_capi(), index.chunks)
        self.reads = self.misses = 0
        self._closed = False
        # its peers as told to C: the local NICs in a slot's lkey order (past NICS: no lkey)
        self.table = PeerTable(list(peers.ep.nics)[:_peerwait.NICS], _peerwait.PEERS,
                               self.c.engine, self.c.peer, self.c.unroute)
        self._wait_ns = int(LIB_WAIT * 1e9)
        self._staging = stage(peers.ep, LIB_STAGING, part_size, self.table.nics,
                              self.c.staging, "lib-staging")

    # -- any thread -----------------------------------------------------------------------

    def read(self, k: int, ext: Extent) -> bytes | None:
        """Extent ``ext`` (in chunk ``k``) READ from its route in C and verified, or None
        (the Python read path takes it)."""
        out: bytes | int = self.c.read(k, ext.chunk_offset, ext.length, ext.digest,
                                       self._wait_ns)
        if isinstance(out, int):
            self.misses += 1
            return None
        self.reads += 1
        return out

    # -- the trio thread ------------------------------------------------------------------

    def route(self, k: int) -> None:
        """Give C chunk ``k``'s route, if its first replica allows (``native_route``)."""
        if self._closed:
            return
        ix = self.index
        route = self.peers.native_route(ix.chunk_digest(k), ix.chunk_len[k])
        if route is None:
            return
        rec, rslot, vqp = route
        peer = self.table.tell(rec, vqp)
        if peer is not None:
            self.c.route(k, peer, rslot * rec.slot_size)

    def tick(self) -> None:
        """What C's READs came back with, fed to Python's bookkeeping; the peers' UP
        paths told again (a path gone DOWN is no longer posted on), and the wait bound
        set from the hedger's thresholds."""
        if self._closed:            # (the run task may wake while aclose waits)
            return
        now = time.monotonic()
        hedger, numbered = self.peers.hedger, self.table.numbered()
        for peer, _path, qpn, ok, nbytes, failed, late in self.c.tallies():
            if peer not in numbered:
                continue
            rec, vqp = numbered[peer]
            if ok:
                vqp.native_done(qpn)
                self.peers.landed_native(rec.node, nbytes, reads=ok)
            if late:
                hedger.overran(rec.node, now)
            if failed or late:
                log.debug("native fetch from %s: %d failed, %d late", rec.node, failed, late)
        # each READ's own time (C keeps the first PW_SAMPLES a tick): the thresholds are
        # the tail of READ times, which a tick's mean would hide
        for peer, _path, length, took_ns in self.c.samples():
            if peer in numbered:
                hedger.done(numbered[peer][0].node, length, took_ns / 1e9)
        for rec, vqp in numbered.values():
            self.table.tell(rec, vqp)
        if self.peers.hedge is not None and numbered:
            part = 4096 << 2 * 3      # the hedger's ≤256 KiB class: a small file's READ
            self._wait_ns = int(max(self.peers.hedger.threshold(rec.node, part)
                                    for rec, _ in numbered.values()) * 1e9)

    async def run(self) -> None:
        """``tick`` every LIB_TICK until cancelled."""
        while True:
            await trio.sleep(LIB_TICK)
            self.tick()

    async def aclose(self, timeout_ms: int = 2000) -> None:
        """No more reads: wait for the READs out (a worker thread) and release the soft
        engines, so the endpoint can close them."""
        if self._closed:
            return
        self._closed = True
        left = await trio.to_thread.run_sync(self.c.stop, timeout_ms)
        if left:
            log.warning("library native fetch: %d READs still out at close", left)
