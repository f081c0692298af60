"""The provider conformance suite (rdma/testing.py) against the soft provider, plus
READ correctness over many sizes/offsets/SGE layouts (Hypothesis)."""
from __future__ import annotations

import os
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rdma.api import SGE, QPAttr, SendWR
from rdma.enums import (
    IBV_QP_STATE,
    IBV_QPS_ERR,
    IBV_QPS_RTS,
    IBV_WC_LOC_PROT_ERR,
    IBV_WC_SUCCESS,
    IBV_WR_RDMA_READ,
)
from rdma.errors import PostError, QPStateError
from rdma.testing import CHECKS, pair_factory, read_wr, soft_pair

SOFT_LO = pair_factory("soft", "soft_lo")


@pytest.mark.parametrize("name", list(CHECKS))
def test_conformance(name: str) -> None:
    CHECKS[name](SOFT_LO)


def test_read_sizes_offsets_hypothesis() -> None:
    size_max = 1 << 18
    with soft_pair(mr_size=2 * size_max) as p:
        p.server.mr.write(os.urandom(p.server.mr.length))
        counter = iter(range(1 << 30))

        @settings(max_examples=150, deadline=None)
        @given(size=st.integers(0, size_max), roff=st.integers(0, size_max),
               loff=st.integers(0, size_max))
        def one(size: int, roff: int, loff: int) -> None:
            wr_id = next(counter)
            p.client.mr.write(b"\0" * size, loff)
            p.client.qp.post_send(read_wr(wr_id, p.client.mr, p.server.mr, size, loff, roff))
            (wc,) = p.client.wait()
            assert wc.status == IBV_WC_SUCCESS and wc.wr_id == wr_id
            assert p.client.mr.read(size, loff) == p.server.mr.read(size, roff)

        one()


def test_read_scatters_into_several_sges() -> None:
    from rdma.api import QPCap

    with soft_pair(cap=QPCap(max_send_wr=8, max_send_sge=4)) as p:
        p.server.mr.write(os.urandom(3000))
        m = p.client.mr
        sges = [m.sge(5000, 1000), m.sge(0, 7), m.sge(9000, 1993)]
        p.client.qp.post_send(SendWR(wr_id=1, opcode=IBV_WR_RDMA_READ, sg_list=sges,
                                     remote_addr=p.server.mr.buf, rkey=p.server.mr.rkey))
        (wc,) = p.client.wait()
        assert wc.ok and wc.byte_len == 3000
        assert m.read(1000, 5000) + m.read(7) + m.read(1993, 9000) == p.server.mr.read(3000)
        too_many = [m.sge(i, 1) for i in range(5)]
        with pytest.raises(PostError):
            p.client.qp.post_send(SendWR(wr_id=2, opcode=IBV_WR_RDMA_READ, sg_list=too_many,
                                         remote_addr=p.server.mr.buf, rkey=p.server.mr.rkey))


def test_local_sge_outside_mr_is_loc_prot_err_not_a_write() -> None:
    with soft_pair() as p:
        bad = SGE(p.client.mr.buf + p.client.mr.length - 4, 64, p.client.mr.lkey)
        p.client.qp.post_send(SendWR(wr_id=3, opcode=IBV_WR_RDMA_READ, sg_list=[bad],
                                     remote_addr=p.server.mr.buf, rkey=p.server.mr.rkey))
        (wc,) = p.client.wait()
        assert wc.status == IBV_WC_LOC_PROT_ERR and p.client.qp.qp_state == IBV_QPS_ERR


def test_illegal_raw_modify_names_both_states() -> None:
    with soft_pair(connect=False) as p:
        with pytest.raises(QPStateError) as ei:
            p.client.qp.modify(QPAttr(qp_state=IBV_QPS_RTS), IBV_QP_STATE)
        assert "RESET" in str(ei.value) and "RTS" in str(ei.value)


