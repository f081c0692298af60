"""Hostile input to the soft engine: random, truncated, oversized and out-of-order
messages, on the listening port and on an established connection.  Each must drop that
one connection (its QP goes to ERR), never return bytes outside an MR, and leave the
engine serving everyone else."""
from __future__ import annotations

import contextlib
import errno
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rdma import _soft_engine as native
from rdma.api import QPInitAttr
from rdma.enums import IBV_QPS_ERR, IBV_QPS_RTS
from rdma.providers.soft import wire
from rdma.testing import Pair, Player, pair_factory, read_wr

SOFT_LO = pair_factory("soft", "soft_lo")
EOF_WAIT_S = 3.0


def _eof_or_reset(sock: socket.socket, timeout: float = EOF_WAIT_S) -> bytes:
    """Read until the engine closes the connection; returns what it sent before."""
    sock.settimeout(timeout)
    got = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return got
            got += chunk
    except ConnectionResetError:
        return got
    except TimeoutError:
        raise AssertionError(f"engine kept the connection open (got {got[:64]!r})") from None


def _assert_still_serves(p: Pair) -> None:
    """The same server context still answers a well-behaved client."""
    p.client.qp.post_send(read_wr(4242, p.client.mr, p.server.mr, 64))
    (wc,) = p.client.wait()
    assert wc.ok and wc.wr_id == 4242


# ------------------------------------------------------------------- parser unit

def test_parser_accepts_what_wire_packs() -> None:
    h = native.parse_header(wire.read_req(7, 0x1000, 0xABC, 99), native.ROLE_REQUESTS)
    assert (h["opcode"], h["psn"], h["raddr"], h["rkey"], h["rlen"]) == (2, 7, 0x1000, 0xABC, 99)
    hello = wire.hello(5, 6, b"x" * 256)
    assert native.parse_header(hello, native.ROLE_HELLO)["length"] == 12 + 256


@pytest.mark.parametrize("hdr,err", [
    (wire.Header(opcode=wire.OP_READ_REQ, magic=0xDEADBEEF).pack(), errno.EPROTO),
    (wire.Header(opcode=wire.OP_READ_REQ, version=2).pack(), errno.EPROTO),
    (wire.Header(opcode=wire.OP_READ_REQ, flags=1).pack(), errno.EPROTO),
    (wire.Header(opcode=99).pack(), errno.EPROTO),
    (wire.Header(opcode=wire.OP_READ_REQ, length=5).pack(), errno.EPROTO),
    (wire.Header(opcode=wire.OP_READ_REQ, rlen=(1 << 30) + 1).pack(), errno.EMSGSIZE),
    (wire.Header(opcode=wire.OP_SEND, length=(16 << 20) + 1).pack(), errno.EMSGSIZE),
    (wire.Header(opcode=wire.OP_READ_RESP).pack(), errno.EPROTO),      # wrong direction
    (wire.Header(opcode=wire.OP_READ_REQ, psn=1 << 24).pack(), errno.EPROTO),
    (wire.Header(opcode=wire.OP_HELLO, length=12 + 257).pack(), errno.EPROTO),  # wrong role
    (b"KSRD" + bytes(20), errno.EPROTO),                                # truncated
])
def test_parser_rejects(hdr: bytes, err: int) -> None:
    with pytest.raises(OSError) as ei:
        native.parse_header(hdr, native.ROLE_REQUESTS)
    assert ei.value.errno == err


@settings(max_examples=500, deadline=None)
@given(st.binary(min_size=32, max_size=32), st.sampled_from([-1, 0, 1, 2]))
def test_parser_never_crashes_and_is_consistent(buf: bytes, role: int) -> None:
    try:
        h = native.parse_header(buf, role)
    except OSError as exc:
        assert exc.errno in (errno.EPROTO, errno.EMSGSIZE)
        return
    assert buf[:4] == b"KSRD" and h["opcode"] in (1, 2, 3, 4, 5)


# ------------------------------------------------------------ the listening port

@pytest.fixture
def pair() -> Iterator[Pair]:
    with SOFT_LO() as p:
        yield p


