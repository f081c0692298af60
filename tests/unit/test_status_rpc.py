"""``kspeedfs status`` asks every live node for its statistics over the ``stats`` RPC.

Nodes used to put their statistics in etcd every 2 s (``stats/<node>``), most of the
cluster's etcd writes; now the CLI asks them (``node_stats.gather``), all at once, and
a node that does not answer (silent, or another cluster's secret) is left out within
the timeout instead of holding the command. Real trio servers on 127.0.0.1
(``rpc.serve``, a silent listener)."""
from __future__ import annotations

import time
from functools import partial
from typing import Any

import trio

from kspeedfs.cluster import node_stats, rpc
from kspeedfs.cluster.lifecycle import node_stats as parsed
from kspeedfs.cluster.membership import NodeRecord

SECRET = b"status-rpc-test-secret-0123456789"
LO = "127.0.0.1"


def _record(name: str, port: int) -> NodeRecord:
    return NodeRecord(name, "h", [LO], 7470, port, 1 << 30, 256, 4 << 20, 512)


def _handler(name: str) -> rpc.Handler:
    async def handle(req: dict[str, Any]) -> dict[str, Any]:
        assert req == {"op": "stats"}
        return {"node": name, "time": 1.5, "disk": {"capacity": 7, "used": 3}}
    return handle


async def test_status_asks_every_node_and_leaves_out_the_silent() -> None:
    async def silent(s: trio.SocketStream) -> None:
        await trio.sleep_forever()

    async with trio.open_nursery() as n:
        ports = []
        for name, secret in (("a", SECRET), ("b", SECRET), ("other", b"x" * 32)):
            listeners = await n.start(partial(rpc.serve, secret, name, _handler(name), 0, LO))
            ports.append(listeners[0].socket.getsockname()[1])
        quiet = await n.start(partial(trio.serve_tcp, silent, 0, host=LO))
        records = [_record(name, port) for name, port in zip(("a", "b", "other"), ports, strict=True)]
        records.append(_record("quiet", quiet[0].socket.getsockname()[1]))
        t0 = time.monotonic()
        got = await node_stats.ask_all(SECRET, records, timeout=1.0)
        took = time.monotonic() - t0
        n.cancel_scope.cancel()
    assert set(got) == {"a", "b"}
    assert parsed(got["a"])["disk"] == {"capacity": 7, "used": 3}
    assert took < 2.0, f"a silent node held status {took:.1f}s"
