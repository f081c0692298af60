"""Provider-neutral, verbs-shaped RDMA API.  Read this docstring first: it is the contract.

Public API (stable names; providers ``soft`` and ``verbs`` implement it identically)
-------------------------------------------------------------------------------------
Selection and devices::

    get_device_list(provider=None) -> list[Device]      # [] when there are no devices
    select_provider(provider=None) -> str               # arg > $KSPEEDFS_RDMA_PROVIDER >
                                                        #   "verbs" if /sys/class/infiniband
                                                        #   has devices, else "soft"
    open_device(name=None, provider=None, addr=None) -> Context   # by name / IPv4 / first
    find_device(addr, provider=None) -> Device          # device whose NIC has IPv4 ``addr``
    Device(name, provider, ipv4, netdev, node_guid).open() -> Context

Objects (rdma-core names; every one is a context manager with idempotent ``close()``;
parents close their children first: Context → PDs (→ QPs, then MRs) → CQs)::

    Context.query_device() -> DeviceAttr;  .query_port(port_num=1) -> PortAttr
    Context.query_gid(port_num=1, index=0) -> str      # IPv6 text; soft: "::ffff:a.b.c.d"
    Context.alloc_pd() -> PD;  Context.create_cq(cqe) -> CQ
    PD.reg_mr(buf_or_length, access) -> MR             # bytearray/mmap/any writable buffer
    PD.create_qp(QPInitAttr) -> QP                     # RC only; returned in RESET
    MR.lkey .rkey .buf (virtual address, int) .length .access
    MR.read(length, offset=0) -> bytes;  MR.write(data, offset=0);  MR.remote() -> RemoteMR
    CQ.fd                                              # readable iff WCs are queued
    CQ.poll(num_entries=1) -> list[WC]                 # non-blocking
    await CQ.poll_async(num_entries=1) -> list[WC]     # trio; see cancellation contract
    CQ.poll_wait(num_entries=1, timeout=None) -> list[WC]   # blocking, for threads/tests
    CQ.modify(cq_count, cq_period)                     # ibv_modify_cq moderation: fd turns
                                                       #   readable at cq_count WCs or cq_period
                                                       #   µs after the first (soft; verbs may
                                                       #   raise NotSupportedError)
    QP.qp_num .qp_state .qp_type .cap
    QP.modify(QPAttr, attr_mask)                       # raw ibv_modify_qp, checked by
                                                       #   rdma.qp_state.TRANSITIONS
    QP.to_init(attr) / to_rtr(attr) / to_rts(attr)     # pyverbs semantics (to_rts walks
                                                       #   RESET/INIT → INIT → RTR → RTS)
    QP.to_reset() / QP.to_err()
    QP.local_info(psn=None) -> ConnInfo                # what the peer needs (exchange OOB)
    QP.connect(remote: ConnInfo, **rc_connect_attr kwargs)  # RESET/INIT → RTS in one call
    QP.post_send(SendWR | list[SendWR]);  QP.post_recv(RecvWR | list[RecvWR])
    QP.remote_private_data -> bytes | None             # soft: private_data the peer sent

Plain data: ``SGE, SendWR, RecvWR, WC, QPCap, QPInitAttr, QPAttr, AHAttr, ConnInfo,
RemoteMR, DeviceAttr, PortAttr`` and ``rc_connect_attr(remote, ...) -> QPAttr``.
Constants are in :mod:`rdma.enums`, exceptions in :mod:`rdma.errors`, the state table in
:mod:`rdma.qp_state`, a conformance suite in :mod:`rdma.testing`.

Semantics the vRDMA layer can rely on
-------------------------------------
* ``post_send`` on a QP not in RTS raises ``PostError`` (EINVAL); a full send queue
  (``cap.max_send_wr`` outstanding) raises ``PostError`` (ENOMEM).  ``post_recv`` is refused
  only in RESET.
* Failed WRs are reported as WCs, never exceptions.  The first failure carries the cause
  (REM_ACCESS_ERR, RETRY_EXC_ERR, LOC_PROT_ERR, REM_INV_REQ_ERR, ...); the QP is then in
  ERR and every other outstanding WR (send and receive queue) completes WR_FLUSH_ERR.
  Errors are always reported, success only for ``IBV_SEND_SIGNALED`` WRs (or sq_sig_all).
* Dead path: a READ with no response for ``timeout`` × (``retry_cnt`` + 1) — per-try
  timeout 4.096 µs × 2**timeout, or ``QPAttr.timeout_ms`` (soft extension) — completes
  RETRY_EXC_ERR.  On the soft provider a reset/closed TCP connection does the same at once.
* Recovery: ``to_reset()`` then ``connect()`` again on BOTH sides (fresh PSNs recommended).
* Connection token: ``QPAttr.private_data`` (≤ 256 bytes) set on INIT→RTR is delivered to
  the responder QP (``remote_private_data``), like rdma_cm private_data.  It is NOT
  authentication; the vRDMA layer runs its own challenge-response over SEND/RECV.
  The verbs provider has no such channel and ignores it (``remote_private_data`` is None).

Cancellation contract of ``await CQ.poll_async``
------------------------------------------------
``poll_async`` only *waits* for the CQ fd and then calls ``poll()``, which is synchronous;
WCs are never lost by cancelling it (a cancelled call has consumed nothing).  Cancelling
does NOT cancel posted work: a buffer named by a posted WR stays the NIC's until that WR's
WC has been polled (trio's ``Abort.FAILED`` case) — do not reuse or free it before.  Run
one consumer task per CQ and dispatch by ``wr_id``; two concurrent pollers steal each
other's WCs.  Nothing here is shielded; shield the drain in the caller if it must finish.
"""
from __future__ import annotations

