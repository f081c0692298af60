"""Provider conformance suite: the semantics the vRDMA layer relies on, as named checks.

Modelled on rdma-core's ``tests/base.py`` players and on ``trio.testing``'s
``check_two_way_stream``: a *pair factory* builds a client and a server (context, PD, CQ,
MR, QP each), :meth:`Pair.connect` swaps their :class:`~rdma.api.ConnInfo` and takes both
QPs to RTS, and every ``check_*`` function is a few lines against that pair.  The same
checks run against ``soft`` and, where hardware exists, ``verbs``::

    from rdma.testing import check_provider, pair_factory
    check_provider(pair_factory("soft", device="soft_lo"))

A provider that cannot build a player raises :class:`~rdma.errors.NotSupportedError`;
:func:`pair_factory` turns that (and "no device") into :class:`ProviderUnavailable`, which
test code maps to a skip with the reason.  Nothing here imports pytest.
"""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from .api import CQ, MR, PD, QP, WC, ConnInfo, Context, QPCap, QPInitAttr, RecvWR, SendWR, open_device
from .enums import (
    IBV_ACCESS_LOCAL_WRITE,
    IBV_ACCESS_REMOTE_READ,
    IBV_QPS_ERR,
    IBV_QPS_INIT,
    IBV_QPS_RESET,
    IBV_QPS_RTS,
    IBV_SEND_SIGNALED,
    IBV_WC_RDMA_READ,
    IBV_WC_RECV,
    IBV_WC_REM_ACCESS_ERR,
    IBV_WC_SEND,
    IBV_WC_SUCCESS,
    IBV_WC_WR_FLUSH_ERR,
    IBV_WR_RDMA_READ,
    IBV_WR_SEND,
)
from .errors import NoDeviceError, NotSupportedError, PostError, QPStateError

DEFAULT_ACCESS = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ
WC_TIMEOUT_S = 10.0


class ProviderUnavailable(Exception):
    """The provider/device cannot run these checks here (the message says why)."""


class CheckFailed(AssertionError):
    """A conformance check found the provider violating the contract."""


# ------------------------------------------------------------------------ players

@dataclass
class Player:
    """One side: its own context (as if on its own host), PD, CQ, one MR and one QP."""

    ctx: Context
    pd: PD
    cq: CQ
    mr: MR
    qp: QP
    extra: list[Any] = field(default_factory=list)

    def info(self) -> ConnInfo:
        return self.qp.local_info()

    def wait(self, n: int = 1, timeout: float = WC_TIMEOUT_S) -> list[WC]:
        """Exactly ``n`` WCs, or CheckFailed after ``timeout`` (a hang is a failure)."""
        got: list[WC] = []
        deadline = time.monotonic() + timeout
        while len(got) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CheckFailed(f"only {len(got)} of {n} WCs after {timeout}s: {got}")
            got += self.cq.poll_wait(n - len(got), left)
        return got

    def close(self) -> None:
        self.ctx.close()


@dataclass
class Pair:
    """Client (requester) and server (responder) players; a context manager."""

    client: Player
    server: Player

    def connect(self, **kw: Any) -> None:
        """Swap ConnInfo and take both QPs to RTS (``kw`` as :func:`rdma.api.rc_connect_attr`
        for the client; the server uses the defaults)."""
        ci, si = self.client.info(), self.server.info()
        self.client.qp.connect(si, **kw)
        self.server.qp.connect(ci)

    def reconnect(self, **kw: Any) -> None:
        """The recovery path: both sides RESET, then connect again with fresh PSNs."""
        self.client.qp.to_reset()
        self.server.qp.to_reset()
        self.connect(**kw)

    def close(self) -> None:
        self.client.close()
        self.server.close()

    def __enter__(self) -> Pair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PairFactory(Protocol):
    def __call__(self, *, mr_size: int = ..., access: int = ..., cap: QPCap = ...,
                 connect: bool = ..., **connect_kw: Any) -> Pair: ...


def make_player(provider: str, device: str | None, *, mr_size: int, access: int,
                cap: QPCap, addr: str | None = None) -> Player:
    ctx = open_device(name=device, provider=provider, addr=addr)
    try:
        pd = ctx.alloc_pd()
        cq = ctx.create_cq(max(256, 4 * cap.max_send_wr))
        mr = pd.reg_mr(mr_size, access)
        qp = pd.create_qp(QPInitAttr(send_cq=cq, cap=cap))
        return Player(ctx, pd, cq, mr, qp)
    except BaseException:
        ctx.close()
        raise