def _listener(p: Pair) -> tuple[str, int]:
    return "127.0.0.1", p.server.ctx.query_port().service_port


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.one_of(
    st.binary(min_size=1, max_size=200),
    st.builds(lambda n, b: wire.hello(n, 1, b)[: len(b) // 2 + 20],       # truncated HELLO
              st.integers(0, 1 << 24), st.binary(max_size=64)),
    st.builds(lambda n: wire.Header(opcode=wire.OP_HELLO, length=n).pack(),  # oversized
              st.integers(12 + 257, 1 << 32 - 1)),
    st.builds(lambda n: wire.hello(n, 1), st.integers(0, 1 << 24)),     # no such QP
))
def test_junk_on_listening_port_drops_only_that_connection(pair: Pair, junk: bytes) -> None:
    with socket.create_connection(_listener(pair), timeout=5) as s:
        s.sendall(junk)
        s.shutdown(socket.SHUT_WR)  # a truncated message ends here
        reply = _eof_or_reset(s)
        if reply:  # at most a refusing HELLO
            h = wire.Header.unpack(reply[:32])
            assert h.opcode == wire.OP_HELLO and h.status != 0 and len(reply) == 32
    _assert_still_serves(pair)


def test_many_idle_connections_do_not_block_the_engine(pair: Pair) -> None:
    socks = [socket.create_connection(_listener(pair), timeout=5) for _ in range(64)]
    try:
        _assert_still_serves(pair)
    finally:
        for s in socks:
            s.close()


def test_dropped_connections_are_counted(pair: Pair) -> None:
    before = pair.server.ctx.statistics().dropped_conns  # type: ignore[attr-defined]
    with socket.create_connection(_listener(pair), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(32))
        _eof_or_reset(s)
    stats = pair.server.ctx.statistics()  # type: ignore[attr-defined]
    assert stats.dropped_conns == before + 1 and stats.qps == 1


def test_hello_to_a_connected_qp_is_refused(pair: Pair) -> None:
    """A QP has one peer: a second HELLO for it (say, a spoofer) is refused."""
    with socket.create_connection(_listener(pair), timeout=5) as s:
        s.sendall(wire.hello(pair.server.qp.qp_num, pair.client.qp.qp_num))
        reply = _eof_or_reset(s)
        assert wire.Header.unpack(reply).status != 0
    _assert_still_serves(pair)


# ----------------------------------------------------- an established connection

@dataclass
class Victim:
    """A server QP at RTS whose incoming (requester → responder) connection is ``sock``,
    a raw socket we drive by hand; ``psn`` is the next request PSN it expects."""

    sock: socket.socket
    player: Player
    psn: int


@contextlib.contextmanager
def victim_on(p: Pair) -> Iterator[Victim]:
    """A second QP on the server context of ``p`` with a hand-driven requester."""
    s_ctx, c = p.server.ctx, p.client
    qp = p.server.pd.create_qp(QPInitAttr(send_cq=p.server.cq))
    peer = c.pd.create_qp(QPInitAttr(send_cq=c.cq))  # only so our QP's to_rtr can connect
    sock = socket.create_connection(("127.0.0.1", s_ctx.query_port().service_port), timeout=5)
    try:
        sock.sendall(wire.hello(qp.qp_num, peer.qp_num))
        assert wire.Header.unpack(sock.recv(32)).status == 0
        psn = 1000
        qp.connect(peer.local_info(psn=psn))
        assert qp.qp_state == IBV_QPS_RTS
        yield Victim(sock, Player(s_ctx, p.server.pd, p.server.cq, p.server.mr, qp), psn)
    finally:
        sock.close()
        qp.close()
        peer.close()


def _resp(sock: socket.socket) -> wire.Header:
    sock.settimeout(5)
    buf = b""
    while len(buf) < 32:
        chunk = sock.recv(32 - len(buf))
        assert chunk, "connection closed"
        buf += chunk
    return wire.Header.unpack(buf)


def test_victim_positive_control(pair: Pair) -> None:
    pair.server.mr.write(b"0123456789")
    with victim_on(pair) as v:
        v.sock.sendall(wire.read_req(v.psn, pair.server.mr.buf, pair.server.mr.rkey, 10))
        h = _resp(v.sock)
        assert (h.opcode, h.status, h.psn, h.length) == (wire.OP_READ_RESP, 0, v.psn, 10)
        assert v.sock.recv(10, socket.MSG_WAITALL) == b"0123456789"


@pytest.mark.parametrize("case", ["past_end", "before_start", "wrapping", "bad_rkey"])
def test_out_of_bounds_read_is_nak_and_no_data(pair: Pair, case: str) -> None:
    mr = pair.server.mr
    raddr, rkey, rlen = {
        "past_end": (mr.buf + mr.length - 8, mr.rkey, 9),
        "before_start": (mr.buf - 1, mr.rkey, 8),
        "wrapping": ((1 << 64) - 4, mr.rkey, 64),
        "bad_rkey": (mr.buf, mr.rkey ^ 0x7000, 8),
    }[case]
    with victim_on(pair) as v:
        v.sock.sendall(wire.read_req(v.psn, raddr, rkey, rlen))
        h = _resp(v.sock)
        assert h.opcode == wire.OP_READ_RESP and h.status == 10 and h.length == 0
        assert _eof_or_reset(v.sock) == b""   # nothing more: no data, then dropped
        assert v.player.qp.qp_state == IBV_QPS_ERR
    _assert_still_serves(pair)


