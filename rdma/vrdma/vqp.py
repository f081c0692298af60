"""The virtual QP: READs from one peer over every usable path, surviving NIC failures.

``await vqp.read(local_vmr, local_off, remote, length)`` returns when the bytes are in
``local_vmr``; it raises :class:`~rdma.errors.PeerUnreachable` only when every path to
the peer has been dead for ``unreachable_grace`` (or the READ is older than
``read_timeout`` while no path is UP, or it failed over ``max_reposts`` times).
The request path, top to bottom::

    read() ─► _dispatch(op) ─► choose_path(): least-loaded UP path, round-robin on ties
                 │                 └─ none: op waits in _waiting (bounded, see below)
                 └─► post RDMA_READ on path.qp, inflight[wr_id] = op
    _consume(path)  (one task per CQ, dispatch by wr_id)
        SUCCESS      ─► op done; the path is alive (traffic is a heartbeat)
        error / flush ─► path DOWN (QP → ERR, every other WR flushes), op ─► _dispatch again
    _monitor()  (every heartbeat interval; every idle_interval on an idle vQP)
        probes, SUSPECT/DOWN verdicts, starts rebuilds, fails waiters with PeerUnreachable
    _rebuild(path)  (background, per path) RESET → INIT → RTR → RTS against a fresh peer QP

Failover semantics.  Only RDMA READ is offered, and a READ is idempotent: executing it
twice writes the same bytes to the same local buffer, so "re-post everything that did not
complete successfully" is exactly right, with no completion log (cf. Varuna).  A READ that
had already executed on the dead path but whose WC was lost is simply executed again.
A flushed WR's buffer is re-posted only after its flush WC has been polled, so the old QP
can no longer write into it (api cancellation contract).  Anything that is *not* idempotent
(SEND used as a notification, WRITE to a flag, atomics) is deliberately not offered by this
layer: re-executing those after an unknown outcome is incorrect (SHIFT's trilemma,
FADD/CAS cannot be failed over transparently); a layer that needs them must carry its own
sequence numbers / completion records and ask the peer what executed.

Errors that are the *caller's* (REM_ACCESS_ERR: bad rkey or range; LOC_PROT/LOC_LEN) are
not retried: they fail that READ with :class:`~rdma.errors.WCError` (the path still goes
through DOWN/REBUILDING, because an RC QP is in ERR after any error).

Cancellation: ``read()`` may be cancelled.  A READ that is posted cannot be recalled, so
the cancelled call waits (shielded) until the WR's WC has been polled — bounded by failure
detection plus flush — and is then not re-posted; the buffer is yours again when
``Cancelled`` propagates (trio's ``Abort.FAILED`` case).

The bound on PeerUnreachable: from the last path's death, detection
(``HeartbeatConfig.detection_bounds``; immediate on a connection reset or error WC), then
``unreachable_grace``, then one monitor tick: see ``HeartbeatConfig.unreachable_bound``.
"""
from __future__ import annotations

import collections
import itertools
import logging
import select
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import trio

from ..api import SendWR
from ..enums import (IBV_QPS_RESET, IBV_SEND_SIGNALED, IBV_WC_LOC_LEN_ERR, IBV_WC_LOC_PROT_ERR,
                     IBV_WC_REM_ACCESS_ERR, IBV_WC_REM_INV_REQ_ERR, IBV_WC_SUCCESS,
                     IBV_WR_RDMA_READ)
from ..errors import (PathBroken, PathClosed, PeerUnreachable, PostError, RdmaUserError,
                      WCError)
from .heartbeat import HEARTBEAT_BYTES, HeartbeatConfig
from .path import Path, PathState, PathStats, Transition, choose_path
from .vmr import VMR, RemoteVMR

if TYPE_CHECKING:
    from .endpoint import Endpoint

log = logging.getLogger(__name__)

#: the caller's fault: fail the READ, do not re-post it elsewhere
CALLER_ERRORS = frozenset({IBV_WC_REM_ACCESS_ERR, IBV_WC_REM_INV_REQ_ERR, IBV_WC_LOC_PROT_ERR,
                           IBV_WC_LOC_LEN_ERR})
