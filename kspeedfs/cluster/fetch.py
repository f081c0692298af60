"""⑤ Fetch a chunk from a replica's arena with one-sided vRDMA READs; next replica on failure.

    read_chunk(k):
      for node in placement.reader_order(key):     local node first, then score order
          READ its index bucket (256 B)            arena.find_in_bucket → (slot, length);
                                                   its second bucket too for the few keys
                                                   not in their first (arena.buckets_of);
                                                   skipped when a hint remembers the slot
          READ the slot                            one READ of up to slot_size bytes
          xxh3-128 == key?  → done                 the checksum (key = content digest)
          missing?          → RPC "load" to the owner (it fetches from another replica
                              or the source into its arena), then READ again
          PeerUnreachable / RpcUnavailable / HandshakeError → the next replica (and
                              skip that node for a while so later reads do not wait on it)
      → None: the caller goes to the source

Failure handling is layered: a NIC or link dying is invisible here (vRDMA re-posts the
READ on another path); a whole peer dying surfaces as ``PeerUnreachable`` after
``cluster.peer_timeout`` with all paths dead, and we move to the next replica. A node
that was unreachable is skipped for ``SKIP`` seconds, then tried again (it may be back,
or its lease has expired and placement no longer names it). A node back as a new
incarnation (restarted: its record's ``started`` changed) is tried last until its new
vQP is up, connected in the background: a node that has just started answers a connect
only as fast as its start-up lets it, and readers waited for it (docs/design.md, "A node
coming back").

A misbehaving peer is a failed replica, never an error for the reader while another copy
(or the source) exists: a listener that answers garbage, deep or oversized
JSON, or does not know the secret fails its handshake (``HandshakeError``, or
``PeerUnreachable``/``RpcUnavailable`` around it); an authenticated node whose ``info``
or RPC reply does not parse is the same; and as a last net, a ``LookupError``,
``TypeError``, ``ValueError`` or ``ArithmeticError`` while reading from one replica
(its reply or its etcd record did not hold what it should) moves to the next replica
too, logged with its traceback.

Slot hints (:mod:`.hints`): where a chunk sat in a node's arena (found by an earlier
bucket READ and verified) is remembered, so the next READ of that chunk, or of another
small file packed in it, goes straight to the slot: one round trip instead of two. A
hint can go stale (the node evicted the chunk and reused the slot); the checksum catches
that, the hint is dropped and the bucket is READ as before. Hints are keyed by the
node's incarnation, so a restarted node's arena is never addressed through old hints.

Buffers: a whole chunk lands in a slot of :class:`~.landing.Landing`, and once verified
that slot *is* the chunk the memory tier keeps (no copy; the slot is reused when the
last view of it is gone). A small file's extent (and a chunk when every landing slot
is held) lands in one of ``nbuf`` staging slots and is copied out as ``bytes``.
Cancellation: a cancelled READ keeps its buffers until its completion (vRDMA owns them
until then): without hedging ``VQP.read`` waits for it, shielded; with hedging it is
detached (the attempt returns at once, its staging and landing slots come back from the
completion, ``_Attempt.on_free``), so a reader never waits on a hung peer's READ.

Hedging (``cluster.hedge``; the rule: :mod:`.hedge`). Without it a replica that stops
answering (SIGSTOP, SIGKILL, a stall) costs every read waiting on it
``cluster.peer_timeout`` before the next replica is asked.
With it, the first replica is still READ in the reader's own task, each READ (and a
connect) with a deadline of ``Hedger.threshold`` on its wait; when one passes, the same
bytes are READ from the next replica in a task of ``nursery``, at most once per read and
within the byte budget, while the first READ goes on. The first attempt whose bytes
verify wins and cancels the other. A read that is not late costs one timer per READ
and no task: the first version ran every attempt as a task, and cost 0.81–0.91× the
reads of hedging off on this machine (+57–153 µs daemon CPU per read). Staging slots
are two counts: ``nbuf`` reads in progress (a semaphore per read_chunk; a hedge takes
none: the budget bounds it) and physical slots, registered lazily in segments of
``nbuf`` up to ``3 × nbuf``, so buffers a hung peer still holds do not block the reads
that follow. A hedge never waits for a staging slot either: with none free it adds one
(the budget bounds how many hedges run, and so how far the pool grows). Waiting, a
hedge was held by the very READs it was to overtake: the losers of a stopped peer keep
their slots until its timeout. The native fetch's hedge of a late C READ
(``read_chunk(budgeted=True)``) is a hedge too: its attempts take neither. Peers whose
READs overrun repeatedly are tried last (``Hedger.order``).
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from rdma.errors import HandshakeError, PathClosed, PeerUnreachable, RdmaError
from rdma.vrdma import VMR, VQP, Endpoint, wait_noting_overrun
from rdma.vrdma.vqp import VQPStats

from .. import checksum
from ..cache.singleflight import SingleFlight
from .arena import BUCKET_BYTES, buckets_of, find_in_bucket
from .hedge import BUCKETS_MS, Hedger, PeerLatency
from .hints import SlotHints
from .landing import Landing
from .membership import Membership, NodeRecord
from .placement import reader_order
from .rpc import RpcClient, RpcUnavailable

log = logging.getLogger(__name__)

SKIP = 2.0      # seconds an unreachable node is skipped before it is tried again
#: replica orders kept per membership (a read's rendezvous hash over every member cost
#: 1.2 µs with 3 members, 4.7 with 16, 36.7 with 128; a kept one ~0.1)
PLACED = 1 << 14
STAGING = 3      # physical staging slots at most, × nbuf (reads in progress + losers)
#: chunk READs the native fetch (native_fetch.py) has out at once, beside the ``nbuf``
#: of read_chunk: each holds a landing slot (registered only when used). With 8, shared
#: with read_chunk, the Python path took 55 % of the chunks (a prefetch window is ~20
#: chunks for 4 readers) and the trio thread's CPU per GB fell 4-23 %; with 32 of its
#: own, 92 % and 47 % (docs/design.md)
NATIVE_READS = 32

#: what makes a replica a failed one (next replica), as opposed to a bug
_FAILED = (PeerUnreachable, RpcUnavailable, PathClosed, HandshakeError)
_MISBEHAVED = (LookupError, TypeError, ValueError, ArithmeticError)


async def _take(sem: trio.Semaphore) -> None:
    """``sem.acquire()``, without its schedule point when a token is free: those two
    schedule points (staging, and reads in progress) were two of the four task steps of
    a chunk READ from a peer."""
    try:
        sem.acquire_nowait()
    except trio.WouldBlock:
        await sem.acquire()


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
    """A snapshot of one :class:`Peers`, from :meth:`Peers.statistics`.

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


