"""⑤ One replica's READs of a chunk by one-sided vRDMA READs, and the buffers they land in.

    ArenaRead.read_from(rec, key, length, part)   one replica, one attempt:
      READ its index bucket (256 B)        arena.find_in_bucket → (slot, length); its
                                           second bucket too for the few keys not in their
                                           first (arena.buckets_of); skipped when a slot
                                           hint remembers the slot
      READ the slot                        one READ of up to slot_size bytes (or of a part)
      xxh3 == key (or the part's digest)?  → the bytes; else None (never unverified bytes)
    ArenaRead.read_index(rec, size)        a node's whole index, kept as hints (native routes)
    Staging                                staging slots and read-in-progress tokens

Slot hints (:mod:`.hints`): where a chunk sat in a node's arena (found by an earlier
bucket READ and verified) is remembered, so the next READ of that chunk, or of another
small file packed in it, goes straight to the slot: one round trip instead of two. A
hint can go stale (the node evicted the chunk and reused the slot); the checksum catches
that, the hint is dropped and the bucket is READ as before. Hints are keyed by the
node's incarnation, so a restarted node's arena is never addressed through old hints.

Buffers: a whole chunk lands in a slot of :class:`~.landing.Landing`, and once verified
that slot *is* the chunk the memory tier keeps (no copy; the slot is reused when the
last view of it is gone). A small file's extent (and a chunk when every landing slot
is held) lands in a staging slot and is copied out as ``bytes``. Cancellation: a
cancelled READ keeps its buffers until its completion (vRDMA owns them until then):
without hedging ``VQP.read`` waits for it, shielded; with hedging it is detached (the
attempt returns at once, its buffers come back from the completion, ``Attempt.on_free``),
so a reader never waits on a hung peer's READ.

Staging slots are two counts: ``nbuf`` reads in progress (a token per read; a hedge takes
none: the hedge budget bounds it) and physical slots, registered lazily in segments of
``nbuf`` up to ``STAGING_PER_BUF × nbuf``, so buffers a hung peer still holds do not block the
reads that follow. A hedge never waits for a staging slot either: with none free it adds
one. Waiting, a hedge was held by the very READs it was to overtake: the losers of a
stopped peer keep their slots until its timeout.
"""
from __future__ import annotations

import logging
import time

import trio

from rdma.errors import RdmaError
from rdma.vrdma import VMR, VQP, Endpoint, wait_noting_overrun

from .. import checksum
from ..tuning import STAGING_PER_BUF
from .arena import BUCKET_BYTES, buckets_of, find_in_bucket
from .connections import FAILED, MISBEHAVED, Connections
from .failover import Attempt, Race
from .hedge import Hedger
from .hints import SlotHints
from .landing import Landing, Slot
from .membership import NodeRecord
from .peer_stats import PeerCounters

log = logging.getLogger(__name__)


async def take(sem: trio.Semaphore) -> None:
    """``sem.acquire()``, without its schedule point when a token is free: a chunk READ
    from a peer is only a few task steps, and these schedule points were two of them
    (docs/design.md, "Peer reads in Python: the figures behind the code")."""
    try:
        sem.acquire_nowait()
    except trio.WouldBlock:
        await sem.acquire()


class Staging:
    """The staging slots of one process's peer READs (module docstring).

    Contract: ``reads`` holds a token per read in progress (``nbuf``; a hedge takes
    none); ``free`` counts the physical slots, registered or not (``STAGING_PER_BUF × nbuf``).
    A slot ``take`` (or ``take_nowait``) gives is the taker's until ``give``, which it
    calls once no READ writes into the slot. Trio thread only.
    """

    def __init__(self, endpoint: Endpoint, slot_size: int, nbuf: int) -> None:
        self.ep = endpoint
        self.slot_size = slot_size
        self.nbuf = nbuf
        buf = endpoint.alloc(nbuf * slot_size, name="fetch-buffers")
        self._slots: list[Slot] = [(buf, i * slot_size) for i in range(nbuf)]
        self._segments = 1
        self.free = trio.Semaphore(STAGING_PER_BUF * nbuf)   # physical slots, made or not
        self.reads = trio.Semaphore(nbuf)            # reads in progress

    async def take(self, hedge: bool = False) -> Slot:
        """A physical staging slot, registering another segment of ``nbuf`` if none is
        free (up to STAGING_PER_BUF × nbuf: losers a hung peer still holds); for a ``hedge``
        without waiting: past that bound, one more slot for good."""
        if hedge and self.free.value == 0:
            self.free.release()
        await take(self.free)
        return self._slot()

    def take_nowait(self) -> Slot | None:
        """A physical staging slot now for the native fetch's extents (``native/fetch.py``;
        back through ``give``), or None when that would leave fewer than 2 × nbuf: those
        stay ``read_chunk``'s (its reads in progress, and their hedges), so extents READ
        from a stopped replica, each holding its slot until the peer timeout, cannot
        make the hedges that answer them wait for one. (A bound by construction: no run
        here has shown that wait.)"""
        if self.free.value <= 2 * self.nbuf:
            return None
        self.free.acquire_nowait()
        return self._slot()

    def give(self, slot: Slot) -> None:
        """A staging slot back (``take``'s or ``take_nowait``'s), once no READ writes
        into it."""
        self._slots.append(slot)
        self.free.release()

    def _slot(self) -> Slot:
        if not self._slots:
            vmr = self.ep.alloc(self.nbuf * self.slot_size,
                                name=f"fetch-buffers{self._segments}")
            self._segments += 1
            self._slots.extend((vmr, i * self.slot_size) for i in range(self.nbuf))
        return self._slots.pop()


