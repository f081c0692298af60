"""⑤ The native chunk fetch: a chunk READ from a replica's arena that C posts, verifies
and answers (native/fuse_fetch.h), for a mount on the native FUSE engine.

    TierChain.start(k) / chunk(k)         a chunk to load from the cluster
      NativeFetch.start(k, key)           its first replica has a slot hint (a chunk READ
                                          from it before verified there), a connected vQP
                                          with an UP path on the soft provider, a landing
                                          slot is free?  else False: today's path
        engine.fetch_post(...)            one RDMA READ into the landing slot, in C
      READs of k meanwhile                parked in C, answered there once it lands
      FETCHED event (session queue)       fetched(): verified → the landing slot kept as
                                          the memory tier's buffer (MemoryCache.put adopts
                                          the engine's entry); else the slot back, a stale
                                          hint dropped, and the chunk's READs (queued for
                                          Python by C) take today's path

      after each chunk posted             Routes.ahead: the ROUTE_AHEAD chunks after k, each
                                          its first replica's peer and slot (fetch_route),
                                          the peers' UP paths (fetch_peer) and landing slots
                                          for C to use (fetch_slot, ``Routes.feed``)
    a sequential reader's window reaches  C starts a routed chunk itself (fuse_fetch.h
      a chunk (C request thread)             fetch_start), no hint to Python; its FETCHED
                                             names slot, peer and path: ``_fetched_own``
                                             adopts it as ``fetched`` a record; past its
                                             peer's hedging limit C reports it LATE once:
                                             ``_late_own`` makes it a record and hedges it

    NativeSession, a chunk READ missed    a sequential READ whose chunks are neither held
      TierChain.hand_chunks(ks, read)        nor in flight (a pass's first, a hint that
        NativeFetch.start, read_or_park      came late): each started here, the READ
                                             parked in C on them (``Reader.hand_off``); on a
                                             fault it comes back, and Python's path takes it

    NativeSession, a small file's READ    the READ a small file's extent alone would
      TierChain.start_extent(k, ext, read)   answer, or one block (a random READ), its
      NativeFetch.start_extent / _block      chunk's slot known (``Reader.hand_off``): as a
        engine.fetch_post_extent / _block    chunk, into a staging slot, with the READ
                                             handed to C (parked there); an extent's chunk
                                             is then routed (``Routes.route``);
      FETCHED event                          C copies the verified extent into a buffer of
                                             its own, puts it, answers the READ; fetched()
                                             takes the buffer (``fetch_landed``) into the
                                             memory tier (adopted). On a fault the READ comes
                                             back after the event, and Python's path takes
                                             it (the part is not handed to C again for
                                             FAILED_FOR s)
    a small file's READ misses in a routed   C starts its extent itself (fuse_fetch.h
      chunk (C request thread)               fetch_start_part) into one of the staging slots
                                             it holds for good (``Routes.feed``), no READ to
                                             Python; its FETCHED names the file, the peer and
                                             the path: ``_fetched_own`` adopts it; LATE as a
                                             chunk's (``_late_own``: a hedge of the extent)

Python decides every load (placement, hints, path state, the prefetch budget); C never
picks a peer, and on any fault it steps aside: a WC error, a short READ, a digest
mismatch (the replica reused the slot: the hint was stale) is a FETCHED event with a
status, and Python's path (vQP failover, hedging, the bucket READ, the owner's ``load``,
the source) does the rest.

Hedging (with ``cluster.hedge``, :mod:`.hedge`): each fetch has the hedger's threshold
for its peer and size as a deadline, and one task (``run``) sleeps until the earliest.
A fetch past it is noted against its peer (tried last once suspected) and, within the
byte budget, READ again through ``read_chunk`` from another replica; when that lands,
the READs parked in C on the chunk are answered from the tier (``fetch_unpark``) and the
C READ, whenever it completes, finds the chunk there (FETCH_EXISTS). Without it, a
SIGSTOPped replica held READs parked in C for the vQP's peer timeout
(tests/cluster/test_cluster_tail.py). While a fetch from a node is past its deadline, no
new one goes to that node through C (``read_chunk`` takes those, hedging each): with many
in flight, a stopped replica would otherwise catch more fetches than the hedge budget
covers.

Why C posts, verifies and answers at all: the Python around each chunk READ from a peer
(single-flight, the vQP dispatch, the CQ consumer, xxh3, the answers to READs waiting for
it) and around each small file (the READ's task, a copy out of the staging slot, the
reply) was most of the trio thread's time. Why C also *starts* routed chunks and small
files' extents: handing each one to C from Python (the hint's wake-up, route, target,
post, deadline) was then about half of what remained. The measurements behind both:
docs/design.md, "The native chunk fetch".
"""
from __future__ import annotations