import abc
import importlib
import ipaddress
import logging
import os
import random
import select
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import Any

from . import qp_state as _qps
from .enums import (
    IBV_ACCESS_LOCAL_WRITE,
    IBV_ACCESS_REMOTE_READ,
    IBV_MTU_1024,
    IBV_QPS_ERR,
    IBV_QPS_INIT,
    IBV_QPS_RESET,
    IBV_QPS_RTR,
    IBV_QPS_RTS,
    IBV_QPT_RC,
    IBV_SEND_SIGNALED,
    IBV_WC_SUCCESS,
    IBV_WR_RDMA_READ,
    IBV_WR_SEND,
    ibv_qp_state,
    ibv_wc_opcode,
    ibv_wc_status,
)
from .errors import NoDeviceError, QPStateError, RdmaUserError, ResourceClosedError, WCError

log = logging.getLogger(__name__)

ENV_PROVIDER = "KSPEEDFS_RDMA_PROVIDER"
SYSFS_INFINIBAND = "/sys/class/infiniband"
PROVIDERS: dict[str, str] = {"soft": "rdma.providers.soft", "verbs": "rdma.providers.verbs"}
MAX_PRIVATE_DATA = 256


# --------------------------------------------------------------------------- plain data

@dataclass(frozen=True)
class DeviceAttr:
    max_qp: int = 1 << 16
    max_qp_wr: int = 4096
    max_sge: int = 16
    max_cqe: int = 1 << 20
    max_mr_size: int = 1 << 40
    max_qp_rd_atom: int = 16
    phys_port_cnt: int = 1
    fw_ver: str = ""
    vendor_id: int = 0


@dataclass(frozen=True)
class PortAttr:
    state: int
    max_mtu: int
    active_mtu: int
    gid_tbl_len: int
    lid: int = 0
    link_layer: str = "Ethernet"
    #: soft provider: TCP port of this device's listener (part of the address a peer needs)
    service_port: int = 0


@dataclass(frozen=True)
class SGE:
    addr: int
    length: int
    lkey: int


