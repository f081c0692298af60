"""⑤ The native chunk fetch: a chunk READ from a replica's arena that C posts, verifies
and answers (native/fuse_fetch.h), for a mount on the native FUSE engine.

    fetch.py            NativeFetch      the seam TierChain and the session use: posts a
                                         chunk, a small file's extent or a block to C when
                                         its first replica's slot, an UP path and a slot
                                         allow (else False: Python's path); ``wait``
    routes.py           Routes           what C may start by itself: the routes of the
                                         chunks ahead, their peers' UP paths, C's slots
    peer_table.py       PeerTable        the peers told to C by number, and their UP
                                         paths (the library's native fetch's too)
    events.py           FetchedEvents    a FETCHED (or LATE) event: the bytes into the
                                         memory tier, or the slot back and the fault noted;
                                         a TALLY: the parts C started and ended itself
    late.py             LateFetches      hedging: a fetch past its deadline READ again
                                         through ``Peers.read_chunk`` from another replica
    inflight.py         Fetch, InFlight  the records of the fetches out

Python decides every load (placement, hints, path state, the prefetch budget); C never
picks a peer, and on any fault it steps aside: a WC error, a short READ, a digest
mismatch (the replica reused the slot: the hint was stale) is a FETCHED event with a
status, and Python's path (vQP failover, hedging, the bucket READ, the owner's ``load``,
the source) does the rest. C posts, verifies and answers, and starts routed loads
itself, because the Python around each chunk READ and each small file was most of the
trio thread's time. The flows step by step: docs/design.md, "The native fetch, step by
step"; the measurements: "The native chunk fetch".
"""
from __future__ import annotations

import errno
import logging
import time
from typing import TYPE_CHECKING, Any

import trio

from ...tuning import NATIVE_READS
from ..fetch import Peers
from .events import FetchedEvents
from .inflight import Fetch, InFlight, give_slot
from .late import LateFetches
from .routes import Routes

if TYPE_CHECKING:
    from rdma.vrdma.vqp import NativeTarget

    from ...cache.memory import MemoryCache
    from ...cache.tiers import TierChain
    from ...manifest.index import ManifestIndex
    from ...manifest.model import Extent

log = logging.getLogger(__name__)


def soft_capi() -> Any:
    """The soft engine's C API capsule, or None when the soft provider is not built."""
    try:
        from rdma import _soft_engine
    except ImportError:
        return None
    return getattr(_soft_engine, "_C_API", None)


class NativeFetch:
    """The native engine's chunk fetch for one mount.

    Contract: a chunk is in :attr:`inflight` from a successful :meth:`start` until its
    FETCHED event reaches :meth:`fetched`; while it is, nobody else loads it (TierChain
    asks first) and :meth:`wait` returns when it is over, landed or not (then look in the
    memory tier, and load it as usual if it is not there). A landing slot is reused only
    after its READ completed. Trio thread only; :meth:`run` hedges (:mod:`.late`).

    Attributes:
        engine: the FUSE engine (``kspeedfs.fuse._engine.Engine``).
        inflight: key → the fetch of that chunk.
        routes: what C may start by itself (:class:`~.routes.Routes`).

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
        self.memory = memory
        self.index = index
        self._fetches = InFlight()
        self.inflight = self._fetches.by_key
        self._cookies = 0
        self._closed = False
        self.routes = Routes(engine, peers, memory, index, self._fetches.late, small_file_limit)
        self._late = LateFetches(engine, peers, tiers, memory, index, self._fetches,
                                 self.routes)
        self._events = FetchedEvents(engine, peers, tiers, index, self._fetches, self.routes,
                                     self._late)

    def start(self, k: int, key: bytes) -> bool:
        """Post chunk ``k`` (digest ``key``) to C if its first replica allows: a slot hint
        (a chunk READ from it before verified there), a connected vQP with an UP path on
        the soft provider, a free landing slot; False: load it the usual way. The chunks
        after it are routed for C to start itself (``Routes.ahead``)."""
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
        if len(self.inflight) >= NATIVE_READS or self._fetches.late[rec.node]:
            return False        # (a node with a READ overdue: read_chunk, which hedges each)
        slot = self.peers.landing.take() if entry is None else self.peers.staging_nowait()
        target = None if slot is None else vqp.native_target(
            slot[0], slot[1], "arena", rslot * rec.slot_size + offset, length)
        if target is None:
            give_slot(self.peers, slot, entry is not None)
            return False
        try:
            self._post(target, k, length, entry, block, want, read)
        except OSError as e:
            give_slot(self.peers, slot, entry is not None)
            if e.errno == errno.EALREADY and entry is None:
                return True         # C started it (a route): its READs park there
            log.debug("native fetch of chunk %d not posted: %s", k, e)
            return False
        f = Fetch(k, key, slot, length, rec.node, rec.started, time.monotonic(), self._cookies,
                  vqp, target.qpn, chunk_key, offset, entry is not None, want or key)
        self._fetches.add(f)
        self._late.deadline(f)
        if entry is None:
            self.routes.ahead(k)
        elif block is None or self.routes.starts_blocks:
            self.routes.route(k, route)     # C starts the other files (blocks) of k itself
        return True

    def _post(self, target: NativeTarget, k: int, length: int, entry: int | None,
              block: int | None, want: bytes, read: tuple[Any, ...] | None) -> None:
        """Post the READ to C under the next cookie: a chunk's (``entry`` None), an
        extent's of file ``entry``, or block ``block``'s; OSError: C refused it."""
        t = target
        handle = self.routes.table.handle(t.engine)
        self._cookies += 1
        if entry is None:
            self.engine.fetch_post(handle, t.qpn, k, self._cookies, t.laddr, t.lkey, t.raddr,
                                   t.rkey, length)
        elif block is None:
            self.engine.fetch_post_extent(handle, t.qpn, entry, self._cookies, t.laddr, t.lkey,
                                          t.raddr, t.rkey, read)
        else:
            self.engine.fetch_post_block(handle, t.qpn, entry, k, block, want, self._cookies,
                                         t.laddr, t.lkey, t.raddr, t.rkey, read)

    def fetched(self, cookie: int, k: int, status: int, slot: int = 0, peer: int = -1,
                path: int = 0, since: float = 0.0) -> None:
        """A FETCHED event from the engine's queue (``FetchedEvents.fetched``)."""
        self._events.fetched(cookie, k, status, slot, peer, path, since)

    async def run(self, nursery: trio.Nursery) -> None:
        """Hedge fetches past their deadline, until cancelled; the hedges run in
        ``nursery`` (``LateFetches.run``)."""
        await self._late.run(nursery)

    def failed_lately(self, key: bytes) -> bool:
        """Whether the native fetch of ``key`` (a chunk, an extent) failed in the last
        FAILED_FOR seconds: a READ of it is not handed to C again meanwhile."""
        return self._fetches.failed_lately(key)

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
