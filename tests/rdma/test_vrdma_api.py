"""vRDMA on loopback, two endpoints in one trio run, the real provider underneath.

What the namespace failover tests do not cover: authentication end to end (wrong secret,
garbage on the listener, a raw QP that tries to attach to a served QP with a leaked
rkey), caller errors (bad range, forged rkey), cancellation of a posted READ, close
semantics, the paths tool.
"""
from __future__ import annotations

import errno
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from rdma.api import SGE, ConnInfo, QPCap, QPInitAttr, gid_from_ipv4, open_device
from rdma.enums import IBV_WC_REM_ACCESS_ERR, IBV_WC_SUCCESS
from rdma.errors import (
    AuthenticationError,
    ConnectError,
    PathClosed,
    PeerUnreachable,
    RdmaError,
    RdmaUserError,
    WCError,
)
from rdma.vrdma import Endpoint, HeartbeatConfig, RemoteVMR

SECRET = b"t3-vrdma-secret"
#: the local NIC both endpoints use; on RDMA hardware point it at the NIC's address
#: (``KSPEEDFS_RDMA_PROVIDER=verbs KSPEEDFS_VRDMA_TEST_ADDR=10.0.0.5``)
LO = os.environ.get("KSPEEDFS_VRDMA_TEST_ADDR", "127.0.0.1")
SIZE = 4 << 20
REPO = str(Path(__file__).resolve().parents[2])
#: these tests are about semantics, not timing: budgets a starved CI box cannot break
CFG = HeartbeatConfig(connect_timeout=5.0, unreachable_grace=3.0)


def _usable() -> str | None:
    try:
        from rdma.api import get_device_list
        if not any(d.ipv4 == LO for d in get_device_list()):
            return "no RDMA device on 127.0.0.1"
    except RdmaError as e:
        return str(e)
    return None


pytestmark = pytest.mark.skipif(bool(_usable()), reason=str(_usable()))


@pytest.fixture
async def server() -> AsyncIterator[tuple[Endpoint, int]]:
    async with Endpoint(SECRET, node="B", addrs=[LO], cfg=CFG) as ep:
        data = ep.alloc(SIZE, name="data", remote_read=True)
        data.write(os.urandom(SIZE))
        ep.export("data", data)
        port = await ep.listen(LO)
        yield ep, port


@pytest.fixture
async def client() -> AsyncIterator[Endpoint]:
    async with Endpoint(SECRET, node="A", addrs=[LO], cfg=CFG) as ep:
        yield ep


async def test_read_roundtrip_and_statistics(server: Any, client: Endpoint) -> None:
    srv, port = server
    vqp = await client.connect([LO], port)
    buf = client.alloc(1 << 20)
    rm = vqp.remote_mr("data")
    await vqp.read(buf, 0, rm, 1 << 20, remote_off=12345)
    assert buf.read(1 << 20) == srv.exports["data"].read(1 << 20, 12345)
    await vqp.read(buf, 100, rm.addr + 7, 50)        # by remote virtual address
    assert buf.read(50, 100) == srv.exports["data"].read(50, 7)
    st = vqp.statistics()
    assert st.state == "reachable" and st.reads_ok == 2
    assert [p.state for p in st.paths] == ["UP"]
    assert srv.statistics().leases == 1


async def test_wrong_secret_cannot_connect(server: Any) -> None:
    srv, port = server
    async with Endpoint(b"not-the-secret", node="mallory", addrs=[LO]) as bad:
        with pytest.raises(AuthenticationError):
            await bad.connect([LO], port)
    assert srv.statistics().refused >= 1
    assert srv.statistics().leases == 0 and srv.served_qp_nums() == []


async def test_garbage_on_the_listener_is_refused_and_service_continues(
        server: Any, client: Endpoint) -> None:
    srv, port = server
    for junk in (b"\x00" * 64, b"GET / HTTP/1.1\r\n\r\n", b"\xff\xff\xff\xff"):
        s = await trio.open_tcp_stream(LO, port)
        await s.send_all(junk)
        with trio.fail_after(5):
            while await s.receive_some():
                pass                                 # server closes on us
        await s.aclose()
    vqp = await client.connect([LO], port)
    assert vqp.statistics().state == "reachable"
    assert srv.statistics().refused >= 3


