"""Verbs RC queue pair: the shared state table (:mod:`rdma.qp_state`) → ``ibv_modify_qp``.

Transitions arrive checked; this module only translates the named attributes into a
pyverbs ``QPAttr`` and the matching ``IBV_QP_*`` mask (``qp_state.attr_mask``):

* RESET → INIT: ``pkey_index``, ``port_num``, ``qp_access_flags`` (the responder needs
  ``IBV_ACCESS_REMOTE_READ`` here *and* on the MR; pyverbs' QPAttr defaults it to 0).
* INIT → RTR: the address vector (RoCE: always global; ``sgid_index`` 0 means this
  device's RoCE v2 IPv4 GID, see ``device.py``; ``dgid`` is the peer's ConnInfo.gid),
  ``dest_qp_num``, ``rq_psn``, ``max_dest_rd_atomic`` (≥ 1 or the peer's READs are
  refused), ``min_rnr_timer``, and ``path_mtu`` = min(requested, the port's active MTU).
  The kernel resolves the peer's MAC here: an unreachable peer fails ``to_rtr`` with
  ETIMEDOUT (ConnectError), like the soft provider's TCP connect.
* RTR → RTS: ``sq_psn``, ``timeout``, ``retry_cnt``, ``rnr_retry``, ``max_rd_atomic``.
  ``timeout_ms`` (soft extension) does not exist in hardware and is ignored: the per-try
  timeout is 4.096 µs × 2**timeout.  **rxe treats retry_cnt = 7 as "retry forever"**
  (rxe_comp.c only decrements when != 7), which would turn a dead path into a READ
  that never completes; on rxe devices 7 is lowered to 6 so the contract's
  ``timeout × (retry_cnt + 1)`` bound holds (docs/verbs.md has the arithmetic).
* → ERR flushes every outstanding WR (WR_FLUSH_ERR); → RESET drops them silently.

The state the API reports (``qp_state``) is the kernel's (``ibv_query_qp``): a QP the
device moved to ERR after a failed WC reads ERR.  ``post_send`` checks the state this
process last set (no syscall per post): not RTS → PostError(EINVAL), as the contract
says; a QP the *device* moved to ERR accepts posts and flushes them, as verbs does.
``private_data`` has no verbs equivalent (rdma_cm has one, raw verbs do not): ignored,
``remote_private_data`` is None; the vRDMA layer authenticates on its own TCP channel.
"""
from __future__ import annotations

import collections
import errno
import ipaddress
import logging
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pyverbs.addr import GID, AHAttr, GlobalRoute
from pyverbs.qp import QP as _QP
from pyverbs.qp import QPAttr as _QPAttr
from pyverbs.qp import QPCap as _QPCap
from pyverbs.qp import QPInitAttr as _QPInitAttr
from pyverbs.wr import SGE as _SGE
from pyverbs.wr import RecvWR as _RecvWR
from pyverbs.wr import SendWR as _SendWR

from ...api import QP, ConnInfo, QPAttr, QPInitAttr, RecvWR, SendWR, random_psn
from ...enums import (
    IBV_QP_STATE,
    IBV_QPS_ERR,
    IBV_QPS_RESET,
    IBV_QPS_RTS,
    IBV_QPT_RC,
    IBV_SEND_SIGNALED,
    ibv_qp_state,
    ibv_wc_opcode,
    ibv_wr_opcode,
)
from ...errors import NotSupportedError, PostError, RdmaUserError
from ...qp_state import attr_mask
from .errors import mapped

if TYPE_CHECKING:
    from .cq import VerbsCQ
    from .pd import VerbsPD

log = logging.getLogger(__name__)

#: rxe: retry_cnt 7 never gives up (see the module docstring)
RXE_MAX_RETRY_CNT = 6

_WC_OF_WR: dict[int, ibv_wc_opcode] = {ibv_wr_opcode.IBV_WR_RDMA_READ: ibv_wc_opcode.IBV_WC_RDMA_READ,
                                        ibv_wr_opcode.IBV_WR_SEND: ibv_wc_opcode.IBV_WC_SEND,
                                        ibv_wr_opcode.IBV_WR_RDMA_WRITE: ibv_wc_opcode.IBV_WC_RDMA_WRITE}

