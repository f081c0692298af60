"""Soft RC queue pair.

Transitions arrive here already checked against :mod:`rdma.qp_state`; this module maps
them onto the engine:

* RESET → INIT: record the access flags (the responder refuses READs without
  ``IBV_ACCESS_REMOTE_READ`` on the QP as well as on the MR).
* INIT → RTR: TCP connect from this device's address to the peer device's listener
  (``ah_attr.dgid`` + ``ah_attr.service_port``), HELLO to ``dest_qp_num`` with
  ``private_data``, then hand the socket to the engine.  From RTR on, the engine serves
  the peer's requests that arrive on the connection the peer opened to us.
* RTR → RTS: ``sq_psn`` and the transport timer: per try ``4.096 µs × 2**timeout`` (or
  ``timeout_ms``) × (``retry_cnt`` + 1) without progress → RETRY_EXC_ERR.  ``timeout=0``
  is infinite, as on IB.
* → ERR flushes; → RESET closes the connections and empties both queues silently.

Who may connect to a QP (the engine checks the HELLO; limits in native/soft_engine.h):
QPNs are 24 random bits.  Before RTR a QP does not know its peer yet, so up to four
HELLOs naming it wait as candidates; RTR keeps the one from ``dest_qp_num`` at the
address we connected to and closes the rest.  :meth:`SoftQP.expect_peer`, called in
RESET/INIT with what the peer sent over an authenticated channel, makes the engine refuse
every other HELLO at once, so a stranger who guessed the QPN cannot take the QP's slots.
"""
from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ...api import QP, ConnInfo, QPAttr, QPInitAttr, RecvWR, SendWR
from ...enums import (
    IBV_QPS_ERR,
    IBV_QPS_INIT,
    IBV_QPS_RESET,
    IBV_QPS_RTR,
    IBV_QPS_RTS,
    IBV_WR_RDMA_READ,
    IBV_WR_SEND,
)
from ...errors import PostError, QPStateError, RdmaUserError
from ...qp_state import total_timeout_seconds
from ...tuning import CONNECT_TIMEOUT_S

if TYPE_CHECKING:
    from .cq import SoftCQ
    from .pd import SoftPD

log = logging.getLogger(__name__)