@dataclass
class SendWR:
    """``ibv_send_wr``.  For RDMA_READ set ``remote_addr``/``rkey`` (or ``set_wr_rdma``)."""

    wr_id: int = 0
    opcode: int = IBV_WR_SEND
    sg_list: Sequence[SGE] = ()
    send_flags: int = IBV_SEND_SIGNALED
    remote_addr: int = 0
    rkey: int = 0

    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        self.rkey, self.remote_addr = rkey, addr

    @property
    def length(self) -> int:
        return sum(s.length for s in self.sg_list)


@dataclass
class RecvWR:
    wr_id: int = 0
    sg_list: Sequence[SGE] = ()


@dataclass(frozen=True)
class WC:
    """``ibv_wc``.  ``status``/``opcode`` are the rdma-core enum members."""

    wr_id: int
    status: ibv_wc_status
    opcode: ibv_wc_opcode
    byte_len: int = 0
    qp_num: int = 0
    vendor_err: int = 0

    @property
    def ok(self) -> bool:
        return self.status == IBV_WC_SUCCESS

    def raise_for_status(self) -> WC:
        if self.status != IBV_WC_SUCCESS:
            raise WCError(self)
        return self


@dataclass(frozen=True)
class QPCap:
    max_send_wr: int = 64
    max_recv_wr: int = 64
    max_send_sge: int = 1
    max_recv_sge: int = 1
    max_inline_data: int = 0


@dataclass
class QPInitAttr:
    send_cq: CQ
    recv_cq: CQ | None = None        # None: same as send_cq
    cap: QPCap = field(default_factory=QPCap)
    qp_type: int = IBV_QPT_RC
    sq_sig_all: bool = False


@dataclass
class AHAttr:
    """``ibv_ah_attr`` (+ GRH).  ``service_port`` is the soft provider's listener port."""

    dgid: str = ""
    dlid: int = 0
    port_num: int = 1
    is_global: int = 1
    sgid_index: int = 0
    hop_limit: int = 64
    sl: int = 0
    service_port: int = 0


@dataclass
class QPAttr:
    """``ibv_qp_attr``.  Which fields a transition uses is decided by the mask / the state
    table, not by the values.  ``timeout_ms`` and ``private_data`` are soft extensions."""

    qp_state: int = IBV_QPS_RESET
    cur_qp_state: int = IBV_QPS_RESET
    path_mtu: int = IBV_MTU_1024
    qkey: int = 0
    rq_psn: int = 0
    sq_psn: int = 0
    dest_qp_num: int = 0
    qp_access_flags: int = 0
    cap: QPCap | None = None
    ah_attr: AHAttr | None = None
    alt_path: Any = None
    pkey_index: int = 0
    en_sqd_async_notify: int = 0
    max_rd_atomic: int = 1
    max_dest_rd_atomic: int = 1
    min_rnr_timer: int = 12
    port_num: int = 1
    timeout: int = 14
    retry_cnt: int = 6
    rnr_retry: int = 7
    path_mig_state: int = 0
    timeout_ms: int | None = None
    private_data: bytes | None = None


@dataclass(frozen=True)
class ConnInfo:
    """Everything a peer needs to connect an RC QP to this one; exchange it out of band.

    ``gid`` is the port GID as IPv6 text (soft and RoCE v2: IPv4-mapped ``::ffff:a.b.c.d``),
    ``service_port`` the soft device's TCP listener (0 on verbs).  ``to_dict``/``from_dict``
    give a JSON-able form for etcd or a TCP handshake.
    """

    qp_num: int
    psn: int
    gid: str
    port_num: int = 1
    lid: int = 0
    service_port: int = 0
    provider: str = "soft"

    @property
    def ipv4(self) -> str | None:
        ip = ipaddress.ip_address(self.gid)
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
            return str(ip.ipv4_mapped)
        return str(ip) if isinstance(ip, ipaddress.IPv4Address) else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ConnInfo:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass(frozen=True)
class RemoteMR:
    """What a requester needs to READ an MR of the peer: ``(addr, rkey, length)``."""

    addr: int
    rkey: int
    length: int


