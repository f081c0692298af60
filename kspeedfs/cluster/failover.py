"""⑤ A chunk read across replicas: each in turn, the next on failure, a hedge when one is late.

    Failover.read_chunk(...)
      for rec in Replicas.to_try(key)      local node first, then score order
          ArenaRead.read_from(rec, ...)    verified bytes?  → done
          missing?                         → RPC "load" to the owner (it fetches from another
                                             replica or the source into its arena), then
                                             READ again
          a failed replica                 → the next replica (and skip that node for a
                                             while so later reads do not wait on it)
      → None: the caller goes to the source
    Failover.overran(att)                  a READ or connect past its threshold: noted, and
                                           the next replica READ as a hedge (a task)
    Race, Attempt                          one read: its replicas, attempts and winner

Failure handling is layered: a NIC or link dying is invisible here (vRDMA re-posts the
READ on another path); a whole peer dying surfaces as ``PeerUnreachable`` after
``cluster.peer_timeout`` with all paths dead, and we move to the next replica.

A misbehaving peer is a failed replica, never an error for the reader while another copy
(or the source) exists: a listener that answers garbage, deep or oversized JSON, or does
not know the secret fails its handshake (``HandshakeError``, or
``PeerUnreachable``/``RpcUnavailable`` around it); an authenticated node whose ``info``
or RPC reply does not parse is the same; and as a last net, a ``MISBEHAVED`` exception
while reading from one replica (its reply or its etcd record did not hold what it
should) moves to the next replica too, logged with its traceback.

Hedging (``cluster.hedge``; the rule: :mod:`.hedge`). Without it a replica that stops
answering (SIGSTOP, SIGKILL, a stall) costs every read waiting on it
``cluster.peer_timeout`` before the next replica is asked. With it, the first replica is
still READ in the reader's own task, each READ (and a connect) with a deadline of
``Hedger.threshold`` on its wait; when one passes, the same bytes are READ from the next
replica in a task of ``nursery``, at most once per read and within the byte budget,
while the first READ goes on. The first attempt whose bytes verify wins and cancels the
other. A read that is not late costs one timer per READ and no task: a task per attempt
cost reads per second (docs/design.md, "Peer reads in Python: the figures behind the
code"). A hedge takes no read-in-progress token and waits for no staging slot
(:mod:`.arena_read`); the native fetch's hedge of a late C READ
(``read_chunk(budgeted=True)``) is a hedge too. Peers whose READs overrun repeatedly are
tried last (``Hedger.order``).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from rdma.errors import RdmaError

from .arena import BUCKET_BYTES
from .connections import FAILED, MISBEHAVED, Connections
from .hedge import Hedger
from .membership import NodeRecord
from .peer_stats import PeerCounters

if TYPE_CHECKING:
    from .arena_read import ArenaRead
    from .replicas import Replicas

log = logging.getLogger(__name__)


class Failover:
    """Chunk reads across the replicas of one process (a mount, or a node re-replicating).

    Contract: ``read_chunk`` returns verified bytes from some replica, or None (go to the
    source); a failed or misbehaving replica is never the caller's error (its node is
    skipped a while and the next replica is tried); an unexpected exception in the
    reader's own attempt raises as it always did, one in a hedge's task is raised by the
    reader. With hedging on (ArenaRead calls ``overran``), a hedge runs in ``nursery``,
    at most one per read, and the loser is cancelled. Counts hits, misses, loads,
    unreachable replicas and the longest waits in ``counters``. Trio thread only.
    """

    def __init__(self, replicas: Replicas, connections: Connections, arena_read: ArenaRead,
                 hedger: Hedger, counters: PeerCounters, nursery: trio.Nursery, *,
                 slot_size: int) -> None:
        self.replicas, self.connections, self.arena_read = replicas, connections, arena_read
        self.hedger, self.counters = hedger, counters
        self.nursery = nursery
        self.slot_size = slot_size

    async def read_chunk(self, dataset: str, version: int, chunk: int, key: bytes, length: int,
                         *, ask_owner: bool = True, exclude: str | None = None,
                         part: tuple[int, int, bytes] | None = None,
                         budgeted: bool = False) -> bytes | memoryview | None:
        """``Peers.read_chunk`` (its docstring): replicas in turn, each in this task;
        with hedging, a READ (or connect) that overruns its threshold starts the next
        replica as a task, once per read; the first bytes that verify win and the other
        attempt is cancelled."""
        if length > self.slot_size:
            return None
        t0 = time.monotonic()
        race = Race(self.replicas.to_try(key, exclude, t0),
                    (dataset, version, chunk, key, length, part, ask_owner),
                    BUCKET_BYTES + (part[1] if part is not None else length), self.overran,
                    budgeted)
        failed = False
        try:
            while race.queue and race.winner is None:
                att = Attempt(race.queue.pop(0), race)
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

    def overran(self, att: Attempt) -> None:
        """``att``'s READ (or connect) passed its threshold: note it against the peer and,
        once per read and within the budget, start the next replica as a hedge."""
        now = time.monotonic()
        race = att.race
        self.hedger.overran(att.rec.node, now)
        if race.hedge is not None or not race.queue or race.winner is not None \
                or not self.hedger.may_hedge(race.nbytes):
            return
        hedge = race.hedge = Attempt(race.queue.pop(0), race, is_hedge=True)
        self.hedger.hedged(att.rec.node)
        log.debug("chunk %d of %s: READ from %s overran %.1f ms; hedging to %s",
                  race.args[2], race.args[0], att.rec.node, (now - att.read_since) * 1e3,
                  hedge.rec.node)
        self.nursery.start_soon(self._hedge, hedge)

    async def _hedge(self, att: Attempt) -> None:
        assert att.ended is not None
        try:
            with att.scope:
                await self._attempt(att)
        finally:
            att.ended.set()

    async def _attempt(self, att: Attempt) -> None:
        """One replica: READ, else ask its owner to load it and READ again. Sets
        ``att.data`` and makes it the race's winner (cancelling the other attempt), or
        sets ``att.failed``; an unexpected exception is the race's ``error``."""
        rec = att.rec
        dataset, version, chunk, key, length, part, ask_owner = att.race.args
        try:
            data = await self.arena_read.read_from(rec, key, length, part, att)
            if data is None and ask_owner and not att.lost:
                self.counters.loads_requested += 1
                reply = await self.connections.rpc(rec).request(
                    {"op": "load", "dataset": dataset, "version": version, "chunk": chunk})
                if reply.get("source") != "refused":     # (it would not keep it: next)
                    data = await self.arena_read.read_from(rec, key, length, part, att)
            if data is not None and not att.lost:
                att.data = data
                self.counters.hits += 1
                self.counters.bytes += len(data)
                self.counters.per_peer[rec.node] += len(data)
                att.race.won(att)
        except FAILED as e:
            self.counters.unreachable += 1
            self.connections.skip(rec.node)
            att.failed = True
            log.warning("chunk %d of %s: replica %s unreachable (%s); trying the next",
                        chunk, dataset, rec.node, e)
        except RdmaError as e:
            att.failed = True
            log.warning("chunk %d of %s: READ from %s failed: %s", chunk, dataset, rec.node, e)
        except MISBEHAVED as e:
            att.failed = True           # what the replica told us did not parse
            self.counters.unreachable += 1
            self.connections.skip(rec.node)
            log.warning("chunk %d of %s: replica %s misbehaved (%r); trying the next",
                        chunk, dataset, rec.node, e, exc_info=True)
        except Exception as e:
            if not att.is_hedge:
                raise                   # in the reader's task: as it always did
            att.failed = True           # the hedge's task: the reader raises it
            att.race.error = e


