"""Dead and dying peers: a separate process (``rdma.perf server``) is the responder so it
can be SIGSTOPped (alive, sockets open, answering nothing) or SIGKILLed."""
from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest
from soft_peer import PeerProcess, RemoteSession, connect_qp, remote_session

from rdma.api import QPAttr, QPCap, QPInitAttr, SendWR, open_device
from rdma.enums import (
    IBV_QPS_ERR,
    IBV_SEND_SIGNALED,
    IBV_WC_RETRY_EXC_ERR,
    IBV_WC_WR_FLUSH_ERR,
    IBV_WR_RDMA_READ,
)
from rdma.errors import PostError
from rdma.testing import DEFAULT_ACCESS


@pytest.fixture
def peer() -> Iterator[PeerProcess]:
    p = PeerProcess()
    try:
        yield p
    finally:
        p.close()


def _read(s: RemoteSession, wr_id: int, size: int = 4096, off: int = 0) -> SendWR:
    return SendWR(wr_id=wr_id, opcode=IBV_WR_RDMA_READ, sg_list=[s.mr.sge(0, size)],
                  send_flags=IBV_SEND_SIGNALED, remote_addr=s.raddr + off, rkey=s.rkey)


def _wait(s: RemoteSession, n: int, timeout: float) -> list:
    got: list = []
    end = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < end:
        got += s.cq.poll_wait(n - len(got), max(0.0, end - time.monotonic()))
    return got


def test_read_from_another_process(peer: PeerProcess) -> None:
    with remote_session(peer) as s:
        s.qp.post_send(_read(s, 1, 4096, 256 * 3))
        (wc,) = _wait(s, 1, 5)
        assert wc.ok and s.mr.read(4096) == (bytes(range(256)) * 16)


def test_stopped_peer_is_retry_exc_err_within_budget(peer: PeerProcess) -> None:
    """timeout_ms=100, retry_cnt=2: no progress for 0.3 s → RETRY_EXC_ERR, rest flushed."""
    with remote_session(peer, timeout_ms=100, retry_cnt=2) as s:
        s.qp.post_send(_read(s, 1))
        assert _wait(s, 1, 5)[0].ok
        budget = s.qp.transport_timeout  # type: ignore[attr-defined]
        assert budget == pytest.approx(0.3)
        peer.stop()
        t0 = time.monotonic()
        s.qp.post_send([_read(s, 10 + i) for i in range(4)])
        wcs = _wait(s, 4, 5)
        took = time.monotonic() - t0
        assert [w.status for w in wcs] == [IBV_WC_RETRY_EXC_ERR] + [IBV_WC_WR_FLUSH_ERR] * 3
        assert [w.wr_id for w in wcs] == [10, 11, 12, 13]
        assert budget * 0.9 <= took <= budget + 0.5, took
        assert s.qp.qp_state == IBV_QPS_ERR
        with pytest.raises(PostError):
            s.qp.post_send(_read(s, 20))


def test_stopped_peer_with_large_reads_in_flight(peer: PeerProcess) -> None:
    """Stop the peer while 1 MiB READs stream: the timer, not TCP, ends them."""
    with remote_session(peer, mr_size=8 << 20, timeout_ms=200, retry_cnt=1) as s:
        wrs = [SendWR(wr_id=i, opcode=IBV_WR_RDMA_READ, sg_list=[s.mr.sge(i << 20, 1 << 20)],
                      remote_addr=s.raddr + (i % 4 << 20), rkey=s.rkey) for i in range(8)]
        peer.stop()
        s.qp.post_send(wrs)
        wcs = _wait(s, 8, 5)
        assert len(wcs) == 8
        assert wcs[0].status == IBV_WC_RETRY_EXC_ERR
        assert all(w.status == IBV_WC_WR_FLUSH_ERR for w in wcs[1:])