def test_private_data_reaches_the_responder() -> None:
    with soft_pair(connect=False) as p:
        si, ci = p.server.info(), p.client.info()
        p.client.qp.connect(si, private_data=b"token-123")
        p.server.qp.connect(ci)
        assert p.server.qp.remote_private_data == b"token-123"
        assert p.client.qp.remote_private_data == b""


def test_recovery_after_remote_error_both_sides() -> None:
    with soft_pair() as p:
        wr = read_wr(1, p.client.mr, p.server.mr, 8)
        wr.rkey ^= 0x1000
        p.client.qp.post_send(wr)
        assert not p.client.wait()[0].ok
        p.reconnect()
        p.client.qp.post_send(read_wr(2, p.client.mr, p.server.mr, 8))
        assert p.client.wait()[0].ok


def test_closed_mr_never_serves_a_read() -> None:
    with soft_pair() as p:
        rmr = p.server.mr
        remote = rmr.remote()
        rmr.close()
        p.client.qp.post_send(SendWR(wr_id=1, opcode=IBV_WR_RDMA_READ,
                                     sg_list=[p.client.mr.sge(0, 64)],
                                     remote_addr=remote.addr, rkey=remote.rkey))
        (wc,) = p.client.wait()
        assert wc.status.name == "IBV_WC_REM_ACCESS_ERR"


def test_mr_closed_mid_flight_kills_only_its_users() -> None:
    """Deregistering an MR that queued responses point into drops that connection (the
    QP goes to ERR) rather than ever reading freed memory; other QPs keep working."""
    with soft_pair(mr_size=16 << 20) as p, soft_pair() as other:
        p.client.qp.post_send([read_wr(i, p.client.mr, p.server.mr, 4 << 20, 0, 0)
                               for i in range(4)])
        p.server.mr.close()
        wcs = p.client.wait(4)
        assert len(wcs) == 4  # completes somehow (success or error), never hangs
        other.client.qp.post_send(read_wr(9, other.client.mr, other.server.mr, 64))
        assert other.client.wait()[0].ok


def test_send_into_too_small_recv_fails_both_sides() -> None:
    """IB class C: the responder's RECV completes LOC_LEN_ERR, the requester's SEND
    REM_INV_REQ_ERR, and both QPs end in ERR."""
    from rdma.api import RecvWR
    from rdma.enums import IBV_WC_LOC_LEN_ERR, IBV_WC_REM_INV_REQ_ERR, IBV_WR_SEND

    with soft_pair() as p:
        p.server.qp.post_recv(RecvWR(1, [p.server.mr.sge(0, 8)]))
        p.client.qp.post_send(SendWR(wr_id=2, opcode=IBV_WR_SEND,
                                     sg_list=[p.client.mr.sge(0, 100)]))
        (rw,) = p.server.wait()
        (sw,) = p.client.wait()
        assert rw.status == IBV_WC_LOC_LEN_ERR and rw.wr_id == 1
        assert sw.status == IBV_WC_REM_INV_REQ_ERR and sw.wr_id == 2
        assert p.client.qp.qp_state == IBV_QPS_ERR


def test_send_recv_many_in_order_both_ways() -> None:
    from rdma.api import QPCap, RecvWR
    from rdma.enums import IBV_WR_SEND

    n = 32
    with soft_pair(cap=QPCap(max_send_wr=n, max_recv_wr=n)) as p:
        for a, b in ((p.client, p.server), (p.server, p.client)):
            b.qp.post_recv([RecvWR(i, [b.mr.sge(i * 64, 64)]) for i in range(n)])
            for i in range(n):
                a.mr.write(f"msg-{i:03d}".encode(), 4096 + i * 64)
            a.qp.post_send([SendWR(wr_id=i, opcode=IBV_WR_SEND,
                                   sg_list=[a.mr.sge(4096 + i * 64, 7)]) for i in range(n)])
            got = b.wait(n)
            assert [w.wr_id for w in got] == list(range(n)) and all(w.ok for w in got)
            assert [b.mr.read(7, i * 64) for i in range(n)] == \
                [f"msg-{i:03d}".encode() for i in range(n)]
            assert len(a.wait(n)) == n