#: send-queue depth of every path QP; one slot is kept for the heartbeat probe
SQ_DEPTH = 256


class _Read:
    """One caller READ, possibly carried by several WRs over its life (one at a time)."""

    __slots__ = ("vmr", "local_off", "remote", "remote_off", "length", "t0", "done",
                 "error", "path", "cancelled", "waiting_since", "posts")

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


@dataclass(frozen=True)
class VQPStats:
    peer: str
    state: str                      # "reachable" / "degraded" / "unreachable" / "closed"
    reads_ok: int
    reads_failed_over: int
    reads_unreachable: int
    waiting: int
    paths: tuple[PathStats, ...]


class VQP:
    """Virtual QP to one peer.  Made by :meth:`Endpoint.connect`; close with ``aclose``."""

    def __init__(self, endpoint: "Endpoint", peer_node: str, peer_port: int,
                 peer_info: dict[str, Any], pairs: list[tuple[str, str]],
                 cfg: HeartbeatConfig, clock: Callable[[], float] = trio.current_time,
                 on_transition: Callable[[Transition], None] | None = None) -> None:
        self.ep = endpoint
        self.peer = peer_node
        self.peer_port = peer_port
        self.cfg = cfg
        self.clock = clock
        self.on_transition = on_transition
        self.id = next(_VQP_IDS)
        now = clock()
        self.paths = [Path(i, l, r, cfg, now) for i, (l, r) in enumerate(pairs)]
        for p in self.paths:
            p.hb_slot = p.id * HEARTBEAT_BYTES
        self.scratch = endpoint.alloc(max(1, len(self.paths)) * HEARTBEAT_BYTES,
                                      name=f"vqp{self.id}-scratch")
        self.remote_mrs: dict[str, RemoteVMR] = {}
        self._apply_info(peer_info)
        self._wr_ids = itertools.count(1)
        self._rr = 0
        self._waiting: collections.deque[_Read] = collections.deque()
        self._rebuilding: set[int] = set()
        self._all_dead_since: float | None = now
        self._last_broken: BaseException | None = None
        self._closed = False
        self._cancel: trio.CancelScope | None = None
        self._nursery: trio.Nursery | None = None
        self._changed = trio.Event()
        self._finished = trio.Event()
        self._last_read = now                 # last data READ posted (idle heartbeats)
        self._wake = trio.Event()             # set by the first READ after an idle spell
        self.reads_ok = self.failed_over = self.unreachable = 0

    # ------------------------------------------------------------------ peer info
    def _apply_info(self, info: dict[str, Any]) -> None:
        self.peer_incarnation = int(info["incarnation"])
        self.peer_nics = [str(n) for n in info["nics"]]
        self.remote_control = {str(n): (int(v[0]), int(v[1]))
                               for n, v in info["control"].items()}
        for name, d in info.get("mrs", {}).items():
            self.remote_mrs[name] = RemoteVMR.from_dict(name, d)

    def remote_mr(self, name: str) -> RemoteVMR:
        try:
            return self.remote_mrs[name]
        except KeyError:
            raise RdmaUserError(f"peer {self.peer} exports no vMR {name!r} "
                                f"(known: {sorted(self.remote_mrs)})") from None

    def _locate(self, remote_addr: int, length: int) -> tuple[RemoteVMR, int]:
        for rm in self.remote_mrs.values():
            if rm.addr <= remote_addr and remote_addr + length <= rm.addr + rm.length:
                return rm, remote_addr - rm.addr
        raise RdmaUserError(f"[{remote_addr:#x}, +{length}) is in no vMR exported by "
                            f"{self.peer}")

    # ------------------------------------------------------------------ lifecycle
    async def _run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as cs:
            self._cancel = cs
            try:
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    for p in self.paths:
                        p.cq = self.ep.nic(p.local_nic).ctx.create_cq(SQ_DEPTH * 2)
                        nursery.start_soon(self._consume, p, name=f"vqp{self.id}-cq{p.id}")
                    nursery.start_soon(self._monitor, name=f"vqp{self.id}-monitor")
                    task_status.started()
                    await trio.sleep_forever()
            finally:
                self._shutdown()
                self._finished.set()

    async def wait_connected(self, timeout: float) -> None:
        """Return once a path is UP; PeerUnreachable once every candidate path has failed
        two builds in a row (one failure may be a race: a connection attempt refused, a
        NIC coming up) or ``timeout`` passed without one coming up."""
        with trio.move_on_after(timeout):
            while True:
                changed = self._changed = trio.Event()
                if any(p.m.alive for p in self.paths):
                    return
                if all(p.m.attempts >= 2 and p.m.state is PathState.DOWN for p in self.paths):
                    break
                await changed.wait()
        if any(p.m.alive for p in self.paths):
            return
        reasons = "; ".join(f"{p.name}: {p.m.reason}" for p in self.paths)
        raise PeerUnreachable(f"no path to {self.peer} came up ({reasons})", self.peer)

    async def aclose(self) -> None:
        """Cancel this vQP's tasks and release its QPs, CQs and scratch MR.  Pending READs
        fail with PathClosed.  Idempotent."""
        if self._cancel is not None:
            self._cancel.cancel()
            with trio.CancelScope(shield=True):
                await self._finished.wait()
        elif not self._closed:
            self._shutdown()

    def _shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        now = self.clock()
        for p in self.paths:
            t = p.m.close(now)
            if t:
                self._note(t)
            p.set_error_state()
            for wr_id, op in list(p.inflight.items()):
                if isinstance(op, _Read) and not op.done.is_set():
                    self._finish(op, PathClosed("virtual QP closed"))
            p.inflight.clear()
            if p.control is not None:
                ch, p.control = p.control, None
                self.ep._close_later(ch)
            for obj in (p.qp, p.cq):
                if obj is not None:
                    try:
                        obj.close()
                    except Exception:
                        log.debug("close %r", obj, exc_info=True)
            p.qp = p.cq = None
        while self._waiting:
            self._finish(self._waiting.popleft(), PathClosed("virtual QP closed"))
        self.scratch.close()
        self.ep._forget(self)

    # ------------------------------------------------------------------ reads
    async def read(self, local_vmr: VMR, local_off: int, remote: RemoteVMR | str | int,
                   length: int, remote_off: int = 0) -> None:
        """READ ``length`` bytes of the peer's memory into ``local_vmr[local_off:]``.

        ``remote`` is a :class:`RemoteVMR` (or its name) plus ``remote_off``, or a remote
        virtual address (inside some vMR the peer exported).  Raises PeerUnreachable,
        WCError (the caller's fault: bad range/rkey), PathClosed (we closed)."""
        if self._closed:
            raise PathClosed("virtual QP closed")
        if length <= 0:
            raise RdmaUserError(f"READ of {length} bytes")
        if isinstance(remote, int):
            rm, off = self._locate(remote, length)
        else:
            rm = self.remote_mr(remote) if isinstance(remote, str) else remote
            off = remote_off
            if off < 0 or off + length > rm.length:
                raise RdmaUserError(f"[{off}, +{length}) outside remote vMR {rm.name!r} "
                                    f"of {rm.length} bytes")
        if local_off < 0 or local_off + length > local_vmr.length:
            raise RdmaUserError(f"[{local_off}, +{length}) outside local vMR")
        now = self.clock()
        if (self._all_dead_since is not None
                and now - self._all_dead_since >= self.cfg.unreachable_grace):
            self.unreachable += 1
            raise self._unreachable(now)
        if now - self._last_read >= self.cfg.idle_after:
            self._wake.set()                  # the monitor back to every interval, now
        self._last_read = now
        op = _Read(local_vmr, local_off, rm, off, length, now)
        self._dispatch(op)
        try:
            await op.done.wait()
        except trio.Cancelled:
            op.cancelled = True
            if op in self._waiting:
                self._waiting.remove(op)
            elif not op.done.is_set():
                with trio.CancelScope(shield=True):
                    await op.done.wait()      # the NIC still owns the buffer until its WC
            raise
        if op.error is not None:
            raise op.error

    def _unreachable(self, now: float) -> PeerUnreachable:
        dead = 0.0 if self._all_dead_since is None else now - self._all_dead_since
        reasons = "; ".join(f"{p.name}: {p.m.state.value} ({p.m.reason})" for p in self.paths)
        e = PeerUnreachable(f"peer {self.peer} unreachable: every path dead for "
                            f"{dead * 1e3:.0f} ms ({reasons})", self.peer)
        e.__cause__ = self._last_broken
        return e

    def _finish(self, op: _Read, error: BaseException | None) -> None:
        if op.done.is_set():
            return
        op.error = error
        op.path = None
        op.done.set()

    def _dispatch(self, op: _Read) -> None:
        """Post ``op`` on the best path, or park it in ``_waiting``."""
        while True:
            if op.cancelled:
                self._finish(op, None)
                return
            path = choose_path(self.paths, self._rr, SQ_DEPTH - 1)
            if path is None:
                now = self.clock()
                if (self._all_dead_since is not None
                        and now - self._all_dead_since >= self.cfg.unreachable_grace):
                    self.unreachable += 1
                    self._finish(op, self._unreachable(now))
                    return
                if op.waiting_since is None:
                    op.waiting_since = self.clock()
                self._waiting.append(op)
                return
            self._rr += 1
            if self._post_read(path, op):
                return

    def _post_read(self, path: Path, op: _Read) -> bool:
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
            self._path_failed(path, f"post refused: {e.msg}", e)
            return False
        path.inflight[wr_id] = op
        path.data_inflight += 1
        op.path = path
        op.waiting_since = None
        op.posts += 1
        return True

    def _drain_waiting(self) -> None:
        for _ in range(len(self._waiting)):
            if choose_path(self.paths, self._rr, SQ_DEPTH - 1) is None:
                return
            self._dispatch(self._waiting.popleft())

    # ------------------------------------------------------------------ completions
    async def _consume(self, path: Path) -> None:
        """The one consumer of ``path.cq``: dispatch each WC by wr_id."""
        cq = path.cq
        assert cq is not None
        while True:
            wcs = await cq.poll_async(64)
            now = self.clock()
            for wc in wcs:
                self._on_wc(path, wc, now)
            if self._waiting:
                self._drain_waiting()

    def _on_wc(self, path: Path, wc: Any, now: float) -> None:
        op = path.inflight.pop(wc.wr_id, None)
        if op is None:
            return                                      # a WR reset away: long handled
        ok = wc.status == IBV_WC_SUCCESS
        if op is Path.HEARTBEAT:
            path.m.live.probe_done()
            if ok:
                word = int.from_bytes(self.scratch.read(HEARTBEAT_BYTES, path.hb_slot),
                                      "little")
                if word != self.peer_incarnation:
                    self._path_failed(path, f"peer incarnation {word:#x} != "
                                      f"{self.peer_incarnation:#x} (restarted?)", None)
                    return
                path.heartbeats_ok += 1
                self._note(path.m.ok(now))
            else:
                self._wc_failed(path, wc, now)
            return
        path.data_inflight -= 1
        op.path = None
        if ok:
            path.reads_ok += 1
            path.bytes_ok += op.length
            self.reads_ok += 1
            path.m.live.data_ok(now)                    # stands in for the next probe
            self._note(path.m.ok(now))
            self._finish(op, None)
            return
        self._wc_failed(path, wc, now)
        if op.cancelled:
            self._finish(op, None)
        elif wc.status in CALLER_ERRORS:
            self._finish(op, WCError(wc))
        elif op.posts >= self.cfg.max_reposts:
            self.unreachable += 1
            e = PeerUnreachable(f"READ from {self.peer} failed over {op.posts} times: its "
                                f"paths keep failing under it", self.peer)
            e.__cause__ = self._last_broken
            self._finish(op, e)
        else:
            path.failed_over += 1
            self.failed_over += 1
            self._dispatch(op)

    def _wc_failed(self, path: Path, wc: Any, now: float) -> None:
        t = path.m.wc_error(wc.status, now)
        if t is not None:
            err = WCError(wc)
            self._broken(path, t.reason, err)
            self._note(t)

    def _path_failed(self, path: Path, reason: str, cause: BaseException | None) -> None:
        t = path.m.fail(reason, self.clock())
        if t is not None:
            self._broken(path, reason, cause)
            self._note(t)

    def _broken(self, path: Path, reason: str, cause: BaseException | None) -> None:
        """The path just went DOWN: flush what is left on it (each flush re-posts)."""
        e = PathBroken(f"path {path.name} to {self.peer}: {reason}")
        e.__cause__ = cause
        self._last_broken = e
        log.info("vqp %s: path %s DOWN: %s", self.peer, path.name, reason)
        path.set_error_state()

    def _note(self, t: Transition | None) -> None:
        if t is None:
            return
        log.debug("vqp %s path %d: %s -> %s (%s)", self.peer, t.path_id, t.old.value,
                  t.new.value, t.reason)
        self._update_reachability(t.at)
        if t.new is PathState.UP:
            # a recovery is news for an operator; a brief SUSPECT under load is not
            level = logging.DEBUG if t.old is PathState.SUSPECT else logging.INFO
            log.log(level, "vqp %s: path %s UP (%s)", self.peer, self.paths[t.path_id].name,
                    t.reason)
            if self._waiting:
                self._drain_waiting()
        self._changed.set()
        if self.on_transition is not None:
            self.on_transition(t)

    def _update_reachability(self, now: float) -> None:
        """The peer counts as dead from the moment no path is alive *and talking*: every
        path DOWN/REBUILDING, or the last one held SUSPECT but silent past the DOWN
        threshold.  That moment starts the ``unreachable_grace`` clock."""
        if any(p.m.alive and (not p.m.silent_dead(now) or _wcs_pending(p))
               for p in self.paths):
            self._all_dead_since = None
        elif self._all_dead_since is None:
            self._all_dead_since = now

    # ------------------------------------------------------------------ heartbeats
    async def _monitor(self) -> None:
        iv = self.cfg.interval
        while True:
            now = self.clock()
            for p in self.paths:
                others = any(q.m.alive for q in self.paths if q is not p)
                if p.m.connected and p.m.live.verdict(now) == "down" and _wcs_pending(p):
                    continue          # its WCs are queued, not yet consumed: not silence
                self._note(p.m.tick(now, hold=not others))
                if p.m.connected and p.m.state is not PathState.DOWN \
                        and p.m.live.want_probe(now):
                    self._probe(p, now)
                if (p.m.state is PathState.DOWN and p.id not in self._rebuilding
                        and now >= p.m.next_attempt and self._nursery is not None):
                    self._rebuilding.add(p.id)
                    self._nursery.start_soon(self._rebuild, p,
                                             name=f"vqp{self.id}-rebuild{p.id}")
            self._update_reachability(now)
            self._expire(now)
            if self._idle(now):
                with trio.move_on_after(self.cfg.idle_interval):
                    await self._wake.wait()
                self._wake = trio.Event()
            else:
                await trio.sleep(iv)

    def _idle(self, now: float) -> bool:
        """No data READ for ``idle_after``, none in flight or waiting: probe slowly."""
        return (now - self._last_read >= self.cfg.idle_after and not self._waiting
                and not any(p.data_inflight for p in self.paths))

    def _probe(self, path: Path, now: float) -> None:
        rc = self.remote_control.get(path.remote_nic)
        if rc is None or path.qp is None:
            return
        wr_id = next(self._wr_ids)
        wr = SendWR(wr_id=wr_id, opcode=IBV_WR_RDMA_READ, send_flags=IBV_SEND_SIGNALED,
                    sg_list=[self.scratch.sge(path.local_nic, path.hb_slot, HEARTBEAT_BYTES)],
                    remote_addr=rc[0], rkey=rc[1])
        try:
            path.qp.post_send(wr)
        except PostError as e:
            self._path_failed(path, f"heartbeat post refused: {e.msg}", e)
            return
        path.inflight[wr_id] = Path.HEARTBEAT
        path.m.live.probe_posted(now)

    def _expire(self, now: float) -> None:
        """Fail waiting READs once the peer has been unreachable for the grace period, or
        (while no path is UP) once they are older than ``read_timeout``."""
        dead_long = (self._all_dead_since is not None
                     and now - self._all_dead_since >= self.cfg.unreachable_grace)
        if dead_long:                   # give up on a held last path: its READs flush,
            for p in self.paths:        # come back here and fail with PeerUnreachable
                if p.m.silent_dead(now) and not _wcs_pending(p):
                    self._path_failed(p, f"no heartbeat for "
                                      f"{p.m.live.silence(now) * 1e3:.0f} ms (last path)", None)
        if not self._waiting:
            return
        none_up = not any(p.m.postable for p in self.paths)
        keep: collections.deque[_Read] = collections.deque()
        while self._waiting:
            op = self._waiting.popleft()
            if dead_long or (none_up and now - op.t0 >= self.cfg.read_timeout):
                self.unreachable += 1
                self._finish(op, self._unreachable(now))
            else:
                keep.append(op)
        self._waiting = keep

    # ------------------------------------------------------------------ rebuild
    async def _rebuild(self, path: Path) -> None:
        """DOWN → REBUILDING → (QP in RTS, waiting for a heartbeat) or back to DOWN."""
        try:
            await self._wait_drained(path)
            self._note(path.m.rebuild_started(self.clock()))
            try:
                await self.ep._connect_path(self, path)
            except Exception as e:
                reason = f"rebuild failed: {type(e).__name__}: {e}"
                log.debug("vqp %s: path %s %s", self.peer, path.name, reason)
                self._note(path.m.rebuild_failed(reason, self.clock()))
                return
            self._note(path.m.rebuild_connected(self.clock()))
            self._probe(path, self.clock())
        finally:
            self._rebuilding.discard(path.id)

    async def _wait_drained(self, path: Path) -> None:
        """Wait until every WR of the dead QP has completed (flushed): only then may the
        QP be reset, or a buffer be re-posted.  A provider that never flushes would hang
        a rebuild forever; after a generous bound the leftovers are taken back by the
        reset (which discards WRs) and re-posted."""
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
                        self.peer, path.name, len(leftovers))
        path.data_inflight = 0
        path.m.live.probe_done()
        for op in leftovers:
            if isinstance(op, _Read):
                op.path = None
                path.failed_over += 1
                self._dispatch(op)

    # ------------------------------------------------------------------ introspection
    def statistics(self) -> VQPStats:
        if self._closed:
            state = "closed"
        elif all(p.m.state is PathState.UP for p in self.paths if p.m.ever_up) and \
                any(p.m.state is PathState.UP for p in self.paths):
            state = "reachable"
        elif any(p.m.alive for p in self.paths):
            state = "degraded"
        else:
            state = "unreachable"
        return VQPStats(peer=self.peer, state=state, reads_ok=self.reads_ok,
                        reads_failed_over=self.failed_over,
                        reads_unreachable=self.unreachable, waiting=len(self._waiting),
                        paths=tuple(p.statistics() for p in self.paths))


_VQP_IDS = itertools.count(1)


def _wcs_pending(path: Path) -> bool:
    """Is the path's CQ holding WCs its consumer has not polled yet?  (A peek at the fd,
    never a poll: the consumer task stays the CQ's only poller.)"""
    cq = path.cq
    if cq is None or cq.closed:
        return False
    try:
        return bool(select.select([cq.fd], [], [], 0)[0])
    except (OSError, ValueError):
        return False