def gid_from_ipv4(addr: str) -> str:
    """``::ffff:a.b.c.d`` as documented (Python < 3.13 would print ``::ffff:7f00:1``)."""
    return "::ffff:" + str(ipaddress.IPv4Address(addr))


def random_psn() -> int:
    return random.getrandbits(24)


def rc_connect_attr(remote: ConnInfo, *, sq_psn: int,
                    qp_access_flags: int = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ,
                    port_num: int = 1, sgid_index: int = 0, path_mtu: int = IBV_MTU_1024,
                    timeout: int = 14, retry_cnt: int = 6, rnr_retry: int = 7,
                    min_rnr_timer: int = 12, max_rd_atomic: int = 1,
                    max_dest_rd_atomic: int = 1, timeout_ms: int | None = None,
                    private_data: bytes | None = None) -> QPAttr:
    """A QPAttr that takes an RC QP from RESET/INIT to RTS against ``remote``
    (the ibv_rc_pingpong values used by rdma-core's tests are the defaults)."""
    return QPAttr(
        qp_access_flags=qp_access_flags, port_num=port_num, path_mtu=path_mtu,
        dest_qp_num=remote.qp_num, rq_psn=remote.psn, sq_psn=sq_psn,
        max_rd_atomic=max_rd_atomic, max_dest_rd_atomic=max_dest_rd_atomic,
        min_rnr_timer=min_rnr_timer, timeout=timeout, retry_cnt=retry_cnt,
        rnr_retry=rnr_retry, timeout_ms=timeout_ms, private_data=private_data,
        ah_attr=AHAttr(dgid=remote.gid, dlid=remote.lid, port_num=port_num,
                       is_global=1, sgid_index=sgid_index,
                       service_port=remote.service_port))


# ---------------------------------------------------------------------- ownership base

class Resource:
    """Parent/child bookkeeping shared by every verbs object (pyverbs ``add_ref`` /
    ``close_weakrefs``).  ``close()`` is idempotent and closes children first, ordered by
    their ``_close_rank`` (QPs before MRs, PDs before CQs)."""

    _close_rank = 0

    def __init__(self, parent: Resource | None = None) -> None:
        self._closed = False
        self._children: list[weakref.ref[Resource]] = []
        self._parent = weakref.ref(parent) if parent is not None else None
        if parent is not None:
            parent._check_open()
            parent._children.append(weakref.ref(self))

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ResourceClosedError(f"{type(self).__name__} is closed")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        kids = [r() for r in self._children]
        for kid in sorted((k for k in kids if k is not None), key=lambda k: k._close_rank):
            kid.close()
        self._children.clear()
        try:
            self._close_impl()
        finally:
            parent = self._parent() if self._parent is not None else None
            if parent is not None:
                parent._children = [r for r in parent._children if r() not in (None, self)]

    def _close_impl(self) -> None:
        """Release the provider resource.  Called once, after the children are closed."""

    def __enter__(self) -> Resource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


# ------------------------------------------------------------------ abstract verbs objects

class Context(Resource, abc.ABC):
    """An opened device (``ibv_context``)."""

    _close_rank = 0

    def __init__(self, device: Device) -> None:
        super().__init__(None)
        self.device = device

    @property
    def name(self) -> str:
        return self.device.name

    @abc.abstractmethod
    def query_device(self) -> DeviceAttr: ...

    @abc.abstractmethod
    def query_port(self, port_num: int = 1) -> PortAttr: ...

    @abc.abstractmethod
    def query_gid(self, port_num: int = 1, index: int = 0) -> str: ...

    @abc.abstractmethod
    def alloc_pd(self) -> PD: ...

    @abc.abstractmethod
    def create_cq(self, cqe: int = 256) -> CQ: ...


class PD(Resource, abc.ABC):
    _close_rank = 0

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.ctx = ctx

    @abc.abstractmethod
    def reg_mr(self, buf: Any, access: int) -> MR:
        """Register ``buf`` (a writable buffer, or an int: allocate that many zero bytes)."""

    @abc.abstractmethod
    def create_qp(self, init_attr: QPInitAttr) -> QP: ...