async def test_leaked_rkey_without_session_reads_nothing(server: Any, client: Endpoint) -> None:
    """A process that learned (addr, rkey) and a served QPN, but not the secret, attaches
    a QP of its own to the served QP: refused (the served QP is bound to its peer)."""
    srv, port = server
    vqp = await client.connect([LO], port)
    rm = vqp.remote_mr("data")
    qpns = srv.served_qp_nums()
    assert qpns
    dev_port = srv.nics[LO].ctx.query_port(1).service_port
    with open_device(addr=LO) as ctx:
        pd = ctx.alloc_pd()
        cq = ctx.create_cq(4)
        mr = pd.reg_mr(4096, 7)
        qp = pd.create_qp(QPInitAttr(send_cq=cq, cap=QPCap(max_send_wr=4)))
        info = ConnInfo(qp_num=qpns[0], psn=1, gid=gid_from_ipv4(LO), service_port=dev_port,
                        provider=ctx.device.provider)
        try:
            await trio.to_thread.run_sync(lambda: qp.connect(info, timeout_ms=100))
        except ConnectError as e:   # soft: the served QP is bound to its peer already
            assert e.errno in (errno.ECONNREFUSED, errno.ETIMEDOUT, errno.ECONNRESET)
        else:                       # verbs: RTR needs no handshake; the READ must fail
            addr, rkey = rm.on(LO, 0)
            qp.read(1, SGE(mr.buf, 64, mr.lkey), addr, rkey)
            wcs = await trio.to_thread.run_sync(lambda: cq.poll_wait(1, timeout=5))
            assert not wcs or wcs[0].status != IBV_WC_SUCCESS
    # the legitimate peer is unaffected
    buf = client.alloc(4096)
    await vqp.read(buf, 0, rm, 4096)
    assert buf.read(4096) == srv.exports["data"].read(4096)


async def test_caller_errors_fail_the_read_not_the_peer(server: Any, client: Endpoint) -> None:
    srv, port = server
    vqp = await client.connect([LO], port)
    rm = vqp.remote_mr("data")
    buf = client.alloc(8192)
    with pytest.raises(RdmaUserError):
        await vqp.read(buf, 0, rm, 4096, remote_off=SIZE - 100)
    with pytest.raises(RdmaUserError):
        await vqp.read(buf, 8000, rm, 4096)
    forged = RemoteVMR("data", rm.length, {n: (a, k ^ 0x5A5A) for n, (a, k) in rm.keys.items()})
    with pytest.raises(WCError) as ei:
        await vqp.read(buf, 0, forged, 64)
    assert ei.value.status == IBV_WC_REM_ACCESS_ERR
    # the path goes through DOWN → REBUILDING → UP; the next good READ just works
    with trio.fail_after(5):
        await vqp.read(buf, 0, rm, 4096, remote_off=4096)
    assert buf.read(4096) == srv.exports["data"].read(4096, 4096)
    assert vqp.statistics().paths[0].downs == 1


async def test_cancelled_read_returns_after_its_wc(server: Any, client: Endpoint) -> None:
    srv, port = server
    vqp = await client.connect([LO], port)
    rm = vqp.remote_mr("data")
    buf = client.alloc(SIZE)
    for _ in range(5):
        with trio.move_on_after(0.0005):
            await vqp.read(buf, 0, rm, SIZE)
        p = vqp.paths[0]
        assert p.data_inflight == 0 and not [v for v in p.inflight.values()
                                             if v is not p.HEARTBEAT]
    await vqp.read(buf, 0, rm, SIZE)
    assert buf.read(SIZE) == srv.exports["data"].read(SIZE)


async def test_detached_read_returns_at_once_and_frees_its_buffer_at_its_wc(
        server: Any, client: Endpoint) -> None:
    """A cancelled READ with ``detach`` does not wait for its WC (a hedged read's loser
    must not wait on a hung peer): ``detach()`` runs exactly once, when no WR of it is
    posted any more; and ``overrun``'s hook runs once for a READ that is late, which
    still completes with the right bytes."""
    srv, port = server
    vqp = await client.connect([LO], port)
    rm = vqp.remote_mr("data")
    buf = client.alloc(SIZE)
    p = vqp.paths[0]
    detached = 0
    for _ in range(5):
        freed: list[int] = []
        with trio.move_on_after(0.0005) as cs:
            await vqp.read(buf, 0, rm, SIZE, detach=lambda freed=freed: freed.append(p.data_inflight))
        if not cs.cancelled_caught:
            continue                             # it beat the timer: nothing to detach
        detached += 1
        with trio.fail_after(5):
            while not freed:
                await trio.sleep(0.001)
        await trio.sleep(0.01)
        assert freed == [0]                      # once, and with nothing in flight
    assert detached
    late: list[bool] = []
    await vqp.read(buf, 0, rm, SIZE, overrun=(0.0, lambda: late.append(True)))
    assert late == [True]
    assert buf.read(SIZE) == srv.exports["data"].read(SIZE)


