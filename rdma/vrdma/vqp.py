"""The virtual QP: READs from one peer over every usable path, surviving NIC failures.

``await vqp.read(local_vmr, local_off, remote, length)`` returns when the bytes are in
``local_vmr``; it raises :class:`~rdma.errors.PeerUnreachable` only when every path to
the peer has been dead for ``unreachable_grace`` (or the READ is older than
``read_timeout`` while no path is UP, or it failed over ``max_reposts`` times).
The parts, one concern each, and the request path through them::

    VQP.read() ─► ReadDispatcher (.dispatch): least-loaded UP path, round-robin on ties;
                  │                           none: the READ waits (bounded)
                  └─► RDMA_READ on path.qp, path.inflight[wr_id] = op
    VQP: CQ consumer    (one task per CQ, dispatch by wr_id)
        a probe's WC ─► HeartbeatMonitor.on_wc     a READ's WC ─► ReadDispatcher.on_wc
            SUCCESS        ─► op done; the path is alive (traffic is a heartbeat)
            error / flush  ─► path DOWN (QP → ERR, every other WR flushes), op re-posted
    HeartbeatMonitor.run()  (.monitor; every interval, every idle_interval when idle)
        probes, SUSPECT/DOWN verdicts, starts rebuilds, fails waiters with PeerUnreachable
    Rebuilder.rebuild(path)  (.rebuild; background, per path)
        drain, RESET, connect_path(path): INIT → RTR → RTS against a fresh peer QP
    PathSet (.pathset)  every transition, the peer-dead clock, reachable/degraded/...
    NativePaths (.native)  UP paths for READs posted in C beside the vQP (no failover)
    Peer (.peer)        what the peer's replies told us: incarnation, NICs, vMRs

:class:`VQP` only composes them: it owns the tasks (:meth:`VQP.run`), routes WCs, and
tears everything down.  What it needs of its endpoint comes in as callables
(``create_cq``, ``connect_path``, ``close_channel``, ``on_closed``), so neither object
reaches into the other.

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

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from ..errors import PathClosed, PeerUnreachable, RdmaUserError
from ..tuning import SQ_DEPTH
from .dispatch import Overrun, ReadDispatcher
from .heartbeat import HeartbeatConfig
from .monitor import HeartbeatMonitor
from .native import NativePaths, NativeTarget
from .path import Path, PathState, PathStats, Transition
from .pathset import PathSet
from .peer import Peer
from .rebuild import ConnectPath, Rebuilder
from .vmr import VMR, RemoteVMR

if TYPE_CHECKING:
    from ..api import CQ

__all__ = ["SQ_DEPTH", "NativeTarget", "VQP", "VQPStats"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VQPStats:
    """One vQP as ``VQP.statistics()`` shows it; ``state``: :mod:`.pathset` diagram."""

    peer: str
    state: str                      # "reachable" / "degraded" / "unreachable" / "closed"
    reads_ok: int
    reads_failed_over: int
    reads_unreachable: int
    waiting: int
    paths: tuple[PathStats, ...]


class VQP:
    """Virtual QP to one peer.  Made by :meth:`Endpoint.connect`; close with ``aclose``.

    Contract: see the module docstring (READ semantics, failover, cancellation, the
    PeerUnreachable bound).  The endpoint starts :meth:`run` in its nursery right after
    construction; until then no path is built.

    Attributes:
        id: process-wide number (task names, the server's lease key).
        peer: the peer's node name.
        peer_info: the :class:`Peer` (incarnation, NICs, exported vMRs), kept current.
        cfg: its heartbeat and failure knobs.
        paths: one :class:`Path` per NIC pair (``paths[i].id == i``).
        scratch: the vMR probes land in; owned, closed with the vQP.
        pathset, reads, rebuilder, monitor, native: its parts (module docstring).

    Seams to the endpoint (all called from this vQP's tasks or ``aclose``):
        create_cq(local_nic): a CQ for one path, on that NIC.
        connect_path(path): build or rebuild ``path`` (:data:`.rebuild.ConnectPath`).
        close_channel(ch): close a lease connection, from synchronous code.
        on_closed(vqp): the vQP is closed (the endpoint forgets it).
    """

    def __init__(self, vqp_id: int, peer: Peer, pairs: list[tuple[str, str]],
                 cfg: HeartbeatConfig, *, scratch: VMR, create_cq: Callable[[str], CQ],
                 connect_path: ConnectPath, close_channel: Callable[[Any], None],
                 on_closed: Callable[[VQP], None],
                 clock: Callable[[], float] = trio.current_time,
                 on_transition: Callable[[Transition], None] | None = None) -> None:
        self.id = vqp_id
        self.peer = peer.node
        self.peer_info = peer
        self.cfg = cfg
        self.clock = clock
        now = clock()
        self.pathset = PathSet(peer.node, pairs, cfg, clock, now, on_transition)
        self.paths = self.pathset.paths
        self.scratch = scratch
        wr_ids = itertools.count(1)          # one wr_id space for READs and probes
        self.reads = ReadDispatcher(self.pathset, cfg, clock, now, wr_ids)
        self.pathset.on_up = self.reads.drain
        self.rebuilder = Rebuilder(self.pathset, self.reads, cfg, clock, connect_path)
        self.monitor = HeartbeatMonitor(f"vqp{vqp_id}", self.pathset, peer, scratch,
                                        self.reads, self.rebuilder, cfg, clock, wr_ids)
        self._create_cq = create_cq
        self._close_channel = close_channel
        self._on_closed = on_closed
        self.native = NativePaths(self.pathset, self.reads, peer, clock)
        self._closed = False
        self._cancel: trio.CancelScope | None = None
        self._finished = trio.Event()

    def remote_mr(self, name: str) -> RemoteVMR:
        """The vMR the peer exports as ``name`` (RdmaUserError if none)."""
        return self.peer_info.remote_mr(name)

    def _checked(self, local_vmr: VMR, local_off: int, remote: RemoteVMR | str | int,
                 remote_off: int, length: int) -> tuple[RemoteVMR, int]:
        """The remote vMR and offset of a READ (:meth:`read` says what ``remote`` may be),
        once both of its ranges are inside their vMRs; RdmaUserError if not."""
        if length <= 0:
            raise RdmaUserError(f"READ of {length} bytes")
        if isinstance(remote, int):
            rm, off = self.peer_info.locate(remote, length)
        else:
            rm = self.remote_mr(remote) if isinstance(remote, str) else remote
            off = remote_off
            if off < 0 or off + length > rm.length:
                raise RdmaUserError(f"[{off}, +{length}) outside remote vMR {rm.name!r} "
                                    f"of {rm.length} bytes")
        if local_off < 0 or local_off + length > local_vmr.length:
            raise RdmaUserError(f"[{local_off}, +{length}) outside local vMR")
        return rm, off

    def native_target(self, local_vmr: VMR, local_off: int, remote: str, remote_off: int,
                      length: int) -> NativeTarget | None:
        """Where C may post this READ itself, beside the vQP (the FUSE engine's native
        fetch, :meth:`.native.NativePaths.target`); None when the vQP is closed, a range
        is wrong or no path is UP, and the caller READs through :meth:`read` instead.
        Nothing is posted here, and a READ posted there is not the vQP's (:mod:`.native`)."""
        if self._closed:
            return None
        try:
            rm, off = self._checked(local_vmr, local_off, remote, remote_off, length)
        except RdmaUserError:
            return None
        return self.native.target(local_vmr, local_off, rm, off)

    def native_paths(self, remote: str) -> list[tuple[Any, int, str, int, int]]:
        """Every UP path as C may post READs of vMR ``remote`` on it itself
        (:meth:`.native.NativePaths.paths`); [] when the vQP is closed."""
        return [] if self._closed else self.native.paths(remote)

    def native_done(self, qpn: int) -> None:
        """A READ C posted on the path of QP ``qpn`` completed successfully: evidence
        that the path lives (:meth:`.native.NativePaths.done`)."""
        self.native.done(qpn)

    # ------------------------------------------------------------------ lifecycle
    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Run the vQP's tasks (a CQ consumer per path, the monitor) until :meth:`aclose`
        cancels them; ``nursery.start(vqp.run)`` returns once they are started."""
        with trio.CancelScope() as cs:
            self._cancel = cs
            try:
                async with trio.open_nursery() as nursery:
                    for p in self.paths:
                        p.cq = self._create_cq(p.local_nic)
                        nursery.start_soon(self._consume, p, name=f"vqp{self.id}-cq{p.id}")
                    nursery.start_soon(self.monitor.run, nursery,
                                       name=f"vqp{self.id}-monitor")
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
                changed = self.pathset.next_change()
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
            self.pathset.note(p.m.close(now))
            p.set_error_state()
            self.reads.close_path(p)
            if p.control is not None:
                ch, p.control = p.control, None
                self._close_channel(ch)
            for obj in (p.qp, p.cq):
                if obj is not None:
                    try:
                        obj.close()
                    except Exception:
                        log.debug("close %r", obj, exc_info=True)
            p.qp = p.cq = None
        self.reads.close()
        self.scratch.close()
        self._on_closed(self)

    # ------------------------------------------------------------------ reads
    async def read(self, local_vmr: VMR, local_off: int, remote: RemoteVMR | str | int,
                   length: int, remote_off: int = 0, *,
                   overrun: Overrun | None = None,
                   detach: Callable[[], None] | None = None) -> None:
        """READ ``length`` bytes of the peer's memory into ``local_vmr[local_off:]``.

        ``remote`` is a :class:`RemoteVMR` (or its name) plus ``remote_off``, or a remote
        virtual address (inside some vMR the peer exported).  Raises PeerUnreachable,
        WCError (the caller's fault: bad range/rkey), PathClosed (we closed).
        ``overrun = (seconds, hook)``: ``hook()`` if the READ is still going after
        ``seconds``; ``detach``: a cancelled READ returns at once and ``detach()`` is
        called when the buffer is free (:mod:`.dispatch`)."""
        if self._closed:
            raise PathClosed("virtual QP closed")
        rm, off = self._checked(local_vmr, local_off, remote, remote_off, length)
        await self.reads.read(local_vmr, local_off, rm, off, length, overrun=overrun,
                              detach=detach)

    # ------------------------------------------------------------------ completions
    async def _consume(self, path: Path) -> None:
        """The one consumer of ``path.cq``: route each WC by wr_id."""
        cq = path.cq
        assert cq is not None
        while True:
            wcs = await cq.poll_async(64)
            now = self.clock()
            for wc in wcs:
                op = path.inflight.pop(wc.wr_id, None)
                if op is None:
                    continue                            # a WR reset away: long handled
                if op is Path.HEARTBEAT:
                    self.monitor.on_wc(path, wc, now)
                else:
                    self.reads.on_wc(path, op, wc, now)
            if self.reads.waiting:
                self.reads.drain()

    # ------------------------------------------------------------------ introspection
    def statistics(self) -> VQPStats:
        """This vQP and each of its paths, as frozen records."""
        r = self.reads
        return VQPStats(peer=self.peer,
                        state="closed" if self._closed else self.pathset.state(),
                        reads_ok=r.reads_ok, reads_failed_over=r.failed_over,
                        reads_unreachable=r.unreachable, waiting=len(r.waiting),
                        paths=tuple(p.statistics() for p in self.paths))