import errno
import heapq
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from rdma.enums import ibv_wc_status

from .fetch import NATIVE_READS, Peers
from .hedge import size_class
from .landing import Slot

if TYPE_CHECKING:
    from rdma.vrdma import VQP

    from ..cache.memory import MemoryCache
    from ..cache.tiers import TierChain
    from ..manifest.index import ManifestIndex
    from ..manifest.model import Extent

log = logging.getLogger(__name__)

#: seconds a chunk or a small file's extent whose native fetch failed is not handed to C
#: with a READ again (the READ comes back to Python after the failure: it takes Python's
#: path)
FAILED_FOR = 1.0

#: chunks after one Python started whose routes it gives C (``Routes.ahead``): the next
#: hint for that stream comes this many chunks later
ROUTE_AHEAD = 8

#: landing slots C holds for the chunks it starts (``Routes.feed``)
C_SLOTS = 16

#: staging slots C holds for good for the small files' extents it starts (``Routes.feed``;
#: each of ReadPolicy.small_file_limit bytes): twice the readers of the ImageNet-like case
C_STAGING = 16

try:
    # FETCHED statuses (native/fuse_fetch.h); the C extension has no stubs
    from ..fuse import _engine as _fe  # type: ignore[attr-defined]
except ImportError:                        # a checkout whose native code was not built
    _fe = None


def soft_capi() -> Any:
    """The soft engine's C API capsule, or None when the soft provider is not built."""
    try:
        from rdma import _soft_engine
    except ImportError:
        return None
    return getattr(_soft_engine, "_C_API", None)


@dataclass(slots=True)
class _Fetch:
    """One chunk (or small file's extent) C is READing: where it lands, from which
    incarnation of which node (for its hint), and the Event of whoever waits for it."""

    k: int
    key: bytes                              # what the memory tier keeps it under
    slot: Slot | None                       # a landing slot; an extent's: a staging slot
                                            # (None: C's own, an extent C started)
    length: int
    node: str
    started: float
    t0: float                               # when it was posted (time.monotonic)
    cookie: int
    vqp: VQP
    qpn: int                                # the path it was posted on
    chunk_key: bytes                        # its chunk's digest (the slot hint's key)
    offset: int = 0                         # a part's offset in its chunk
    extent: bool = False                    # a part (an extent, a block), not a chunk
    want: bytes = b""                       # a part's digest (an extent's is its key)
    event: trio.Event | None = None
    delivered: bool = False                 # a hedge put its bytes: nobody waits for it
    landed: bool = False                    # C's READ landed verified (before any hedge)
    hedged: bool = False
    late: bool = False                      # past its hedging deadline, not back yet


