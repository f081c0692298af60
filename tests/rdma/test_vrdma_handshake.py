"""vRDMA control channel: challenge–response with the shared secret, over real loopback TCP.

Hostile peers: wrong secret (either side), tampered and replayed messages, garbage, an
oversized frame, a peer that never answers.  None of them gets an authenticated channel,
and the secret never appears on the wire.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

from rdma.errors import AuthenticationError, HandshakeError
from rdma.vrdma import handshake as hs

SECRET = b"cluster-secret-0123456789"


async def _pair(server_fn: Callable[[trio.SocketStream], Awaitable[Any]],
                client_fn: Callable[[trio.SocketStream], Awaitable[Any]]) -> tuple[Any, Any]:
    """Run ``server_fn`` on an accepted loopback connection and ``client_fn`` on the
    connecting side; return both results (exceptions are returned, not raised)."""
    results: dict[str, Any] = {}

    async def run(key: str, fn: Callable[[trio.SocketStream], Awaitable[Any]],
                  stream: trio.SocketStream) -> None:
        try:
            results[key] = await fn(stream)
        except Exception as e:  # noqa: BLE001
            results[key] = e
        finally:
            await stream.aclose()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        client = await trio.open_tcp_stream("127.0.0.1", port)
        server = await listeners[0].accept()
        nursery.start_soon(run, "s", server_fn, server)
        nursery.start_soon(run, "c", client_fn, client)
    await listeners[0].aclose()
    return results["s"], results["c"]


async def test_right_secret_gives_an_authenticated_channel_both_ways() -> None:
    async def server(s: trio.SocketStream) -> Any:
        ch = await hs.server_handshake(s, SECRET, "B", timeout=2)
        msg = await ch.recv()
        await ch.send({"echo": msg})
        return ch

    async def client(s: trio.SocketStream) -> Any:
        ch = await hs.client_handshake(s, SECRET, "A", timeout=2)
        return ch, await ch.request({"op": "x", "n": 1})

    sch, (cch, reply) = await _pair(server, client)
    assert reply == {"echo": {"op": "x", "n": 1}}
    assert sch.key == cch.key and sch.session_id == cch.session_id
    assert sch.peer_node == "A" and cch.peer_node == "B"


@pytest.mark.parametrize("who", ["client", "server"])
async def test_wrong_secret_is_refused(who: str) -> None:
    cs = b"wrong" if who == "client" else SECRET
    ss = b"wrong" if who == "server" else SECRET
    s_res, c_res = await _pair(lambda s: hs.server_handshake(s, ss, "B", timeout=2),
                               lambda s: hs.client_handshake(s, cs, "A", timeout=2))
    # The server checks the client's proof first, with its own secret: a mismatch either
    # way ends there, and the server never sends a proof (it closes: the client's error).
    assert isinstance(c_res, AuthenticationError), c_res
    assert isinstance(s_res, HandshakeError), s_res


async def test_client_proof_without_the_secret_is_refused() -> None:
    async def guessing_client(s: trio.SocketStream) -> Any:
        fs = hs.FrameStream(s, 2)
        await fs.send({"proto": hs.PROTO, "node": "mallory", "nonce": "22" * 32})
        srv = await fs.recv()
        t = hs.transcript(b"\x22" * 32, bytes.fromhex(srv["nonce"]), "mallory", "B")
        await fs.send({"mac": hs.client_proof(b"guess", t).hex()})
        with trio.move_on_after(0.5):
            return await fs.recv()

    s_res, c_res = await _pair(lambda s: hs.server_handshake(s, SECRET, "B", timeout=2),
                               guessing_client)
    assert isinstance(s_res, AuthenticationError), s_res
    assert isinstance(c_res, HandshakeError), c_res      # closed: nothing learned


async def test_secret_never_on_the_wire() -> None:
    seen = bytearray()

    async def sniffing_client(s: trio.SocketStream) -> Any:
        class Tap(trio.abc.Stream):
            async def send_all(self, data: bytes) -> None:
                seen.extend(data)
                await s.send_all(data)

            async def receive_some(self, max_bytes: int | None = None) -> bytes:
                data = await s.receive_some(max_bytes)
                seen.extend(data)
                return data

            async def wait_send_all_might_not_block(self) -> None:
                await s.wait_send_all_might_not_block()

            async def aclose(self) -> None:
                await s.aclose()

        ch = await hs.client_handshake(Tap(), SECRET, "A", timeout=2)
        await ch.send({"op": "bye"})

    async def server(s: trio.SocketStream) -> Any:
        ch = await hs.server_handshake(s, SECRET, "B", timeout=2)
        return await ch.recv()

    s_res, c_res = await _pair(server, sniffing_client)
    assert s_res == {"op": "bye"}
    assert SECRET not in bytes(seen) and SECRET.hex().encode() not in bytes(seen)


async def test_reflection_and_tampering() -> None:
    t = hs.transcript(b"a" * 32, b"b" * 32, "A", "B")
    assert hs.server_proof(SECRET, t) != hs.client_proof(SECRET, t)

    async def server(s: trio.SocketStream) -> Any:
        ch = await hs.server_handshake(s, SECRET, "B", timeout=2)
        return await ch.recv()

    async def tampering_client(s: trio.SocketStream) -> Any:
        ch = await hs.client_handshake(s, SECRET, "A", timeout=2)
        # a valid frame for another message: MAC over {"op": "info"}, body {"op": "path"}
        body = {"op": "info"}
        tag = hs._mac(ch.key, b"c", b"0", hs._dumps(body))
        await ch.frames.send({"m": {"op": "path"}, "t": tag.hex()})

    s_res, _ = await _pair(server, tampering_client)
    assert isinstance(s_res, AuthenticationError)


async def test_replayed_message_is_refused() -> None:
    async def server(s: trio.SocketStream) -> Any:
        ch = await hs.server_handshake(s, SECRET, "B", timeout=2)
        first = await ch.recv()
        try:
            await ch.recv()
        except AuthenticationError as e:
            return first, e
        return first, None

    async def replaying_client(s: trio.SocketStream) -> Any:
        ch = await hs.client_handshake(s, SECRET, "A", timeout=2)
        body = {"op": "info"}
        frame = {"m": body, "t": hs._mac(ch.key, b"c", b"0", hs._dumps(body)).hex()}
        await ch.frames.send(frame)
        await ch.frames.send(frame)          # same frame again: seq 1 expected

    (first, err), _ = await _pair(server, replaying_client)
    assert first == {"op": "info"} and isinstance(err, AuthenticationError)


def _raw(obj: Any) -> bytes:
    b = json.dumps(obj).encode()
    return struct.pack(">I", len(b)) + b


@pytest.mark.parametrize("payload", [
    b"GET / HTTP/1.0\r\n\r\n",                                   # not our protocol
    struct.pack(">I", 1 << 30),                                  # oversized frame
    _raw({"proto": "kspeedfs-vrdma/0", "node": "x", "nonce": "00" * 32}),   # version
    _raw({"proto": hs.PROTO, "node": "x", "nonce": "zz"}),       # bad nonce
    _raw([1, 2, 3]),                                             # not an object
    b"",                                                         # silent peer
])
async def test_hostile_hello_is_refused_quickly(payload: bytes) -> None:
    async def server(s: trio.SocketStream) -> Any:
        return await hs.server_handshake(s, SECRET, "B", timeout=0.3)

    async def hostile(s: trio.SocketStream) -> Any:
        await s.send_all(payload)
        with trio.move_on_after(1):
            await s.receive_some()

    with trio.fail_after(3):
        s_res, _ = await _pair(server, hostile)
    assert isinstance(s_res, HandshakeError), s_res


async def test_client_with_forged_server_proof_is_refused() -> None:
    async def fake_server(s: trio.SocketStream) -> Any:
        fs = hs.FrameStream(s, 2)
        await fs.recv()
        await fs.send({"proto": hs.PROTO, "node": "B", "nonce": "11" * 32})
        proof = await fs.recv()
        await fs.send({"mac": "00" * 32})
        return proof

    s_res, c_res = await _pair(fake_server,
                               lambda s: hs.client_handshake(s, SECRET, "A", timeout=2))
    assert isinstance(c_res, AuthenticationError)
    assert set(s_res) == {"mac"}    # the client proves first (the dialled node is in etcd)


async def test_an_unauthenticated_client_gets_nothing_keyed_on_the_secret() -> None:
    async def curious_client(s: trio.SocketStream) -> Any:
        fs = hs.FrameStream(s, 2)
        await fs.send({"proto": hs.PROTO, "node": "mallory", "nonce": "22" * 32})
        return await fs.recv()

    s_res, srv = await _pair(lambda s: hs.server_handshake(s, SECRET, "B", timeout=0.3),
                             curious_client)
    assert set(srv) == {"proto", "node", "nonce"}       # no MAC: nothing to test guesses on
    assert isinstance(s_res, HandshakeError)
