"""Verbs completion queue, and how its WCs reach a trio task without blocking it.

The problem
-----------
The API promises ``CQ.fd``: readable iff WCs are queued, so ``poll_async`` can
``await trio.lowlevel.wait_readable(fd)``.  Verbs' own answer is a completion channel,
but pyverbs 44's ``CompChannel`` exposes no fd (added in v57) and its ``get_cq_event``
blocks *holding the GIL* (v44 has no ``nogil`` anywhere): calling it from a trio worker
thread would freeze every thread of the process, the event loop included.

What we do: a poller thread with backoff
----------------------------------------
One :class:`Poller` thread per opened device polls the device's CQs with the
non-blocking ``ibv_poll_cq`` (a few µs, GIL held only for that), moves the WCs into each
CQ's queue and signals the CQ's eventfd, which is ``CQ.fd``.  Between rounds it sleeps,
starting at ``CQ_MIN_SLEEP`` and doubling up to ``CQ_MAX_SLEEP`` while nothing completes; any
completion resets the sleep.  It parks on an Event (no wake-ups at all) when no QP of the
device has a signaled send or a receive outstanding and nothing completed for ``CQ_LINGER``
seconds; every post wakes it.

``CQ.poll()`` itself also polls the hardware directly (after handing out what the
thread already queued, under the same lock, so order is kept): a caller that busy-polls
pays no thread hop.  Only a *waiting* caller (``poll_async``, ``poll_wait``) depends on
the thread, and pays at most one sleep period of latency: ≤ ``CQ_MAX_SLEEP`` (1 ms) on a
CQ that has been idle, ~``CQ_MIN_SLEEP`` plus a GIL hand-off on a busy one.  Measured in the
rxe guest (tests/vm): see docs/verbs.md.

Cost: while work is outstanding, up to 1/CQ_MIN_SLEEP wake-ups per second per device (in
practice ~5–10k/s given timer slack) with the GIL held a few µs each; idle devices cost
nothing after ``CQ_LINGER``.  A pyverbs ≥ 57 build could replace all this with the channel
fd; the eventfd contract of ``CQ.fd`` would not change.

Send-queue accounting lives here too: RC completes in order, so a send WC for ``wr_id``
retires every WR posted before it on that QP (unsignaled ones included).  ``qp.py`` uses
that count to refuse the ``max_send_wr + 1``-th outstanding WR with ENOMEM, as the
contract says, whatever the device rounded its queue up to.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING

from pyverbs.cq import CQ as _CQ

from ...api import CQ, WC
from ...enums import ibv_wc_opcode, ibv_wc_status
from ...tuning import CQ_BATCH, CQ_LINGER, CQ_MAX_SLEEP, CQ_MIN_SLEEP
from .errors import mapped

if TYPE_CHECKING:
    from .device import VerbsContext
    from .qp import VerbsQP

log = logging.getLogger(__name__)

_STATUS = {int(s): s for s in ibv_wc_status}
_OPCODE = {int(o): o for o in ibv_wc_opcode}


class Poller:
    """The completion thread of one device (started on its first CQ)."""

    def __init__(self, name: str) -> None:
        self._cqs: weakref.WeakSet[VerbsCQ] = weakref.WeakSet()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"verbs-cq-{name}",
                                        daemon=True)
        self._thread.start()

    def add(self, cq: VerbsCQ) -> None:
        self._cqs.add(cq)
        self.kick()

    def remove(self, cq: VerbsCQ) -> None:
        self._cqs.discard(cq)

    def kick(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(5)

    def _run(self) -> None:
        sleep = CQ_MIN_SLEEP
        last_hit = time.monotonic()
        while not self._stop:
            got = busy = 0
            for cq in list(self._cqs):
                try:
                    got += cq._pump()
                    busy |= cq._busy()
                except Exception:   # a CQ closing under us: it is gone next round
                    log.debug("poller: %r", cq, exc_info=True)
            now = time.monotonic()
            if got:
                sleep, last_hit = CQ_MIN_SLEEP, now
                continue
            if not busy and now - last_hit > CQ_LINGER:
                self._wake.clear()      # then re-check: a post or stop() may have raced
                if not self._stop and not any(cq._busy() for cq in list(self._cqs)):
                    self._wake.wait()
                sleep, last_hit = CQ_MIN_SLEEP, time.monotonic()
                continue
            time.sleep(sleep)
            sleep = min(CQ_MAX_SLEEP, sleep * 2)


class VerbsCQ(CQ):
    """:class:`rdma.api.CQ` over a pyverbs ``CQ``, its ``fd`` an eventfd the poller thread signals.

    ``fd`` is readable iff WCs wait in this CQ's queue: the device's :class:`Poller` thread
    (owned by the context, started by its first CQ) moves WCs from the hardware into the
    queue and signals the eventfd; ``poll`` hands out the queue first, then polls the
    hardware itself, under one lock, so order is kept and a busy-polling caller needs no
    thread. Differences from the interface: a waiting caller (``poll_async``,
    ``poll_wait``) depends on the poller and is woken up to one of its sleep periods late
    (module docstring); there is no moderation (``modify`` raises NotSupportedError); an
    error WC's opcode is filled in from the queue its ``wr_id`` was posted on (rxe leaves
    0 = SEND on flushed RECVs). Each WC retires its QP's send or receive books, which the
    poller reads to decide when to park and ``qp.py`` to refuse a full send queue.
    Owns the pyverbs CQ, the eventfd and the queued WCs. ``close()`` leaves the poller,
    destroys the CQ, drops queued WCs, wakes a trio waiter on ``fd`` (when called from the
    trio thread) and closes the eventfd.
    Threads: ``poll`` from any thread (one consumer per CQ, as :mod:`rdma.api` says); the
    poller thread calls ``_pump``; both hold the CQ's lock."""

    def __init__(self, ctx: VerbsContext, cqe: int) -> None:
        super().__init__(ctx, cqe)
        self._vctx = ctx
        with mapped(f"ibv_create_cq({cqe})"):
            self.raw = _CQ(ctx.raw, int(cqe))
        self._lock = threading.Lock()
        self._queue: collections.deque[WC] = collections.deque()
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._signalled = False
        #: QPs whose send and/or receive queue completes here (qp_num → QP)
        self._senders: weakref.WeakValueDictionary[int, VerbsQP] = \
            weakref.WeakValueDictionary()
        self._receivers: weakref.WeakValueDictionary[int, VerbsQP] = \
            weakref.WeakValueDictionary()
        self._poller: Poller = ctx.poller  # type: ignore[assignment]
        self._poller.add(self)

    @property
    def fd(self) -> int:
        self._check_open()
        return self._efd

    def attach(self, qp: VerbsQP, send: bool, recv: bool) -> None:
        if send:
            self._senders[qp.qp_num] = qp
        if recv:
            self._receivers[qp.qp_num] = qp

    def kick(self) -> None:
        self._poller.kick()

    # ---- called with self._lock held
    def _hw_poll(self, n: int) -> list[WC]:
        npolled, raw = self.raw.poll(n)
        out = []
        for w in raw[:npolled]:
            wc = WC(int(w.wr_id), _STATUS.get(int(w.status), ibv_wc_status.IBV_WC_GENERAL_ERR),
                    _OPCODE.get(int(w.opcode), ibv_wc_opcode.IBV_WC_SEND), int(w.byte_len),
                    int(w.qp_num), int(w.vendor_err))
            out.append(self._account(wc))
        return out

    def _account(self, wc: WC) -> WC:
        """Retire the WR in its QP's books.  An error WC's opcode is undefined in verbs
        (rxe leaves it 0 = SEND on flushed RECVs): we fill it in from the queue the
        ``wr_id`` was posted on, so a flushed RECV reads IBV_WC_RECV as on soft."""
        s, r = self._senders.get(wc.qp_num), self._receivers.get(wc.qp_num)
        if wc.status == ibv_wc_status.IBV_WC_SUCCESS:
            if wc.opcode & ibv_wc_opcode.IBV_WC_RECV:
                if r is not None:
                    r._recv_done(wc.wr_id)
            elif s is not None:
                s._send_done(wc.wr_id)
            return wc
        in_s = s is not None and s._owns(wc.wr_id)[0]
        in_r = r is not None and r._owns(wc.wr_id)[1]
        if in_r and (not in_s or wc.opcode & ibv_wc_opcode.IBV_WC_RECV):
            r._recv_done(wc.wr_id)    # type: ignore[union-attr]
            op: int | None = ibv_wc_opcode.IBV_WC_RECV
        elif in_s:
            op = s._send_done(wc.wr_id)  # type: ignore[union-attr]
        else:
            return wc
        if op is None or op == wc.opcode:
            return wc
        return WC(wc.wr_id, wc.status, _OPCODE[int(op)], wc.byte_len, wc.qp_num,
                  wc.vendor_err)

    def _pump(self) -> int:
        """Poller thread: move ready WCs into the queue; signal the fd."""
        if self._closed:
            return 0
        with self._lock:
            if self._closed:
                return 0
            wcs = self._hw_poll(CQ_BATCH)
            if wcs:
                self._queue.extend(wcs)
            if self._queue and not self._signalled:
                os.eventfd_write(self._efd, 1)
                self._signalled = True
            return len(wcs)

    def _busy(self) -> bool:
        return any(q._sq_signaled for q in list(self._senders.values())) or \
            any(q._rq_outstanding for q in list(self._receivers.values()))

    # ---- API
    def poll(self, num_entries: int = 1) -> list[WC]:
        self._check_open()
        with self._lock:
            out: list[WC] = []
            while self._queue and len(out) < num_entries:
                out.append(self._queue.popleft())
            if len(out) < num_entries:
                out += self._hw_poll(num_entries - len(out))
            if not self._queue and self._signalled:
                try:
                    os.eventfd_read(self._efd)
                except BlockingIOError:
                    pass
                self._signalled = False
            return out

    def _close_impl(self) -> None:
        self._poller.remove(self)
        with self._lock:
            raw = getattr(self, "raw", None)
            if raw is not None:
                raw.close()
            self._queue.clear()
        try:
            import trio

            trio.lowlevel.notify_closing(self._efd)
        except (ImportError, RuntimeError):
            pass
        os.close(self._efd)