class SoftQP(QP):
    """:class:`rdma.api.QP` (RC) on a soft device: a QPN in the native engine, carried over TCP.

    Transitions map onto engine calls (module docstring). INIT→RTR needs ``ah_attr.dgid``
    and ``ah_attr.service_port``: it connects from this device's address to the peer's
    listener, sends the HELLO with ``private_data`` and hands the socket to the engine.
    Differences from the verbs provider: ``timeout_ms`` (when > 0) replaces the exponent's
    per-try timeout; the engine completes RETRY_EXC_ERR after ``transport_timeout``
    seconds without progress, and at once on a reset or closed connection;
    ``remote_private_data`` is what the peer's HELLO carried; ``rx_age`` is known;
    ``expect_peer`` (soft-only) binds the QP to one peer before RTR; ``post_send`` takes
    RDMA_READ and SEND only; there is no SQD/SQE.
    Owns its QPN in the engine; the engine owns the connections, queues and their fds
    (``close()`` destroys the QP there).
    Threads: the native engine serialises the calls under its own lock, so any thread may
    make them. ``to_rtr`` (also ``to_rts`` and ``connect`` from RESET/INIT) blocks on the
    TCP connect and HELLO, up to ``CONNECT_TIMEOUT_S``: call it from a worker thread under
    trio."""

    def __init__(self, pd: SoftPD, init_attr: QPInitAttr) -> None:
        super().__init__(pd, init_attr)
        self.engine = pd.engine
        self._pd = pd
        scq: SoftCQ = init_attr.send_cq  # type: ignore[assignment]
        rcq: SoftCQ = (init_attr.recv_cq or init_attr.send_cq)  # type: ignore[assignment]
        for cq in (scq, rcq):
            if getattr(cq, "engine", None) is not self.engine:
                raise RdmaUserError("the QP's CQs must belong to the same soft device")
        cap = init_attr.cap
        self.qp_num: int = self.engine.call(
            "create_qp", self.engine.raw.create_qp, pd.handle, scq.handle, rcq.handle,
            cap.max_send_wr, cap.max_recv_wr, cap.max_send_sge, cap.max_recv_sge,
            bool(init_attr.sq_sig_all))
        self._timeout = 14
        self._retry_cnt = 6
        self._timeout_ms: int | None = None

    def expect_peer(self, remote: ConnInfo, private_data: bytes | None = None) -> None:
        """Only ``remote``'s QP (its QPN at its address), carrying exactly
        ``private_data`` on its INIT→RTR (None: any), may connect to this QP; connections
        that already wait for it and do not match are closed.  RESET/INIT only; RESET
        forgets it.  Soft-only (verbs binds the QP to its peer at RTR)."""
        self._check_open()
        ip = remote.ipv4
        if ip is None:
            raise RdmaUserError(f"gid {remote.gid} is not an IPv4(-mapped) address")
        ip_be = int.from_bytes(socket.inet_aton(ip), "little")  # network order in memory
        self.engine.call("qp_expect", self.engine.raw.qp_expect, self.qp_num,
                         remote.qp_num, ip_be,
                         None if private_data is None else bytes(private_data))

    # ---- state
    def _query_state(self) -> int:
        self._check_open()
        return int(self.engine.call("qp_state", self.engine.raw.qp_state, self.qp_num))

    def rx_age(self) -> float | None:
        self._check_open()
        age: float | None = self.engine.call("qp_rx_age", self.engine.raw.qp_rx_age, self.qp_num)
        return age

    def _modify(self, attr: QPAttr, names: frozenset[str], current: int,
                requested: int) -> None:
        raw = self.engine.raw
        n = self.qp_num
        if requested == IBV_QPS_RESET:
            self.engine.call("qp_reset", raw.qp_reset, n)
        elif requested == IBV_QPS_ERR:
            self.engine.call("qp_err", raw.qp_err, n)
        elif requested == IBV_QPS_INIT:
            if current == IBV_QPS_RESET:
                self.engine.call("qp_init", raw.qp_init, n, int(attr.qp_access_flags))
            elif "qp_access_flags" in names:
                self.engine.call("qp_set_access", raw.qp_set_access, n,
                                 int(attr.qp_access_flags))
        elif requested == IBV_QPS_RTR:
            self._to_rtr(attr, names)
        elif requested == IBV_QPS_RTS:
            self._to_rts(attr, names, current)
        else:
            raise QPStateError(current, requested, "soft QPs do not implement SQD/SQE")

    def _to_rtr(self, attr: QPAttr, names: frozenset[str]) -> None:
        ah = attr.ah_attr
        if ah is None or not ah.dgid or not ah.service_port:
            raise RdmaUserError("soft INIT->RTR needs ah_attr.dgid and ah_attr.service_port "
                                "(take them from the peer's ConnInfo)")
        remote_ip = ConnInfo(qp_num=0, psn=0, gid=ah.dgid).ipv4
        if remote_ip is None:
            raise RdmaUserError(f"dgid {ah.dgid} is not an IPv4(-mapped) address")
        if "qp_access_flags" in names:
            self.engine.call("qp_set_access", self.engine.raw.qp_set_access, self.qp_num,
                             int(attr.qp_access_flags))
        pdata = attr.private_data if "private_data" in names and attr.private_data else b""
        ctx = self._pd.ctx
        fd = self.engine.connect(ctx.ipv4, remote_ip, ah.service_port,  # type: ignore[attr-defined]
                                 attr.dest_qp_num, self.qp_num, bytes(pdata),
                                 timeout=CONNECT_TIMEOUT_S)
        try:
            self.engine.call("qp_rtr", self.engine.raw.qp_rtr, self.qp_num, fd,
                             attr.dest_qp_num, attr.rq_psn)
        except BaseException:
            os.close(fd)
            raise
        log.debug("QP %#x connected to %s:%d QP %#x", self.qp_num, remote_ip,
                  ah.service_port, attr.dest_qp_num)

    def _to_rts(self, attr: QPAttr, names: frozenset[str], current: int) -> None:
        if "timeout" in names:
            self._timeout = attr.timeout
        if "retry_cnt" in names:
            self._retry_cnt = attr.retry_cnt
        if "timeout_ms" in names:
            self._timeout_ms = attr.timeout_ms
        total = total_timeout_seconds(self._timeout, self._retry_cnt, self._timeout_ms)
        timeout_ns = 0 if total == float("inf") else max(1, int(total * 1e9))
        self.engine.call("qp_rts", self.engine.raw.qp_rts, self.qp_num,
                         attr.sq_psn & 0xFFFFFF, timeout_ns, current == IBV_QPS_RTR)

    @property
    def transport_timeout(self) -> float:
        """Seconds without progress before an outstanding WR completes RETRY_EXC_ERR."""
        return total_timeout_seconds(self._timeout, self._retry_cnt, self._timeout_ms)

    @property
    def remote_private_data(self) -> bytes | None:
        self._check_open()
        data: bytes | None = self.engine.call("qp_private_data", self.engine.raw.qp_private_data,
                                              self.qp_num)
        return data

    # ---- posting
    def post_send(self, wr: SendWR | Iterable[SendWR]) -> None:
        self._check_open()
        wrs = [wr] if isinstance(wr, SendWR) else list(wr)
        raw = []
        for w in wrs:
            if w.opcode not in (IBV_WR_RDMA_READ, IBV_WR_SEND):
                raise PostError(f"soft provider: opcode {w.opcode} not supported "
                                "(RDMA_READ and SEND only)")
            raw.append((w.wr_id, int(w.opcode), int(w.send_flags), w.remote_addr, w.rkey,
                        [(s.addr, s.length, s.lkey) for s in w.sg_list]))
        self.engine.call("post_send", self.engine.raw.post_send, self.qp_num, raw,
                         error=PostError)

    def post_recv(self, wr: RecvWR | Iterable[RecvWR]) -> None:
        self._check_open()
        wrs = [wr] if isinstance(wr, RecvWR) else list(wr)
        raw = [(w.wr_id, [(s.addr, s.length, s.lkey) for s in w.sg_list]) for w in wrs]
        self.engine.call("post_recv", self.engine.raw.post_recv, self.qp_num, raw,
                         error=PostError)

    def _close_impl(self) -> None:
        if not hasattr(self, 'qp_num'):
            return  # construction failed before the engine made it
        self.engine.call("destroy_qp", self.engine.raw.destroy_qp, self.qp_num)