def test_killed_peer_is_an_error_at_once_not_a_hang(peer: PeerProcess) -> None:
    """A reset/closed connection fails the outstanding READ immediately, long before the
    (here 2 x 5 s) transport timeout."""
    with remote_session(peer, timeout_ms=5000, retry_cnt=1) as s:
        peer.stop()
        s.qp.post_send([_read(s, 1), _read(s, 2)])
        time.sleep(0.1)
        t0 = time.monotonic()
        peer.signal(signal.SIGKILL)
        wcs = _wait(s, 2, 5)
        assert time.monotonic() - t0 < 2.0
        assert [w.status for w in wcs] == [IBV_WC_RETRY_EXC_ERR, IBV_WC_WR_FLUSH_ERR]
        assert s.qp.qp_state == IBV_QPS_ERR


def test_killed_idle_peer_moves_qp_to_err(peer: PeerProcess) -> None:
    with remote_session(peer) as s:
        peer.signal(signal.SIGKILL)
        end = time.monotonic() + 5
        while s.qp.qp_state != IBV_QPS_ERR and time.monotonic() < end:
            time.sleep(0.01)
        assert s.qp.qp_state == IBV_QPS_ERR
        with pytest.raises(PostError):
            s.qp.post_send(_read(s, 1))


def test_continued_peer_serves_again_after_recovery(peer: PeerProcess) -> None:
    """SIGSTOP → RETRY_EXC_ERR; SIGCONT; a fresh session (new QPs on both sides) works."""
    with remote_session(peer, timeout_ms=100, retry_cnt=0) as s:
        peer.stop()
        s.qp.post_send(_read(s, 1))
        assert _wait(s, 1, 5)[0].status == IBV_WC_RETRY_EXC_ERR
        peer.signal(signal.SIGCONT)
    with remote_session(peer) as s2:
        s2.qp.post_send(_read(s2, 2))
        assert _wait(s2, 1, 5)[0].ok


def test_qp_error_is_not_starved_by_reads_streaming_on_other_qps() -> None:
    """Moving a QP to ERR waits until the engine thread is out of its unlocked readv
    (``quiesce``). With 4 MiB READ responses streaming on three other QPs of the same
    engine that wait must end after about one readv, not when the streams drain: it once
    waited for about half of them in 2 of 8 tries (in the 4-reader peer loop up to 101 ms,
    the GIL held)."""
    peers = [PeerProcess(mr_size="4MiB") for _ in range(3)]
    ctx = open_device(provider="soft", addr="127.0.0.1")
    ctls = []
    try:
        pd, cq = ctx.alloc_pd(), ctx.create_cq(256)
        mr = pd.reg_mr(4 << 20, DEFAULT_ACCESS)
        streams = []
        for p in peers:
            qp, rmr, ctl = connect_qp(p, pd, cq)
            ctls.append(ctl)
            streams.append((qp, rmr))
        done_at_err = []
        for _ in range(8):
            idle = pd.create_qp(QPInitAttr(send_cq=cq, cap=QPCap(max_send_wr=4, max_recv_wr=4)))
            idle.to_init(QPAttr(qp_access_flags=DEFAULT_ACCESS))
            for qp, rmr in streams:
                qp.post_send([SendWR(wr_id=i, opcode=IBV_WR_RDMA_READ,
                                     sg_list=[mr.sge(0, 4 << 20)], send_flags=IBV_SEND_SIGNALED,
                                     remote_addr=rmr["addr"], rkey=rmr["rkey"])
                              for i in range(16)])
            wcs = cq.poll_wait(1, 5)            # the streams are moving
            idle.to_err()
            wcs += cq.poll(256)
            done_at_err.append(len(wcs))
            while len(wcs) < 48:
                got = cq.poll_wait(256, 5)
                assert got, "the streams stopped"
                wcs += got
            assert all(w.ok for w in wcs)
            idle.close()
        assert max(done_at_err) <= 12, done_at_err      # of 48 READs (before: 24, 28)
    finally:
        for c in ctls:
            c.close()
        ctx.close()
        for p in peers:
            p.close()
