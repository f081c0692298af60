"""⑤ Which replicas a chunk is READ from, in which order: Python's reads, and C's.

    Replicas.order(key, exclude)         placement's reader order (kept per member list):
                                         the local node first, peers the hedger suspects last
    Replicas.to_try(key, exclude, now)   that order less the nodes skipped as unreachable,
                                         nodes back as a new incarnation last (Connections)
    Replicas.native_route(key, length)   where C may READ the chunk itself (native/fetch.py):
                                         its first replica's slot, by a slot hint or a copy
                                         of that node's whole index
    Replicas.local_member()              the member on this host

Orders are kept because a rendezvous hash over every member per read grows with the
members (docs/design.md, "Peer reads in Python: the figures behind the code").
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import trio

from rdma.vrdma import VQP

from ..tuning import PLACED_ORDERS
from .connections import Connections
from .hedge import Hedger
from .hints import SlotHints
from .membership import Membership, NodeRecord
from .placement import reader_order

if TYPE_CHECKING:
    from .arena_read import ArenaRead


class Replicas:
    """The replica order of each chunk for one process's reads.

    Contract: ``order`` is placement's ``reader_order`` over the member list now (any
    change replaces the list, and the orders kept go), with ``local_node`` first (with
    ``find_local``, the member with one of this endpoint's NICs, looked up again at
    each change); with ``hedge``, peers it suspects last. ``native_route`` names only a
    connected replica whose slot is known (a hint, or that node's index READ whole in
    ``nursery``, once due). Trio thread only.
    """

    def __init__(self, membership: Membership, count: int, connections: Connections,
                 hints: SlotHints, arena_read: ArenaRead, nursery: trio.Nursery, *,
                 slot_size: int, hedge: Hedger | None = None, local_node: str | None = None,
                 find_local: bool = False) -> None:
        self.membership = membership
        self.count = count                     # replicas of each chunk
        self.connections = connections
        self.hints = hints
        self.arena_read = arena_read
        self.nursery = nursery
        self.slot_size = slot_size
        self.hedge = hedge
        self.local_node = local_node           # the node on this host, tried first
        self._find_local = find_local
        self._placed_orders: dict[bytes, list[str]] = {}         # key → reader_order
        self._placed_for: object = None                          # ... of these members

    def order(self, key: bytes, exclude: str | None = None) -> list[NodeRecord]:
        nodes = self.membership.nodes
        names = self._placed(key)
        if self.hedge is not None:
            names = self.hedge.order(names, time.monotonic())
        return [nodes[n] for n in names if n != exclude and n in nodes]

    def to_try(self, key: bytes, exclude: str | None, now: float) -> list[NodeRecord]:
        """The replicas a read of ``key`` tries, in turn: ``order`` less the nodes
        skipped as unreachable, the nodes back as a new incarnation last."""
        skipped = self.connections.skipped
        return self.connections.back_last([r for r in self.order(key, exclude)
                                           if not skipped(r.node, now)])

    def local_member(self) -> str | None:
        """The member on this host: one of this endpoint's NICs is among its NICs."""
        nics = set(self.connections.ep.nics)
        return next((r.node for r in self.membership.nodes.values() if nics & set(r.nics)),
                    None)

    def _placed(self, key: bytes) -> list[str]:
        """``reader_order`` of ``key``, kept until the membership's member list is
        replaced (any change replaces it) or ``PLACED_ORDERS`` orders are kept (then all go)."""
        members = self.membership.members
        if members is not self._placed_for:
            self._placed_orders.clear()
            self._placed_for = members
            if self._find_local:
                self.local_node = self.local_member()
        names = self._placed_orders.get(key)
        if names is None:
            if len(self._placed_orders) >= PLACED_ORDERS:
                self._placed_orders.clear()
            names = self._placed_orders[key] = reader_order(key, members, self.count,
                                                            self.local_node)
        return names

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
            if self.connections.skipped(rec.node, now):
                continue
            if self.connections.back(rec):
                self.connections.back_last([rec])     # (C READs from it once it is connected)
                continue
            vqp = self.connections.now(rec)
            if vqp is None:
                return None
            rslot = self.hints.get(rec.node, rec.started, key)
            if rslot is None:
                if self.hints.lacks(rec, key, now):
                    continue
                rslot = self._index_slot(rec, key, length, now)
            return None if rslot is None else (rec, rslot, vqp)
        return None

    def _index_slot(self, rec: NodeRecord, key: bytes, length: int, now: float) -> int | None:
        """The slot of ``key`` in ``rec``'s arena by a copy of its whole index, or None;
        with no copy, one is READ in the background (``SlotHints.index_due``). Without
        it, a fresh mount's first pass over the data went through ``read_chunk`` chunk
        by chunk (a bucket READ and the chunk READ in Python), and only later passes
        reached the native fetch."""
        rslot = self.hints.in_index(rec, key, length)
        if rslot is None and (size := self.hints.index_due(rec, self.slot_size, now)):
            self.nursery.start_soon(self.arena_read.read_index, rec, size)
        return rslot