def test_oversized_send_and_unsupported_opcode_are_post_errors() -> None:
    from rdma.enums import IBV_WR_RDMA_WRITE, IBV_WR_SEND

    with soft_pair(mr_size=(16 << 20) + 1) as p:
        with pytest.raises(PostError):
            p.client.qp.post_send(SendWR(wr_id=1, opcode=IBV_WR_SEND,
                                         sg_list=[p.client.mr.sge(0, (16 << 20) + 1)]))
        with pytest.raises(PostError):
            p.client.qp.post_send(SendWR(wr_id=2, opcode=IBV_WR_RDMA_WRITE,
                                         sg_list=[p.client.mr.sge(0, 8)],
                                         remote_addr=p.server.mr.buf, rkey=p.server.mr.rkey))
        assert p.client.qp.qp_state == IBV_QPS_RTS  # a refused post changes nothing


def test_qp_without_remote_read_serves_nothing() -> None:
    """The responder QP's own access flags gate READs too (not only the MR's)."""
    from rdma.enums import IBV_ACCESS_LOCAL_WRITE, IBV_WC_REM_INV_REQ_ERR

    with soft_pair(connect=False) as p:
        ci, si = p.client.info(), p.server.info()
        p.client.qp.connect(si)
        p.server.qp.connect(ci, qp_access_flags=IBV_ACCESS_LOCAL_WRITE)
        p.client.mr.write(b"\x55" * 64)
        p.client.qp.post_send(read_wr(1, p.client.mr, p.server.mr, 64))
        (wc,) = p.client.wait()
        assert wc.status == IBV_WC_REM_INV_REQ_ERR
        assert p.client.mr.read(64) == b"\x55" * 64


