"""The soft engine's C API (``rdma._soft_engine._C_API``, native/soft_engine.h), driven
through ctypes as the FUSE engine's chunk fetch drives it from C: READs posted beside
Python's on the same QP complete on the poster's own CQ, every one of them exactly once
(also when Python resets the QP under them), and a held engine cannot be closed."""
from __future__ import annotations

import ctypes
import errno
import os
import time

import pytest

from rdma.testing import pair_factory

_soft = pytest.importorskip("rdma._soft_engine")

KS_WR_RDMA_READ = 4
KS_SEND_SIGNALED = 2
KS_WC_SUCCESS = 0
KS_WC_WR_FLUSH_ERR = 5


class Sge(ctypes.Structure):
    _fields_ = [("addr", ctypes.c_uint64), ("length", ctypes.c_uint32),
                ("lkey", ctypes.c_uint32)]


class Wqe(ctypes.Structure):
    _fields_ = [("wr_id", ctypes.c_uint64), ("opcode", ctypes.c_uint32),
                ("flags", ctypes.c_uint32), ("psn", ctypes.c_uint32), ("nsge", ctypes.c_uint32),
                ("total", ctypes.c_uint64), ("raddr", ctypes.c_uint64), ("rkey", ctypes.c_uint32),
                ("hdr", ctypes.c_uint8 * 32), ("sge", Sge * 16), ("cq", ctypes.c_void_p)]


class Wc(ctypes.Structure):
    _fields_ = [("wr_id", ctypes.c_uint64), ("status", ctypes.c_uint32),
                ("opcode", ctypes.c_uint32), ("byte_len", ctypes.c_uint32),
                ("qp_num", ctypes.c_uint32), ("vendor_err", ctypes.c_uint32)]


_why = ctypes.POINTER(ctypes.c_char_p)


class Capi(ctypes.Structure):
    _fields_ = [
        ("abi", ctypes.c_int),
        ("hold", ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object)),
        ("release", ctypes.PYFUNCTYPE(None, ctypes.py_object)),
        ("post_send", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32,
                                       ctypes.POINTER(Wqe), ctypes.c_size_t, _why)),
        ("cq_open", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                     ctypes.POINTER(ctypes.c_void_p),
                                     ctypes.POINTER(ctypes.c_int),
                                     ctypes.POINTER(ctypes.c_int), _why)),
        ("cq_close", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, _why)),
        ("cq_poll", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                     ctypes.POINTER(Wc), ctypes.c_int, _why)),
    ]


def _capi() -> Capi:
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    api = Capi.from_address(get(_soft._C_API, b"rdma._soft_engine._C_API"))
    assert api.abi == 1
    return api


class OwnCQ:
    """A CQ of the engine's opened through the C API, and READs posted to complete on it."""

    def __init__(self, api: Capi, raw: object) -> None:
        self.api, self.raw = api, raw
        self.e = api.hold(raw)
        self.cq, cid, efd = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_int()
        why = ctypes.c_char_p()
        assert api.cq_open(self.e, 64, ctypes.byref(self.cq), ctypes.byref(cid),
                           ctypes.byref(efd), ctypes.byref(why)) == 0, why.value
        self.id, self.efd = cid.value, efd.value

    def wqe(self, wr_id: int, laddr: int, lkey: int, raddr: int, rkey: int, n: int) -> Wqe:
        w = Wqe(wr_id=wr_id, opcode=KS_WR_RDMA_READ, flags=KS_SEND_SIGNALED, nsge=1, total=n,
                raddr=raddr, rkey=rkey, cq=self.cq.value)
        w.sge[0] = Sge(laddr, n, lkey)
        return w

    def post(self, qpn: int, *wrs: Wqe) -> tuple[int, bytes | None]:
        arr = (Wqe * len(wrs))(*wrs)
        why = ctypes.c_char_p()
        return self.api.post_send(self.e, qpn, arr, len(wrs), ctypes.byref(why)), why.value

    def read(self, qpn: int, wr_id: int, laddr: int, lkey: int, raddr: int, rkey: int,
             n: int) -> None:
        rc = self.post(qpn, self.wqe(wr_id, laddr, lkey, raddr, rkey, n))
        assert rc[0] == 0, rc

    def poll(self, want: int, timeout: float = 10.0) -> list[tuple[int, int, int]]:
        out: list[tuple[int, int, int]] = []
        wcs = (Wc * 16)()
        why = ctypes.c_char_p()
        end = time.monotonic() + timeout
        while len(out) < want and time.monotonic() < end:
            n = self.api.cq_poll(self.e, self.id, wcs, 16, ctypes.byref(why))
            assert n >= 0, why.value
            out += [(wcs[i].wr_id, wcs[i].status, wcs[i].byte_len) for i in range(n)]
            if not n:
                time.sleep(0.001)
        return out

    def close(self) -> int:
        why = ctypes.c_char_p()
        rc = self.api.cq_close(self.e, self.cq, ctypes.byref(why))
        if rc == 0:
            self.api.release(self.raw)
        return rc


