"""READ dispatch of a virtual QP: posting, completion, failover, waiting, cancellation.

::

    read() ─► dispatch(op) ─► choose_path(): least-loaded UP path, round-robin on ties
                 │                 └─ none: op waits in ``waiting`` (bounded, see below)
                 └─► post RDMA_READ on path.qp, path.inflight[wr_id] = op
    on_wc(path, op, wc)   (called by the path's CQ consumer, :mod:`.vqp`)
        SUCCESS        ─► op done; the path is alive (traffic is a heartbeat)
        error / flush  ─► path DOWN (QP → ERR, every other WR flushes), op ─► dispatch again
    drain()      a path came UP or WCs freed queue slots: waiting READs are posted
    expire(now)  (every monitor tick) waiting READs that waited too long fail

The contract these implement (READ only because a READ is idempotent, so "re-post
everything that did not complete successfully" is exactly right; the caller's errors are
not retried; a buffer is re-posted only after its flush WC was polled) is stated once, in
:mod:`.vqp`.  Here: a failed or flushed op is re-posted until it succeeds, fails with
:class:`~rdma.errors.WCError` for the caller's reason (:data:`CALLER_ERRORS`), or has been
posted ``max_reposts`` times (PeerUnreachable).  WRs a provider never flushed come back
through the rebuild's QP reset (:meth:`ReadDispatcher.take_back`).

Waiting.  A READ with no path to go to waits; it fails with PeerUnreachable once the peer
has been dead for ``unreachable_grace`` (:mod:`.pathset`), or, while no path is UP, once
it is ``read_timeout`` old.  A READ that waits only because every UP path's queue is full
is never failed for it: that is load, not unreachability.

Cancellation (:meth:`ReadDispatcher.read`): a cancelled READ that is still waiting is
dropped (``Abort.SUCCEEDED``: nothing was handed to a NIC); one that is posted is not
re-posted, and either waited for, shielded, until its WC has been polled
(``Abort.FAILED``), or, when the caller passed ``detach``, left behind: the caller
returns at once and ``detach()`` tells it when the buffer is its own again (a hedged
read's loser must not wait for a hung peer: :mod:`kspeedfs.cluster.fetch`).

Overrun (``overrun=(seconds, hook)``, :func:`wait_noting_overrun`): ``hook()`` runs once,
in the caller's task, when the READ has had no outcome for ``seconds``; the READ goes on.
One deadline on the caller's own wait, no task: this is how a hedged read learns it is
late at the cost of a timer, not of a task per READ.
"""
from __future__ import annotations

import collections
import itertools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from ..api import SendWR
from ..enums import (
    IBV_SEND_SIGNALED,
    IBV_WC_LOC_LEN_ERR,
    IBV_WC_LOC_PROT_ERR,
    IBV_WC_REM_ACCESS_ERR,
    IBV_WC_REM_INV_REQ_ERR,
    IBV_WC_SUCCESS,
    IBV_WR_RDMA_READ,
)
from ..errors import PathClosed, PeerUnreachable, PostError, WCError
from ..tuning import SQ_DEPTH
from .heartbeat import HeartbeatConfig
from .path import Path, choose_path
from .pathset import PathSet
from .vmr import VMR, RemoteVMR

T = TypeVar("T")

#: ``(seconds, hook)``: call ``hook()`` once if a wait is still going after ``seconds``
Overrun = tuple[float, Callable[[], None]]


async def wait_noting_overrun(wait: Callable[[], Awaitable[T]], overrun: Overrun | None) -> T:
    """``await wait()``; if it has not returned after ``overrun``'s seconds, call its hook
    once and go on waiting. ``wait`` must be safe to cancel and call again (an Event's
    wait, a single-flight join): the deadline is a timer on the caller's own wait, so a
    late READ or connect is noticed without a task of its own."""
    if overrun is not None:
        with trio.move_on_after(overrun[0]):
            return await wait()
        overrun[1]()
    return await wait()


#: the caller's fault: fail the READ, do not re-post it elsewhere
CALLER_ERRORS = frozenset({IBV_WC_REM_ACCESS_ERR, IBV_WC_REM_INV_REQ_ERR, IBV_WC_LOC_PROT_ERR,
                           IBV_WC_LOC_LEN_ERR})