class ArenaRead:
    """The READs of a replica's arena for one process (module docstring).

    Contract: ``read_from`` returns verified bytes (a landing slot's view, which the
    memory tier keeps, or a copy out of a staging slot) or None (the replica lacks the
    chunk, or another attempt of the race has won); never unverified bytes. It learns
    and drops slot hints, counts in ``counters`` (hinted, stale hints, checksum retries,
    connect waits) and gives each READ's latency to the hedger. Its buffers go back once
    no NIC writes them (a detached READ's, from its completion). With ``hedging``, a READ
    or connect past its threshold calls its attempt's ``overran``. Trio thread only.
    """

    def __init__(self, connections: Connections, staging: Staging, landing: Landing,
                 hints: SlotHints, hedger: Hedger, counters: PeerCounters, *,
                 hedging: bool) -> None:
        self.connections, self.staging, self.landing = connections, staging, landing
        self.hints, self.hedger, self.counters = hints, hedger, counters
        self.hedging = hedging

    async def read_from(self, rec: NodeRecord, key: bytes, length: int,
                        part: tuple[int, int, bytes] | None = None,
                        att: Attempt | None = None) -> bytes | memoryview | None:
        """Index bucket READ (its second bucket's too, for a key not in its first), then
        slot READ, then verify; None if the node lacks the chunk (or, in a race, another
        attempt has won: nothing is kept or copied then). ``att``: the attempt of a
        race this READ is part of (None: a race of its own)."""
        off, want, digest = part if part is not None else (0, length, key)
        if att is None:
            att = Attempt(rec, Race.alone(self._overran))
        hedge = att.is_hedge or att.race.budgeted   # bounded by the budget, not by nbuf
        connecting = not self.connections.connected(rec)
        if connecting and not hedge:
            self.counters.connect_waits += 1
        connecting &= self.hedging
        if connecting:                  # a connect is hedged like a READ (a cancelled
            att.read_since = time.monotonic()   # joiner: it goes on in its single-flight)
        vqp = await wait_noting_overrun(lambda: self.connections.vqp(rec),
                                        (self.hedger.cap, att.overran) if connecting else None)
        token = not hedge
        if token:
            await take(self.staging.reads)
        staging = await self.staging.take(hedge)
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
                    rslot = await self._bucket_slot(att, vqp, rec, staging, key, length)
                    if rslot is None:
                        return None
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
                self.staging.reads.release()

            def give_back() -> None:
                if landing is not None:
                    self.landing.give(landing)
                self.staging.give(staging)

            if att.in_flight:          # cancelled while a NIC still owns the buffers:
                att.on_free = give_back    # they come back with the READ's completion
            else:
                give_back()

    async def _bucket_slot(self, att: Attempt, vqp: VQP, rec: NodeRecord, staging: Slot,
                           key: bytes, length: int) -> int | None:
        """``key``'s slot by READs of its index buckets into ``staging`` (the second
        bucket for the few keys not in their first); None when the node lacks it with
        ``length`` bytes, or another attempt has won."""
        sbuf, base = staging
        for b in buckets_of(key, rec.nbuckets):
            await self._read(att, vqp, rec, sbuf, base, "index", BUCKET_BYTES,
                             b * BUCKET_BYTES)
            if att.lost:
                return None
            found = find_in_bucket(sbuf.view[base:base + BUCKET_BYTES], key)
            if found is not None:
                return found[0] if found[1] == length else None
        return None

    async def _read(self, att: Attempt, vqp: VQP, rec: NodeRecord, dst: VMR, at: int,
                    remote: str, nbytes: int, remote_off: int) -> None:
        """One timed vqp.read: its latency goes to the hedger (a sample only if it came
        within its threshold); hedging, it calls ``att.overran`` when it passes the
        threshold and, when cancelled, returns at once (``att.in_flight`` until its WC)."""
        t = att.read_since = time.monotonic()
        limit = self.hedger.threshold(rec.node, nbytes)
        if not self.hedging:
            await vqp.read(dst, at, remote, nbytes, remote_off)
        else:
            att.in_flight = True
            await vqp.read(dst, at, remote, nbytes, remote_off, overrun=(limit, att.overran),
                           detach=att.freed)
            att.in_flight = False
        took = time.monotonic() - t
        self.hedger.done(rec.node, nbytes, took, sample=took <= limit)

    def _overran(self, att: Attempt) -> None:
        """A READ of a race of its own passed its threshold: noted against the peer
        (there is no next replica to hedge to)."""
        self.hedger.overran(att.rec.node, time.monotonic())

    async def read_index(self, rec: NodeRecord, size: int) -> None:
        """READ ``rec``'s whole arena index into a staging slot and keep a copy."""
        try:
            vqp = await self.connections.vqp(rec)
            staging = await self.staging.take()
            try:
                await vqp.read(staging[0], staging[1], "index", size, 0)
                self.hints.keep_index(rec, staging[0].read(size, staging[1]), time.monotonic())
            finally:
                self.staging.give(staging)
        except (*FAILED, RdmaError, *MISBEHAVED) as e:     # only hints: never fatal
            log.debug("index of %s not READ: %s", rec.node, e)