def test_many_qps_share_one_responder_engine() -> None:
    """Four requesters (each its own context and thread) READ concurrently from QPs of
    one responder context: every byte right, nobody starves or sees another's data."""
    import threading

    from rdma.api import QPCap, QPInitAttr
    from rdma.testing import DEFAULT_ACCESS, Player, make_player

    server = make_player("soft", "soft_lo", mr_size=4 << 20, access=DEFAULT_ACCESS,
                         cap=QPCap())
    server.mr.write(os.urandom(server.mr.length))
    clients: list[Player] = []
    server_qps = []  # hold them: a verbs object that is garbage-collected is destroyed
    errors: list[BaseException] = []
    try:
        for _ in range(4):
            c = make_player("soft", "soft_lo", mr_size=1 << 20, access=DEFAULT_ACCESS,
                            cap=QPCap(max_send_wr=8))
            sqp = server.pd.create_qp(QPInitAttr(send_cq=server.cq))
            server_qps.append(sqp)
            ci, si = c.info(), sqp.local_info()
            c.qp.connect(si)
            sqp.connect(ci)
            clients.append(c)

        def run(k: int, c: Player) -> None:
            try:
                for i in range(40):
                    off = ((k * 40 + i) * 65536) % (server.mr.length - 65536)
                    c.qp.post_send(read_wr(i, c.mr, server.mr, 65536, 0, off))
                    (wc,) = c.wait()
                    assert wc.ok and c.mr.read(65536) == server.mr.read(65536, off)
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(k, c)) for k, c in enumerate(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
    finally:
        for c in clients:
            c.close()
        server.close()


def test_local_mr_closed_while_responses_stream_into_it() -> None:
    """The engine reads large responses into registered memory without its lock; closing
    that MR (or the QP, or the context) meanwhile must wait for the copy, then flush:
    no crash, no hang, and the freed memory is never written again."""
    import time as _time

    from rdma.api import QPCap

    for i in range(25):
        with soft_pair(mr_size=16 << 20, cap=QPCap(max_send_wr=8)) as p:
            p.client.qp.post_send([read_wr(k, p.client.mr, p.server.mr, 4 << 20,
                                           k << 22, 0) for k in range(4)])
            _time.sleep(0.0005 * (i % 5))
            if i % 3 == 0:
                p.client.mr.close()
            elif i % 3 == 1:
                p.client.qp.to_err()
            else:
                p.client.ctx.close()
                continue
            wcs = p.client.wait(4)
            assert len(wcs) == 4


def test_reads_and_sends_interleaved_on_one_qp() -> None:
    """Requests of both kinds share one ordered connection: completions come back in post
    order, READ data and SEND payloads land where they should."""
    from rdma.api import QPCap, RecvWR
    from rdma.enums import IBV_WC_RDMA_READ, IBV_WC_SEND, IBV_WR_SEND

    n = 24
    with soft_pair(cap=QPCap(max_send_wr=n, max_recv_wr=n)) as p:
        c, s = p.client, p.server
        s.mr.write(os.urandom(s.mr.length))
        s.qp.post_recv([RecvWR(1000 + i, [s.mr.sge(512 * 1024 + i * 64, 64)])
                        for i in range(n // 2)])
        wrs = []
        for i in range(n):
            if i % 2:
                c.mr.write(f"send-{i:02d}".encode(), 768 * 1024 + i * 64)
                wrs.append(SendWR(wr_id=i, opcode=IBV_WR_SEND,
                                  sg_list=[c.mr.sge(768 * 1024 + i * 64, 7)]))
            else:
                wrs.append(read_wr(i, c.mr, s.mr, 8192 + i, i * 16384, i * 1000))
        c.qp.post_send(wrs)
        wcs = c.wait(n)
        assert [w.wr_id for w in wcs] == list(range(n)) and all(w.ok for w in wcs)
        assert [w.opcode for w in wcs] == [IBV_WC_RDMA_READ, IBV_WC_SEND] * (n // 2)
        for i in range(0, n, 2):
            assert c.mr.read(8192 + i, i * 16384) == s.mr.read(8192 + i, i * 1000)
        rws = s.wait(n // 2)
        assert [w.wr_id for w in rws] == [1000 + i for i in range(n // 2)]
        for k, i in enumerate(range(1, n, 2)):
            assert s.mr.read(7, 512 * 1024 + k * 64) == f"send-{i:02d}".encode()


def test_threads_posting_on_one_qp_lose_nothing() -> None:
    import errno
    import threading

    from rdma.api import QPCap

    per, nthreads = 150, 4
    with soft_pair(cap=QPCap(max_send_wr=64)) as p:
        p.server.mr.write(os.urandom(4096))
        posted = []
        lock = threading.Lock()

        def poster(t: int) -> None:
            for i in range(per):
                wr = read_wr(t * 1000 + i, p.client.mr, p.server.mr, 64, t * 4096, 0)
                while True:
                    try:
                        p.client.qp.post_send(wr)
                        break
                    except PostError as exc:  # queue full: the consumer will make room
                        assert exc.errno == errno.ENOMEM
                with lock:
                    posted.append(wr.wr_id)

        threads = [threading.Thread(target=poster, args=(t,)) for t in range(nthreads)]
        for t in threads:
            t.start()
        got = p.client.wait(per * nthreads, timeout=60)
        for t in threads:
            t.join(10)
        assert sorted(w.wr_id for w in got) == sorted(posted)
        assert len(set(w.wr_id for w in got)) == per * nthreads and all(w.ok for w in got)


def test_rx_age_says_how_long_ago_response_bytes_arrived() -> None:
    """``QP.rx_age`` (vRDMA's liveness evidence while a long READ is still moving): None
    before any response, then the time since its last byte; requests sent do not count."""
    with soft_pair(mr_size=1 << 20) as p:
        qp = p.client.qp
        assert qp.rx_age() is None and p.server.qp.rx_age() is None
        qp.post_send(read_wr(1, p.client.mr, p.server.mr, 1 << 20, 0, 0))
        (wc,) = p.client.wait()
        assert wc.status == IBV_WC_SUCCESS
        first = qp.rx_age()
        assert first is not None and 0 <= first < 1.0
        time.sleep(0.2)
        later = qp.rx_age()
        assert later is not None and later >= first + 0.19
        assert p.server.qp.rx_age() is None     # it only received requests