class ReadOp:
    """One caller READ, possibly carried by several WRs over its life (one at a time).

    Attributes: the READ (``vmr``, ``local_off``, ``remote``, ``remote_off``,
    ``length``); ``t0`` when it was issued; ``done`` set once it has an outcome, which is
    ``error`` (``None``: success, or cancelled); ``path`` where its WR is posted now
    (``None``: not posted); ``cancelled`` by the caller; ``waiting_since``; ``posts``;
    ``on_done``: a detached READ's ``detach``, called once it is done.
    """

    __slots__ = ("vmr", "local_off", "remote", "remote_off", "length", "t0", "done",
                 "error", "path", "cancelled", "waiting_since", "posts", "on_done")

    def __init__(self, vmr: VMR, local_off: int, remote: RemoteVMR, remote_off: int,
                 length: int, now: float) -> None:
        self.vmr, self.local_off, self.length = vmr, local_off, length
        self.remote, self.remote_off = remote, remote_off
        self.t0 = now
        self.done = trio.Event()
        self.error: BaseException | None = None
        self.path: Path | None = None            # where its WR is posted now
        self.cancelled = False
        self.waiting_since: float | None = None
        self.posts = 0
        self.on_done: Callable[[], None] | None = None


class ReadDispatcher:
    """Posts a vQP's READs on its paths and re-posts them when a path fails.

    Contract: an op's ``done`` is set exactly once, never while a WR of it may still be
    written by a NIC; a failed or flushed op is re-posted until it succeeds, fails for the
    caller's reason, or gives up with PeerUnreachable (see the module docstring).

    Attributes:
        paths: the :class:`PathSet` it posts on and reports failures to.
        waiting: ops with no path to go to, oldest first.
        last_read: when the last READ was issued (the monitor's idle test).
        last_native: when a READ of the native fetch's was last posted or completed (the
            monitor's quiet test).
        reads_ok, failed_over, unreachable: counters for ``VQP.statistics()``.
    """

    def __init__(self, paths: PathSet, cfg: HeartbeatConfig, clock: Callable[[], float],
                 now: float, wr_ids: itertools.count[int]) -> None:
        self.paths = paths
        self.cfg = cfg
        self.clock = clock
        self._wr_ids = wr_ids                 # shared with the heartbeat probes
        self._rr = 0
        self.waiting: collections.deque[ReadOp] = collections.deque()
        self.last_read = now                  # last data READ posted (idle heartbeats)
        self.last_native = now                # ... of the native fetch's, posted or done
        self._wake = trio.Event()             # set by the first READ after an idle spell
        self.reads_ok = self.failed_over = self.unreachable = 0

    # ------------------------------------------------------------------ the caller
    async def read(self, vmr: VMR, local_off: int, remote: RemoteVMR, remote_off: int,
                   length: int, *, overrun: Overrun | None = None,
                   detach: Callable[[], None] | None = None) -> None:
        """Issue one READ (arguments already checked) and wait for its outcome.
        Raises PeerUnreachable, WCError, PathClosed. ``overrun``, and cancellation with
        or without ``detach`` (called exactly once, when the buffer is the caller's
        again; at once if no NIC holds it): module docstring."""
        now = self.clock()
        if self.paths.dead_for_grace(now):
            self.unreachable += 1
            raise self.paths.unreachable(now)
        if now - self.last_read >= self.cfg.idle_after:
            self._wake.set()                  # the monitor back to every interval, now
        self.last_read = now
        op = ReadOp(vmr, local_off, remote, remote_off, length, now)
        self.dispatch(op)
        try:
            await wait_noting_overrun(op.done.wait, overrun)
        except trio.Cancelled:
            op.cancelled = True
            if op in self.waiting:
                self.waiting.remove(op)
            elif not op.done.is_set():
                if detach is not None:        # the NIC still owns the buffer until its WC
                    op.on_done = detach
                    raise
                with trio.CancelScope(shield=True):
                    await op.done.wait()
            if detach is not None:
                detach()
            raise
        if op.error is not None:
            raise op.error

    def idle(self, now: float) -> bool:
        """No data READ for ``idle_after``, none in flight or waiting: probe slowly."""
        return (now - self.last_read >= self.cfg.idle_after and not self.waiting
                and not any(p.data_inflight for p in self.paths.paths))

    def idle_tick(self, now: float) -> float | None:
        """The monitor's tick while ``idle``: ``idle_interval``, or ``quiet_interval`` once
        no READ of the native fetch's was posted or completed for ``idle_after`` either
        (:mod:`.heartbeat`); None when not idle (it ticks every ``interval``)."""
        if not self.idle(now):
            return None
        quiet = now - self.last_native >= self.cfg.idle_after
        return self.cfg.quiet_interval if quiet else self.cfg.idle_interval

    def native_traffic(self, now: float) -> None:
        """A READ of the native fetch's is about to be posted (``VQP.native_target``) or
        completed (``VQP.native_done``): a quiet monitor back to its idle ticks at once."""
        if now - self.last_native >= self.cfg.idle_after:
            self._wake.set()
        self.last_native = now

    async def wait_for_read(self, timeout: float) -> None:
        """Sleep ``timeout``, or less if a READ ends the idle spell first."""
        with trio.move_on_after(timeout):
            await self._wake.wait()
        self._wake = trio.Event()

    # ------------------------------------------------------------------ posting
    def finish(self, op: ReadOp, error: BaseException | None) -> None:
        if op.done.is_set():
            return
        op.error = error
        op.path = None
        op.done.set()
        if op.on_done is not None:
            detached, op.on_done = op.on_done, None
            detached()

    def dispatch(self, op: ReadOp) -> None:
        """Post ``op`` on the best path, or park it in ``waiting``."""
        while True:
            if op.cancelled:
                self.finish(op, None)
                return
            path = choose_path(self.paths.paths, self._rr, SQ_DEPTH - 1)
            if path is None:
                now = self.clock()
                if self.paths.dead_for_grace(now):
                    self.unreachable += 1
                    self.finish(op, self.paths.unreachable(now))
                    return
                if op.waiting_since is None:
                    op.waiting_since = self.clock()
                self.waiting.append(op)
                return
            self._rr += 1
            if self._post(path, op):
                return

    def _post(self, path: Path, op: ReadOp) -> bool:
        wr_id = next(self._wr_ids)
        addr, rkey = op.remote.on(path.remote_nic, op.remote_off)
        wr = SendWR(wr_id=wr_id, opcode=IBV_WR_RDMA_READ, send_flags=IBV_SEND_SIGNALED,
                    sg_list=[op.vmr.sge(path.local_nic, op.local_off, op.length)],
                    remote_addr=addr, rkey=rkey)
        assert path.qp is not None
        try:
            path.qp.post_send(wr)
        except PostError as e:
            # The QP left RTS under us (the provider moved it to ERR): the path is broken.
            self.paths.fail(path, f"post refused: {e.msg}", e)
            return False
        path.inflight[wr_id] = op
        path.data_inflight += 1
        op.path = path
        op.waiting_since = None
        op.posts += 1
        return True

    def drain(self) -> None:
        """Post waiting READs while some path has room."""
        for _ in range(len(self.waiting)):
            if choose_path(self.paths.paths, self._rr, SQ_DEPTH - 1) is None:
                return
            self.dispatch(self.waiting.popleft())

    # ------------------------------------------------------------------ outcomes
    def on_wc(self, path: Path, op: ReadOp, wc: Any, now: float) -> None:
        """The WC of ``op``'s WR on ``path`` (already taken out of ``path.inflight``)."""
        path.data_inflight -= 1
        op.path = None
        if wc.status == IBV_WC_SUCCESS:
            path.reads_ok += 1
            path.bytes_ok += op.length
            self.reads_ok += 1
            self.paths.note(path.m.traffic(now))
            self.finish(op, None)
            return
        self.paths.wc_failed(path, wc, now)
        if op.cancelled:
            self.finish(op, None)
        elif wc.status in CALLER_ERRORS:
            self.finish(op, WCError(wc))
        elif op.posts >= self.cfg.max_reposts:
            self.unreachable += 1
            e = PeerUnreachable(f"READ from {self.paths.peer} failed over {op.posts} "
                                f"times: its paths keep failing under it", self.paths.peer)
            e.__cause__ = self.paths.last_broken
            self.finish(op, e)
        else:
            path.failed_over += 1
            self.failed_over += 1
            self.dispatch(op)

    def take_back(self, path: Path, leftovers: list[Any]) -> None:
        """Re-post the READs among ``leftovers``: WRs the reset QP of ``path`` discarded
        without a WC (a provider that never flushed them)."""
        for op in leftovers:
            if isinstance(op, ReadOp):
                op.path = None
                path.failed_over += 1
                self.dispatch(op)

    def expire(self, now: float, dead_long: bool) -> None:
        """Fail waiting READs once the peer has been unreachable for the grace period
        (``dead_long``), or (while no path is UP) once they are older than
        ``read_timeout``."""
        if not self.waiting:
            return
        none_up = not any(p.m.postable for p in self.paths.paths)
        keep: collections.deque[ReadOp] = collections.deque()
        while self.waiting:
            op = self.waiting.popleft()
            if dead_long or (none_up and now - op.t0 >= self.cfg.read_timeout):
                self.unreachable += 1
                self.finish(op, self.paths.unreachable(now))
            else:
                keep.append(op)
        self.waiting = keep

    def close_path(self, path: Path) -> None:
        """The vQP is closing: READs posted on ``path`` fail with PathClosed (its QP is
        in ERR and about to be destroyed)."""
        for op in list(path.inflight.values()):
            if isinstance(op, ReadOp) and not op.done.is_set():
                self.finish(op, PathClosed("virtual QP closed"))
        path.inflight.clear()

    def close(self) -> None:
        """The vQP is closing: waiting READs fail with PathClosed."""
        while self.waiting:
            self.finish(self.waiting.popleft(), PathClosed("virtual QP closed"))
