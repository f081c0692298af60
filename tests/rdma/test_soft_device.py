"""Soft provider, object level: devices, lifecycle, ownership, MR bytes, CQ fd."""
from __future__ import annotations

import errno
import gc
import os

import pytest
import trio

import rdma
from rdma.api import QPCap, QPInitAttr, RecvWR, find_device, get_device_list, open_device
from rdma.enums import (
    IBV_ACCESS_LOCAL_WRITE,
    IBV_ACCESS_REMOTE_READ,
    IBV_PORT_ACTIVE,
    IBV_QPS_RESET,
    IBV_WC_RECV,
    IBV_WC_WR_FLUSH_ERR,
)
from rdma.errors import NoDeviceError, RdmaUserError, ResourceBusyError, ResourceClosedError
from rdma.testing import read_wr, soft_pair

ACCESS = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ


def test_device_list_has_loopback_and_names_by_nic() -> None:
    devs = get_device_list("soft")
    lo = [d for d in devs if d.ipv4 == "127.0.0.1"]
    assert lo and lo[0].name == "soft_lo" and lo[0].netdev == "lo"
    assert all(d.name.startswith("soft_") and d.provider == "soft" for d in devs)
    assert len({d.name for d in devs}) == len(devs)
    assert find_device("127.0.0.1", "soft").name == "soft_lo"
    with pytest.raises(NoDeviceError):
        find_device("203.0.113.77", "soft")


def test_open_query_and_gid() -> None:
    with open_device("soft_lo", provider="soft") as ctx:
        port = ctx.query_port(1)
        assert port.state == IBV_PORT_ACTIVE and port.service_port > 0
        assert ctx.query_gid(1, 0) == "::ffff:127.0.0.1"
        assert ctx.query_device().max_sge >= 1
        with pytest.raises(RdmaUserError):
            ctx.query_gid(1, 1)


def test_two_contexts_on_one_device_listen_apart() -> None:
    with open_device("soft_lo", provider="soft") as a, open_device("soft_lo", provider="soft") as b:
        assert a.query_port().service_port != b.query_port().service_port


def test_parents_close_children_and_close_is_idempotent() -> None:
    ctx = open_device("soft_lo", provider="soft")
    pd = ctx.alloc_pd()
    cq = ctx.create_cq(16)
    mr = pd.reg_mr(4096, ACCESS)
    qp = pd.create_qp(QPInitAttr(send_cq=cq))
    assert qp.qp_state == IBV_QPS_RESET and qp.qp_num > 0
    ctx.close()
    for obj in (qp, mr, pd, cq, ctx):
        assert obj.closed
        obj.close()  # idempotent
    with pytest.raises(ResourceClosedError):
        _ = qp.qp_state
    with pytest.raises(ResourceClosedError):
        mr.read(1)
    with pytest.raises(ResourceClosedError):
        ctx.alloc_pd()


def test_cq_in_use_is_busy_until_its_qp_closes() -> None:
    with open_device("soft_lo", provider="soft") as ctx:
        pd = ctx.alloc_pd()
        cq = ctx.create_cq(16)
        qp = pd.create_qp(QPInitAttr(send_cq=cq))
        with pytest.raises(ResourceBusyError):
            ctx.create_cq(1)  # fine
            cq._close_impl()  # the native refusal, without marking the object closed
        qp.close()
        cq.close()


def test_mr_registers_buffers_and_bounds_local_access() -> None:
    with open_device("soft_lo", provider="soft") as ctx:
        pd = ctx.alloc_pd()
        buf = bytearray(b"x" * 100)
        mr = pd.reg_mr(buf, ACCESS)
        assert mr.length == 100 and mr.lkey == mr.rkey != 0
        mr.write(b"abc", 10)
        assert buf[10:13] == b"abc" and mr.read(3, 10) == b"abc"
        with pytest.raises(BufferError):
            buf.extend(b"no")  # pinned while registered
        with pytest.raises(RdmaUserError):
            mr.read(2, 99)
        with pytest.raises(RdmaUserError):
            pd.reg_mr(bytes(10), ACCESS)  # read-only
        mr.close()
        buf.extend(b"ok")  # released
        big = pd.reg_mr(1 << 20, ACCESS)
        assert big.read(8, (1 << 20) - 8) == bytes(8)


def test_objects_are_collected_without_leaks() -> None:
    for _ in range(50):
        with soft_pair() as p:
            p.client.qp.post_recv(RecvWR(1, [p.client.mr.sge(0, 8)]))
    gc.collect()


async def test_cq_fd_wakes_trio() -> None:
    with soft_pair() as p:
        c = p.client
        c.qp.post_recv(RecvWR(5, [c.mr.sge(0, 8)]))
        got = []

        async def consumer() -> None:
            got.extend(await c.cq.poll_async(4))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(consumer)
            await trio.sleep(0.05)
            assert not got  # nothing queued: the fd is not readable
            c.qp.to_err()  # flushes the RECV: the engine writes the eventfd
            with trio.fail_after(5):
                while not got:
                    await trio.sleep(0.005)
        assert got[0].wr_id == 5 and got[0].status == IBV_WC_WR_FLUSH_ERR
        assert got[0].opcode == IBV_WC_RECV
        assert c.cq.poll(4) == []