_PSN = 1000


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msg=st.one_of(
    st.binary(min_size=32, max_size=96),                                          # random
    st.builds(lambda d: wire.read_req(_PSN + d, 0, 0, 0), st.integers(1, 1000)),  # out of order
    st.builds(lambda n: wire.Header(opcode=wire.OP_SEND, psn=_PSN, length=n).pack(),
              st.integers((16 << 20) + 1, (1 << 32) - 1)),                        # oversized
    st.builds(lambda op: wire.Header(opcode=op, psn=_PSN).pack(),
              st.sampled_from([wire.OP_HELLO, wire.OP_READ_RESP, wire.OP_SEND_ACK, 0, 6, 255])),
    st.builds(lambda b: wire.send(_PSN, b)[: 32 + len(b) // 2], st.binary(min_size=2, max_size=64)),
))
def test_hostile_message_on_established_connection(pair: Pair, msg: bytes) -> None:
    with victim_on(pair) as v:
        assert v.psn == _PSN
        v.sock.sendall(msg)
        v.sock.shutdown(socket.SHUT_WR)   # truncated messages end here
        reply = _eof_or_reset(v.sock)
        # whatever came back is well-formed responses only, never MR bytes we did not ask
        # for: the random cases may contain a valid zero-length request at most
        assert len(reply) % 32 == 0 or wire.Header.unpack(reply[:32]).length > 0
        assert v.player.qp.qp_state == IBV_QPS_ERR
    _assert_still_serves(pair)


def test_replayed_psn_drops_the_connection(pair: Pair) -> None:
    with victim_on(pair) as v:
        req = wire.read_req(v.psn, pair.server.mr.buf, pair.server.mr.rkey, 4)
        v.sock.sendall(req)
        assert _resp(v.sock).status == 0 and len(v.sock.recv(4, socket.MSG_WAITALL)) == 4
        v.sock.sendall(req)  # same PSN again
        assert _eof_or_reset(v.sock) == b""
        assert v.player.qp.qp_state == IBV_QPS_ERR
    _assert_still_serves(pair)


def test_send_flood_without_recv_is_backpressured_not_buffered_forever(pair: Pair) -> None:
    """SENDs with no RECV posted are buffered up to a cap, then the engine stops reading
    (TCP backpressure) instead of growing without bound."""
    with victim_on(pair) as v:
        payload = os.urandom(64 << 10)
        v.sock.setblocking(False)
        sent = 0
        psn = v.psn
        with contextlib.suppress(BlockingIOError):
            for _ in range(4096):   # 256 MiB offered
                msg = wire.send(psn, payload)
                n = v.sock.send(msg)
                sent += n
                if n < len(msg):
                    break
                psn += 1
        assert sent < 64 << 20, "engine kept buffering"
    _assert_still_serves(pair)




def test_responder_bounds_property(pair: Pair) -> None:
    """Random READ_REQs around an MR: inside → exactly the MR's bytes; anything else →
    a NAK with no payload (and the connection dropped).  Nothing outside is ever sent."""
    mr = pair.server.mr
    mr.write(os.urandom(mr.length))
    psn_box = {}

    @settings(max_examples=120, deadline=None)
    @given(start=st.integers(-4096, mr.length + 4096), rlen=st.integers(0, 8192))
    def one(start: int, rlen: int) -> None:
        inside = 0 <= start and start + rlen <= mr.length
        with victim_on(pair) as v:
            raddr = (mr.buf + start) % (1 << 64)
            v.sock.sendall(wire.read_req(v.psn, raddr, mr.rkey, rlen))
            h = _resp(v.sock)
            if inside or rlen == 0:
                assert h.status == 0 and h.length == rlen
                data = v.sock.recv(rlen, socket.MSG_WAITALL) if rlen else b""
                assert data == mr.read(rlen, start) if rlen else True
            else:
                assert h.status == 10 and h.length == 0
                assert _eof_or_reset(v.sock) == b""
        psn_box["n"] = psn_box.get("n", 0) + 1

    one()
    _assert_still_serves(pair)
