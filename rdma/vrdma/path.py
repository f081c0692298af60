"""One physical path of a virtual QP: local NIC × remote NIC, one RC QP, and its state.

::

              silent >= suspect_after*I            silent >= M*I
     +----+  ------------------------->  +---------+  ------------------+
     | UP |                              | SUSPECT |                    |
     +----+  <-------------------------  +---------+                    v
      ^  |        anything completes          |  error WC           +------+
      |  |                                    +-------------------> |      |
      |  |  error WC (RETRY_EXC, flush, access ...), post refused   | DOWN |
      |  +--------------------------------------------------------> |      |
      |                                                             +------+
      |                                                              |    ^
      |                    rebuild task, after backoff:              |    |  connect failed,
      |                    QP RESET, fresh control connection,       v    |  or silent >= M*I
      |  first heartbeat   INIT -> RTR -> RTS                     +------------+
      +---------------------------------------------------------- | REBUILDING |
         (READs flow again)                                       +------------+

    any state --close()--> CLOSED

* UP: READs are posted here (least-loaded first).  SUSPECT: no *new* READs unless no path
  is UP; in-flight ones keep their chance.  DOWN: the QP has been moved to ERR, so every
  outstanding WR flushes and each flushed READ is re-posted on another path by the vQP.
  REBUILDING: QP RESET → INIT → RTR → RTS against a fresh peer QP, over a fresh
  authenticated control connection on this very NIC pair; it rejoins (UP) only when a
  heartbeat completes, i.e. when READs demonstrably flow again.
* The last live path to a peer is *held*: silence makes it SUSPECT, not DOWN (nowhere to
  fail over to, and a starved host or peer may only be late).  The vQP starts the
  peer-dead clock from that silence and fails the path when ``unreachable_grace`` runs out
  (:meth:`rdma.vrdma.monitor.HeartbeatMonitor.give_up_held`), so PeerUnreachable keeps
  its bound.
* A path that has never been UP (e.g. a cross-rail NIC pair with no route) sits in DOWN and
  is retried with a slower backoff; it never counts as a lost path.

:class:`PathMachine` is the state machine alone: synchronous, no I/O, time passed in, so
Hypothesis drives it (``tests/rdma/test_vrdma_path.py``).  :class:`Path` adds the verbs
objects (QP, CQ) and the in-flight table; the tasks that drive it are :mod:`.vqp` (the
CQ consumer), :mod:`.monitor` (heartbeats) and :mod:`.rebuild`.
"""
from __future__ import annotations

import enum
import logging
import random
import select
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..enums import IBV_QPS_ERR, IBV_QPS_RESET, ibv_wc_status
from .heartbeat import HeartbeatConfig, Liveness

if TYPE_CHECKING:
    from ..api import CQ, QP

log = logging.getLogger(__name__)


class PathState(enum.Enum):
    UP = "UP"
    SUSPECT = "SUSPECT"
    DOWN = "DOWN"
    REBUILDING = "REBUILDING"
    CLOSED = "CLOSED"


@dataclass(frozen=True)
class Transition:
    path_id: int
    old: PathState
    new: PathState
    reason: str
    at: float