class MR(Resource, abc.ABC):
    _close_rank = 1          # after the QPs of the same PD

    def __init__(self, pd: PD, access: int) -> None:
        super().__init__(pd)
        self.pd = pd
        self.access = access

    lkey: int
    rkey: int
    buf: int
    length: int

    @abc.abstractmethod
    def read(self, length: int, offset: int = 0) -> bytes: ...

    @abc.abstractmethod
    def write(self, data: bytes | bytearray | memoryview, offset: int = 0) -> None: ...

    def remote(self) -> RemoteMR:
        return RemoteMR(self.buf, self.rkey, self.length)

    def _check_range(self, offset: int, length: int) -> None:
        """For ``read``/``write`` of both providers: the range must lie inside the MR."""
        if offset < 0 or length < 0 or offset + length > self.length:
            raise RdmaUserError(f"[{offset}, {offset + length}) is outside the MR "
                                f"(length {self.length})")

    def sge(self, offset: int = 0, length: int | None = None) -> SGE:
        """An SGE covering ``[offset, offset+length)`` of this MR."""
        n = self.length - offset if length is None else length
        return SGE(self.buf + offset, n, self.lkey)


class CQ(Resource, abc.ABC):
    """Completion queue with a completion-channel-like ``fd``: readable iff WCs are queued
    (level-triggered; ``poll`` re-arms it when it empties the queue)."""

    _close_rank = 1          # after the PDs (hence QPs) of the same context

    def __init__(self, ctx: Context, cqe: int) -> None:
        super().__init__(ctx)
        self.ctx = ctx
        self.cqe = cqe

    @property
    @abc.abstractmethod
    def fd(self) -> int: ...

    @abc.abstractmethod
    def poll(self, num_entries: int = 1) -> list[WC]: ...

    def modify(self, cq_count: int, cq_period: int) -> None:
        """Completion moderation (``ibv_modify_cq``): ``fd`` becomes readable once
        ``cq_count`` WCs are queued or ``cq_period`` µs after the first one, whichever
        comes first; ``cq_count`` <= 1 restores "readable iff WCs are queued".  Fewer
        wake-ups per WC for bandwidth consumers; ``poll`` itself is never delayed."""
        from .errors import NotSupportedError

        raise NotSupportedError(f"{type(self).__name__} has no CQ moderation")

    async def poll_async(self, num_entries: int = 1) -> list[WC]:
        """Wait (trio) until at least one WC is available, return up to ``num_entries``.
        See the module docstring for the cancellation contract."""
        import trio

        while True:
            self._check_open()
            wcs = self.poll(num_entries)
            if wcs:
                return wcs
            await trio.lowlevel.wait_readable(self.fd)

    def poll_wait(self, num_entries: int = 1, timeout: float | None = None) -> list[WC]:
        """Blocking variant for threads, subprocess peers and tests; [] on timeout."""
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._check_open()
            wcs = self.poll(num_entries)
            if wcs:
                return wcs
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if left == 0.0:
                return []
            p = select.poll()               # poll, not select: any fd number
            p.register(self.fd, select.POLLIN)
            p.poll(None if left is None else left * 1000)


