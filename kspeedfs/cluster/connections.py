"""⑤ The vQP and the RPC client to each node, for one process's peer reads (:mod:`.fetch`).

    Connections.vqp(rec)          the vQP to this incarnation of ``rec.node``, connected once
                                  (single-flight: the reads of a node join one connect)
    Connections.connected(rec)    that vQP is set up; ``now(rec)``: it, or None
    Connections.back(rec)         the node is back as a new incarnation with no vQP yet
    Connections.back_last(recs)   those moved last, their connects started in the background
    Connections.skip / skipped    a node found unreachable is skipped for ``UNREACHABLE_SKIP`` seconds
    Connections.rpc(rec)          the RPC client to a node (a miss: ask the owner to load)

A node that was unreachable is skipped for ``UNREACHABLE_SKIP`` seconds, then tried again (it may be
back, or its lease has expired and placement no longer names it), so later reads do not
wait on it. A node back as a new incarnation (restarted: its record's ``started``
changed) is tried last until its new vQP is up: a node that has just started answers a
connect only as fast as its start-up lets it, and readers waited for it (docs/design.md,
"A node coming back").
"""
from __future__ import annotations

import time

import trio

from rdma.errors import HandshakeError, PathClosed, PeerUnreachable
from rdma.vrdma import VQP, Endpoint
from rdma.vrdma.vqp import VQPStats

from ..cache.singleflight import SingleFlight
from ..tuning import UNREACHABLE_SKIP
from .membership import NodeRecord
from .rpc import RpcClient, RpcUnavailable

#: what makes a replica a failed one (next replica), as opposed to a bug
FAILED = (PeerUnreachable, RpcUnavailable, PathClosed, HandshakeError)
#: what a replica (its reply, its etcd record) told us that did not hold what it should:
#: a failed replica too, logged with its traceback
MISBEHAVED = (LookupError, TypeError, ValueError, ArithmeticError)


class Connections:
    """The vQPs and RPC clients of one process (a mount, or a node re-replicating) to the
    nodes it reads from.

    Contract: at most one vQP per node, to the incarnation last connected (a connect to a
    new one closes the vQP kept first); one connect per node at a time, run in
    ``nursery`` (single-flight); a node whose connect failed, or that a reader found
    unreachable (``skip``), is ``skipped`` for UNREACHABLE_SKIP seconds. Owns the vQPs and the RPC
    clients until ``aclose``. Trio thread only.
    """

    def __init__(self, endpoint: Endpoint, secret: bytes, me: str, rpc_timeout: float,
                 nursery: trio.Nursery) -> None:
        self.ep = endpoint
        self.secret = secret
        self.me = me                           # this process, as named in RPC handshakes
        self.rpc_timeout = rpc_timeout
        self._vqps: dict[str, tuple[float, VQP]] = {}   # node → (started, vqp)
        self._connects: SingleFlight[VQP] = SingleFlight(nursery)   # keyed by node
        self._rpc: dict[str, RpcClient] = {}
        self._skip_until: dict[str, float] = {}

    async def vqp(self, rec: NodeRecord) -> VQP:
        """The vQP to this incarnation of ``rec.node``, connecting once if there is none.
        A joined connect may have been to another incarnation: then look again."""
        while not self.connected(rec):
            await self._connects.run(rec.node, self._connect, rec)
        return self._vqps[rec.node][1]

    def connected(self, rec: NodeRecord) -> bool:
        """Whether a vQP to this incarnation of ``rec.node`` is set up (its paths may have
        died since: that is a fault, which hedging covers, not a connect)."""
        have = self._vqps.get(rec.node)
        return have is not None and have[0] == rec.started

    def now(self, rec: NodeRecord) -> VQP | None:
        """The vQP to this incarnation of ``rec.node`` if it is set up, else None."""
        return self._vqps[rec.node][1] if self.connected(rec) else None

    def back(self, rec: NodeRecord) -> bool:
        """Whether ``rec.node`` is back as a new incarnation that has no vQP yet (the
        vQP kept is to the one before)."""
        have = self._vqps.get(rec.node)
        return have is not None and have[0] != rec.started

    def back_last(self, recs: list[NodeRecord]) -> list[NodeRecord]:
        """``recs`` with the nodes back as a new incarnation moved last, and their
        connects started in the background (single-flight; module docstring)."""
        back = [r for r in recs if self.back(r)]
        if not back:
            return recs
        for r in back:
            if not self._connects.in_flight(r.node):
                self._connects.start(r.node, self._connect, r)
        return [r for r in recs if not self.back(r)] + back

    def connecting(self, node: str) -> bool:
        """Whether a connect to ``node`` is going on."""
        return self._connects.in_flight(node)

    def skip(self, node: str) -> None:
        """``node`` was unreachable (or misbehaved): skip it for UNREACHABLE_SKIP seconds."""
        self._skip_until[node] = time.monotonic() + UNREACHABLE_SKIP

    def skipped(self, node: str, now: float) -> bool:
        return self._skip_until.get(node, 0.0) > now

    async def _connect(self, rec: NodeRecord) -> VQP:
        have = self._vqps.get(rec.node)
        if have is not None:                           # the node restarted: new incarnation
            await have[1].aclose()
        grace = self.ep.cfg.unreachable_grace
        try:
            vqp = await self.ep.connect(rec.nics, rec.port, timeout=max(1.0, 2 * grace))
        except FAILED:
            self.skip(rec.node)                        # (nobody may wait on it)
            raise
        self._vqps[rec.node] = (rec.started, vqp)
        return vqp

    def rpc(self, rec: NodeRecord) -> RpcClient:
        c = self._rpc.get(rec.node)
        if c is None or c.addrs != rec.nics:
            c = self._rpc[rec.node] = RpcClient(self.secret, self.me, rec.nics, rec.rpc_port,
                                                self.rpc_timeout)
        return c

    def statistics(self) -> dict[str, VQPStats]:
        """Each node's vQP statistics (``rdma.vrdma`` VQPStats, with its paths)."""
        return {n: v.statistics() for n, (_, v) in list(self._vqps.items())}

    async def aclose(self) -> None:
        for _, vqp in self._vqps.values():
            await vqp.aclose()
        for c in self._rpc.values():
            await c.aclose()