@pytest.fixture
def pair():
    with pair_factory("soft", "soft_lo")(mr_size=8 << 20) as p:
        yield p


def test_reads_with_their_own_cq_complete_there_beside_pythons(pair) -> None:
    c, s = pair.client, pair.server
    s.mr.write(os.urandom(s.mr.length))
    own = OwnCQ(_capi(), c.ctx.engine.raw)
    try:
        for i in range(8):
            own.read(c.qp.qp_num, 100 + i, c.mr.buf + i * 4096, c.mr.lkey,
                     s.mr.buf + i * 8192, s.mr.rkey, 4096)
        wcs = own.poll(8)
        assert sorted(wcs) == [(100 + i, KS_WC_SUCCESS, 4096) for i in range(8)]
        for i in range(8):
            assert c.mr.read(4096, i * 4096) == s.mr.read(4096, i * 8192)
        assert c.cq.poll(16) == []          # nothing on the QP's own send CQ
    finally:
        assert own.close() == 0


def test_every_own_cq_read_completes_once_when_python_resets_the_qp(pair) -> None:
    c, s = pair.client, pair.server
    own = OwnCQ(_capi(), c.ctx.engine.raw)
    try:
        n = 6
        for i in range(n):                  # 6 MiB in flight, then the QP is reset
            own.read(c.qp.qp_num, i, c.mr.buf + i * (1 << 20), c.mr.lkey, s.mr.buf,
                     s.mr.rkey, 1 << 20)
        c.ctx.engine.raw.qp_reset(c.qp.qp_num)
        wcs = own.poll(n)
        assert sorted(w[0] for w in wcs) == list(range(n)), wcs
        assert {w[1] for w in wcs} <= {KS_WC_SUCCESS, KS_WC_WR_FLUSH_ERR}
        assert own.poll(1, timeout=0.2) == []   # exactly once each
    finally:
        assert own.close() == 0


def test_a_held_engine_refuses_to_close(pair) -> None:
    raw = pair.client.ctx.engine.raw
    own = OwnCQ(_capi(), raw)
    with pytest.raises(OSError) as e:
        raw.close()
    assert e.value.errno == errno.EBUSY
    assert own.close() == 0
    with pytest.raises(TypeError):
        _capi().hold(object())


def test_own_cq_reads_after_a_bad_one_in_the_same_post_complete_flushed(pair) -> None:
    """The first WR's local SGE is outside every MR: it completes LOC_PROT_ERR and the QP
    goes to ERR; the second, never queued, still completes (WR_FLUSH_ERR)."""
    c, s = pair.client, pair.server
    own = OwnCQ(_capi(), c.ctx.engine.raw)
    try:
        bad = own.wqe(1, c.mr.buf, c.mr.lkey ^ 0x5A5A0000, s.mr.buf, s.mr.rkey, 4096)
        good = own.wqe(2, c.mr.buf, c.mr.lkey, s.mr.buf, s.mr.rkey, 4096)
        assert own.post(c.qp.qp_num, bad, good)[0] == 0
        assert sorted(own.poll(2)) == [(1, 4, 0), (2, KS_WC_WR_FLUSH_ERR, 0)]  # 4: LOC_PROT
    finally:
        assert own.close() == 0


def test_a_cq_of_another_engine_is_refused(pair) -> None:
    c, s = pair.client, pair.server
    api = _capi()
    theirs = OwnCQ(api, s.ctx.engine.raw)
    mine = OwnCQ(api, c.ctx.engine.raw)
    try:
        w = mine.wqe(1, c.mr.buf, c.mr.lkey, s.mr.buf, s.mr.rkey, 4096)
        w.cq = theirs.cq.value
        rc, why = mine.post(c.qp.qp_num, w)
        assert rc == -errno.EINVAL and b"not this engine's" in why
    finally:
        assert theirs.close() == 0 and mine.close() == 0