class QP(Resource, abc.ABC):
    """RC queue pair.  State changes go through :mod:`rdma.qp_state`; providers implement
    ``_modify`` (apply a checked transition) and ``_query_state``."""

    _close_rank = 0

    def __init__(self, pd: PD, init_attr: QPInitAttr) -> None:
        super().__init__(pd)
        if init_attr.qp_type != IBV_QPT_RC:
            raise RdmaUserError(f"only IBV_QPT_RC is supported, got {init_attr.qp_type}")
        self.pd = pd
        self.init_attr = init_attr
        self.qp_type = init_attr.qp_type
        self.cap = init_attr.cap
        self._local_psn: int | None = None

    qp_num: int

    # provider hooks
    @abc.abstractmethod
    def _query_state(self) -> int: ...

    @abc.abstractmethod
    def _modify(self, attr: QPAttr, names: frozenset[str], current: int,
                requested: int) -> None: ...

    @abc.abstractmethod
    def post_send(self, wr: SendWR | Iterable[SendWR]) -> None: ...

    @abc.abstractmethod
    def post_recv(self, wr: RecvWR | Iterable[RecvWR]) -> None: ...

    @property
    def remote_private_data(self) -> bytes | None:
        return None

    def rx_age(self) -> float | None:
        """Seconds since a byte of a response last arrived on this QP, where the provider
        can tell (the soft one: a long READ still moving proves the path alive before its
        WC); None here, and when nothing arrived yet."""
        return None

    @property
    def qp_state(self) -> ibv_qp_state:
        self._check_open()
        return ibv_qp_state(self._query_state())

    # ---- transitions
    def modify(self, attr: QPAttr, attr_mask: int) -> None:
        """Raw ``ibv_modify_qp``: ``attr_mask`` is IBV_QP_* bits and must include STATE
        (else only attributes of the current state are changed: not supported here)."""
        self._check_open()
        names = _qps.names_from_mask(attr_mask)
        if "qp_state" not in names:
            raise RdmaUserError("modify without IBV_QP_STATE is not supported")
        current = self._query_state()
        tr = _qps.TRANSITIONS.get((ibv_qp_state(current), ibv_qp_state(attr.qp_state)))
        if tr is not None:
            names |= {n for n in _qps.SOFT_EXTENSION_ATTRS
                      if getattr(attr, n) is not None and n in tr.optional}
        self._transition(attr, frozenset(names), current, attr.qp_state)

    def _transition(self, attr: QPAttr, names: frozenset[str], current: int,
                    requested: int) -> None:
        _qps.check_transition(current, requested, names)
        if "private_data" in names and attr.private_data is not None \
                and len(attr.private_data) > MAX_PRIVATE_DATA:
            raise RdmaUserError(f"private_data is {len(attr.private_data)} bytes, "
                                f"max {MAX_PRIVATE_DATA}")
        log.debug("QP %#x %s -> %s (%s)", self.qp_num, ibv_qp_state(current).name,
                  ibv_qp_state(requested).name, ",".join(sorted(names)))
        self._modify(attr, names, current, requested)

    def _step(self, attr: QPAttr, requested: int) -> None:
        current = self._query_state()
        tr = _qps.TRANSITIONS.get((ibv_qp_state(current), ibv_qp_state(requested)))
        if tr is None:
            raise QPStateError(ibv_qp_state(current), ibv_qp_state(requested))
        optional = {n for n in tr.optional & _qps.SOFT_EXTENSION_ATTRS
                    if getattr(attr, n) is not None}
        a = QPAttr(**{**attr.__dict__, "qp_state": requested})
        self._transition(a, tr.required | optional | {"qp_state"}, current, requested)

    def to_init(self, attr: QPAttr) -> None:
        """RESET → INIT.  Assumes the current state is RESET (INIT → INIT is also legal)."""
        self._check_open()
        self._step(attr, IBV_QPS_INIT)

    def to_rtr(self, attr: QPAttr) -> None:
        """INIT → RTR; from RESET it first does ``to_init``.  On the soft provider this
        connects to the remote listener (may block up to the connect timeout)."""
        self._check_open()
        if self._query_state() == IBV_QPS_RESET:
            self.to_init(attr)
        self._step(attr, IBV_QPS_RTR)

    def to_rts(self, attr: QPAttr) -> None:
        """RTR → RTS; from RESET or INIT it first does ``to_rtr``."""
        self._check_open()
        if self._query_state() in (IBV_QPS_RESET, IBV_QPS_INIT):
            self.to_rtr(attr)
        self._step(attr, IBV_QPS_RTS)

    def to_reset(self) -> None:
        self._check_open()
        self._step(QPAttr(), IBV_QPS_RESET)

    def to_err(self) -> None:
        self._check_open()
        self._step(QPAttr(), IBV_QPS_ERR)

    # ---- connection helpers
    def local_info(self, psn: int | None = None) -> ConnInfo:
        """This QP's half of the out-of-band exchange.  ``psn`` defaults to a random PSN,
        remembered and used as ``sq_psn`` by :meth:`connect`."""
        self._check_open()
        self._local_psn = random_psn() if psn is None else psn & 0xFFFFFF
        ctx = self.pd.ctx
        port = ctx.query_port(1)
        return ConnInfo(qp_num=self.qp_num, psn=self._local_psn, gid=ctx.query_gid(1, 0),
                        port_num=1, lid=port.lid, service_port=port.service_port,
                        provider=ctx.device.provider)

    def connect(self, remote: ConnInfo, **kwargs: Any) -> None:
        """RESET/INIT → RTS against ``remote`` (kwargs as :func:`rc_connect_attr`)."""
        if "sq_psn" not in kwargs:
            if self._local_psn is None:
                self.local_info()
            kwargs["sq_psn"] = self._local_psn
        self.to_rts(rc_connect_attr(remote, **kwargs))

    def read(self, wr_id: int, local: SGE, remote_addr: int, rkey: int,
             send_flags: int = IBV_SEND_SIGNALED) -> None:
        """Shorthand: post one RDMA_READ of ``local.length`` bytes from the peer."""
        self.post_send(SendWR(wr_id=wr_id, opcode=IBV_WR_RDMA_READ, sg_list=[local],
                              send_flags=send_flags, remote_addr=remote_addr, rkey=rkey))