def pair_factory(provider: str, device: str | None = None,
                 server_device: str | None = None) -> PairFactory:
    """A factory of connected pairs on ``provider`` (``device`` for both sides unless
    ``server_device`` differs).  Raises :class:`ProviderUnavailable` at once if the
    provider has no such device, so a test suite can skip with the reason."""
    try:
        open_device(name=device, provider=provider).close()
    except (NoDeviceError, NotSupportedError) as exc:
        raise ProviderUnavailable(f"{provider}: {exc}") from exc

    def make(*, mr_size: int = 1 << 20, access: int = DEFAULT_ACCESS,
             cap: QPCap = QPCap(max_send_wr=64, max_recv_wr=64),
             connect: bool = True, server_access: int | None = None,
             **connect_kw: Any) -> Pair:
        client = make_player(provider, device, mr_size=mr_size, access=DEFAULT_ACCESS,
                             cap=cap)
        try:
            server = make_player(provider, server_device or device, mr_size=mr_size,
                                 access=access if server_access is None else server_access,
                                 cap=cap)
        except BaseException:
            client.close()
            raise
        pair = Pair(client, server)
        if connect:
            try:
                pair.connect(**connect_kw)
            except BaseException:
                pair.close()
                raise
        return pair

    return make


def read_wr(wr_id: int, local: MR, remote: MR, length: int, local_off: int = 0,
            remote_off: int = 0, flags: int = IBV_SEND_SIGNALED) -> SendWR:
    """An RDMA_READ of ``remote[remote_off:+length]`` into ``local[local_off:]``."""
    return SendWR(wr_id=wr_id, opcode=IBV_WR_RDMA_READ, sg_list=[local.sge(local_off, length)],
                  send_flags=flags, remote_addr=remote.buf + remote_off, rkey=remote.rkey)


def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise CheckFailed(msg)


# ------------------------------------------------------------------------- checks

def check_read(make_pair: PairFactory, sizes: tuple[int, ...] = (1, 7, 4096, 65537, 1 << 20),
               offsets: tuple[int, ...] = (0, 3, 4095)) -> None:
    """READ returns exactly the responder's bytes at every size/offset; SUCCESS WC."""
    with make_pair(mr_size=(1 << 20) + 8192) as p:
        p.server.mr.write(os.urandom(p.server.mr.length))
        n = 0
        for size in sizes:
            for off in offsets:
                if off + size > p.server.mr.length:
                    continue
                p.client.qp.post_send(read_wr(n, p.client.mr, p.server.mr, size, off, off))
                (wc,) = p.client.wait()
                _expect(wc.status == IBV_WC_SUCCESS and wc.opcode == IBV_WC_RDMA_READ
                        and wc.wr_id == n, f"READ {size}@{off}: {wc}")
                _expect(p.client.mr.read(size, off) == p.server.mr.read(size, off),
                        f"READ {size}@{off}: data differs")
                n += 1


def _remote_error(p: Pair, wr: SendWR, what: str) -> None:
    p.client.mr.write(b"\xAA" * 4096)
    p.client.qp.post_send(wr)
    (wc,) = p.client.wait()
    _expect(wc.status == IBV_WC_REM_ACCESS_ERR, f"{what}: expected REM_ACCESS_ERR, got {wc}")
    _expect(p.client.mr.read(4096) == b"\xAA" * 4096, f"{what}: data was written")
    _expect(p.client.qp.qp_state == IBV_QPS_ERR, f"{what}: requester QP not in ERR")


def check_rkey_violation(make_pair: PairFactory) -> None:
    with make_pair() as p:
        wr = read_wr(1, p.client.mr, p.server.mr, 64)
        wr.rkey ^= 0x5A5A5000
        _remote_error(p, wr, "bad rkey")


def check_bounds_violation(make_pair: PairFactory) -> None:
    """A READ that ends one byte past the MR (and one that starts before it) fails."""
    with make_pair() as p:
        size = p.server.mr.length
        _remote_error(p, read_wr(1, p.client.mr, p.server.mr, 64, 0, size - 63), "past end")
        p.reconnect()
        wr = read_wr(2, p.client.mr, p.server.mr, 64)
        wr.remote_addr -= 1
        _remote_error(p, wr, "before start")


def check_access_violation(make_pair: PairFactory) -> None:
    """An MR registered without REMOTE_READ is never read remotely."""
    with make_pair(server_access=IBV_ACCESS_LOCAL_WRITE) as p:
        _remote_error(p, read_wr(1, p.client.mr, p.server.mr, 64), "no REMOTE_READ")