#: the QPAttr fields copied as plain integers
_SCALARS = ("qkey", "rq_psn", "sq_psn", "dest_qp_num", "qp_access_flags", "pkey_index",
            "en_sqd_async_notify", "max_rd_atomic", "max_dest_rd_atomic", "min_rnr_timer",
            "port_num", "timeout", "retry_cnt", "rnr_retry", "path_mig_state",
            "cur_qp_state")


def gid_text(gid: str) -> str:
    """The 8-group form pyverbs' GID parser takes (``0000:...:ffff:c612:0101``)."""
    return ipaddress.IPv6Address(gid).exploded


class VerbsQP(QP):
    """:class:`rdma.api.QP` (RC) over a pyverbs ``QP``: checked transitions → ``ibv_modify_qp``.

    Each transition the state table allowed becomes a pyverbs ``QPAttr`` and mask (module
    docstring). Differences from the interface and the soft provider: ``path_mtu`` is capped
    at the port's active MTU; on rxe a ``retry_cnt`` of 7 becomes 6 (rxe retries forever at
    7); ``timeout_ms`` and ``private_data`` are ignored (``remote_private_data`` and
    ``rx_age`` are None); addressing is RoCE v2 only (``local_info`` raises
    NotSupportedError without a RoCE v2 GID holding the device's IPv4; ``service_port`` is
    0); ``to_rtr`` resolves the peer's MAC in the kernel (unreachable: ConnectError).
    ``post_send`` takes RDMA_READ, RDMA_WRITE and SEND; it checks the state this process
    last set (a QP the device moved to ERR accepts posts and flushes them) and counts its own
    outstanding WRs, so the ``max_send_wr + 1``-th is ENOMEM whatever depth the device
    rounded the queue up to.
    Owns the pyverbs QP (``close()`` destroys it) and the books of posted, unretired WRs,
    under the QP's lock: whichever thread polls its CQs (the poller, or a ``poll`` caller)
    retires them through the CQ. Its CQs must be of the same device; it registers with them
    weakly, and every post kicks the device's poller thread."""

    def __init__(self, pd: VerbsPD, init_attr: QPInitAttr) -> None:
        super().__init__(pd, init_attr)
        self._vpd = pd
        ctx = pd.ctx
        scq: VerbsCQ = init_attr.send_cq  # type: ignore[assignment]
        rcq: VerbsCQ = init_attr.recv_cq or init_attr.send_cq  # type: ignore[assignment]
        for cq in (scq, rcq):
            if getattr(cq, "ctx", None) is not ctx:
                raise RdmaUserError("the QP's CQs must belong to the same verbs device")
        cap = init_attr.cap
        ia = _QPInitAttr(qp_type=IBV_QPT_RC, scq=scq.raw, rcq=rcq.raw,
                         cap=_QPCap(max_send_wr=cap.max_send_wr, max_recv_wr=cap.max_recv_wr,
                                    max_send_sge=cap.max_send_sge,
                                    max_recv_sge=cap.max_recv_sge,
                                    max_inline_data=cap.max_inline_data),
                         sq_sig_all=int(bool(init_attr.sq_sig_all)))
        with mapped("ibv_create_qp"):
            self.raw = _QP(pd.raw, ia)
        self.qp_num: int = int(self.raw.qp_num)
        self._scq, self._rcq = scq, rcq
        self._state: int = IBV_QPS_RESET     # as last set by us
        self._lock = threading.Lock()
        #: posted send WRs not yet retired: (wr_id, signaled, WC opcode)
        self._sq: collections.deque[tuple[int, bool, int]] = collections.deque()
        self._sq_signaled = 0
        self._rq: collections.deque[int] = collections.deque()
        self._rq_outstanding = 0
        self._is_rxe = bool(getattr(pd.ctx, "is_rxe", False))
        self.timeout, self.retry_cnt = 14, 6
        scq.attach(self, send=True, recv=rcq is scq)
        if rcq is not scq:
            rcq.attach(self, send=False, recv=True)

    # ---- state
    def _query_state(self) -> int:
        self._check_open()
        with mapped("ibv_query_qp"):
            attr, _ = self.raw.query(IBV_QP_STATE)
        return int(attr.qp_state)

    def _modify(self, attr: QPAttr, names: frozenset[str], current: int,
                requested: int) -> None:
        a = _QPAttr()
        a.qp_state = requested
        for n in _SCALARS:
            if n in names:
                setattr(a, n, int(getattr(attr, n)))
        if "retry_cnt" in names and self._is_rxe and attr.retry_cnt > RXE_MAX_RETRY_CNT:
            log.debug("QP %#x: rxe retries forever at retry_cnt=7; using %d",
                      self.qp_num, RXE_MAX_RETRY_CNT)
            a.retry_cnt = RXE_MAX_RETRY_CNT
        if "path_mtu" in names:
            a.path_mtu = min(int(attr.path_mtu), self._vpd.ctx.query_port(
                attr.port_num or 1).active_mtu)
        if "ah_attr" in names:
            a.ah_attr = self._ah(attr)
        mask = attr_mask(names) | IBV_QP_STATE
        with mapped(f"QP {self.qp_num:#x} {ibv_qp_state(current).name} -> "
                    f"{ibv_qp_state(requested).name}"):
            self.raw.modify(a, mask)
        if "timeout" in names:
            self.timeout = attr.timeout
        if "retry_cnt" in names:
            self.retry_cnt = int(a.retry_cnt)
        self._state = requested
        if requested == IBV_QPS_RESET:     # the device dropped every WR without a WC
            with self._lock:
                self._sq.clear()
                self._rq.clear()
                self._sq_signaled = self._rq_outstanding = 0
        elif requested == IBV_QPS_ERR:
            self._scq.kick()

    def _ah(self, attr: QPAttr) -> AHAttr:
        ah = attr.ah_attr
        if ah is None or not ah.dgid:
            raise RdmaUserError("verbs INIT->RTR needs ah_attr.dgid (the peer's "
                                "ConnInfo.gid): RoCE addresses are GIDs")
        ctx = self._vpd.ctx
        sgid = ah.sgid_index
        if sgid == 0 and ctx.gid_index is not None:     # type: ignore[attr-defined]
            sgid = ctx.gid_index                        # type: ignore[attr-defined]
        gr = GlobalRoute(dgid=GID(gid_text(ah.dgid)), sgid_index=sgid,
                         hop_limit=ah.hop_limit or 64)
        return AHAttr(port_num=ah.port_num or 1, is_global=1, dlid=ah.dlid, sl=ah.sl, gr=gr)

    @property
    def transport_timeout(self) -> float:
        """Seconds before a READ on a dead path completes RETRY_EXC_ERR (nominal)."""
        from ...qp_state import total_timeout_seconds

        return total_timeout_seconds(self.timeout, self.retry_cnt)

    # ---- connection info
    def local_info(self, psn: int | None = None) -> ConnInfo:
        """qpn, PSN, this device's RoCE v2 GID, port 1's LID (0 on RoCE)."""
        self._check_open()
        ctx = self._vpd.ctx
        if ctx.refresh_gid() is None:                   # type: ignore[attr-defined]
            raise NotSupportedError(f"{ctx.name}: no RoCE v2 GID with an IPv4 address "
                                    "(InfiniBand / LID addressing is not supported)")
        self._local_psn = random_psn() if psn is None else psn & 0xFFFFFF
        port = ctx.query_port(1)
        return ConnInfo(qp_num=self.qp_num, psn=self._local_psn,
                        gid=ctx.query_gid(1, ctx.gid_index),  # type: ignore[attr-defined]
                        port_num=1, lid=port.lid, service_port=0, provider="verbs")

    # ---- accounting (called by the CQ, with its lock held)
    def _send_done(self, wr_id: int) -> int | None:
        """Retire WRs up to and including the oldest one with ``wr_id`` (RC order);
        returns its WC opcode, None if it is not ours (e.g. posted before a RESET)."""
        with self._lock:
            if not any(e[0] == wr_id for e in self._sq):
                return None
            while self._sq:
                wid, signaled, op = self._sq.popleft()
                self._sq_signaled -= signaled
                if wid == wr_id:
                    return op
        return None

    def _recv_done(self, wr_id: int) -> bool:
        with self._lock:
            if wr_id not in self._rq:
                return False
            while self._rq:
                self._rq_outstanding -= 1
                if self._rq.popleft() == wr_id:
                    return True
        return False

    def _owns(self, wr_id: int) -> tuple[bool, bool]:
        with self._lock:
            return (any(e[0] == wr_id for e in self._sq), wr_id in self._rq)

    # ---- posting
    def post_send(self, wr: SendWR | Iterable[SendWR]) -> None:
        self._check_open()
        wrs = [wr] if isinstance(wr, SendWR) else list(wr)
        if self._state != IBV_QPS_RTS:
            raise PostError(f"post_send on QP {self.qp_num:#x} in "
                            f"{ibv_qp_state(self._state).name} (needs RTS)", errno.EINVAL)
        sig_all = bool(self.init_attr.sq_sig_all)
        try:
            for w in wrs:
                op = _WC_OF_WR.get(w.opcode)
                if op is None:
                    raise PostError(f"verbs provider: opcode {w.opcode} not supported "
                                    "(RDMA_READ, RDMA_WRITE, SEND)", errno.EINVAL)
                if len(w.sg_list) > self.cap.max_send_sge:
                    raise PostError(f"{len(w.sg_list)} SGEs > max_send_sge "
                                    f"{self.cap.max_send_sge}", errno.EINVAL)
                signaled = sig_all or bool(w.send_flags & IBV_SEND_SIGNALED)
                with self._lock:
                    if len(self._sq) >= self.cap.max_send_wr:
                        raise PostError(f"send queue of QP {self.qp_num:#x} full "
                                        f"({self.cap.max_send_wr} outstanding)", errno.ENOMEM)
                    self._sq.append((w.wr_id, signaled, int(op)))
                    self._sq_signaled += signaled
                sges = [_SGE(s.addr, s.length, s.lkey) for s in w.sg_list]
                swr = _SendWR(wr_id=w.wr_id, opcode=int(w.opcode), num_sge=len(sges),
                              sg=sges or None, send_flags=int(w.send_flags))
                if w.opcode != ibv_wr_opcode.IBV_WR_SEND:
                    swr.set_wr_rdma(int(w.rkey), int(w.remote_addr))
                try:
                    with mapped("ibv_post_send", PostError):
                        self.raw.post_send(swr)
                except BaseException:
                    with self._lock:
                        if self._sq and self._sq[-1][0] == w.wr_id:
                            self._sq.pop()
                            self._sq_signaled -= signaled
                    raise
        finally:
            self._scq.kick()

    def post_recv(self, wr: RecvWR | Iterable[RecvWR]) -> None:
        self._check_open()
        wrs = [wr] if isinstance(wr, RecvWR) else list(wr)
        if self._state == IBV_QPS_RESET:
            raise PostError(f"post_recv on QP {self.qp_num:#x} in RESET", errno.EINVAL)
        try:
            for w in wrs:
                with self._lock:
                    self._rq.append(w.wr_id)
                    self._rq_outstanding += 1
                sges = [_SGE(s.addr, s.length, s.lkey) for s in w.sg_list]
                rwr = _RecvWR(wr_id=w.wr_id, num_sge=len(sges), sg=sges or None)
                try:
                    with mapped("ibv_post_recv", PostError):
                        self.raw.post_recv(rwr)
                except BaseException:
                    with self._lock:
                        if self._rq and self._rq[-1] == w.wr_id:
                            self._rq.pop()
                            self._rq_outstanding -= 1
                    raise
        finally:
            self._rcq.kick()

    def _close_impl(self) -> None:
        raw = getattr(self, "raw", None)
        if raw is not None:
            raw.close()