# ------------------------------------------------------------------- devices & providers

@dataclass(frozen=True)
class Device:
    """An RDMA device as enumerated by a provider.  ``ipv4`` is the NIC's address (soft: the
    address the device serves on; verbs: from the GID table when IPv4-mapped)."""

    name: str
    provider: str
    ipv4: str | None = None
    netdev: str | None = None
    node_guid: int = 0

    def open(self) -> Context:
        ctx: Context = load_provider(self.provider).open_device(self)
        return ctx


def sysfs_devices(path: str = SYSFS_INFINIBAND) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def select_provider(provider: str | None = None) -> str:
    """Override order: argument > $KSPEEDFS_RDMA_PROVIDER > auto (verbs iff sysfs lists
    devices, else soft)."""
    name = provider or os.environ.get(ENV_PROVIDER) or (
        "verbs" if sysfs_devices() else "soft")
    if name not in PROVIDERS:
        raise RdmaUserError(f"unknown RDMA provider {name!r} (known: {sorted(PROVIDERS)})")
    return name


def load_provider(name: str) -> ModuleType:
    """Import a provider module lazily (so importing ``rdma`` never imports pyverbs)."""
    if name not in PROVIDERS:
        raise RdmaUserError(f"unknown RDMA provider {name!r}")
    return importlib.import_module(PROVIDERS[name])


def get_device_list(provider: str | None = None) -> list[Device]:
    return list(load_provider(select_provider(provider)).get_device_list())


def find_device(addr: str, provider: str | None = None) -> Device:
    for dev in get_device_list(provider):
        if dev.ipv4 == addr:
            return dev
    raise NoDeviceError(f"no {select_provider(provider)} RDMA device with address {addr}")


def open_device(name: str | None = None, provider: str | None = None,
                addr: str | None = None) -> Context:
    """Open a device by ``name``, by NIC IPv4 ``addr``, or the first one."""
    devs = get_device_list(provider)
    for dev in devs:
        if (name is None or dev.name == name) and (addr is None or dev.ipv4 == addr):
            return dev.open()
    raise NoDeviceError(f"no RDMA device matching name={name!r} addr={addr!r} "
                        f"(provider {select_provider(provider)}: {[d.name for d in devs]})")