def check_state_machine(make_pair: PairFactory) -> None:
    """Illegal transitions are refused with both states named; posts need RTS."""
    with make_pair(connect=False) as p:
        qp = p.client.qp
        _expect(qp.qp_state == IBV_QPS_RESET, "new QP not in RESET")
        try:
            qp.post_send(read_wr(1, p.client.mr, p.server.mr, 8))
            raise CheckFailed("post_send in RESET accepted")
        except PostError:
            pass
        try:
            qp.to_err()  # RESET -> ERR is illegal
            raise CheckFailed("RESET -> ERR accepted")
        except QPStateError as exc:
            _expect("RESET" in str(exc) and "ERR" in str(exc), f"unhelpful: {exc}")
        try:
            qp.post_recv(RecvWR(1, [p.client.mr.sge(0, 8)]))
            raise CheckFailed("post_recv in RESET accepted")
        except PostError:
            pass
        from .api import QPAttr
        qp.to_init(QPAttr(qp_access_flags=DEFAULT_ACCESS))
        _expect(qp.qp_state == IBV_QPS_INIT, "to_init did not reach INIT")
        try:
            qp.post_send(read_wr(1, p.client.mr, p.server.mr, 8))
            raise CheckFailed("post_send in INIT accepted")
        except PostError:
            pass
        qp.to_reset()
        p.connect()
        _expect(qp.qp_state == IBV_QPS_RTS, "connect() did not reach RTS")


def check_err_flushes(make_pair: PairFactory) -> None:
    """to_err(): every outstanding send and receive WR completes WR_FLUSH_ERR, and the
    QP refuses new sends until RESET -> connect again."""
    with make_pair() as p:
        p.client.qp.post_recv([RecvWR(100 + i, [p.client.mr.sge(i * 64, 64)]) for i in range(3)])
        p.client.qp.to_err()
        wcs = p.client.wait(3)
        _expect(all(w.status == IBV_WC_WR_FLUSH_ERR and w.opcode == IBV_WC_RECV for w in wcs),
                f"flush: {wcs}")
        _expect(sorted(w.wr_id for w in wcs) == [100, 101, 102], f"flush ids: {wcs}")
        try:
            p.client.qp.post_send(read_wr(1, p.client.mr, p.server.mr, 8))
            raise CheckFailed("post_send in ERR accepted")
        except PostError:
            pass
        p.reconnect()
        p.client.qp.post_send(read_wr(2, p.client.mr, p.server.mr, 8))
        _expect(p.client.wait()[0].ok, "READ after recovery failed")


def check_error_then_flush(make_pair: PairFactory, depth: int = 8) -> None:
    """The first failing WR carries the cause, every later outstanding one is flushed."""
    with make_pair() as p:
        wrs = [read_wr(i, p.client.mr, p.server.mr, 4096, 4096 * i, 0) for i in range(depth)]
        wrs[0].rkey ^= 0x1000
        p.client.qp.post_send(wrs)
        wcs = p.client.wait(depth)
        _expect(wcs[0].wr_id == 0 and wcs[0].status == IBV_WC_REM_ACCESS_ERR, f"first: {wcs[0]}")
        _expect(all(w.status == IBV_WC_WR_FLUSH_ERR for w in wcs[1:]), f"rest: {wcs[1:]}")


def check_send_recv(make_pair: PairFactory) -> None:
    """SEND lands in the posted RECV (byte_len, data); both sides get their WCs, in order,
    and a SEND posted before the RECV is still delivered."""
    with make_pair() as p:
        c, s = p.client, p.server
        s.qp.post_recv(RecvWR(7, [s.mr.sge(0, 256)]))
        c.mr.write(b"hello, responder")
        c.qp.post_send(SendWR(wr_id=8, opcode=IBV_WR_SEND, sg_list=[c.mr.sge(0, 16)]))
        (cw,) = c.wait()
        (sw,) = s.wait()
        _expect(cw.ok and cw.opcode == IBV_WC_SEND and cw.wr_id == 8, f"send WC {cw}")
        _expect(sw.ok and sw.opcode == IBV_WC_RECV and sw.wr_id == 7 and sw.byte_len == 16,
                f"recv WC {sw}")
        _expect(s.mr.read(16) == b"hello, responder", "payload differs")
        # reverse direction, SEND before RECV
        s.mr.write(b"pong")
        s.qp.post_send(SendWR(wr_id=9, opcode=IBV_WR_SEND, sg_list=[s.mr.sge(0, 4)]))
        time.sleep(0.05)
        c.qp.post_recv(RecvWR(10, [c.mr.sge(1024, 64)]))
        (rw,) = c.wait()
        _expect(rw.ok and rw.byte_len == 4 and c.mr.read(4, 1024) == b"pong", f"late recv {rw}")
        _expect(s.wait()[0].ok, "reverse send WC failed")