async def test_authenticated_nonsense_does_not_kill_the_server(
        server: Any, client: Endpoint) -> None:
    srv, port = server
    for bad in ({"op": "path", "vqp": "x", "path": 0, "nic": LO,
                 "conn": {"qp_num": 1, "psn": 0, "gid": "not-an-address"}},
                {"op": "path", "vqp": "x", "path": "zero", "nic": LO, "conn": {}},
                {"op": "path", "vqp": "x", "path": 0, "nic": "10.255.255.1", "conn": {}},
                {"op": "nope"}, ["not", "a", "dict"]):
        ch = await client.requester.open_channel(LO, port, None)
        with trio.fail_after(10):
            try:
                await ch.request(bad)
            except RdmaError:
                pass
        await ch.aclose()
    vqp = await client.connect([LO], port)
    assert vqp.statistics().state == "reachable"


async def test_close_semantics(server: Any, client: Endpoint) -> None:
    srv, port = server
    vqp = await client.connect([LO], port)
    buf = client.alloc(4096)
    await vqp.aclose()
    await vqp.aclose()
    with pytest.raises(PathClosed):
        await vqp.read(buf, 0, "data", 64)
    with trio.fail_after(5):
        while srv.statistics().leases:                # the lease closed with the vQP
            await trio.sleep(0.01)


async def test_nobody_listening_is_peer_unreachable(client: Endpoint) -> None:
    s = trio.socket.socket()
    await s.bind((LO, 0))
    port = s.getsockname()[1]
    s.close()
    with trio.fail_after(5):
        with pytest.raises(PeerUnreachable):
            await client.connect([LO], port)


async def test_paths_tool(server: Any) -> None:
    srv, port = server
    py = sys.executable
    out = await trio.run_process([py, "-m", "rdma.vrdma.paths"], capture_stdout=True,
                                 cwd=REPO)
    assert b"device" in out.stdout and LO.encode() in out.stdout
    env = {**os.environ, "KSPEEDFS_SECRET": SECRET.hex()}
    res = await trio.run_process([py, "-m", "rdma.vrdma.paths", "--peer", LO, "--port",
                                  str(port), "--local", LO, "--timeout", "5"],
                                 capture_stdout=True,
                                 capture_stderr=True, cwd=REPO, env=env, check=False)
    # 0 reachable; 1 degraded (a path SUSPECT at the snapshot: a loaded CI box)
    assert res.returncode in (0, 1), res.stderr
    assert f"{LO} -> {LO}".encode() in res.stdout
    assert b" UP " in res.stdout or b" SUSPECT " in res.stdout
    env["KSPEEDFS_SECRET"] = b"wrong".hex()
    res = await trio.run_process([py, "-m", "rdma.vrdma.paths", "--peer", LO, "--port",
                                  str(port), "--local", LO, "--timeout", "5"],
                                 capture_stdout=True,
                                 capture_stderr=True, cwd=REPO, env=env, check=False)
    assert res.returncode != 0


async def test_more_reads_than_queue_slots_all_complete(server: Any, client: Endpoint) -> None:
    """Thousands of concurrent READs on one path (SQ depth 256): the excess waits for
    slots and is never mistaken for an unreachable peer."""
    srv, port = server
    vqp = await client.connect([LO], port)
    rm = vqp.remote_mr("data")
    n, size = 3000, 1024
    buf = client.alloc(n * size)
    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(vqp.read, buf, i * size, rm, size, i * size)
    assert buf.read(n * size) == srv.exports["data"].read(n * size)
    assert vqp.statistics().reads_ok == n