class Peers:
    """Chunk reads from the cluster for one process (a mount, or a node re-replicating)."""

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
        with ``hedge``, every replica attempt (hedged reads; None: one replica at a time,
        in the caller's task; latencies are summarised either way)."""
        self.ep = endpoint
        self.membership = membership
        self.secret = secret
        self.replicas = replicas
        self.slot_size = slot_size
        self.me = me or endpoint.node          # this process, as named in RPC handshakes
        self.local_node = local_node           # the node on this host, tried first
        self._find_local = find_local
        self.rpc_timeout = rpc_timeout
        self.nursery = nursery
        self.hedge = hedge
        self.hedger = hedge if hedge is not None else Hedger()
        self.nbuf = nbuf
        self.buf: VMR = endpoint.alloc(nbuf * slot_size, name="fetch-buffers")
        self.landing = Landing(endpoint, slot_size, landing_slots + nbuf + NATIVE_READS)
        self._staging: list[tuple[VMR, int]] = [(self.buf, i * slot_size) for i in range(nbuf)]
        self._staging_segments = 1
        self._staging_free = trio.Semaphore(STAGING * nbuf)   # physical slots, made or not
        self._slot_free = trio.Semaphore(nbuf)                 # reads in progress
        self._vqps: dict[str, tuple[float, VQP]] = {}   # node → (started, vqp)
        self._connects: SingleFlight[VQP] = SingleFlight(nursery)   # keyed by node
        self._rpc: dict[str, RpcClient] = {}
        self._skip_until: dict[str, float] = {}
        self.hints = SlotHints()
        self._placed_orders: dict[bytes, list[str]] = {}         # key → reader_order
        self._placed_for: object = None                          # ... of these members
        self.counters = PeerCounters()

    # -- connections ----------------------------------------------------------------------

    def give_staging(self, staging: tuple[VMR, int]) -> None:
        """A staging slot back (``_take_staging``'s or ``staging_nowait``'s), once no
        READ writes into it."""
        self._staging.append(staging)
        self._staging_free.release()

    async def _vqp(self, rec: NodeRecord) -> VQP:
        """The vQP to this incarnation of ``rec.node``, connecting once if there is none.
        A joined connect may have been to another incarnation: then look again."""
        while not self._connected(rec):
            await self._connects.run(rec.node, self._connect, rec)
        return self._vqps[rec.node][1]

    def _connected(self, rec: NodeRecord) -> bool:
        """Whether a vQP to this incarnation of ``rec.node`` is set up (its paths may have
        died since: that is a fault, which hedging covers, not a connect)."""
        have = self._vqps.get(rec.node)
        return have is not None and have[0] == rec.started

    def _back(self, rec: NodeRecord) -> bool:
        """Whether ``rec.node`` is back as a new incarnation that has no vQP yet (the
        vQP kept is to the one before)."""
        have = self._vqps.get(rec.node)
        return have is not None and have[0] != rec.started

    def _back_last(self, recs: list[NodeRecord]) -> list[NodeRecord]:
        """``recs`` with the nodes back as a new incarnation moved last, and their
        connects started in the background (single-flight; module docstring)."""
        back = [r for r in recs if self._back(r)]
        if not back:
            return recs
        for r in back:
            if not self._connects.in_flight(r.node):
                self._connects.start(r.node, self._connect, r)
        return [r for r in recs if not self._back(r)] + back

    async def _connect(self, rec: NodeRecord) -> VQP:
        have = self._vqps.get(rec.node)
        if have is not None:                           # the node restarted: new incarnation
            await have[1].aclose()
        try:
            vqp = await self.ep.connect(rec.nics, rec.port, timeout=max(1.0, 2 * self._grace()))
        except _FAILED:
            self._skip_until[rec.node] = time.monotonic() + SKIP   # (nobody may wait on it)
            raise
        self._vqps[rec.node] = (rec.started, vqp)
        return vqp

    def _grace(self) -> float:
        return self.ep.cfg.unreachable_grace

    def rpc(self, rec: NodeRecord) -> RpcClient:
        c = self._rpc.get(rec.node)
        if c is None or c.addrs != rec.nics:
            c = self._rpc[rec.node] = RpcClient(self.secret, self.me, rec.nics, rec.rpc_port,
                                                self.rpc_timeout)
        return c

    async def aclose(self) -> None:
        for _, vqp in self._vqps.values():
            await vqp.aclose()
        for c in self._rpc.values():
            await c.aclose()

    # -- reads ----------------------------------------------------------------------------

    def order(self, key: bytes, exclude: str | None = None) -> list[NodeRecord]:
        nodes = self.membership.nodes
        names = self._placed(key)
        if self.hedge is not None:
            names = self.hedge.order(names, time.monotonic())
        return [nodes[n] for n in names if n != exclude and n in nodes]

    def local_member(self) -> str | None:
        """The member on this host: one of this endpoint's NICs is among its NICs."""
        nics = set(self.ep.nics)
        return next((r.node for r in self.membership.nodes.values() if nics & set(r.nics)),
                    None)

    def _placed(self, key: bytes) -> list[str]:
        """``reader_order`` of ``key``, kept until the membership's member list is
        replaced (any change replaces it) or ``PLACED`` orders are kept (then all go)."""
        members = self.membership.members
        if members is not self._placed_for:
            self._placed_orders.clear()
            self._placed_for = members
            if self._find_local:
                self.local_node = self.local_member()
        names = self._placed_orders.get(key)
        if names is None:
            if len(self._placed_orders) >= PLACED:
                self._placed_orders.clear()
            names = self._placed_orders[key] = reader_order(key, members, self.replicas,
                                                            self.local_node)
        return names

    async def read_chunk(self, dataset: str, version: int, chunk: int, key: bytes, length: int,
                         *, ask_owner: bool = True, exclude: str | None = None,
                         part: tuple[int, int, bytes] | None = None,
                         budgeted: bool = False) -> bytes | memoryview | None:
        """Verified bytes of the chunk from some replica, or None (go to the source).

        ``part = (offset, length, digest)`` READs only that extent (or block) of the
        chunk and verifies it against its own digest: a small file, or a random read's
        block, costs a READ of its bytes, not of the 4 MiB chunk that holds it.

        Replicas in turn, each in this task; with hedging, a READ (or connect) that
        overruns its threshold starts the next replica as a task, once per read; the
        first bytes that verify win and the other attempt is cancelled (module
        docstring).

        ``budgeted``: this read is itself a hedge, charged to the byte budget already
        (``NativeFetch``'s, of a C READ past its deadline): its attempts take no
        read-in-progress token and wait for no staging slot (module docstring)."""
        if length > self.slot_size:
            return None
        t0 = time.monotonic()
        recs = self._back_last([r for r in self.order(key, exclude)
                                if self._skip_until.get(r.node, 0.0) <= t0])
        race = _Race(recs, (dataset, version, chunk, key, length, part, ask_owner),
                     BUCKET_BYTES + (part[1] if part is not None else length), self._overran,
                     budgeted)
        failed = False
        try:
            while race.queue and race.winner is None:
                att = _Attempt(race.queue.pop(0), race)
                race.first = att
                with att.scope:
                    await self._attempt(att)
                failed |= att.failed
                hedge = race.hedge
                if race.winner is None and hedge is not None and hedge.ended is not None:
                    await hedge.ended.wait()  # this replica is done; the hedge may still win
                if hedge is not None:
                    failed |= hedge.failed
            win = race.winner
        finally:
            race.first = race.hedge = race.winner = None   # (no cycle holds the bytes)
        if win is None and race.error is not None:
            raise race.error
        if win is None:
            self.counters.misses += 1
            return None
        if win.is_hedge:
            self.hedger.hedge_won(win.rec.node)
        took = time.monotonic() - t0
        self.counters.longest_wait = max(self.counters.longest_wait, took)
        if failed:
            self.counters.longest_stall = max(self.counters.longest_stall, took)
        return win.data

    def _overran(self, att: _Attempt) -> None:
        """``att``'s READ (or connect) passed its threshold: note it against the peer and,
        once per read and within the budget, start the next replica as a hedge."""
        now = time.monotonic()
        race = att.race
        self.hedger.overran(att.rec.node, now)
        if race.hedge is not None or not race.queue or race.winner is not None \
                or not self.hedger.may_hedge(race.nbytes):
            return
        hedge = race.hedge = _Attempt(race.queue.pop(0), race, is_hedge=True)
        self.hedger.hedged(att.rec.node)
        log.debug("chunk %d of %s: READ from %s overran %.1f ms; hedging to %s",
                  race.args[2], race.args[0], att.rec.node, (now - att.read_since) * 1e3,
                  hedge.rec.node)
        self.nursery.start_soon(self._hedge, hedge)

    async def _hedge(self, att: _Attempt) -> None:
        assert att.ended is not None
        try:
            with att.scope:
                await self._attempt(att)
        finally:
            att.ended.set()

    async def _attempt(self, att: _Attempt) -> None:
        """One replica: READ, else ask its owner to load it and READ again. Sets
        ``att.data`` and makes it the race's winner (cancelling the other attempt), or
        sets ``att.failed``; an unexpected exception is the race's ``error``."""
        rec = att.rec
        dataset, version, chunk, key, length, part, ask_owner = att.race.args
        try:
            data = await self._read_from(rec, key, length, part, att)
            if data is None and ask_owner and not att.lost:
                self.counters.loads_requested += 1
                reply = await self.rpc(rec).request({"op": "load", "dataset": dataset,
                                                     "version": version, "chunk": chunk})
                if reply.get("source") != "refused":     # (it would not keep it: next)
                    data = await self._read_from(rec, key, length, part, att)
            if data is not None and not att.lost:
                att.data = data
                self.counters.hits += 1
                self.counters.bytes += len(data)
                self.counters.per_peer[rec.node] += len(data)
                att.race.won(att)
        except _FAILED as e:
            self.counters.unreachable += 1
            self._skip_until[rec.node] = time.monotonic() + SKIP
            att.failed = True
            log.warning("chunk %d of %s: replica %s unreachable (%s); trying the next",
                        chunk, dataset, rec.node, e)
        except RdmaError as e:
            att.failed = True
            log.warning("chunk %d of %s: READ from %s failed: %s", chunk, dataset, rec.node, e)
        except _MISBEHAVED as e:
            att.failed = True           # what the replica told us did not parse
            self.counters.unreachable += 1
            self._skip_until[rec.node] = time.monotonic() + SKIP
            log.warning("chunk %d of %s: replica %s misbehaved (%r); trying the next",
                        chunk, dataset, rec.node, e, exc_info=True)
        except Exception as e:
            if not att.is_hedge:
                raise                   # in the reader's task: as it always did
            att.failed = True           # the hedge's task: the reader raises it
            att.race.error = e

    async def _read(self, att: _Attempt, vqp: VQP, rec: NodeRecord, dst: VMR, at: int,
                    remote: str, nbytes: int, remote_off: int) -> None:
        """One timed vqp.read: its latency goes to the hedger (a sample only if it came
        within its threshold); hedging, it calls ``_overran`` when it passes the threshold
        and, when cancelled, returns at once (``att.in_flight`` until its WC)."""
        t = att.read_since = time.monotonic()
        limit = self.hedger.threshold(rec.node, nbytes)
        if self.hedge is None:
            await vqp.read(dst, at, remote, nbytes, remote_off)
        else:
            att.in_flight = True
            await vqp.read(dst, at, remote, nbytes, remote_off, overrun=(limit, att.overran),
                           detach=att.freed)
            att.in_flight = False
        took = time.monotonic() - t
        self.hedger.done(rec.node, nbytes, took, sample=took <= limit)

    async def _take_staging(self, hedge: bool = False) -> tuple[VMR, int]:
        """A physical staging slot, registering another segment of ``nbuf`` if none is
        free (up to STAGING × nbuf: losers a hung peer still holds); for a ``hedge``
        without waiting: past that bound, one more slot for good."""
        if hedge and self._staging_free.value == 0:
            self._staging_free.release()
        await _take(self._staging_free)
        return self._staging_slot()

    def staging_nowait(self) -> tuple[VMR, int] | None:
        """A physical staging slot now for the native fetch's extents (``native_fetch.py``;
        back through ``give_staging``), or None when that would leave fewer than 2 ×
        nbuf: those stay ``read_chunk``'s (its reads in progress, and their hedges), so
        extents READ from a stopped replica, each holding its slot until the peer
        timeout, cannot make the hedges that answer them wait for one. (A bound by
        construction: no run here has shown that wait.)"""
        if self._staging_free.value <= 2 * self.nbuf:
            return None
        self._staging_free.acquire_nowait()
        return self._staging_slot()

    def _staging_slot(self) -> tuple[VMR, int]:
        if not self._staging:
            vmr = self.ep.alloc(self.nbuf * self.slot_size,
                                name=f"fetch-buffers{self._staging_segments}")
            self._staging_segments += 1
            self._staging.extend((vmr, i * self.slot_size) for i in range(self.nbuf))
        return self._staging.pop()

    async def _read_from(self, rec: NodeRecord, key: bytes, length: int,
                         part: tuple[int, int, bytes] | None = None,
                         att: _Attempt | None = None) -> bytes | memoryview | None:
        """Index bucket READ (its second bucket's too, for a key not in its first), then
        slot READ, then verify; None if the node lacks the chunk (or, in a race, another
        attempt has won: nothing is kept or copied then)."""
        off, want, digest = part if part is not None else (0, length, key)
        if att is None:
            att = _Attempt(rec, _Race([], (), 0, self._overran))
        hedge = att.is_hedge or att.race.budgeted   # bounded by the budget, not by nbuf
        connecting = not self._connected(rec)
        if connecting and not hedge:
            self.counters.connect_waits += 1
        connecting &= self.hedge is not None
        if connecting:                  # a connect is hedged like a READ (a cancelled
            att.read_since = time.monotonic()   # joiner: it goes on in its single-flight)
        vqp = await wait_noting_overrun(lambda: self._vqp(rec),
                                        (self.hedger.cap, att.overran) if connecting else None)
        token = not hedge
        if token:
            await _take(self._slot_free)
        staging = await self._take_staging(hedge)
        sbuf, base = staging
        landing = self.landing.take() if part is None else None
        try:
            dst, at = landing if landing is not None else staging
            rslot = self.hints.get(rec.node, rec.started, key)
            for _ in range(2 + (rslot is not None)):   # a stale hint, then twice the bucket
                hinted = rslot is not None
                if rslot is not None:
                    self.counters.hinted += 1
                else:
                    found = None
                    for b in buckets_of(key, rec.nbuckets):     # the second: a few keys
                        await self._read(att, vqp, rec, sbuf, base, "index", BUCKET_BYTES,
                                         b * BUCKET_BYTES)
                        if att.lost:
                            return None
                        found = find_in_bucket(sbuf.view[base:base + BUCKET_BYTES], key)
                        if found is not None:
                            break
                    if found is None or found[1] != length:
                        return None
                    rslot = found[0]
                await self._read(att, vqp, rec, dst, at, "arena", want,
                                 rslot * rec.slot_size + off)
                if att.lost:
                    return None
                if checksum.matches(dst.view[at:at + want], digest):
                    self.hints.learn(rec.node, rec.started, key, rslot)
                    if landing is None:
                        return sbuf.read(want, base)
                    kept, landing = landing, None      # owned by the view now: not given back
                    return self.landing.keep(kept, want)
                if hinted:                             # the slot holds another chunk now
                    self.counters.stale_hints += 1
                    self.hints.stale(rec.node, rec.started, key)
                else:
                    self.counters.checksum_retries += 1    # raced an eviction: look again
                    log.info("chunk %s from %s failed its checksum; looking again",
                             key.hex()[:12], rec.node)
                rslot = None
            return None
        finally:
            if token:
                self._slot_free.release()

            def give_back() -> None:
                if landing is not None:
                    self.landing.give(landing)
                self.give_staging(staging)

            if att.in_flight:          # cancelled while a NIC still owns the buffers:
                att.on_free = give_back    # they come back with the READ's completion
            else:
                give_back()

    # -- the native fetch's side (native_fetch.py) --------------------------------------

    def native_route(self, key: bytes, length: int) -> tuple[NodeRecord, int, VQP] | None:
        """Where C may READ chunk ``key`` itself: its first replica not being skipped
        (nor lacking it by a copy of its index: ``SlotHints.lacks``), when a slot hint
        (or that node's index, READ whole: ``_index_slot``) says where the chunk sits
        there and its vQP is connected — ``(record, slot, vqp)``; None: ``read_chunk``
        (which learns the hint). (Without the skip, a chunk its first replica does not
        hold took ``read_chunk`` on every pass, which asks that node to load it.)"""
        if length > self.slot_size:
            return None
        now = time.monotonic()
        for rec in self.order(key):
            if self._skip_until.get(rec.node, 0.0) > now:
                continue
            if self._back(rec):
                self._back_last([rec])     # (C READs from it once it is connected)
                continue
            have = self._vqps.get(rec.node)
            if have is None:
                return None
            rslot = self.hints.get(rec.node, rec.started, key)
            if rslot is None:
                if self.hints.lacks(rec, key, now):
                    continue
                rslot = self._index_slot(rec, key, length, now)
            return None if rslot is None else (rec, rslot, have[1])
        return None

    def _index_slot(self, rec: NodeRecord, key: bytes, length: int, now: float) -> int | None:
        """The slot of ``key`` in ``rec``'s arena by a copy of its whole index, or None;
        with no copy, one is READ in the background (``SlotHints.index_due``). Without
        it, a fresh mount's first pass over the data went through ``read_chunk`` chunk
        by chunk (a bucket READ and the chunk READ in Python), and only later passes
        reached the native fetch."""
        rslot = self.hints.in_index(rec, key, length)
        if rslot is None and (size := self.hints.index_due(rec, self.slot_size, now)):
            self.nursery.start_soon(self._read_index, rec, size)
        return rslot

    async def _read_index(self, rec: NodeRecord, size: int) -> None:
        """READ ``rec``'s whole arena index into a staging slot and keep a copy."""
        try:
            vqp = await self._vqp(rec)
            staging = await self._take_staging()
            try:
                await vqp.read(staging[0], staging[1], "index", size, 0)
                self.hints.keep_index(rec, staging[0].read(size, staging[1]), time.monotonic())
            finally:
                self.give_staging(staging)
        except (*_FAILED, RdmaError, *_MISBEHAVED) as e:     # only hints: never fatal
            log.debug("index of %s not READ: %s", rec.node, e)

    def landed_native(self, node: str, nbytes: int) -> None:
        """A chunk C READ from ``node`` landed verified: counted as a hinted peer hit."""
        c = self.counters
        c.hits += 1
        c.hinted += 1
        c.bytes += nbytes
        c.per_peer[node] += nbytes

    def stale_hint(self, node: str, started: float, key: bytes) -> None:
        """C found another chunk in the slot a hint named: forget the hint, and the copy
        of that node's index it may have come from."""
        self.counters.stale_hints += 1
        self.hints.stale(node, started, key)

    def links(self) -> list[VQPStats]:
        """Every vQP's statistics (``rdma.vrdma`` VQPStats, with its paths): metrics."""
        return [v.statistics() for _, v in list(self._vqps.values())]

    def statistics(self) -> PeerStatistics:
        c = self.counters
        h = self.hedger
        now = time.monotonic()
        vqps = {n: v.statistics() for n, (_, v) in self._vqps.items()}
        land = self.landing.statistics()
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


class _Race:
    """One read_chunk: the replicas not yet tried (``queue``), the reader's own attempt
    (``first``) and the hedge (a task; at most one per read), the ``winner`` (the first
    attempt whose bytes verified), and the arguments every attempt reads with.

    Attempts point at their race and the race at them: read_chunk unlinks the three
    when it returns. Left to the cycle collector, the winner's bytes (a landing slot)
    stayed held after the memory tier had let them go: 35 % of a sequential reader's
    chunks found every landing slot held and were copied out of a staging buffer."""

    __slots__ = ("queue", "args", "nbytes", "on_overrun", "budgeted", "first", "hedge",
                 "winner", "error")

    def __init__(self, queue: list[NodeRecord], args: tuple[Any, ...], nbytes: int,
                 on_overrun: Callable[[_Attempt], None], budgeted: bool = False) -> None:
        self.queue, self.args, self.nbytes = queue, args, nbytes
        self.on_overrun = on_overrun            # Peers._overran
        self.budgeted = budgeted                # read_chunk(budgeted=True): a hedge itself
        self.first: _Attempt | None = None
        self.hedge: _Attempt | None = None
        self.winner: _Attempt | None = None
        self.error: Exception | None = None     # the hedge's unexpected exception

    def won(self, att: _Attempt) -> None:
        """``att``'s bytes verified first: it wins, the other attempt is cancelled (its
        READ, if one is out, gives its buffers back when it completes)."""
        self.winner = att
        for other in (self.first, self.hedge):
            if other is not None and other is not att:
                other.scope.cancel()


class _Attempt:
    """One replica's part in a read, run in ``scope`` (cancelled when the other attempt
    wins): ``read_since`` (its current READ or connect), the outcome (``data`` or
    ``failed``), ``in_flight`` while a NIC owns its buffers (``on_free`` runs when it
    stops: a cancelled READ's completion), and ``ended`` for a hedge's task."""

    __slots__ = ("rec", "race", "is_hedge", "scope", "read_since", "data", "failed",
                 "in_flight", "on_free", "ended")

    def __init__(self, rec: NodeRecord, race: _Race, is_hedge: bool = False) -> None:
        self.rec, self.race, self.is_hedge = rec, race, is_hedge
        self.scope = trio.CancelScope()
        self.read_since = 0.0
        self.data: bytes | memoryview | None = None
        self.failed = False
        self.in_flight = False
        self.on_free: Callable[[], None] | None = None
        self.ended = trio.Event() if is_hedge else None     # what the reader waits on

    def overran(self) -> None:
        """Its READ or connect passed its threshold (``Peers._overran``)."""
        self.race.on_overrun(self)

    def freed(self) -> None:
        """The NIC is done with this attempt's buffers (a detached READ completed)."""
        self.in_flight = False
        if self.on_free is not None:
            give_back, self.on_free = self.on_free, None
            give_back()

    @property
    def lost(self) -> bool:
        """Another attempt of the race has won: stop, keep nothing."""
        return self.race.winner is not None and self.race.winner is not self