def check_queue_depth(make_pair: PairFactory, depth: int = 16, size: int = 65536) -> None:
    """``depth`` READs in flight at once complete in order with the right data.  One more
    post is either refused with ENOMEM (queue full) or, if a READ already completed and
    made room, accepted and completed after the others; never anything else."""
    import errno

    spare = depth * size  # the extra READ lands here, outside the checked slots
    with make_pair(mr_size=(depth + 1) * size,
                   cap=QPCap(max_send_wr=depth, max_recv_wr=4)) as p:
        p.server.mr.write(os.urandom(p.server.mr.length))
        p.client.qp.post_send([read_wr(i, p.client.mr, p.server.mr, size, i * size,
                                       (depth - 1 - i) * size) for i in range(depth)])
        try:
            p.client.qp.post_send(read_wr(99, p.client.mr, p.server.mr, 8, spare))
            extra = 1
        except PostError as exc:
            _expect(exc.errno == errno.ENOMEM, f"extra post: {exc}")
            extra = 0
        wcs = p.client.wait(depth + extra)
        want = list(range(depth)) + [99] * extra
        _expect([w.wr_id for w in wcs] == want, f"order: {[w.wr_id for w in wcs]}")
        _expect(all(w.ok for w in wcs), f"statuses: {wcs}")
        for i in range(depth):
            _expect(p.client.mr.read(size, i * size) ==
                    p.server.mr.read(size, (depth - 1 - i) * size), f"data of WR {i}")


def check_queue_full(make_pair: PairFactory, depth: int = 8) -> None:
    """With the responder unable to answer (its QP not yet at RTR, so requests wait in
    its socket), ``max_send_wr`` posts are accepted and the next is refused ENOMEM."""
    import errno

    with make_pair(connect=False, cap=QPCap(max_send_wr=depth, max_recv_wr=4)) as p:
        ci, si = p.client.info(), p.server.info()   # local_info() mints the PSN: once
        p.client.qp.connect(si)           # the server QP stays in RESET: no answers
        p.client.qp.post_send([read_wr(i, p.client.mr, p.server.mr, 8) for i in range(depth)])
        try:
            p.client.qp.post_send(read_wr(99, p.client.mr, p.server.mr, 8))
            raise CheckFailed("post beyond max_send_wr accepted")
        except PostError as exc:
            _expect(exc.errno == errno.ENOMEM, f"queue full: {exc}")
        p.server.qp.connect(ci)           # now the server answers what waited
        wcs = p.client.wait(depth)
        _expect([w.wr_id for w in wcs] == list(range(depth)) and all(w.ok for w in wcs),
                f"after RTR: {wcs}")


def check_unsignaled(make_pair: PairFactory) -> None:
    """Unsignaled successes produce no WC; a later signaled one does."""
    with make_pair() as p:
        p.client.qp.post_send([read_wr(1, p.client.mr, p.server.mr, 8, flags=0),
                               read_wr(2, p.client.mr, p.server.mr, 8)])
        (wc,) = p.client.wait()
        _expect(wc.wr_id == 2 and wc.ok, f"{wc}")
        time.sleep(0.05)
        _expect(p.client.cq.poll(4) == [], "unsignaled WR produced a WC")


CHECKS: dict[str, Callable[[PairFactory], None]] = {
    "read": check_read,
    "rkey_violation": check_rkey_violation,
    "bounds_violation": check_bounds_violation,
    "access_violation": check_access_violation,
    "state_machine": check_state_machine,
    "err_flushes": check_err_flushes,
    "error_then_flush": check_error_then_flush,
    "send_recv": check_send_recv,
    "queue_depth": check_queue_depth,
    "queue_full": check_queue_full,
    "unsignaled": check_unsignaled,
}


def check_provider(make_pair: PairFactory, only: list[str] | None = None) -> None:
    """Run every check (or ``only`` those names) against ``make_pair``."""
    for name, check in CHECKS.items():
        if only is None or name in only:
            check(make_pair)


@contextlib.contextmanager
def soft_pair(device: str = "soft_lo", **kw: Any) -> Iterator[Pair]:
    """One connected soft pair on ``device`` (two contexts, as two hosts would have)."""
    with pair_factory("soft", device)(**kw) as p:
        yield p


__all__ = ["CHECKS", "CheckFailed", "Pair", "PairFactory", "Player", "ProviderUnavailable",
           "check_provider", "make_player", "pair_factory", "read_wr", "soft_pair"]