class PathMachine:
    """The path state machine (see the module diagram).  Every event returns the
    :class:`Transition` it caused, or ``None``."""

    def __init__(self, path_id: int, cfg: HeartbeatConfig, now: float) -> None:
        self.path_id = path_id
        self.cfg = cfg
        self.state = PathState.DOWN
        self.reason = "not connected yet"
        self.since = now
        self.live = Liveness(cfg, now)
        self.connected = False          # QP in RTS (REBUILDING: waiting for a heartbeat)
        self.ever_up = False
        self.attempts = 0               # consecutive failed (re)builds
        self.next_attempt = now         # DOWN: earliest time of the next rebuild
        self.downs = 0
        self.rebuilds = 0
        self.rebuild_started_at: float | None = None
        self.last_rebuild_seconds: float | None = None

    # ---- queries
    @property
    def postable(self) -> bool:
        return self.state is PathState.UP

    @property
    def fallback_postable(self) -> bool:
        return self.state is PathState.SUSPECT

    @property
    def alive(self) -> bool:
        """Counts towards 'the peer is reachable': READs may still complete here."""
        return self.state in (PathState.UP, PathState.SUSPECT)

    def silent_dead(self, now: float) -> bool:
        """Alive, but silent for the DOWN threshold (a held last path)."""
        return self.alive and self.live.verdict(now) == "down"

    def _go(self, new: PathState, reason: str, now: float) -> Transition:
        t = Transition(self.path_id, self.state, new, reason, now)
        self.state, self.reason, self.since = new, reason, now
        return t

    # ---- events
    def ok(self, now: float) -> Transition | None:
        """Something (probe or data READ) completed successfully on this path."""
        if self.state is PathState.CLOSED or not self.connected:
            return None
        self.live.ok(now)
        if self.state is PathState.SUSPECT:
            return self._go(PathState.UP, "traffic resumed", now)
        if self.state is PathState.REBUILDING:
            self.ever_up = True
            self.attempts = 0
            if self.rebuild_started_at is not None:
                self.last_rebuild_seconds = now - self.rebuild_started_at
            return self._go(PathState.UP, "heartbeat after (re)connect", now)
        return None

    def traffic(self, now: float) -> Transition | None:
        """A data READ completed on this path (or its response bytes are arriving): ``ok``,
        and it stands in for the next probe (``Liveness.data_ok``)."""
        self.live.data_ok(now)
        return self.ok(now)

    def tick(self, now: float, hold: bool = False) -> Transition | None:
        """Periodic heartbeat verdict.  ``hold``: this is the last live path to the peer;
        silence makes it SUSPECT but not DOWN (see :attr:`silent_dead`), because there is
        nowhere to fail over to and a transient stall (a starved peer or host) should not
        flush READs that may still complete.  The vQP decides when to give up on it."""
        if not self.connected or self.state in (PathState.DOWN, PathState.CLOSED):
            return None
        if self.state is PathState.REBUILDING:
            # A rebuilt QP is verified by its first heartbeat, with the rebuild's budget
            # (connect_timeout): the M·I rule is for noticing that a working path died.
            if self.live.silence(now) >= self.cfg.connect_timeout and \
                    self.live.probe_since is not None:
                return self.fail(f"no heartbeat {self.cfg.connect_timeout * 1e3:.0f} ms "
                                 "after (re)connect", now)
            return None
        v = self.live.verdict(now)
        if v == "down" and hold:
            if self.state is PathState.UP:
                return self._go(PathState.SUSPECT, f"silent for "
                                f"{self.live.silence(now) * 1e3:.0f} ms (last path: held)", now)
            return None
        if v == "down":
            return self.fail(f"no heartbeat for {self.live.silence(now) * 1e3:.0f} ms", now)
        if v == "suspect" and self.state is PathState.UP:
            return self._go(PathState.SUSPECT,
                            f"silent for {self.live.silence(now) * 1e3:.0f} ms", now)
        return None

    def wc_error(self, status: int, now: float) -> Transition | None:
        """A WC failed on this path (the QP is in ERR now, whatever the status)."""
        if not self.connected or self.state in (PathState.DOWN, PathState.CLOSED):
            return None
        name = getattr(ibv_wc_status(status), "name", str(status))
        return self.fail(f"completion error {name}", now)

    def fail(self, reason: str, now: float) -> Transition | None:
        if self.state in (PathState.DOWN, PathState.CLOSED):
            return None
        was_rebuilding = self.state is PathState.REBUILDING
        self.connected = False
        if was_rebuilding:
            return self.rebuild_failed(reason, now)
        self.downs += 1
        self.attempts = 0
        self.next_attempt = now          # rebuild right away, back off after failures
        return self._go(PathState.DOWN, reason, now)

    def rebuild_started(self, now: float) -> Transition | None:
        if self.state is not PathState.DOWN:
            return None
        self.rebuilds += 1
        self.connected = False
        if self.rebuild_started_at is None or self.attempts == 0:
            self.rebuild_started_at = now
        return self._go(PathState.REBUILDING, "rebuilding", now)

    def rebuild_connected(self, now: float) -> Transition | None:
        """QP back in RTS against a fresh peer QP; UP follows the first heartbeat."""
        if self.state is not PathState.REBUILDING:
            return None
        self.connected = True
        self.live.reset(now)
        return None

    def rebuild_failed(self, reason: str, now: float,
                       rng: random.Random | None = None) -> Transition | None:
        if self.state is not PathState.REBUILDING:
            return None
        self.connected = False
        self.attempts += 1
        self.next_attempt = now + self.backoff(self.attempts, rng)
        return self._go(PathState.DOWN, reason, now)

    def backoff(self, attempts: int, rng: random.Random | None = None) -> float:
        cap = self.cfg.rebuild_backoff_max if self.ever_up else self.cfg.never_up_backoff_max
        base: float = min(cap, self.cfg.rebuild_backoff * (2 ** max(0, attempts - 1)))
        return base * (0.75 + 0.5 * (rng or random).random())

    def close(self, now: float) -> Transition | None:
        if self.state is PathState.CLOSED:
            return None
        self.connected = False
        return self._go(PathState.CLOSED, "closed", now)


