"""⑤ The native fetch's FETCHED events (:mod:`.native_fetch`): how a fetch C had out ends.

    FetchedEvents.fetched(cookie, k, status, ...)   one event from the engine's queue:
      a record's (Python posted it, or C's start was late)   → ``end``
      a C-started fetch's, not recorded (it was not late)    → a record from the event's
                                                               fields (``_own``), ``end``
      FETCH_LATE of a C-started fetch                        → a record, overdue
                                                               (LateFetches: hedged)
      FETCH_TALLY: the parts (extents, blocks) C started and → ``tally``: a kept one's
      ended without a FETCHED of their own, kept or not        buffer adopted into the
                                                               memory tier; each counted,
                                                               the hedger's sample
    end(f, status)   verified → the landing slot (or C's extent buffer) into the memory
                     tier (MemoryCache.put adopts the engine's entry), counted, the
                     hedger's sample; else the slot back, the key failed lately, a stale
                     hint dropped; whoever waits woken
    keep             whether C keeps the extents it starts: while the memory tier's
                     resident part has room (``fetch_keep``)

A C-started fetch is unknown to Python until its event, which names its slot, peer and
path by number (``Routes.slot``, ``Routes.origin``): its record is made from those. A
part C started and verified comes in a tally instead, unless it was LATE (Python holds
its record) or the tally was full: one event per 64 parts (or 5 ms), not one each
(docs/design.md, "Kept extents told in batches").
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from rdma.enums import ibv_wc_status

from ...manifest.model import block_key
from .inflight import Fetch, InFlight, fe, give_slot

if TYPE_CHECKING:
    from ...cache.tiers import TierChain
    from ...manifest.index import ManifestIndex
    from ..fetch import Peers
    from .late import LateFetches
    from .routes import Routes

log = logging.getLogger(__name__)


class FetchedEvents:
    """What each FETCHED event does, for one mount's native fetch.

    Contract: a record's event takes it out of ``inflight`` and ends it (``end``): its
    bytes reach the memory tier (``tiers.arrived``) only verified, its slot goes back
    to its pool unless a NIC may still write it (FETCH_STOPPED), and its waiters are
    woken either way; a C-started fetch's slot goes back to ``routes`` and C is fed
    another. Events of unknown slots or peers are dropped. C keeps the small files'
    extents it starts exactly while the memory tier's resident part has room (checked
    at every put here and every tally); a tally's parts count and sample as their
    FETCHEDs would have, and a kept one's buffer (in C's tier with no owner) goes into
    the memory tier once, known peer or not: it is verified. Trio thread only.
    """

    def __init__(self, engine: Any, peers: Peers, tiers: TierChain, index: ManifestIndex,
                 inflight: InFlight, routes: Routes, late: LateFetches) -> None:
        self.engine, self.peers, self.tiers, self.index = engine, peers, tiers, index
        self.inflight, self.routes, self.late = inflight, routes, late
        self.kept = True                    # as C starts: fetch_keep(True)

    def fetched(self, cookie: int, k: int, status: int, slot: int = 0, peer: int = -1,
                path: int = 0, since: float = 0.0) -> None:
        """A FETCHED event from the engine's queue (``status``: fuse_fetch.h; ``k``, the
        chunk, is the record's too: FE_NO_CHUNK for an extent). A C-started fetch's
        (``cookie & FETCH_OWN``) also names its landing slot, peer, path and start, and
        may be FETCH_LATE (it goes on); a FETCH_TALLY names no fetch (``tally``)."""
        if status == fe.FETCH_TALLY:
            self.tally()
            return
        if cookie & fe.FETCH_OWN:
            if status == fe.FETCH_LATE:
                self._late_own(cookie, k, slot, peer, path, since)
                return
            if cookie not in self.inflight.by_cookie:
                self._fetched_own(cookie, k, status, slot, peer, path, since)
                return
            if not cookie & fe.FETCH_PART:
                self.routes.slot(slot, back=True)  # a late one: its record has the slot
        f = self.inflight.pop(cookie)
        if f is None:
            return
        self.end(f, status)
        if cookie & fe.FETCH_OWN:
            self.routes.feed()

    def end(self, f: Fetch, status: int) -> None:
        """``f`` is back with ``status``: its bytes into the memory tier, or its slot back
        and the fault noted; whoever waits for it woken."""
        cookie = f.cookie
        if status in (fe.FETCH_OK, fe.FETCH_MISMATCH, fe.FETCH_EXISTS):
            f.vqp.native_done(f.qpn)                # the READ came back: its path lives
        block = self.engine.fetch_landed(cookie) if f.extent and status == fe.FETCH_OK \
            else None
        if block is not None or (status == fe.FETCH_OK and not f.extent):
            f.landed = True
            if f.extent:                   # C's buffer, in the tier already: adopted
                assert block is not None
                data = memoryview(block)
                give_slot(self.peers, f.slot, True)
            else:
                assert f.slot is not None
                data = self.peers.landing.keep(f.slot, f.length)
            self.peers.landed_native(f.node, f.length)
            if self.peers.hedge is not None:
                took = time.monotonic() - f.t0
                self.peers.hedger.done(f.node, f.length, took, sample=not f.hedged)
            self.tiers.arrived(f.k, f.key, data, "peer", whole=not f.extent)
            self.keep()
        else:
            if status != fe.FETCH_STOPPED:         # else a NIC may yet write the slot
                give_slot(self.peers, f.slot, f.extent)
            if status != fe.FETCH_EXISTS:
                self.inflight.failed(f.key)         # its READ takes Python's path
            if status == fe.FETCH_MISMATCH:
                self.peers.stale_hint(f.node, f.started, f.chunk_key)
            elif status != fe.FETCH_EXISTS:
                # a flush is its path's reset, which the vQP logs once: not a line per
                # READ that was on it (up to 16 at once, at every path DOWN)
                log.log(logging.DEBUG if status == ibv_wc_status.IBV_WC_WR_FLUSH_ERR
                        else logging.INFO, "native fetch of chunk %d%s from %s: status %d; "
                        "the usual path takes it", f.k, " (an extent)" if f.extent else "",
                        f.node, status)
        if f.event is not None:
            f.event.set()

    def keep(self) -> None:
        """Tell C whether to keep the extents it starts: only while the resident part
        has room for the largest (its staging slot's size; a part filled by puts of
        ~110 KB files stops short of its capacity). Past it, the transient LRU would
        evict a scanned file before an epoch came back to it, and the kernel's page
        cache serves re-reads meanwhile (docs/design.md, "Small files from peers, not
        kept")."""
        keep = self.routes.memory.resident_room >= max(1, self.routes.part_size)
        if keep != self.kept:
            self.kept = keep
            self.engine.fetch_keep(keep)

    def tally(self) -> None:
        """Take C's samples of the parts it ended in a tally: a kept one's buffer adopted
        into the memory tier first (C's tier holds it with no owner until then); then,
        per path, the parts counted as peer hits and the path seen alive once, and each
        READ's time given to the hedger as its FETCHED's would be (every READ's time:
        the thresholds stay those of every READ)."""
        memory = self.tiers.memory
        by_path: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for peer, path, length, took_ns, key, block in self.engine.fetch_tally():
            if block is not None:
                memory.put(key, memoryview(block))
            by_path.setdefault((peer, path), []).append((length, took_ns))
        for (peer, path), parts in by_path.items():
            self._tallied(peer, path, parts)
        self.keep()

    def _tallied(self, peer: int, path: int, parts: list[tuple[int, int]]) -> None:
        """``parts`` (length, READ ns) came by peer number ``peer``'s ``path``-th
        path: counted and sampled, unless that number is not known (then nothing)."""
        origin = self.routes.origin(peer, path)
        if origin is None:
            return
        rec, vqp, qpn = origin
        nbytes = sum(length for length, _ in parts)
        self.peers.landed_native(rec.node, nbytes, len(parts))
        counters = self.tiers.counters
        counters.add("peer_hits", len(parts))
        counters.add("peer_bytes", nbytes)
        if self.peers.hedge is not None:
            done = self.peers.hedger.done
            for length, took_ns in parts:
                done(rec.node, length, took_ns / 1e9)
        vqp.native_done(qpn)

    # -- the fetches C starts itself (their routes: ``Routes``) -------------------------

    def _own(self, cookie: int, k: int, slot: int, peer: int, path: int, since: float,
             back: bool = False) -> tuple[Fetch, Any] | None:
        """A record of the C-started fetch ``cookie`` of chunk ``k``, from its event: a
        chunk's lands in C's landing slot ``slot`` (``back``: C gave it back), a part's
        (``cookie & FETCH_PART``) is file ``slot``'s extent in a staging slot of C's (with
        FETCH_BLOCK: block ``slot`` of chunk ``k``, a random read's); READ
        from peer number ``peer``'s ``path``-th path since ``since``. With the peer's
        record; None for a slot or peer not known."""
        part = cookie & fe.FETCH_PART
        at = None if part else self.routes.slot(slot, back=back)
        origin = self.routes.origin(peer, path)
        if origin is None or (at is None and not part):
            return None
        rec, vqp, qpn = origin
        ix = self.index
        key = ix.chunk_digest(k)
        if part and cookie & fe.FETCH_BLOCK:          # block ``slot`` of chunk k
            f = Fetch(k, block_key(key, slot), None, ix.block_len(k, slot), rec.node,
                      rec.started, since, cookie, vqp, qpn, key, slot * ix.block_size, True,
                      ix.block_digest(k, slot))
        elif part:
            (ext,) = ix.file_extents(slot)    # (C's own index said it is one)
            f = Fetch(k, ext.digest, None, ext.length, rec.node, rec.started, since, cookie,
                      vqp, qpn, key, ext.chunk_offset, True, ext.digest)
        else:
            f = Fetch(k, key, at, ix.chunk_len[k], rec.node, rec.started, since,
                      cookie, vqp, qpn, key)
        return f, rec

    def _late_own(self, cookie: int, k: int, slot: int, peer: int, path: int,
                  since: float) -> None:
        """A C-started fetch passed its peer's hedging limit: a record for it, then as
        ``LateFetches.run`` does for Python's own (the peer's other chunks go to
        ``read_chunk`` meanwhile: its entry in C is off until none of its READs is
        overdue)."""
        own = None if cookie in self.inflight.by_cookie else self._own(cookie, k, slot, peer,
                                                                         path, since)
        if own is None or own[0].key in self.inflight.by_key:
            return
        f, rec = own
        self.inflight.add(f)
        self.late.overdue(f)
        self.routes.tell(rec, f.vqp)                # off in C while it is late

    def _fetched_own(self, cookie: int, k: int, status: int, slot: int, peer: int,
                     path: int, since: float) -> None:
        """The FETCHED of a C-started fetch nobody made a record of (it was not late):
        as ``fetched`` handles a record, from the event's own fields."""
        own = self._own(cookie, k, slot, peer, path, since, back=True)
        if own is None:
            return
        f, rec = own
        self.end(f, status)
        if status not in (fe.FETCH_OK, fe.FETCH_EXISTS, fe.FETCH_MISMATCH):
            self.routes.tell(rec, f.vqp)            # a path that failed is not told again
        self.routes.feed()
