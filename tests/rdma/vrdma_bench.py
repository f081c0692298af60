"""READ rate of one raw RC QP vs one vQP (single path) on one local address.

    /opt/kspeedfs/venv/bin/python tests/rdma/vrdma_bench.py [--addr 127.0.0.1] [--n 20000]

Both endpoints live in this process, so the numbers include the responder's engine; the
point is the ratio: what the vRDMA bookkeeping (per-READ op, wr_id table, path choice,
trio wake-up) costs on top of the provider.  Not a test; prints one line per size.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import trio

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from rdma.api import QPCap, QPInitAttr, open_device  # noqa: E402
from rdma.vrdma import Endpoint  # noqa: E402


def raw_rate(addr: str, size: int, n: int, qd: int) -> float:
    with open_device(addr=addr) as a, open_device(addr=addr) as b:
        pa, pb = a.alloc_pd(), b.alloc_pd()
        ma, mb = pa.reg_mr(qd * size, 7), pb.reg_mr(1 << 22, 7)
        ca, cb = a.create_cq(1024), b.create_cq(16)
        qa = pa.create_qp(QPInitAttr(send_cq=ca, cap=QPCap(max_send_wr=256)))
        qb = pb.create_qp(QPInitAttr(send_cq=cb, cap=QPCap(max_send_wr=4)))
        ia, ib = qa.local_info(), qb.local_info()
        t = threading.Thread(target=lambda: qb.connect(ia, max_rd_atomic=16,
                                                       max_dest_rd_atomic=16))
        t.start()
        qa.connect(ib, max_rd_atomic=16, max_dest_rd_atomic=16)
        t.join()
        t0, done, posted = time.perf_counter(), 0, 0
        for i in range(qd):
            qa.read(i, ma.sge(i * size, size), mb.buf, mb.rkey)
            posted += 1
        while done < n:
            for wc in ca.poll_wait(16):
                done += 1
                if posted < n:
                    qa.read(wc.wr_id, ma.sge(wc.wr_id * size, size), mb.buf, mb.rkey)
                    posted += 1
        return n / (time.perf_counter() - t0)


async def vqp_rate(addr: str, size: int, n: int, qd: int) -> float:
    async with Endpoint(b"bench", addrs=[addr]) as srv, Endpoint(b"bench", addrs=[addr]) as cli:
        srv.export("d", srv.alloc(1 << 22, "d", remote_read=True))
        port = await srv.listen(addr)
        vqp = await cli.connect([addr], port)
        buf, rm = cli.alloc(qd * size), vqp.remote_mr("d")
        t0 = time.perf_counter()

        async def worker(i: int) -> None:
            for _ in range(n // qd):
                await vqp.read(buf, i * size, rm, size)

        async with trio.open_nursery() as nursery:
            for i in range(qd):
                nursery.start_soon(worker, i)
        rate = n / (time.perf_counter() - t0)
        await vqp.aclose()
        return rate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--addr", default="127.0.0.1")
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--qd", type=int, default=8)
    args = ap.parse_args()
    for size in (4096, 65536, 1 << 20):
        n = args.n if size <= 65536 else args.n // 10
        r = raw_rate(args.addr, size, n, args.qd)
        v = trio.run(vqp_rate, args.addr, size, n, args.qd)
        print(f"{size:>8} B qd{args.qd}: raw QP {r:8.0f} READ/s {r * size / 1e6:7.0f} MB/s | "
              f"vQP {v:8.0f} READ/s {v * size / 1e6:7.0f} MB/s | vQP/raw {v / r:.2f}")


if __name__ == "__main__":
    main()
