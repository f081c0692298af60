"""Rebuilding a failed path of a virtual QP (and building it the first time: same code).

One rebuild, started by the monitor (:mod:`.monitor`) once a DOWN path's backoff ran
out::

     DOWN ── QP → ERR, wait until every WR on it has flushed (≤ 1 s) ──┐
                                                                        v
       QP → RESET; WRs never flushed are taken back and re-posted (:mod:`.dispatch`)
                                                                        │
                                              rebuild_started ─► REBUILDING
                                                                        │
       connect_path(path): fresh authenticated control connection on this NIC pair,
       the peer's reply refreshes :class:`~.peer.Peer`, RESET → INIT → RTR → RTS
          │ raised                                        │ returned
          v                                               v
     rebuild_failed ─► DOWN, next_attempt               connected (still REBUILDING):
       after a backoff (:class:`~.path.PathMachine`)     the monitor probes at once and
                                                         the first heartbeat makes it UP

One build has ``path.build_budget`` seconds (``connect_timeout``, 1 s), doubled after a
build that ran out of it (up to 8 s), and kept: measured in the one-vCPU TCG guests of
tests/vm, every rebuild after a NIC flap took just over 1 s, so with a fixed budget the
repaired path never came back (0 of 4 runs); with one reset after each success every
repair cost a timed-out build first (rebuilds of 2.6–5.6 s). A failure is logged at INFO once per
distinct reason, then at DEBUG.

Why wait for the flush: a READ's buffer may be re-posted only when the old QP can no
longer write into it, i.e. after its flush WC was polled (api cancellation contract).  A
provider that never flushes would hang a rebuild forever; after a generous bound the
leftovers are taken back by the reset (which discards WRs) and re-posted.
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from ..enums import IBV_QPS_RESET
from .dispatch import ReadDispatcher
from .heartbeat import HeartbeatConfig
from .path import Path, PathState
from .pathset import PathSet

#: the vQP's log lines keep the logger name they always had (operators filter on it)
log = logging.getLogger("rdma.vrdma.vqp")

#: (re)build one path: QP from RESET to RTS against a fresh peer QP, over a fresh control
#: connection that stays open as the peer QP's lease (``path.control``); raises on failure
ConnectPath = Callable[[Path], Awaitable[None]]


class Rebuilder:
    """Runs the rebuilds of one vQP's paths, at most one per path at a time.

    Attributes:
        paths: the :class:`PathSet` whose transitions it reports.
        reads: where READs a reset QP discarded go back to.
        connect_path: the endpoint's half of a build (:data:`ConnectPath`).
    """

    def __init__(self, paths: PathSet, reads: ReadDispatcher, cfg: HeartbeatConfig,
                 clock: Callable[[], float], connect_path: ConnectPath) -> None:
        self.paths = paths
        self.reads = reads
        self.cfg = cfg
        self.clock = clock
        self.connect_path = connect_path
        self._running: set[int] = set()
        self._told: dict[int, str] = {}          # path id -> the last failure logged at INFO

    def claim(self, path: Path, now: float) -> bool:
        """Is a rebuild of ``path`` due now (DOWN, backoff over, none running)?  If so
        it counts as running from here: the caller must start :meth:`rebuild`."""
        if (path.m.state is PathState.DOWN and path.id not in self._running
                and now >= path.m.next_attempt):
            self._running.add(path.id)
            return True
        return False

    async def rebuild(self, path: Path) -> bool:
        """DOWN → REBUILDING → connected (True: its QP is in RTS, waiting for a heartbeat)
        or back to DOWN (False)."""
        try:
            await self._wait_drained(path)
            self.paths.note(path.m.rebuild_started(self.clock()))
            try:
                await self.connect_path(path)
            except Exception as e:
                reason = f"rebuild failed: {type(e).__name__}: {e}"
                # INFO once per distinct reason (a path that keeps failing to come back
                # says why, without a line per attempt)
                level = logging.DEBUG if self._told.get(path.id) == reason else logging.INFO
                self._told[path.id] = reason
                log.log(level, "vqp %s: path %s %s", self.paths.peer, path.name, reason)
                self.paths.note(path.m.rebuild_failed(reason, self.clock()))
                return False
            self.paths.note(path.m.rebuild_connected(self.clock()))
            self._told.pop(path.id, None)
            return True
        finally:
            self._running.discard(path.id)

    async def _wait_drained(self, path: Path) -> None:
        """Wait until every WR of the dead QP has completed (flushed): only then may the
        QP be reset, or a buffer be re-posted (module docstring)."""
        path.set_error_state()
        deadline = self.clock() + 1.0
        while path.inflight and self.clock() < deadline:
            await trio.sleep(self.cfg.interval / 2)
        if path.qp is not None and path.qp.qp_state != IBV_QPS_RESET:
            path.qp.to_reset()
        leftovers = list(path.inflight.values())
        path.inflight.clear()
        if leftovers:
            log.warning("vqp %s: path %s: %d WRs never flushed; re-posting after reset",
                        self.paths.peer, path.name, len(leftovers))
        path.data_inflight = 0
        path.m.live.probe_done()
        self.reads.take_back(path, leftovers)
