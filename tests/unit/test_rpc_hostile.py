"""Hostile peers around the node RPC (kspeedfs/cluster/rpc.py) and a mount's replica
reads (kspeedfs/cluster/fetch.py), a node keeps serving whatever a client
sends, and a mount treats a peer that answers nonsense as a failed replica — the next
replica serves the read, never an error.

Real trio servers on 127.0.0.1 (``rpc.serve``, soft-provider ``Endpoint``s, fake
listeners speaking raw TCP); Hypothesis fuzzes the request parsing of ``rpc.serve`` and
the reply parsing of ``RpcClient`` with a bounded budget.
"""
from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kspeedfs.cluster import rpc
from kspeedfs.cluster.arena import Arena, Geometry
from kspeedfs.cluster.fetch import Peers
from kspeedfs.cluster.membership import NodeRecord
from kspeedfs.errors import KspeedfsError
from rdma.tuning import PREAUTH_PER_SOURCE
from rdma.vrdma import Endpoint
from rdma.vrdma import handshake as hs
from tests.fixtures.hostile import (
    LO,
    close_all,
    closed_by_peer,
    connect_many,
    fd_count,
    json_values,
    nested,
    run,
    send_quietly,
    settle,
    wire_bytes,
)

SECRET = b"t3-rpc-hostile-secret"
SLOT = 64 << 10
FUZZ = settings(max_examples=100, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


async def _handler(req: dict[str, Any]) -> dict[str, Any]:
    op = req.get("op")
    if op == "ping":
        return {"pong": True}
    if op == "big":
        return {"x": "a" * (2 << 20)}                 # larger than any frame
    if op == "boom":
        raise RuntimeError("a handler bug")
    raise KspeedfsError(f"unknown op {str(op)[:40]}")


@asynccontextmanager
async def _rpc_server(gate: hs.PreAuthGate | None = None) -> AsyncIterator[int]:
    async with trio.open_nursery() as n:
        listeners = await n.start(lambda task_status: rpc.serve(
            SECRET, "node", _handler, 0, LO, gate=gate, task_status=task_status))
        yield listeners[0].socket.getsockname()[1]
        n.cancel_scope.cancel()


@asynccontextmanager
async def _fake(behave: Callable[[trio.SocketStream], Awaitable[None]]) -> AsyncIterator[int]:
    """A listener on LO running ``behave`` on each connection; yields its port."""
    async def conn(s: trio.SocketStream) -> None:
        try:
            await behave(s)
            await trio.sleep(0.2)
        except (hs.HandshakeError, trio.BrokenResourceError, OSError):
            pass
        finally:
            await s.aclose()

    async with trio.open_nursery() as n:
        listeners = await n.start(partial(trio.serve_tcp, conn, 0, host=LO))
        yield listeners[0].socket.getsockname()[1]
        n.cancel_scope.cancel()


def _authenticated_then(send: Callable[[hs.Channel], Awaitable[None]]
                        ) -> Callable[[trio.SocketStream], Awaitable[None]]:
    """A fake node that knows the secret: handshake, then ``send`` for every request."""
    async def behave(s: trio.SocketStream) -> None:
        ch = await hs.server_handshake(s, SECRET, "fake", timeout=2)
        while True:
            await ch.recv(2)
            await send(ch)
    return behave


async def _nested_on_hello(s: trio.SocketStream) -> None:
    await s.receive_some()
    await s.send_all(nested())


# ------------------------------------------------------------------ the server


async def test_rpc_server_survives_nested_json_and_bad_requests() -> None:
    async with _rpc_server() as port:
        s = await trio.open_tcp_stream(LO, port)
        await s.send_all(nested())                     # before authentication
        assert await closed_by_peer(s)
        await s.aclose()
        client = rpc.RpcClient(SECRET, "me", [LO], port, timeout=2)
        assert await client.request({"op": "ping"}) == {"pong": True}
        for bad in ({"op": "big"}, {"op": "boom"}, {"op": [1, {"x": None}]}):
            with pytest.raises(rpc.RpcUnavailable):    # an error reply, same channel
                await client.request(bad)
        assert await client.request({"op": "ping"}) == {"pong": True}
        assert len(client._idle) == 1                  # one channel carried all of it
        ch = client._idle[0]                           # after authentication: too deep
        await ch.frames.stream.send_all(nested(5000))
        assert await closed_by_peer(ch.frames.stream)  # type: ignore[arg-type]
        await client._idle.pop().aclose()
        assert await client.request({"op": "ping"}) == {"pong": True}
        await client.aclose()


async def test_rpc_idle_flood_is_capped_and_requests_are_served() -> None:
    gate = hs.PreAuthGate("rpc test")
    async with _rpc_server(gate) as port:
        base = fd_count()
        idle = await connect_many(port, 300, ["127.0.0.2", "127.0.0.3"])
        assert await settle(lambda: gate.refused >= 300 - 2 * PREAUTH_PER_SOURCE)
        client = rpc.RpcClient(SECRET, "me", [LO], port, timeout=2)
        assert await client.request({"op": "ping"}) == {"pong": True}
        await client.aclose()
        await close_all(idle)
        assert await settle(lambda: fd_count() <= base and gate.pending == 0)


@FUZZ
@given(reqs=st.lists(json_values, min_size=1, max_size=4), garbage=wire_bytes)
def test_rpc_server_request_parsing(reqs: list[Any], garbage: bytes) -> None:
    """Any JSON value as a request gets an object back on the same channel; raw garbage
    after authentication ends that connection only."""
    async def one() -> None:
        async with _rpc_server() as port:
            stream = await trio.open_tcp_stream(LO, port)
            ch = await hs.client_handshake(stream, SECRET, "fuzz", timeout=2)
            for r in reqs:
                assert isinstance(await _ask(ch, r), dict)
            await send_quietly(stream, garbage)
            assert await closed_by_peer(stream, 3)
            await ch.aclose()
            client = rpc.RpcClient(SECRET, "me", [LO], port, timeout=2)
            assert await client.request({"op": "ping"}) == {"pong": True}
            await client.aclose()
    run(one, 20)


async def _ask(ch: hs.Channel, req: Any) -> Any:
    await ch.send(req)
    return await ch.recv(2)


@FUZZ
@given(replies=st.lists(json_values.map(lambda v: ("value", v))
                        | wire_bytes.map(lambda b: ("raw", b)), min_size=1, max_size=3))
def test_rpc_client_reply_parsing(replies: list[tuple[str, Any]]) -> None:
    """Whatever an authenticated node answers, ``request`` returns an object or raises
    RpcUnavailable: nothing else reaches the reader."""
    it = iter(replies)

    async def send(ch: hs.Channel) -> None:
        kind, v = next(it, ("raw", b""))
        if kind == "value":
            await ch.send(v)
        else:
            await send_quietly(ch.frames.stream, v)    # type: ignore[arg-type]

    async def one() -> None:
        async with _fake(_authenticated_then(send)) as port:
            client = rpc.RpcClient(SECRET, "me", [LO], port, timeout=0.5)
            for _ in replies:
                try:
                    assert isinstance(await client.request({"op": "load"}), dict)
                except rpc.RpcUnavailable:
                    pass
            await client.aclose()
    run(one, 20)


# ------------------------------------------------------------------ a mount's replicas


def _chunk() -> tuple[bytes, bytes]:
    data = os.urandom(SLOT)
    return xxhash.xxh3_128_digest(data), data


@asynccontextmanager
async def _node(name: str) -> AsyncIterator[tuple[Endpoint, Arena, NodeRecord]]:
    """A real node's vRDMA side (arena and index exported, as node.py does)."""
    geometry = Geometry.for_memory(4 * SLOT, SLOT)
    async with Endpoint(SECRET, node=name, addrs=[LO], provider="soft") as ep:
        arena_mr = ep.alloc(geometry.arena_bytes, name="arena", remote_read=True)
        index_mr = ep.alloc(geometry.index_bytes, name="index", remote_read=True)
        ep.export("arena", arena_mr)
        ep.export("index", index_mr)
        port = await ep.listen(LO)
        yield ep, Arena(geometry, arena_mr, index_mr), NodeRecord(
            name, name, [LO], port, 0, geometry.arena_bytes, geometry.nslots, SLOT,
            geometry.nbuckets)


async def _bad_info(ch: hs.Channel) -> None:
    await ch.send({"node": "fake", "nics": 5, "control": [], "incarnation": "x"})


async def _non_object(ch: hs.Channel) -> None:
    await ch.send([1, 2, 3])


async def _deep_after_auth(ch: hs.Channel) -> None:
    await ch.frames.stream.send_all(nested())


async def _bad_mac(ch: hs.Channel) -> None:
    await ch.frames.send({"m": {"ok": True}, "t": "00" * 32})


FAKES = {   # where the first replica misbehaves → how
    "vrdma: nested JSON for a hello": ("vrdma", _nested_on_hello),
    "vrdma: info that does not parse": ("vrdma", _authenticated_then(_bad_info)),
    "rpc: nested JSON for a hello": ("rpc", _nested_on_hello),
    "rpc: a reply that is not an object": ("rpc", _authenticated_then(_non_object)),
    "rpc: nested JSON after auth": ("rpc", _authenticated_then(_deep_after_auth)),
    "rpc: a reply with a bad MAC": ("rpc", _authenticated_then(_bad_mac)),
}


@pytest.mark.parametrize("case", list(FAKES))
async def test_a_misbehaving_replica_is_skipped_for_the_next(case: str) -> None:
    where, behave = FAKES[case]
    key, data = _chunk()
    async with _node("bad") as (_, _, bad), _node("good") as (_, good_arena, good), \
            _fake(behave) as fake_port, \
            Endpoint(SECRET, node="mount", addrs=[LO], provider="soft") as mount, \
            trio.open_nursery() as nursery:
        good_arena.put(key, data)                 # the bad node lacks it: asks its RPC
        bad = replace(bad, **{"port" if where == "vrdma" else "rpc_port": fake_port})
        members = SimpleNamespace(nodes={"bad": bad, "good": good},
                                  members=[bad.member(), good.member()])
        peers = Peers(mount, members, SECRET, replicas=2, slot_size=SLOT,  # type: ignore[arg-type]
                      nursery=nursery, nbuf=2, local_node="bad", rpc_timeout=2)
        assert [r.node for r in peers.order(key)] == ["bad", "good"]
        with trio.fail_after(10):
            got = await peers.read_chunk("ds", 1, 0, key, len(data))
        assert got is not None and bytes(got) == data
        assert peers.counters.unreachable == 1 and peers.counters.per_peer["good"] == SLOT
        await peers.aclose()
