"""⑤ The peers a native fetch tells C of, by number: one table for the mount's
(:class:`~.routes.Routes`, fuse_fetch.h) and the library's (:class:`~..peer_wait.PeerWait`,
peer_wait.h).

    PeerTable.tell(rec, vqp)   a peer's number in C's table, its UP paths told (and what
                               else its caller tells with them) only when they changed
    PeerTable.record(n)        the record and vQP last told under number n (origin of a
                               READ C started); ``numbered``: those numbered now
    PeerTable.qpn(n, path)     the QP of number n's ``path``-th path as last told
    PeerTable.handle(raw)      a soft engine's handle in C (one per engine, made once)
    stage(ep, ...)             C's staging slots, of one size, from one vMR of their own

Both fetches number peers the same way, compute the same paths and give C the same
slots; only the C calls differ, so they are passed in.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rdma.vrdma import VMR, VQP, Endpoint

    from ..membership import NodeRecord

#: one UP path as C takes it: (engine handle, QP number, remote address, rkey, NIC index)
Path = tuple[int, int, int, int, int]


class PeerTable:
    """The peers told to C, numbered ``0 .. size - 1`` by incarnation (node, started).

    Contract: a new incarnation past ``size`` numbers them anew (``unroute()`` first: C
    drops its routes and peers); ``peer(n, paths, *extra)`` is called only when the
    paths or ``extra`` of number n differ from those told last. A path is one of the
    vQP's first two UP paths on a local NIC among ``nics`` (past them: no lkey), with
    that NIC's index in ``nics``. ``record`` keeps a number's last holder across a
    renumbering, for a READ C started before it. Not thread-safe: the trio thread's.
    """

    def __init__(self, nics: Sequence[str], size: int, engine: Callable[[Any], int],
                 peer: Callable[..., Any], unroute: Callable[[], Any]) -> None:
        """``nics``: the local NICs in a slot's lkey order; ``engine(raw)``: C's handle of
        soft engine ``raw``; ``peer(n, paths, *extra)``, ``unroute()``: C's calls."""
        self.nics = list(nics)
        self.size = size
        self._engine, self._peer, self._unroute = engine, peer, unroute
        self._ids: dict[tuple[str, float], int] = {}        # (node, started) → number
        self._of: dict[int, tuple[NodeRecord, VQP]] = {}    # number → its last holder
        self._told: dict[int, tuple[Any, ...]] = {}         # number → (paths, *extra)
        self._handles: dict[int, int] = {}                  # id(soft engine) → handle

    def tell(self, rec: NodeRecord, vqp: VQP, withhold: bool = False,
             extra: Callable[[tuple[Any, ...], bool], tuple[Any, ...]] | None = None,
             ) -> int | None:
        """``rec``'s number, its UP paths told to C when they changed; None when it has
        none. ``withhold``: tell it no path. ``extra(last, up)``: what else C is told
        with the paths (``last``: the extra told last, () if none; ``up``: it has one)."""
        idx = self.number(rec, vqp)
        paths = [] if withhold else self.paths(vqp)
        last = self._told.get(idx, ((),))[1:]
        more = extra(last, bool(paths)) if extra is not None else ()
        told = (tuple(paths), *more)
        if self._told.get(idx) != told:
            self._peer(idx, paths, *more)
            self._told[idx] = told
        return idx if paths else None

    def number(self, rec: NodeRecord, vqp: VQP) -> int:
        """``rec``'s number (a new one, or the table numbered anew when full), ``vqp``
        kept as its way to it."""
        ident = (rec.node, rec.started)
        idx = self._ids.get(ident)
        if idx is None:
            if len(self._ids) >= self.size:     # (incarnations come and go)
                # numbered anew; a C-started READ still out is then counted against the
                # new holder of its number, or the last one while there is none
                self._unroute()
                self._ids.clear()
                self._told.clear()
            idx = self._ids[ident] = len(self._ids)
        self._of[idx] = (rec, vqp)
        return idx

    def paths(self, vqp: VQP) -> list[Path]:
        """``vqp``'s UP paths as C posts on them (the first two, on a NIC of ``nics``)."""
        paths = []
        for raw, qpn, nic, raddr, rkey in vqp.native_paths("arena")[:2]:
            if nic in self.nics:
                paths.append((self.handle(raw), qpn, raddr, rkey, self.nics.index(nic)))
        return paths

    def number_of(self, node: str, started: float) -> int | None:
        """The number of incarnation ``started`` of ``node`` now, if it has one."""
        return self._ids.get((node, started))

    def record(self, idx: int) -> tuple[NodeRecord, VQP] | None:
        """The record and vQP last told under number ``idx``, also before a renumbering;
        None for a number never told."""
        return self._of.get(idx)

    def numbered(self) -> dict[int, tuple[NodeRecord, VQP]]:
        """Number → record and vQP, of the peers numbered now."""
        return {idx: self._of[idx] for idx in self._ids.values()}

    def qpn(self, idx: int, path: int) -> int:
        """The QP of number ``idx``'s ``path``-th path as last told; 0: no such path."""
        paths = self._told.get(idx, ((),))[0]
        return int(paths[path][1]) if 0 <= path < len(paths) else 0

    def handle(self, raw: Any) -> int:
        """C's handle of soft engine ``raw`` (``engine(raw)``, once per engine)."""
        handle = self._handles.get(id(raw))
        if handle is None:
            handle = self._handles[id(raw)] = self._engine(raw)
        return handle


def stage(ep: Endpoint, count: int, size: int, nics: Sequence[str],
          give: Callable[[int, int, list[int]], bool], name: str) -> VMR:
    """``count`` staging slots of ``size`` bytes (rounded up to pages) in a vMR of their
    own, each given to C as ``give(laddr, size, lkeys)`` (an lkey on each of ``nics``)
    until C takes no more; the vMR, C's for good."""
    step = -(-size // 4096) * 4096
    vmr = ep.alloc(count * step, name=name)
    for i in range(count):
        keys = [vmr.on(nic, i * step) for nic in nics]
        if not give(keys[0][0], size, [lkey for _, lkey in keys]):
            break
    return vmr