class Race:
    """One read_chunk: the replicas not yet tried (``queue``), the reader's own attempt
    (``first``) and the hedge (a task; at most one per read), the ``winner`` (the first
    attempt whose bytes verified), and the arguments every attempt reads with.

    Attempts point at their race and the race at them: read_chunk unlinks the three
    when it returns. Left to the cycle collector, the winner's bytes (a landing slot)
    stayed held after the memory tier had let them go, and later chunks found every
    landing slot held and were copied out of a staging buffer."""

    __slots__ = ("queue", "args", "nbytes", "on_overrun", "budgeted", "first", "hedge",
                 "winner", "error")

    def __init__(self, queue: list[NodeRecord], args: tuple[Any, ...], nbytes: int,
                 on_overrun: Callable[[Attempt], None], budgeted: bool = False) -> None:
        self.queue, self.args, self.nbytes = queue, args, nbytes
        self.on_overrun = on_overrun            # Failover.overran
        self.budgeted = budgeted                # read_chunk(budgeted=True): a hedge itself
        self.first: Attempt | None = None
        self.hedge: Attempt | None = None
        self.winner: Attempt | None = None
        self.error: Exception | None = None     # the hedge's unexpected exception

    @classmethod
    def alone(cls, on_overrun: Callable[[Attempt], None]) -> Race:
        """A race of one attempt, no replica after it: nothing to hedge to."""
        return cls([], (), 0, on_overrun)

    def won(self, att: Attempt) -> None:
        """``att``'s bytes verified first: it wins, the other attempt is cancelled (its
        READ, if one is out, gives its buffers back when it completes)."""
        self.winner = att
        for other in (self.first, self.hedge):
            if other is not None and other is not att:
                other.scope.cancel()


class Attempt:
    """One replica's part in a read, run in ``scope`` (cancelled when the other attempt
    wins): ``read_since`` (its current READ or connect), the outcome (``data`` or
    ``failed``), ``in_flight`` while a NIC owns its buffers (``on_free`` runs when it
    stops: a cancelled READ's completion), and ``ended`` for a hedge's task."""

    __slots__ = ("rec", "race", "is_hedge", "scope", "read_since", "data", "failed",
                 "in_flight", "on_free", "ended")

    def __init__(self, rec: NodeRecord, race: Race, is_hedge: bool = False) -> None:
        self.rec, self.race, self.is_hedge = rec, race, is_hedge
        self.scope = trio.CancelScope()
        self.read_since = 0.0
        self.data: bytes | memoryview | None = None
        self.failed = False
        self.in_flight = False
        self.on_free: Callable[[], None] | None = None
        self.ended = trio.Event() if is_hedge else None     # what the reader waits on

    def overran(self) -> None:
        """Its READ or connect passed its threshold (``Failover.overran``)."""
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