@dataclass(frozen=True)
class PathStats:
    """One path as ``python -m rdma.vrdma.paths`` and ``VQP.statistics()`` show it."""

    path_id: int
    local_nic: str
    remote_nic: str
    state: str
    reason: str
    since: float
    ever_up: bool
    inflight: int
    reads_ok: int
    bytes_ok: int
    reads_failed_over: int
    heartbeats_ok: int
    downs: int
    rebuilds: int
    last_rebuild_seconds: float | None
    qp_num: int | None


class Path:
    """A :class:`PathMachine` plus its verbs objects and in-flight table.

    ``inflight`` maps wr_id → the op that WR carries (a vQP read op, or ``HEARTBEAT``);
    an entry leaves only when that WR's WC has been polled, so a buffer is never re-posted
    while the old QP may still write it (api cancellation contract).
    """

    HEARTBEAT = object()

    def __init__(self, path_id: int, local_nic: str, remote_nic: str,
                 cfg: HeartbeatConfig, now: float) -> None:
        self.id = path_id
        self.local_nic = local_nic
        self.remote_nic = remote_nic
        self.m = PathMachine(path_id, cfg, now)
        self.qp: QP | None = None
        self.cq: CQ | None = None
        self.inflight: dict[int, Any] = {}
        self.data_inflight = 0
        self.reads_ok = 0
        self.bytes_ok = 0
        self.failed_over = 0
        self.heartbeats_ok = 0
        self.control: Any = None        # the open control stream that leases the peer QP
        self.build_budget = cfg.connect_timeout   # s for one (re)build; grows when too slow
        self.remote_control: tuple[int, int] | None = None   # (addr, rkey) heartbeat word
        self.hb_slot = 0                 # offset of this path's probe target, local scratch

    def __repr__(self) -> str:
        return f"<Path {self.id} {self.local_nic}->{self.remote_nic} {self.m.state.value}>"

    @property
    def name(self) -> str:
        return f"{self.local_nic}->{self.remote_nic}"

    def set_error_state(self) -> None:
        """Move the QP to ERR so every outstanding WR flushes (idempotent, never raises)."""
        qp = self.qp
        if qp is None or qp.closed:
            return
        try:
            if qp.qp_state not in (IBV_QPS_ERR, IBV_QPS_RESET):
                qp.to_err()
        except Exception:  # a provider that is already tearing down: flushes come anyway
            log.debug("path %s: to_err failed", self.name, exc_info=True)

    def wcs_pending(self) -> bool:
        """Is the CQ holding WCs its consumer has not polled yet?  (A peek at the fd,
        never a poll: the consumer task stays the CQ's only poller.)"""
        cq = self.cq
        if cq is None or cq.closed:
            return False
        try:
            p = select.poll()               # poll, not select: any fd number
            p.register(cq.fd, select.POLLIN)
            return bool(p.poll(0))
        except (OSError, ValueError):
            return False

    def statistics(self) -> PathStats:
        m = self.m
        qpn = None
        if self.qp is not None and not self.qp.closed:
            qpn = self.qp.qp_num
        return PathStats(
            path_id=self.id, local_nic=self.local_nic, remote_nic=self.remote_nic,
            state=m.state.value, reason=m.reason, since=m.since, ever_up=m.ever_up,
            inflight=self.data_inflight, reads_ok=self.reads_ok, bytes_ok=self.bytes_ok,
            reads_failed_over=self.failed_over, heartbeats_ok=self.heartbeats_ok,
            downs=m.downs, rebuilds=m.rebuilds,
            last_rebuild_seconds=m.last_rebuild_seconds, qp_num=qpn)


def choose_path(paths: list[Path], rr: int, max_inflight: int) -> Path | None:
    """Least-loaded healthy path, round-robin among equals (``rr`` rotates the start).
    UP paths first; SUSPECT ones only when no path is UP.  ``None``: nowhere to post."""
    n = len(paths)
    for want in ("postable", "fallback_postable"):
        best: Path | None = None
        for i in range(n):
            p = paths[(rr + i) % n]
            if not getattr(p.m, want) or p.data_inflight >= max_inflight:
                continue
            if best is None or p.data_inflight < best.data_inflight:
                best = p
        if best is not None:
            return best
    return None
