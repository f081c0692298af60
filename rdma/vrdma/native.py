"""The paths of a virtual QP as C sees them: READs posted in C beside the vQP.

The FUSE engine's native fetch (``kspeedfs.cluster.native.fetch``) posts some READs
itself, on the soft provider's C engine, instead of through :meth:`VQP.read`.  It asks
for an UP path and the READ's addresses and keys through it
(:meth:`NativePaths.target`, or every UP path at once: :meth:`NativePaths.paths`), and
tells when one of its READs completed (:meth:`NativePaths.done`).  A READ posted there is
not the vQP's: no failover, no re-post; its poster steps aside on any error (soft engine
C API, ``ks_post_send``).  Its only effects here are on liveness: its traffic keeps the
monitor from idling (``ReadDispatcher.native_traffic``), and its completions are evidence
that their path lives.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from .dispatch import ReadDispatcher
from .pathset import PathSet
from .peer import Peer
from .vmr import VMR, RemoteVMR


class NativeTarget(NamedTuple):
    """A READ as C posts it (:meth:`VQP.native_target`): the soft engine (an
    ``rdma._soft_engine.Engine``) and QP number of one UP path, the local buffer's address
    and lkey, and the remote address and rkey through that path."""

    engine: Any
    qpn: int
    laddr: int
    lkey: int
    raddr: int
    rkey: int


class NativePaths:
    """The UP paths of one vQP that C may post READs on, round-robin.

    Contract: synchronous, called from the vQP's owner's trio task; posts nothing itself
    and changes no path's state but through ``PathSet.note`` of a completion C reported.
    The vQP answers for closed-ness and checks a READ's ranges before asking here.
    """

    def __init__(self, pathset: PathSet, reads: ReadDispatcher, peer: Peer,
                 clock: Callable[[], float]) -> None:
        self._pathset = pathset
        self._reads = reads
        self._peer = peer
        self._clock = clock
        self._rr = 0                         # round-robin over paths

    def target(self, local_vmr: VMR, local_off: int, rm: RemoteVMR,
               off: int) -> NativeTarget | None:
        """Where C may post one READ (both ranges already checked) of ``rm`` at ``off``
        into ``local_vmr`` at ``local_off``: the next UP path on the soft provider, or
        None when there is none (or the provider has no C handles)."""
        paths = self._pathset.paths
        n = len(paths)
        for i in range(n):
            p = paths[(self._rr + i) % n]
            raw = getattr(getattr(p.qp, "engine", None), "raw", None)
            if not p.m.postable or raw is None:
                continue
            self._rr = (self._rr + i + 1) % n
            self._reads.native_traffic(self._clock())
            laddr, lkey = local_vmr.on(p.local_nic, local_off)
            raddr, rkey = rm.on(p.remote_nic, off)
            assert p.qp is not None
            return NativeTarget(raw, p.qp.qp_num, laddr, lkey, raddr, rkey)
        return None

    def paths(self, remote: str) -> list[tuple[Any, int, str, int, int]]:
        """Every UP path on the soft provider as C may post READs of vMR ``remote`` on it:
        ``(soft engine, QP number, local NIC, remote address of the vMR's first byte,
        rkey)`` each; [] when none is UP or the peer exports no ``remote``."""
        rm = self._peer.remote_mrs.get(remote)
        if rm is None:
            return []
        out = []
        for p in self._pathset.paths:
            raw = getattr(getattr(p.qp, "engine", None), "raw", None)
            if p.m.postable and raw is not None and p.qp is not None:
                raddr, rkey = rm.on(p.remote_nic, 0)
                out.append((raw, p.qp.qp_num, p.local_nic, raddr, rkey))
        return out

    def done(self, qpn: int) -> None:
        """A READ C posted on the path of QP ``qpn`` completed successfully: proof that
        the path lives, as a data READ's WC is (``ReadDispatcher.on_wc``).  Those WCs
        reach C's CQ, not the path's, so without this a path carrying only C's READs was
        silent to the monitor: healthy paths went SUSPECT and DOWN under steady load
        (docs/design.md, "The native chunk fetch").  A QP number no path has any more is
        ignored, and so is a path not alive: a READ that completed before its path went
        DOWN must not bring the rebuilt one UP (its heartbeat does, checking the peer's
        incarnation)."""
        for p in self._pathset.paths:
            if p.qp is not None and p.qp.qp_num == qpn and p.m.alive:
                now = self._clock()
                self._reads.native_traffic(now)
                self._pathset.note(p.m.traffic(now))
                return
