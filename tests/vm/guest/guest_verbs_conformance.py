"""Runs INSIDE a Soft-RoCE guest (tests/vm/test_verbs_conformance.py boots it).

The guest has rxe0 on eth0 and rxe1 on eth1, the two ends of one wire, with the
policy routing of init.sh (ks.loopwire=1) so rxe0 → rxe1 really crosses the wire.

* the provider conformance suite (rdma/testing.py), unchanged, on the verbs provider:
  ``loopback`` (both players on rxe0: rxe short-circuits, never touches the NIC) and
  ``wire`` (client rxe0, server rxe1);
* real failure statuses and their timing (results to $KS_RESULTS as JSON lines);
* the latency cost of the CQ poller thread (cq.py) vs polling the CQ directly.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from typing import Any

import pytest

from rdma.api import open_device
from rdma.enums import IBV_QPS_ERR, IBV_WC_LOC_QP_OP_ERR, IBV_WC_RETRY_EXC_ERR, IBV_WC_SUCCESS
from rdma.qp_state import total_timeout_seconds
from rdma.testing import CHECKS, pair_factory, read_wr

RESULTS = os.environ.get("KS_RESULTS", "/run/ks/results.jsonl")
WHERE = {"loopback": ("rxe0", None), "wire": ("rxe0", "rxe1")}
#: every check, over the wire and over loopback (rxe short-circuits: no NIC involved)
CASES = [(name, where) for where in WHERE for name in CHECKS]
A0, A1 = "198.18.1.1", "198.18.1.2"


def report(test: str, **data: Any) -> None:
    with open(RESULTS, "a") as f:
        f.write(json.dumps({"test": test, **data}) + "\n")


def sh(cmd: str) -> None:
    subprocess.run(["/bin/sh", "-c", cmd], check=True)


def cat(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def rewire() -> None:
    """Re-apply the wire routing of init.sh: link-down flushes its routes and neighbours."""
    mac0, mac1 = cat("/sys/class/net/eth0/address"), cat("/sys/class/net/eth1/address")
    sh(f"ip link set eth0 up; ip link set eth1 up; "
       f"ip route replace {A1}/32 dev eth0 src {A0} table 100; "
       f"ip route replace {A0}/32 dev eth1 src {A1} table 101; "
       f"ip neigh replace {A1} lladdr {mac1} dev eth0 nud permanent; "
       f"ip neigh replace {A0} lladdr {mac0} dev eth1 nud permanent")
    for _ in range(100):
        if all("ACTIVE" in cat(f"/sys/class/infiniband/rxe{i}/ports/1/state") for i in (0, 1)):
            return
        time.sleep(0.05)


def test_devices_have_roce_v2_ipv4_gids() -> None:
    from rdma.api import get_device_list

    devs = {d.name: d for d in get_device_list("verbs")}
    assert devs["rxe0"].ipv4 == A0 and devs["rxe0"].netdev == "eth0"
    assert devs["rxe1"].ipv4 == A1
    with open_device("rxe0", "verbs") as ctx:
        assert ctx.gid_index == 1            # index 0 is fe80:: (link-local)
        port = ctx.query_port(1)
        assert port.link_layer == "Ethernet" and port.state == 4
        report("device", gid_index=ctx.gid_index, active_mtu=port.active_mtu,
               max_qp_rd_atom=ctx.query_device().max_qp_rd_atom)


@pytest.mark.parametrize("name,where", CASES)
def test_conformance(name: str, where: str) -> None:
    t0 = time.monotonic()
    CHECKS[name](pair_factory("verbs", *WHERE[where]))
    report("conformance", check=name, where=where, s=round(time.monotonic() - t0, 3))


def _read_once(p: Any, wr_id: int, timeout: float = 15.0) -> tuple[Any, float]:
    t0 = time.monotonic()
    p.client.qp.post_send(read_wr(wr_id, p.client.mr, p.server.mr, 4096))
    (wc,) = p.client.wait(1, timeout)
    return wc, time.monotonic() - t0


@pytest.mark.parametrize("timeout,retry_cnt", [(14, 2), (14, 6), (14, 7), (10, 6)])
def test_dead_responder_is_retry_exc_err(timeout: int, retry_cnt: int) -> None:
    """Responder's NIC down (its packets never arrive): RETRY_EXC_ERR after
    (retry_cnt+1) × timeout; retry_cnt=7 would be forever on rxe, the provider caps it."""
    make = pair_factory("verbs", "rxe0", "rxe1")
    with make(timeout=timeout, retry_cnt=retry_cnt) as p:
        assert _read_once(p, 1)[0].ok
        try:
            sh("ip link set eth1 down")
            wc, took = _read_once(p, 2)
        finally:
            rewire()
        eff = min(retry_cnt, 6)
        nominal = total_timeout_seconds(timeout, eff)
        report("retry_exc", timeout=timeout, retry_cnt=retry_cnt, effective_retry_cnt=eff,
               status=wc.status.name, post_to_cqe_ms=round(took * 1e3, 1),
               nominal_ms=round(nominal * 1e3, 1))
        assert wc.status == IBV_WC_RETRY_EXC_ERR, wc
        assert p.client.qp.qp_state == IBV_QPS_ERR
        assert nominal * 0.5 < took < nominal * 3 + 0.5
        p.reconnect()
        assert _read_once(p, 3)[0].ok         # ERR → RESET → RTS on both sides


def test_netem_loss_is_retry_exc_err() -> None:
    with pair_factory("verbs", "rxe0", "rxe1")(timeout=12, retry_cnt=3) as p:
        assert _read_once(p, 1)[0].ok
        try:
            sh("tc qdisc add dev eth0 root netem loss 100%")
            wc, took = _read_once(p, 2)
        finally:
            sh("tc qdisc del dev eth0 root || true")
        report("netem_loss", status=wc.status.name, post_to_cqe_ms=round(took * 1e3, 1),
               nominal_ms=round(total_timeout_seconds(12, 3) * 1e3, 1))
        assert wc.status == IBV_WC_RETRY_EXC_ERR, wc
        p.reconnect()
        assert _read_once(p, 3)[0].ok


def test_local_link_down_is_loc_qp_op_err() -> None:
    with pair_factory("verbs", "rxe0", "rxe1")(timeout=14, retry_cnt=6) as p:
        assert _read_once(p, 1)[0].ok
        try:
            sh("ip link set eth0 down")
            wc, took = _read_once(p, 2)
        finally:
            rewire()
        report("local_down", status=wc.status.name, post_to_cqe_ms=round(took * 1e3, 1))
        assert wc.status == IBV_WC_LOC_QP_OP_ERR, wc
        assert took < 1.0


def test_completion_latency_thread_vs_direct() -> None:
    """What the poller thread costs: post→WC of a 4 KiB loopback READ, busy-polling the
    CQ directly vs awaiting ``poll_async`` (eventfd from the poller thread)."""
    import trio

    n = 200
    with pair_factory("verbs", "rxe0")() as p:
        c = p.client
        direct = []
        for i in range(n):
            t0 = time.perf_counter()
            c.qp.post_send(read_wr(i, c.mr, p.server.mr, 4096))
            while not (w := c.cq.poll()):
                pass
            direct.append(time.perf_counter() - t0)
            assert w[0].status == IBV_WC_SUCCESS

        async def via_thread() -> list[float]:
            out = []
            for i in range(n):
                t0 = time.perf_counter()
                c.qp.post_send(read_wr(i, c.mr, p.server.mr, 4096))
                (w,) = await c.cq.poll_async()
                out.append(time.perf_counter() - t0)
                assert w.status == IBV_WC_SUCCESS
            return out

        async def idle_then_one() -> list[float]:
            out = []
            for i in range(20):            # a CQ idle long enough for full backoff
                await trio.sleep(0.02)
                t0 = time.perf_counter()
                c.qp.post_send(read_wr(i, c.mr, p.server.mr, 4096))
                await c.cq.poll_async()
                out.append(time.perf_counter() - t0)
            return out

        threaded = trio.run(via_thread)
        idle = trio.run(idle_then_one)

    def q(xs: list[float]) -> dict[str, float]:
        xs = sorted(xs)
        return {"p50_us": round(statistics.median(xs) * 1e6),
                "p99_us": round(xs[int(len(xs) * 0.99) - 1] * 1e6),
                "max_us": round(xs[-1] * 1e6)}

    report("cq_latency", direct=q(direct), poll_async=q(threaded), poll_async_idle=q(idle))
