"""The heartbeat monitor of a virtual QP: the one task that keeps time for its paths.

Every tick (``interval``; ``idle_interval`` on an idle vQP, ``quiet_interval`` on a quiet
one, see :mod:`.heartbeat`)::

    for each path:
        looks quiet, but response bytes arrived on its QP within I ─► alive (_rx_evidence)
        WCs queued on its CQ, not yet consumed? ─► skip: that is not silence
        tick(): silence ─► SUSPECT / DOWN (the last live path is held SUSPECT)
        connected, not DOWN, no probe out, no data in the last I/2 ─► post a probe
        DOWN, backoff elapsed, no rebuild running ─► start a rebuild task (:mod:`.rebuild`);
                                                     connected again ─► probe at once
    peer-dead clock (:mod:`.pathset`) ─► held last path given up after the grace period
    waiting READs past their bound ─► PeerUnreachable (:mod:`.dispatch`)

A probe is an 8-byte RDMA READ of the peer's heartbeat word into this path's slot of the
vQP's scratch vMR; its WC (routed here by the CQ consumer) must carry the peer's
incarnation, else the peer restarted and the path fails.  The arithmetic behind the
defaults and their measurements are in :mod:`.heartbeat`.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import trio

from ..api import SendWR
from ..enums import IBV_SEND_SIGNALED, IBV_WC_SUCCESS, IBV_WR_RDMA_READ
from ..errors import PostError, RdmaError
from .dispatch import ReadDispatcher
from .heartbeat import HEARTBEAT_BYTES, HeartbeatConfig
from .path import Path, PathState
from .pathset import PathSet
from .peer import Peer
from .rebuild import Rebuilder
from .vmr import VMR


class HeartbeatMonitor:
    """Probes, verdicts, rebuild starts and expiry for the paths of one vQP.

    Contract: :meth:`run` is the only caller of ``PathMachine.tick`` and the only starter
    of rebuilds; at most one probe is in flight per path (``Liveness.want_probe``).

    Attributes:
        name: task-name prefix (``vqp<id>``).
        paths, peer, reads, rebuilder: the vQP's parts it drives.
        scratch: the vMR probes land in, :data:`HEARTBEAT_BYTES` per path at
            ``path.hb_slot``.
    """

    def __init__(self, name: str, paths: PathSet, peer: Peer, scratch: VMR,
                 reads: ReadDispatcher, rebuilder: Rebuilder, cfg: HeartbeatConfig,
                 clock: Callable[[], float], wr_ids: itertools.count[int]) -> None:
        self.name = name
        self.paths = paths
        self.peer = peer
        self.scratch = scratch
        self.reads = reads
        self.rebuilder = rebuilder
        self.cfg = cfg
        self.clock = clock
        self._wr_ids = wr_ids
        for p in paths.paths:
            p.hb_slot = p.id * HEARTBEAT_BYTES

    async def run(self, nursery: trio.Nursery) -> None:
        """Tick forever; rebuild tasks are started in ``nursery``."""
        iv = self.cfg.interval
        paths = self.paths.paths
        while True:
            now = self.clock()
            for p in paths:
                self._rx_evidence(p, now)
                others = any(q.m.alive for q in paths if q is not p)
                if p.m.connected and p.m.live.verdict(now) == "down" and p.wcs_pending():
                    continue          # its WCs are queued, not yet consumed: not silence
                self.paths.note(p.m.tick(now, hold=not others))
                if p.m.connected and p.m.state is not PathState.DOWN \
                        and p.m.live.want_probe(now):
                    self.probe(p, now)
                if p.m.state is PathState.DOWN and self.rebuilder.claim(p, now):
                    nursery.start_soon(self._rebuild, p, name=f"{self.name}-rebuild{p.id}")
            self.paths.update_reachability(now)
            dead_long = self.paths.dead_for_grace(now)
            if dead_long:
                self.give_up_held(now)
            self.reads.expire(now, dead_long)
            tick = self.reads.idle_tick(now)
            if tick is not None:
                await self.reads.wait_for_read(tick)
            else:
                await trio.sleep(iv)

    def _rx_evidence(self, path: Path, now: float) -> None:
        """Bytes of a response arriving on a quiet-looking path's QP (``QP.rx_age``: a
        READ still moving) prove it alive as a completed READ does, so it is neither
        probed nor judged silent meanwhile. Without it a probe waited behind the 4 MiB
        READs on the same QP (~19 ms each per path on this VM's soft provider), and in
        the steady 4-reader peer loop healthy paths still went SUSPECT ~110 and DOWN ~4
        times in 10 s. UP and SUSPECT paths only: a rebuilt one is UP after a heartbeat
        (which checks the peer's incarnation)."""
        live = path.m.live
        if path.qp is None or not path.m.alive \
                or not (live.want_probe(now) or live.verdict(now) != "ok"):
            return
        try:
            age = path.qp.rx_age()
        except RdmaError:
            return
        if age is not None and age < self.cfg.interval:
            self.paths.note(path.m.traffic(now - age))

    async def _rebuild(self, path: Path) -> None:
        if await self.rebuilder.rebuild(path):
            self.probe(path, self.clock())      # UP follows this probe's WC

    def give_up_held(self, now: float) -> None:
        """The peer has been dead for the grace period: fail a held last path that is
        still silent, so its READs flush, come back and fail with PeerUnreachable."""
        for p in self.paths.paths:
            if p.m.silent_dead(now) and not p.wcs_pending():
                self.paths.fail(p, f"no heartbeat for "
                                f"{p.m.live.silence(now) * 1e3:.0f} ms (last path)", None)

    def probe(self, path: Path, now: float) -> None:
        """Post one heartbeat READ on ``path`` (a refused post fails the path)."""
        rc = self.peer.control.get(path.remote_nic)
        if rc is None or path.qp is None:
            return
        wr_id = next(self._wr_ids)
        wr = SendWR(wr_id=wr_id, opcode=IBV_WR_RDMA_READ, send_flags=IBV_SEND_SIGNALED,
                    sg_list=[self.scratch.sge(path.local_nic, path.hb_slot, HEARTBEAT_BYTES)],
                    remote_addr=rc[0], rkey=rc[1])
        try:
            path.qp.post_send(wr)
        except PostError as e:
            self.paths.fail(path, f"heartbeat post refused: {e.msg}", e)
            return
        path.inflight[wr_id] = Path.HEARTBEAT
        path.m.live.probe_posted(now)

    def on_wc(self, path: Path, wc: Any, now: float) -> None:
        """The WC of a probe on ``path`` (already taken out of ``path.inflight``)."""
        path.m.live.probe_done()
        if wc.status != IBV_WC_SUCCESS:
            self.paths.wc_failed(path, wc, now)
            return
        word = int.from_bytes(self.scratch.read(HEARTBEAT_BYTES, path.hb_slot), "little")
        if word != self.peer.incarnation:
            self.paths.fail(path, f"peer incarnation {word:#x} != "
                            f"{self.peer.incarnation:#x} (restarted?)", None)
            return
        path.heartbeats_ok += 1
        self.paths.note(path.m.ok(now))