async def test_an_idle_vqp_probes_slowly_until_the_next_read(server: Any) -> None:
    """No READ for ``idle_after``: probes every ``idle_interval`` (10/s, not 100/s); the
    next READ wakes the monitor at once and probing is back to every ``interval``."""
    srv, port = server
    cfg = HeartbeatConfig(connect_timeout=5.0, unreachable_grace=3.0, interval=0.01,
                          idle_interval=0.1, quiet_interval=0.1, idle_after=0.3)  # (no quiet tier)
    async with Endpoint(SECRET, node="A", addrs=[LO], cfg=cfg) as ep:
        vqp = await ep.connect([LO], port)
        buf = ep.alloc(4096)
        rm = vqp.remote_mr("data")

        def beats() -> int:
            return sum(p.heartbeats_ok for p in vqp.statistics().paths)

        await vqp.read(buf, 0, rm, 4096)
        await trio.sleep(0.5)                              # idle from 0.3 s on
        h0 = beats()
        await trio.sleep(1.0)
        idle = beats() - h0
        assert 3 <= idle <= 15, f"{idle} probes in 1 s idle (every 100 ms: ~10)"
        h1 = beats()
        await vqp.read(buf, 0, rm, 4096)
        await trio.sleep(0.25)
        busy = beats() - h1
        assert busy >= 8, f"{busy} probes in 0.25 s after a READ (every 10 ms: ~25)"
        assert buf.read(4096) == srv.exports["data"].read(4096)


async def test_a_quiet_vqp_probes_more_slowly_until_a_native_read_is_posted(server: Any) -> None:
    """No READ of Python's nor of the native fetch's for ``idle_after``: probes every
    ``quiet_interval``; a READ C is about to post (``native_target``) wakes the monitor
    at once, back to ``idle_interval`` (a NIC dying under C's READs is found by those
    ticks), and quiet again ``idle_after`` after it."""
    srv, port = server
    cfg = HeartbeatConfig(connect_timeout=5.0, unreachable_grace=3.0, interval=0.01,
                          idle_interval=0.05, quiet_interval=0.5, idle_after=0.3)
    async with Endpoint(SECRET, node="A", addrs=[LO], cfg=cfg) as ep:
        vqp = await ep.connect([LO], port)
        buf = ep.alloc(4096)
        await vqp.read(buf, 0, vqp.remote_mr("data"), 4096)

        def beats() -> int:
            return sum(p.heartbeats_ok for p in vqp.statistics().paths)

        await trio.sleep(0.8)                              # quiet from 0.3 s on
        h0 = beats()
        await trio.sleep(1.0)
        quiet = beats() - h0
        assert quiet <= 4, f"{quiet} probes in 1 s quiet (every 500 ms: ~2)"
        h1 = beats()
        assert vqp.native_target(buf, 0, "data", 0, 4096) is not None
        await trio.sleep(0.25)
        idle = beats() - h1
        assert idle >= 3, f"{idle} probes in 0.25 s after a native READ (every 50 ms: ~5)"


async def test_reads_c_completed_on_a_path_stand_in_for_its_probes(server: Any) -> None:
    """``VQP.native_done``: a path whose traffic is the native fetch's READs (their WCs
    reach C's CQ, not the path's) is proven alive by them, as by its own data READs, and
    is not probed meanwhile; a QP number no path has is ignored."""
    srv, port = server
    cfg = HeartbeatConfig(connect_timeout=5.0, unreachable_grace=3.0, interval=0.01)
    async with Endpoint(SECRET, node="A", addrs=[LO], cfg=cfg) as ep:
        vqp = await ep.connect([LO], port)
        buf = ep.alloc(4096)
        await vqp.read(buf, 0, vqp.remote_mr("data"), 4096)
        target = vqp.native_target(buf, 0, "data", 0, 4096)
        assert target is not None

        def beats() -> int:
            return sum(p.heartbeats_ok for p in vqp.statistics().paths)

        h0 = beats()
        await trio.sleep(0.25)
        probed = beats() - h0
        h1 = beats()
        for _ in range(125):                            # a READ of C's every 2 ms
            vqp.native_done(target.qpn)
            vqp.native_done(target.qpn ^ 0xFFFFFF)      # no such QP: ignored
            await trio.sleep(0.002)
        carried = beats() - h1
        assert probed >= 8 and carried <= 2, (probed, carried)
        assert [p.state for p in vqp.statistics().paths] == ["UP"]