class NativeFetch:
    """The native engine's chunk fetch for one mount.

    Contract: a chunk is in :attr:`inflight` from a successful :meth:`start` until its
    FETCHED event reaches :meth:`fetched`; while it is, nobody else loads it (TierChain
    asks first) and :meth:`wait` returns when it is over, landed or not (then look in the
    memory tier, and load it as usual if it is not there). A landing slot is reused only
    after its READ completed.

    Attributes:
        engine: the FUSE engine (``kspeedfs.fuse._engine.Engine``).
        inflight: key → the fetch of that chunk.

    Its counters are the engine's (``fetch_*`` in ``Engine.counters()``, the stats xattr);
    its hedges count in the hedger's.
    """

    def __init__(self, engine: Any, peers: Peers, tiers: TierChain, memory: MemoryCache,
                 index: ManifestIndex, small_file_limit: int = 0) -> None:
        """``small_file_limit``: ReadPolicy.small_file_limit, the largest small file read
        alone (0: none), the size of the staging slots C holds for those it starts."""
        capi = soft_capi()
        if capi is None:
            raise RuntimeError("the soft engine's C API is not built")
        engine.fetch_enable(capi)
        self.engine = engine
        self.peers = peers
        self.tiers = tiers
        self.memory = memory
        self.index = index
        self.inflight: dict[bytes, _Fetch] = {}
        self._by_cookie: dict[int, _Fetch] = {}
        self._cookies = 0
        self._handles: dict[int, int] = {}     # id(soft engine) → fetch_engine handle
        self._closed = False
        self._deadlines: list[tuple[float, int]] = []    # (deadline, cookie): hedging
        self._wake = trio.Event()
        self._late: Counter[str] = Counter()   # node → its fetches past their deadline
        self._failed: dict[bytes, float] = {}  # extent → when its fetch last failed
        self.routes = Routes(engine, peers, memory, index, self._handle, self._late,
                             small_file_limit)
        self._nursery: trio.Nursery | None = None

    def start(self, k: int, key: bytes) -> bool:
        """Post chunk ``k`` (digest ``key``) to C if its first replica allows (module
        docstring); False: load it the usual way."""
        return self._start(k, key, key, self.index.chunk_len[k], 0, None)

    def start_extent(self, k: int, ext: Extent, read: tuple[Any, ...] | None = None) -> bool:
        """Post small file ``ext.entry``'s one extent (in chunk ``k``) to C, as ``start``
        a chunk: READ into a staging slot, verified and copied into a buffer of its own,
        which the memory tier keeps under ``ext.digest``; with ``read`` (fd, unique,
        offset, size, random, since: a READ of the file taken from the engine's queue), C
        answers that READ too once it lands, or queues it again. False: the usual way
        (and ``read`` stays the caller's), also for an extent whose fetch failed in the
        last FAILED_FOR seconds (its READ comes back after that event)."""
        return self._start(k, ext.digest, self.index.chunk_digest(k), ext.length,
                           ext.chunk_offset, ext.entry, read)

    def start_block(self, k: int, b: int, key: bytes, entry: int, read: tuple[Any, ...]) -> bool:
        """Post block ``b`` of chunk ``k`` (tier key ``key``) to C with ``read``, a random
        READ of ``entry`` inside it, as ``start_extent`` an extent (verified against the
        block's xxh3-64)."""
        ix = self.index
        return self._start(k, key, ix.chunk_digest(k), ix.block_len(k, b), b * ix.block_size,
                           entry, read, b, ix.block_digest(k, b))

    def _start(self, k: int, key: bytes, chunk_key: bytes, length: int, offset: int,
               entry: int | None, read: tuple[Any, ...] | None = None, block: int | None = None,
               want: bytes = b"") -> bool:
        if self._closed or key in self.inflight:
            return False
        if read is not None and self.failed_lately(key):
            return False            # its READ came back after a failure: Python's path
        if length > self.memory.transient_capacity:
            return False        # MemoryCache.put would not keep it: C must not serve it
        route = self.peers.native_route(chunk_key, self.index.chunk_len[k])
        if route is None:
            return False
        rec, rslot, vqp = route
        if len(self.inflight) >= NATIVE_READS or self._late[rec.node]:
            return False        # (a node with a READ overdue: read_chunk, which hedges each)
        slot = self.peers.landing.take() if entry is None else self.peers.staging_nowait()
        target = None if slot is None else vqp.native_target(
            slot[0], slot[1], "arena", rslot * rec.slot_size + offset, length)
        if target is None:
            if slot is not None:
                self._give(slot, entry is not None)
            return False
        try:
            handle = self._handle(target.engine)
            self._cookies += 1
            if entry is None:
                self.engine.fetch_post(handle, target.qpn, k, self._cookies, target.laddr,
                                       target.lkey, target.raddr, target.rkey, length)
            elif block is None:
                self.engine.fetch_post_extent(handle, target.qpn, entry, self._cookies,
                                              target.laddr, target.lkey, target.raddr,
                                              target.rkey, read)
            else:
                self.engine.fetch_post_block(handle, target.qpn, entry, k, block, want,
                                             self._cookies, target.laddr, target.lkey,
                                             target.raddr, target.rkey, read)
        except OSError as e:
            self._give(slot, entry is not None)
            if e.errno == errno.EALREADY and entry is None:
                return True         # C started it (a route): its READs park there
            log.debug("native fetch of chunk %d not posted: %s", k, e)
            return False
        now = time.monotonic()
        f = _Fetch(k, key, slot, length, rec.node, rec.started, now, self._cookies, vqp,
                   target.qpn, chunk_key, offset, entry is not None, want or key)
        self.inflight[key] = self._by_cookie[self._cookies] = f
        if self.peers.hedge is not None:         # (deadlines in trio's clock, not monotonic)
            limit = trio.current_time() + self.peers.hedger.threshold(rec.node, length)
            if not self._deadlines or limit < self._deadlines[0][0]:
                self._wake.set()
            heapq.heappush(self._deadlines, (limit, self._cookies))
        if entry is None:
            self.routes.ahead(k)
        elif block is None:
            self.routes.route(k, route)     # C starts the other files of k itself
        return True

    def _handle(self, raw: Any) -> int:
        """The fetch engine handle of soft engine ``raw`` (a fetch CQ there, once)."""
        handle = self._handles.get(id(raw))
        if handle is None:
            handle = self._handles[id(raw)] = self.engine.fetch_engine(raw)
        return handle

    # -- the chunks C starts itself (their routes: ``Routes``) --------------------------

    def _own(self, cookie: int, k: int, slot: int, peer: int, path: int, since: float,
             back: bool = False) -> tuple[_Fetch, Any] | None:
        """A record of the C-started fetch ``cookie`` of chunk ``k``, from its event: a
        chunk's lands in C's landing slot ``slot`` (``back``: C gave it back), a part's
        (``cookie & FETCH_PART``) is file ``slot``'s extent in a staging slot of C's; READ
        from peer number ``peer``'s ``path``-th path since ``since``. With the peer's
        record; None for a slot or peer not known."""
        part = cookie & _fe.FETCH_PART
        at = None if part else self.routes.slot(slot, back=back)
        origin = self.routes.origin(peer, path)
        if origin is None or (at is None and not part):
            return None
        rec, vqp, qpn = origin
        key = self.index.chunk_digest(k)
        if part:
            (ext,) = self.index.file_extents(slot)    # (C's own index said it is one)
            f = _Fetch(k, ext.digest, None, ext.length, rec.node, rec.started, since, cookie,
                       vqp, qpn, key, ext.chunk_offset, True, ext.digest)
        else:
            f = _Fetch(k, key, at, self.index.chunk_len[k], rec.node, rec.started, since,
                       cookie, vqp, qpn, key)
        return f, rec

    def _late_own(self, cookie: int, k: int, slot: int, peer: int, path: int,
                  since: float) -> None:
        """A C-started fetch passed its peer's hedging limit: a record for it, then as
        ``run`` does for its own (the peer's other chunks go to ``read_chunk`` meanwhile:
        its entry in C is off until none of its READs is overdue)."""
        own = None if cookie in self._by_cookie else self._own(cookie, k, slot, peer, path,
                                                                since)
        if own is None or own[0].key in self.inflight:
            return
        f, rec = own
        self.inflight[f.key] = self._by_cookie[cookie] = f
        self._overdue(f)
        self.routes.tell(rec, f.vqp)                # off in C while it is late

    def _overdue(self, f: _Fetch) -> None:
        """``f`` passed its hedging deadline (once): noted against its peer, and READ from
        another replica within the hedge budget."""
        f.late = True
        self._late[f.node] += 1
        self.peers.hedger.overran(f.node, time.monotonic())
        if self._nursery is not None and self.peers.hedger.may_hedge(f.length):
            f.hedged = True
            self.peers.hedger.hedged(f.node)
            self._nursery.start_soon(self._hedge, f)

    def _fetched_own(self, cookie: int, k: int, status: int, slot: int, peer: int,
                     path: int, since: float) -> None:
        """The FETCHED of a C-started fetch nobody made a record of (it was not late):
        as ``fetched`` handles a record, from the event's own fields."""
        own = self._own(cookie, k, slot, peer, path, since, back=True)
        if own is None:
            return
        f, rec = own
        self._end(f, status)
        if status not in (_fe.FETCH_OK, _fe.FETCH_EXISTS, _fe.FETCH_MISMATCH):
            self.routes.tell(rec, f.vqp)            # a path that failed is not told again
        self.routes.feed()

    async def run(self, nursery: trio.Nursery) -> None:
        """Hedge fetches past their deadline (module docstring), until cancelled; the
        hedges run in ``nursery`` (so do those of C-started fetches C reports late)."""
        self._nursery = nursery
        while True:
            # Fetches back in time leave their deadline in the heap: drop them from its
            # head first, or this task woke once per fetch for nothing (the steady
            # 4-reader peer loop: ~150 wake-ups a second, one trio timeout each).
            while self._deadlines and self._deadlines[0][1] not in self._by_cookie:
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
                f = self._by_cookie.get(cookie)
                if f is None:
                    continue                        # landed (or failed) in time
                self._overdue(f)                    # (one deadline per fetch)
                self.routes.retell(f.node, f.started)   # its node off in C while late

    async def _hedge(self, f: _Fetch) -> None:
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

    def failed_lately(self, key: bytes) -> bool:
        """Whether the native fetch of ``key`` (a chunk, an extent) failed in the last
        FAILED_FOR seconds: a READ of it is not handed to C again meanwhile."""
        return time.monotonic() - self._failed.get(key, -FAILED_FOR) < FAILED_FOR

    def read_or_park(self, entry: int, read: tuple[Any, ...]) -> bool:
        """``read`` (a queued READ of ``entry``: fd, unique, offset, size, random, since)
        answered from the tier or parked in C on its chunks in flight here; False: it
        stays the caller's."""
        return not self._closed and self.engine.read_or_park(entry, read)

    async def wait(self, key: bytes) -> None:
        """Until the fetch of ``key`` is over (at once if there is none, or a hedge has
        put its bytes: the memory tier may have evicted them again since, and waiting
        for the late READ itself cost a reader up to the peer timeout)."""
        f = self.inflight.get(key)
        if f is None or f.delivered:
            return
        if f.event is None:
            f.event = trio.Event()
        await f.event.wait()

    def fetched(self, cookie: int, k: int, status: int, slot: int = 0, peer: int = -1,
                path: int = 0, since: float = 0.0) -> None:
        """A FETCHED event from the engine's queue (``status``: fuse_fetch.h; ``k``, the
        chunk, is the record's too: FE_NO_CHUNK for an extent). A C-started fetch's
        (``cookie & FETCH_OWN``) also names its landing slot, peer, path and start, and
        may be FETCH_LATE (it goes on)."""
        if cookie & _fe.FETCH_OWN:
            if status == _fe.FETCH_LATE:
                self._late_own(cookie, k, slot, peer, path, since)
                return
            if cookie not in self._by_cookie:
                self._fetched_own(cookie, k, status, slot, peer, path, since)
                return
            if not cookie & _fe.FETCH_PART:
                self.routes.slot(slot, back=True)  # a late one: its record has the slot
        f = self._by_cookie.pop(cookie, None)
        if f is None:
            return
        del self.inflight[f.key]
        if f.late:
            self._late[f.node] -= 1
        self._end(f, status)
        if cookie & _fe.FETCH_OWN:
            self.routes.feed()

    def _end(self, f: _Fetch, status: int) -> None:
        """``f`` is back with ``status``: its bytes into the memory tier, or its slot back
        and the fault noted; whoever waits for it woken."""
        cookie = f.cookie
        if status in (_fe.FETCH_OK, _fe.FETCH_MISMATCH, _fe.FETCH_EXISTS):
            f.vqp.native_done(f.qpn)                # the READ came back: its path lives
        block = self.engine.fetch_landed(cookie) if f.extent and status == _fe.FETCH_OK \
            else None
        if block is not None or (status == _fe.FETCH_OK and not f.extent):
            f.landed = True
            if f.extent:                   # C's buffer, in the tier already: adopted
                assert block is not None
                data = memoryview(block)
                self._give(f.slot, True)
            else:
                assert f.slot is not None
                data = self.peers.landing.keep(f.slot, f.length)
            self.peers.landed_native(f.node, f.length)
            if self.peers.hedge is not None:
                took = time.monotonic() - f.t0
                self.peers.hedger.done(f.node, f.length, took, sample=not f.hedged)
            self.tiers.arrived(f.k, f.key, data, "peer", whole=not f.extent)
        else:
            if status != _fe.FETCH_STOPPED:        # else a NIC may yet write the slot
                self._give(f.slot, f.extent)
            if status != _fe.FETCH_EXISTS:
                if len(self._failed) >= NATIVE_READS * 8:
                    self._failed.clear()
                self._failed[f.key] = time.monotonic()   # its READ takes Python's path
            if status == _fe.FETCH_MISMATCH:
                self.peers.stale_hint(f.node, f.started, f.chunk_key)
            elif status != _fe.FETCH_EXISTS:
                # a flush is its path's reset, which the vQP logs once: not a line per
                # READ that was on it (up to 16 at once, at every path DOWN)
                log.log(logging.DEBUG if status == ibv_wc_status.IBV_WC_WR_FLUSH_ERR
                        else logging.INFO, "native fetch of chunk %d%s from %s: status %d; "
                        "the usual path takes it", f.k, " (an extent)" if f.extent else "",
                        f.node, status)
        if f.event is not None:
            f.event.set()

    def _give(self, slot: Slot | None, staging: bool) -> None:
        """A slot whose READ is over back to its pool (None: C's staging slot, C's)."""
        if slot is None:
            return
        if staging:
            self.peers.give_staging(slot)
        else:
            self.peers.landing.give(slot)

    async def aclose(self, timeout_ms: int = 2000) -> None:
        """No more fetches: wait for the READs out (up to ``timeout_ms``, in a worker
        thread) and release the soft engines, so the cluster's endpoint can close them."""
        if self._closed:
            return
        self._closed = self.routes.closed = True
        left = await trio.to_thread.run_sync(self.engine.fetch_stop, timeout_ms)
        if left:
            log.warning("native fetch: %d READs still out at close; their landing slots "
                        "are not reused", left)



