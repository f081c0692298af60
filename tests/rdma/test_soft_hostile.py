"""Unauthenticated peers against the soft engine's listener: idle-connection
floods, HELLO deadlines, HELLOs racing a legitimate QP setup, random frames.  Each test
ends with a legitimate QP pair moving data through the same engine, and the process's
fds and RSS back where they started once the attack is over.  Loopback only."""
from __future__ import annotations

import errno
import os
import resource
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rdma.api import ConnInfo
from rdma.enums import IBV_QPS_RTS
from rdma.errors import ConnectError
from rdma.providers.soft import wire
from rdma.testing import Pair, pair_factory, read_wr
from tests.fixtures.hostile import fd_count, rss_bytes

SOFT_LO = pair_factory("soft", "soft_lo")
FLOOD = 1500        # idle attack connections held open at once (engine caps: 256 / 64)


@pytest.fixture(scope="module", autouse=True)
def _enoughfd_count() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, 4 * FLOOD))
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture
def pair() -> Iterator[Pair]:
    with SOFT_LO(connect=False) as p:
        yield p


def _port(p: Pair) -> int:
    return p.server.ctx.query_port().service_port


def _stats(p: Pair):  # type: ignore[no-untyped-def]
    return p.server.ctx.statistics()  # type: ignore[attr-defined]


def _read_ok(p: Pair, size: int = 4096) -> None:
    data = os.urandom(size)
    p.server.mr.write(data)
    p.client.qp.post_send(read_wr(77, p.client.mr, p.server.mr, size))
    (wc,) = p.client.wait()
    assert wc.ok and p.client.mr.read(size) == data


def _idle(port: int, n: int, src: str = "127.0.0.1") -> list[socket.socket]:
    """``n`` connections that never send a byte (non-blocking connects: the ones past
    the listen backlog stay in SYN-SENT, which is an attacker's view too)."""
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.bind((src, 0))
        err = s.connect_ex(("127.0.0.1", port))
        assert err in (0, errno.EINPROGRESS), os.strerror(err)
        socks.append(s)
    return socks


def _closed_by_engine(s: socket.socket, timeout: float) -> bool:
    s.settimeout(timeout)
    try:
        return s.recv(64) == b""
    except ConnectionError:
        return True
    except (TimeoutError, BlockingIOError, OSError):
        return False


def _wait_pending(p: Pair, at_most: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while _stats(p).pending_hello > at_most:
        assert time.monotonic() < deadline, f"{_stats(p)}"
        time.sleep(0.02)


# ----------------------------------------------------------- pending HELLO limits

def test_idle_flood_is_capped_and_a_qp_still_connects(pair: Pair) -> None:
    fds0, rss0 = fd_count(), rss_bytes()
    socks = _idle(_port(pair), FLOOD)
    try:
        time.sleep(0.3)
        st_ = _stats(pair)
        assert st_.pending_hello <= 64, st_            # one source: the per-source cap
        pair.connect()                                  # while the flood is held open
        _read_ok(pair, 1 << 20)
        assert _stats(pair).hello_evicted > 0
    finally:
        for s in socks:
            s.close()
    _wait_pending(pair, 0, timeout=5)                   # evicted or timed out (2 s)
    assert fd_count() <= fds0 + 4, (fds0, fd_count())           # + the pair's two data sockets
    assert rss_bytes() < rss0 + (16 << 20), (rss0, rss_bytes())
    _read_ok(pair)


def test_flood_while_connecting(pair: Pair) -> None:
    """An attacker opening connections as fast as it can, concurrently with the setup:
    the legitimate HELLO arrives microseconds after its connect, and only 64 newer
    connections from the same source could evict it first."""
    stop = threading.Event()
    opened = [0]

    def flood() -> None:
        while not stop.is_set():
            for s in _idle(_port(pair), 50):
                s.close()
            opened[0] += 50

    t = threading.Thread(target=flood, daemon=True)
    t.start()
    try:
        time.sleep(0.1)
        for _ in range(5):
            pair.reconnect() if pair.client.qp.qp_state == IBV_QPS_RTS else pair.connect()
            _read_ok(pair)
    finally:
        stop.set()
        t.join()
    assert opened[0] >= 100


def test_silent_connection_is_closed_after_the_deadline(pair: Pair) -> None:
    before = _stats(pair).hello_timeouts
    partial = socket.create_connection(("127.0.0.1", _port(pair)), timeout=5)
    partial.sendall(wire.hello(1234, 5678)[:20])         # half a header, then nothing
    silent = _idle(_port(pair), 3)
    t0 = time.monotonic()
    try:
        assert _closed_by_engine(partial, 4.0)
        took = time.monotonic() - t0
        assert 1.5 < took < 3.5, took                    # KS_HELLO_TIMEOUT_MS = 2 s
        assert all(_closed_by_engine(s, 1.0) for s in silent)
        assert _stats(pair).hello_timeouts >= before + 4
    finally:
        partial.close()
        for s in silent:
            s.close()
    pair.connect()
    _read_ok(pair)


def test_other_sources_keep_their_room(pair: Pair) -> None:
    """A flood from 127.0.0.2 evicts its own connections, not 127.0.0.3's."""
    mine = _idle(_port(pair), 8, src="127.0.0.3")
    time.sleep(0.2)
    flood = _idle(_port(pair), 600, src="127.0.0.2")
    try:
        time.sleep(0.5)
        assert _stats(pair).pending_hello <= 64 + 8
        for s in mine:                   # still open: not closed by the engine
            assert not _closed_by_engine(s, 0.05)
    finally:
        for s in mine + flood:
            s.close()


# -------------------------------------------------- HELLO racing a QP in INIT

def _hello(port: int, dest: int, src: int, pdata: bytes = b"",
           src_ip: str = "127.0.0.1") -> tuple[socket.socket, int]:
    s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(src_ip, 0))
    s.sendall(wire.hello(dest, src, pdata))
    reply = s.recv(wire.HDR_LEN, socket.MSG_WAITALL)
    return s, wire.Header.unpack(reply).status