async def test_hostile_connection_racing_the_client_reads_nothing(
        server: Any, client: Endpoint) -> None:
    """Soft wire level: an attacker who learned a served QP's number, the client's QPN and
    PSN and a valid rkey sends a forged HELLO to the served QP before the client does.
    The served QP expects the client's token (expect_peer), so the engine refuses the
    forged HELLO at once; the real client then attaches and its path comes up."""
    import socket

    from rdma.vrdma.handshake import qp_token
    if client.nics[LO].device.provider != "soft":
        pytest.skip("wire-level attack on the soft provider")
    from rdma.providers.soft import wire

    srv, port = server
    ch = await client.requester.open_channel(LO, port, None)
    nic = client.nics[LO]
    cq = nic.ctx.create_cq(8)
    qp = nic.pd.create_qp(QPInitAttr(send_cq=cq, cap=QPCap(max_send_wr=4)))
    info = qp.local_info()
    await ch.send({"op": "path", "vqp": "race", "path": 0, "nic": LO, "conn": info.to_dict()})
    reply = await ch.recv()
    served = ConnInfo.from_dict(reply["conn"])
    rm = RemoteVMR.from_dict("data", reply["mrs"]["data"])
    addr, rkey = rm.on(LO, 0)

    def attack() -> bytes:
        s = socket.create_connection((LO, served.service_port), timeout=3)
        try:
            s.sendall(wire.hello(served.qp_num, info.qp_num, b"forged"))
            s.sendall(wire.read_req(info.psn, addr, rkey, 64))
            out = b""
            try:
                while chunk := s.recv(65536):
                    out += chunk
            except (TimeoutError, ConnectionError):
                pass
            return out
        finally:
            s.close()

    served_bytes = await trio.to_thread.run_sync(attack)
    refusal = wire.Header.unpack(served_bytes)
    assert len(served_bytes) == wire.HDR_LEN       # a refusing HELLO and nothing else
    assert refusal.opcode == wire.OP_HELLO and refusal.status != 0
    await trio.to_thread.run_sync(lambda: qp.connect(
        served, private_data=qp_token(ch.key, info.qp_num), timeout_ms=100))
    await ch.send({"op": "ready"})
    assert await ch.recv() == {"ok": True}
    await ch.aclose()
    qp.close()
    cq.close()


async def test_only_remote_readable_memory_can_be_exported(client: Endpoint) -> None:
    landing = client.alloc(4096)
    with pytest.raises(RdmaUserError):
        client.export("landing", landing)
    client.export("ok", client.alloc(4096, remote_read=True))
    assert client.advertisement()["mrs"].keys() == {"ok"}


def _attack(port: int, dest_qpn: int, src_qpn: int, psn: int, addr: int, rkey: int,
            n: int) -> bytes:
    """Forge a HELLO onto a soft QP, send one READ request, return all bytes received."""
    import socket

    from rdma.providers.soft import wire
    s = socket.create_connection((LO, port), timeout=0.5)
    out = b""
    try:
        s.sendall(wire.hello(dest_qpn, src_qpn, b""))
        s.sendall(wire.read_req(psn, addr, rkey, n))
        while chunk := s.recv(65536):
            out += chunk
    except (TimeoutError, ConnectionError):
        pass
    finally:
        s.close()
    return out


async def test_client_path_qp_serves_no_reads(server: Any, client: Endpoint,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Every node is client and server at once.  In the window where the client's path QP
    is in RTS but the server has not attached to it yet, an attacker forges the server's
    HELLO onto it and asks for the client's *exported* memory: the client QP has no
    REMOTE_READ access, so nothing comes back."""
    if client.nics[LO].device.provider != "soft":
        pytest.skip("wire-level attack on the soft provider")
    from rdma.providers.soft import wire
    from rdma.vrdma.handshake import Channel

    srv, port = server
    mine = client.alloc(4096, remote_read=True)
    mine.write(b"S3CRET!!" * 512)
    client.export("mine", mine)
    addr, rkey = mine.remote().keys[LO]
    real = Channel.request
    seen: dict[str, Any] = {}

    async def spy(self: Channel, msg: Any, timeout: float | None = None) -> Any:
        if msg == {"op": "ready"} and "stolen" not in seen:
            qp = client.vqps[-1].paths[0].qp
            served = ConnInfo.from_dict(seen["reply"]["conn"])
            eport = client.nics[LO].ctx.query_port(1).service_port
            seen["stolen"] = await trio.to_thread.run_sync(
                _attack, eport, qp.qp_num, served.qp_num, served.psn, addr, rkey, 64)
        reply = await real(self, msg, timeout)
        if isinstance(msg, dict) and msg.get("op") == "path":
            seen["reply"] = reply
        return reply

    monkeypatch.setattr(Channel, "request", spy)
    await client.connect([LO], port, timeout=10)
    stolen = seen["stolen"]
    assert b"S3CRET!!" not in stolen
    for off in range(0, len(stolen) - wire.HDR_LEN + 1, wire.HDR_LEN):
        h = wire.Header.unpack(stolen[off:off + wire.HDR_LEN])
        assert not (h.opcode == wire.OP_READ_RESP and h.status == 0)
