"""⑤ What the native fetch lets C start by itself (:mod:`.native_fetch`): routes, peers, slots.

    Routes.ahead(k)          the routes of the ROUTE_AHEAD chunks after k, each its first
                             replica's peer and slot (fetch_route), and the slots below
    Routes.route(k, route)   chunk k's route, with its peer's limits for small files' extents
    Routes.tell(rec, vqp)    a peer's number in C's table and its UP paths (fetch_peer,
                             through a :class:`~.peer_table.PeerTable`) with its hedging
                             limits; ``retell``: again (no path while a READ is overdue)
    Routes.feed()            C_SLOTS landing slots with C (fetch_slot), and once C_STAGING
                             staging slots for the small files' extents it starts
    Routes.slot / origin     from a C-started fetch's FETCHED back to its slot, node and QP

A sequential reader's window then starts each routed chunk in C as it enters, and a
small file's READ that misses in a routed chunk its extent, with no hint to Python:
handing each one over from Python was about half of what the trio thread still did
(docs/design.md, "The native chunk fetch").
"""
from __future__ import annotations

import itertools
from collections import Counter
from typing import TYPE_CHECKING, Any

from ..hedge import size_class
from ..landing import Slot
from .inflight import fe
from .peer_table import PeerTable, stage
from ...tuning import C_SLOTS, C_STAGING, ROUTE_AHEAD

if TYPE_CHECKING:
    from rdma.vrdma import VQP

    from ...cache.memory import MemoryCache
    from ...manifest.index import ManifestIndex
    from ..fetch import Peers


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

    Attributes:
        table: the peers told to C (:class:`~.peer_table.PeerTable`), and the handles of
            the soft engines, which ``NativeFetch`` posts its own READs with too.
    """

    def __init__(self, engine: Any, peers: Peers, memory: MemoryCache,
                 index: ManifestIndex, late: Counter[str], small_file_limit: int = 0) -> None:
        self.engine = engine
        self.peers = peers
        self.memory = memory
        self.index = index
        self.closed = False
        self._late = late                      # node → its fetches past their deadline
        # the local NICs, in a slot's lkey order: the endpoint's, fixed from the start (a
        # staging slot is C's for good, with an lkey on each)
        self.table = PeerTable(list(peers.ep.nics)[:fe.FETCH_NICS], fe.FETCH_PEERS,
                               engine.fetch_engine, engine.fetch_peer, engine.fetch_unroute)
        self._slots: dict[int, Slot] = {}                   # C's landing slots by id
        self._slot_ids = itertools.count()
        # a staging slot holds a small file or a random read's block: both are read alone
        # exactly when the dataset outgrows the tiers (small_file_limit > 0)
        self._part_size = max(small_file_limit, index.block_size) if small_file_limit else 0
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

    @property
    def part_size(self) -> int:
        """The largest part (extent, block) C starts: its staging slots' size; 0: none."""
        return self._part_size

    @property
    def starts_blocks(self) -> bool:
        """Whether C may start random reads' blocks itself (fuse_read.c ``start_block``):
        it has staging slots, which it has when the dataset outgrows the tiers; random
        reads then keep blocks (no chunk is promoted: ReadPolicy.blocks_for), so C never
        starts a block Python would load whole."""
        return 0 < self.index.block_size <= self._part_size

    def route(self, k: int, route: tuple[Any, int, VQP]) -> None:
        """Give C chunk ``k``'s route (``Peers.native_route``'s record, slot, vQP): a small
        file's READ that misses in it then starts its extent in C (fuse_read.c
        ``start_small``), a random READ inside one block that block (``start_block``), and
        a sequential reader's window the chunk."""
        rec, rslot, vqp = route
        peer = self.tell(rec, vqp, parts=True)
        if peer is not None:
            self.engine.fetch_route(k, peer, rslot * rec.slot_size)
        self.feed()

    def tell(self, rec: Any, vqp: VQP, parts: bool = False) -> int | None:
        """``rec``'s number in C's peer table, its UP paths told again when they (or its
        hedging limits) changed; None when it has none, or a READ of it is overdue
        (``read_chunk`` takes its chunks then, hedging each). ``parts``: its limits for
        small files' extents too (``route``), else those told last: ``ahead`` tells its
        peers for each chunk Python starts, and computing them on every call doubled
        this method's cost (docs/design.md, "The native fetch, step by step")."""
        return self.table.tell(rec, vqp, withhold=bool(self._late[rec.node]),
                               extra=lambda last, up: self._limits(rec, last, up, parts))

    def _limits(self, rec: Any, last: tuple[Any, ...], up: bool,
                parts: bool) -> tuple[int, tuple[int, ...]]:
        """``rec``'s hedging limits as C takes them, ns: its chunks', and its small files'
        extents' per size class (``parts``; else those told ``last``); 0, (): none."""
        limit, limits = 0, last[1] if last else ()
        if up and self.peers.hedge is not None:
            threshold = self.peers.hedger.threshold
            limit = int(threshold(rec.node, self.peers.slot_size) * 1e9)
            if parts and self._part_size:   # (4 KiB << 2c: the largest READ of class c)
                limits = tuple(int(threshold(rec.node, 4096 << 2 * c) * 1e9)
                               for c in range(size_class(self._part_size) + 1))
        return limit, limits

    def retell(self, node: str, started: float) -> None:
        """Tell C again what it knows of incarnation ``started`` of ``node``, if anything:
        with a READ of it overdue, that is no path, so C starts nothing more on it."""
        idx = self.table.number_of(node, started)
        held = None if idx is None else self.table.record(idx)
        if held is not None:
            self.tell(*held)

    def feed(self) -> None:
        """Keep ``C_SLOTS`` landing slots with C (each with its lkey on every local NIC),
        while the landing pool keeps as many for Python's own fetches (a small memory
        tier's pool ran dry otherwise, and its READs went to Python); and, once, C's
        staging slots."""
        if self._staging is None and self._part_size and not self.closed:
            self._staging = stage(self.peers.ep, C_STAGING, self._part_size, self.table.nics,
                                  self.engine.fetch_staging, "c-staging")
        landing = self.peers.landing
        while len(self._slots) < C_SLOTS and not self.closed and landing.spare > C_SLOTS:
            slot = landing.take()
            if slot is None:
                return
            vmr, at = slot
            keys = [vmr.on(nic, at) for nic in self.table.nics]
            sid = next(self._slot_ids)
            if not self.engine.fetch_slot(sid, keys[0][0], [lkey for _, lkey in keys]):
                landing.give(slot)
                return
            self._slots[sid] = slot

    def slot(self, sid: int, back: bool = False) -> Slot | None:
        """C's landing slot ``sid`` (``back``: C has given it back), or None."""
        return self._slots.pop(sid, None) if back else self._slots.get(sid)

    def origin(self, peer: int, path: int) -> tuple[Any, VQP, int] | None:
        """Peer number ``peer``'s record and vQP, and the QP of its ``path``-th path as
        last told; None for a number never told."""
        held = self.table.record(peer)
        if held is None:
            return None
        rec, vqp = held
        return rec, vqp, self.table.qpn(peer, path)