def test_wrong_hello_to_a_qp_in_init_does_not_break_its_setup(pair: Pair) -> None:
    """Strangers (a wrong QPN; the right QPN from another address) HELLO the server QP
    while it waits in INIT; they wait as candidates, RTR keeps the real peer's."""
    srv = pair.server.qp
    from rdma.api import QPAttr
    from rdma.enums import IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_READ
    srv.to_init(QPAttr(qp_access_flags=IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ))
    port = _port(pair)
    wrong_qpn, st1 = _hello(port, srv.qp_num, (pair.client.qp.qp_num + 1) & 0xFFFFFF)
    wrong_ip, st2 = _hello(port, srv.qp_num, pair.client.qp.qp_num, src_ip="127.0.0.2")
    try:
        assert st1 == 0 and st2 == 0                     # not checkable before RTR
        pair.connect()
        assert _closed_by_engine(wrong_qpn, 3) and _closed_by_engine(wrong_ip, 3)
        _read_ok(pair)
    finally:
        wrong_qpn.close()
        wrong_ip.close()


def test_expect_peer_refuses_strangers_at_once(pair: Pair) -> None:
    """With expect_peer (what vRDMA does with the token it exchanged), any HELLO but the
    peer's is refused immediately, however many come first."""
    srv, cli = pair.server.qp, pair.client.qp
    from rdma.api import QPAttr
    from rdma.enums import IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_READ
    srv.to_init(QPAttr(qp_access_flags=IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ))
    token = os.urandom(16)
    srv.expect_peer(cli.local_info(), token)  # type: ignore[attr-defined]
    port = _port(pair)
    for src, pdata, ip in [(cli.qp_num, b"forged", "127.0.0.1"), (cli.qp_num, b"", "127.0.0.1"),
                           (cli.qp_num ^ 1, token, "127.0.0.1"), (cli.qp_num, token, "127.0.0.2")
                           ] * 3:
        s, status = _hello(port, srv.qp_num, src, pdata, src_ip=ip)
        s.close()
        assert status != 0, (src, pdata, ip)
    ci, si = pair.client.info(), pair.server.info()
    pair.client.qp.connect(si, private_data=token)
    pair.server.qp.connect(ci)
    assert srv.remote_private_data == token
    _read_ok(pair)


def test_candidates_are_capped(pair: Pair) -> None:
    """Without expect_peer, a QP in INIT holds at most 4 HELLO'd strangers (the 5th is
    refused) and RTR closes them all; the documented price: a stranger who guessed
    the 24-bit QPN and got 4 in first has the real peer refused."""
    srv = pair.server.qp
    socks = []
    try:
        statuses = []
        for i in range(6):
            s, status = _hello(_port(pair), srv.qp_num, 1000 + i)
            socks.append(s)
            statuses.append(status)
        assert statuses[:4] == [0] * 4 and all(x != 0 for x in statuses[4:])
        with pytest.raises(ConnectError):
            pair.client.qp.connect(pair.server.info())
    finally:
        for s in socks:
            s.close()


def test_qpns_are_random_and_unique(pair: Pair) -> None:
    from rdma.api import QPInitAttr
    qps = [pair.server.pd.create_qp(QPInitAttr(send_cq=pair.server.cq)) for _ in range(200)]
    try:
        nums = [q.qp_num for q in qps]
        assert len(set(nums)) == len(nums) and all(1 < n <= 0xFFFFFF for n in nums)
        assert len({n >> 12 for n in nums}) > 150     # not a counter in the high bits
        assert len({n & 0xFFF for n in nums}) > 150   # nor the slot in the low ones
    finally:
        for q in qps:
            q.close()


# ------------------------------------------------------------ random frames

_frames = st.one_of(
    st.binary(min_size=1, max_size=400),
    st.builds(lambda d, s, b: wire.hello(d, s, b), st.integers(0, (1 << 32) - 1),
              st.integers(0, (1 << 32) - 1), st.binary(max_size=300)),
    st.builds(lambda op, f, n: wire.Header(opcode=op, flags=f, length=n).pack(),
              st.integers(0, 255), st.integers(0, 1), st.integers(0, (1 << 32) - 1)),
    st.builds(lambda p, a, k, n: wire.read_req(p, a, k, n), st.integers(0, (1 << 24) - 1),
              st.integers(0, (1 << 64) - 1), st.integers(0, (1 << 32) - 1),
              st.integers(0, (1 << 32) - 1)),
)


def _send_frames(port: int, frames: list[bytes], peer: ConnInfo | None) -> None:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        if peer is not None:     # a HELLO that names the live QP first (it is in RTS)
            s.sendall(wire.hello(peer.qp_num, 0x42))
        for f in frames:
            s.sendall(f)
        s.shutdown(socket.SHUT_WR)
        s.settimeout(3)
        while s.recv(65536):
            pass
    except OSError:      # reset by the engine, or timed out: both are fine here
        pass
    finally:
        s.close()


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.lists(_frames, min_size=1, max_size=6), name_the_qp=st.booleans())
def test_random_frames_leave_the_engine_serving(frames: list[bytes], name_the_qp: bool) -> None:
    with SOFT_LO() as p:
        peer = p.server.info() if name_the_qp else None
        threads = [threading.Thread(target=_send_frames, args=(_port(p), frames, peer))
                   for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        _read_ok(p)
        assert p.client.qp.qp_state == IBV_QPS_RTS