class Routes:
    """What C may start by itself (fuse_fetch.h ``fetch_start``, ``fetch_start_part``):
    the routes of chunks, the peers they name, the landing slots and the staging slots C
    holds, all told to the engine; and the way back from a C-started fetch's FETCHED (its
    slot, peer and path numbers) to the slot, the node and the QP.

    Contract: every route and peer told comes from ``Peers.native_route`` and the vQP's
    UP paths now (Python decides; C never picks a peer); a peer with a READ overdue
    (``late``) or no UP path is told off; a landing slot is C's from ``feed`` until
    ``slot(id, back=True)``; the staging slots (with ``small_file_limit``) are C's for
    good, from one vMR of their own. Not thread-safe: the trio thread's.
    """

    def __init__(self, engine: Any, peers: Peers, memory: MemoryCache,
                 index: ManifestIndex, handle: Callable[[Any], int],
                 late: Counter[str], small_file_limit: int = 0) -> None:
        self.engine = engine
        self.peers = peers
        self.memory = memory
        self.index = index
        self.closed = False
        self._handle = handle                  # soft engine → fetch engine handle
        self._late = late                      # node → its fetches past their deadline
        self._ids: dict[tuple[str, float], int] = {}        # (node, started) → peer number
        self._of: dict[int, tuple[Any, VQP]] = {}           # number → (NodeRecord, vQP)
        self._told: dict[int, tuple[Any, ...]] = {}         # number → ((paths), limit)
        self._slots: dict[int, Slot] = {}                   # C's landing slots by id
        self._slot_ids = itertools.count()
        # the local NICs, in a slot's lkey order: the endpoint's, fixed from the start (a
        # staging slot is C's for good, with an lkey on each)
        self._nics: list[str] = list(peers.ep.nics)[:_fe.FETCH_NICS]
        self._part_size = small_file_limit
        self._staging: Any = None              # the vMR of C's staging slots, once given

    def ahead(self, k: int) -> None:
        """Give C the routes of the ``ROUTE_AHEAD`` chunks after ``k`` (their first
        replica's peer and slot, as ``NativeFetch.start`` would READ them): a sequential
        reader's prefetch window then starts each there as it enters (fuse_read.c
        ``do_read``, no hint), and only the chunk after them comes back to Python. A
        route is only a hint: a chunk that moved fails its digest, C drops the route,
        Python's path takes it."""
        ix = self.index
        told: dict[tuple[str, float], int | None] = {}     # each peer told once a call
        for j in range(k + 1, min(k + 1 + ROUTE_AHEAD, ix.chunks)):
            length = ix.chunk_len[j]
            key = ix.chunk_digest(j)
            if length > self.memory.transient_capacity or key in self.memory:
                continue
            route = self.peers.native_route(key, length)
            if route is None:
                continue
            rec = route[0]
            ident = (rec.node, rec.started)
            if ident not in told:
                told[ident] = self.tell(rec, route[2])
            peer = told[ident]
            if peer is not None:
                self.engine.fetch_route(j, peer, route[1] * rec.slot_size)
        self.feed()

    def route(self, k: int, route: tuple[Any, int, VQP]) -> None:
        """Give C chunk ``k``'s route (``Peers.native_route``'s record, slot, vQP): a small
        file's READ that misses in it then starts its extent in C (fuse_read.c
        ``start_small``), and a sequential reader's window the chunk."""
        rec, rslot, vqp = route
        peer = self.tell(rec, vqp, parts=True)
        if peer is not None:
            self.engine.fetch_route(k, peer, rslot * rec.slot_size)
        self.feed()

    def tell(self, rec: Any, vqp: VQP, parts: bool = False) -> int | None:
        """``rec``'s number in C's peer table, its UP paths told again when they (or its
        hedging limits) changed; None when it has none, or a READ of it is overdue
        (``read_chunk`` takes its chunks then, hedging each). ``parts``: its limits for
        small files' extents too (``route``), else those told last: computing them on
        every call doubled this method's cost (cProfile of the steady sequential loop,
        where no extent is read and ``ahead`` tells its peers for each chunk Python
        starts: 201 against 99 µs a call, ~6 % of the trio thread)."""
        ident = (rec.node, rec.started)
        idx = self._ids.get(ident)
        if idx is None:
            if len(self._ids) >= _fe.FETCH_PEERS:     # (incarnations come and go)
                # numbered anew; a C-started fetch still out is then counted against the
                # new holder of its number (its bytes and slot are handled all the same)
                self.engine.fetch_unroute()
                self._ids.clear()
                self._told.clear()
            idx = self._ids[ident] = len(self._ids)
        self._of[idx] = (rec, vqp)
        paths = []
        if not self._late[rec.node]:
            for raw, qpn, nic, raddr, rkey in vqp.native_paths("arena")[:2]:
                if nic not in self._nics:       # (past FETCH_NICS: no lkey for it)
                    continue
                paths.append((self._handle(raw), qpn, raddr, rkey, self._nics.index(nic)))
        limit, limits = 0, self._told.get(idx, ((), 0, ()))[2]
        if paths and self.peers.hedge is not None:
            threshold = self.peers.hedger.threshold
            limit = int(threshold(rec.node, self.peers.slot_size) * 1e9)
            if parts and self._part_size:   # (4 KiB << 2c: the largest READ of class c)
                limits = tuple(int(threshold(rec.node, 4096 << 2 * c) * 1e9)
                               for c in range(size_class(self._part_size) + 1))
        told = (tuple(paths), limit, limits)
        if self._told.get(idx) != told:
            self.engine.fetch_peer(idx, paths, limit, limits)
            self._told[idx] = told
        return idx if paths else None

    def retell(self, node: str, started: float) -> None:
        """Tell C again what it knows of incarnation ``started`` of ``node``, if anything:
        with a READ of it overdue, that is no path, so C starts nothing more on it."""
        idx = self._ids.get((node, started))
        if idx is not None and idx in self._of:
            self.tell(*self._of[idx])

    def feed(self) -> None:
        """Keep ``C_SLOTS`` landing slots with C (each with its lkey on every local NIC),
        while the landing pool keeps as many for Python's own fetches (a small memory
        tier's pool ran dry otherwise, and its READs went to Python); and, once, C's
        staging slots."""
        if self._staging is None and self._part_size and not self.closed:
            self._stage()
        landing = self.peers.landing
        while len(self._slots) < C_SLOTS and not self.closed and landing.spare > C_SLOTS:
            slot = landing.take()
            if slot is None:
                return
            vmr, at = slot
            keys = [vmr.on(nic, at) for nic in self._nics]
            sid = next(self._slot_ids)
            if not self.engine.fetch_slot(sid, keys[0][0], [lkey for _, lkey in keys]):
                landing.give(slot)
                return
            self._slots[sid] = slot

    def _stage(self) -> None:
        """C_STAGING staging slots of ``small_file_limit`` bytes (pages), C's for good."""
        size = -(-self._part_size // 4096) * 4096
        vmr = self._staging = self.peers.ep.alloc(C_STAGING * size, name="c-staging")
        for i in range(C_STAGING):
            keys = [vmr.on(nic, i * size) for nic in self._nics]
            if not self.engine.fetch_staging(keys[0][0], self._part_size,
                                             [lkey for _, lkey in keys]):
                return

    def slot(self, sid: int, back: bool = False) -> Slot | None:
        """C's landing slot ``sid`` (``back``: C has given it back), or None."""
        return self._slots.pop(sid, None) if back else self._slots.get(sid)

    def origin(self, peer: int, path: int) -> tuple[Any, VQP, int] | None:
        """Peer number ``peer``'s record and vQP, and the QP of its ``path``-th path as
        last told; None for a number never told."""
        if peer not in self._of:
            return None
        rec, vqp = self._of[peer]
        paths = self._told.get(peer, ((), 0, ()))[0]
        return rec, vqp, paths[path][1] if 0 <= path < len(paths) else 0