async def test_poll_async_cancel_loses_nothing() -> None:
    with soft_pair() as p:
        c = p.client
        with trio.move_on_after(0.05):
            await c.cq.poll_async()
        c.qp.post_recv(RecvWR(6, [c.mr.sge(0, 8)]))
        c.qp.to_err()
        with trio.fail_after(5):
            (wc,) = await c.cq.poll_async()
        assert wc.wr_id == 6


def test_qp_caps_out_of_range_refused() -> None:
    with open_device("soft_lo", provider="soft") as ctx:
        pd, cq = ctx.alloc_pd(), ctx.create_cq(4)
        with pytest.raises(rdma.RdmaError) as ei:
            pd.create_qp(QPInitAttr(send_cq=cq, cap=QPCap(max_send_wr=0)))
        assert ei.value.errno == errno.EINVAL


def test_cq_moderation_batches_wakeups_but_never_strands_wcs() -> None:
    """cq_count=4: the fd stays quiet for 1-3 WCs until cq_period passes, then wakes;
    4 WCs wake it at once; poll() is never delayed."""
    import select
    import time

    with soft_pair() as p:
        c = p.client
        c.cq.modify(4, 200_000)  # 4 WCs or 200 ms
        c.qp.post_recv([RecvWR(i, [c.mr.sge(i * 8, 8)]) for i in range(6)])
        p.server.mr.write(b"x" * 8)
        from rdma.api import SendWR
        from rdma.enums import IBV_WR_SEND

        def send(n: int) -> None:
            p.server.qp.post_send([SendWR(wr_id=100 + i, opcode=IBV_WR_SEND,
                                          sg_list=[p.server.mr.sge(0, 8)]) for i in range(n)])

        send(2)
        time.sleep(0.05)
        assert select.select([c.cq.fd], [], [], 0)[0] == []      # 2 < 4, period not over
        t0 = time.monotonic()
        assert select.select([c.cq.fd], [], [], 2)[0] == [c.cq.fd]  # the period ends it
        assert 0.08 < time.monotonic() - t0 + 0.05 < 1.0
        assert len(c.cq.poll(8)) == 2
        send(4)
        assert select.select([c.cq.fd], [], [], 2)[0] == [c.cq.fd]
        got = []
        while len(got) < 4:
            got += c.cq.poll(8)
        c.cq.modify(1, 0)  # back to one wake-up per WC
        with pytest.raises(rdma.RdmaError):
            c.cq.modify(8, 0)  # count without a period could strand WCs


def test_moderated_flush_from_app_thread_is_signalled_within_the_period() -> None:
    import select
    import time

    from rdma.api import QPAttr

    with soft_pair(connect=False) as p:
        c = p.client
        c.cq.modify(16, 50_000)  # 16 WCs or 50 ms
        c.qp.to_init(QPAttr(qp_access_flags=ACCESS))  # no RTS QP: the engine sleeps long
        c.qp.post_recv([RecvWR(i, [c.mr.sge(0, 8)]) for i in range(3)])
        time.sleep(1.2)
        t0 = time.monotonic()
        c.qp.to_err()            # 3 flush WCs pushed by this (app) thread
        assert select.select([c.cq.fd], [], [], 2)[0] == [c.cq.fd]
        assert time.monotonic() - t0 < 0.5
        assert len(c.cq.poll(16)) == 3


def test_chunk_sized_read_is_sent_by_the_engine_thread_a_small_one_inline() -> None:
    """On an idle QP a READ below KS_DOORBELL_READ (1 MiB) is sent by the poster itself
    (a lone READ's latency); a chunk-sized one rings the doorbell, and the engine thread
    sends it, as a NIC's send engine would (native/soft_engine.c, "Requester")."""
    size = 4 << 20
    with soft_pair(mr_size=size) as p:
        p.server.mr.write(os.urandom(size))
        stats = p.client.ctx.statistics
        rung = stats().doorbell_posts
        for wr_id, length in enumerate((4096, (1 << 20) - 1)):
            p.client.qp.post_send(read_wr(wr_id, p.client.mr, p.server.mr, length))
            (wc,) = p.client.wait()
            assert wc.ok and p.client.mr.read(length) == p.server.mr.read(length)
        assert stats().doorbell_posts == rung
        for wr_id, length in enumerate((1 << 20, size), start=2):
            p.client.qp.post_send(read_wr(wr_id, p.client.mr, p.server.mr, length))
            (wc,) = p.client.wait()
            assert wc.ok and p.client.mr.read(length) == p.server.mr.read(length)
        assert stats().doorbell_posts == rung + 2
