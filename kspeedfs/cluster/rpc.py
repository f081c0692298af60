"""The node control RPC: the few things that need the owner's CPU (never a chunk's bytes).

Requests (JSON, one per round trip, on vRDMA's authenticated control channel —
``rdma.vrdma.handshake``: HMAC challenge–response with the cluster secret, every
message MAC'd — so only cluster members can make a node load or report anything)::

    {"op": "load", "dataset": D, "version": N, "chunk": k}  → {"ok": true, "source": "peer"|"source"|"cache"}
    {"op": "have", "dataset": D, "version": N}              → {"chunks": [k, ...]}   (preload --check)
    {"op": "stats"}                                         → node statistics

``load`` is the cache-miss path: a reader found the chunk missing in the owner's
index, so it asks the owner to fetch it (from another replica, else the source) into
its arena, then READs it one-sidedly like any hit. The bytes never travel over RPC.

A client keeps up to ``POOL`` idle channels per node and opens more under load; a
channel that fails is dropped, and the request fails with :class:`RpcUnavailable` so
the reader moves to the next replica.
"""
from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable

import trio

from rdma.errors import HandshakeError
from rdma.vrdma.dial import DialFailed, dial
from rdma.vrdma.handshake import Channel, client_handshake, server_handshake

from ..errors import KspeedfsError

log = logging.getLogger(__name__)

POOL = 4
Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class RpcUnavailable(KspeedfsError):
    """The node did not answer a control request (down, unreachable, or refused it)."""


async def serve(secret: bytes, node: str, handler: Handler, port: int, host: str = "0.0.0.0",
                *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Accept authenticated control connections on ``port`` until cancelled."""

    async def conn(stream: trio.SocketStream) -> None:
        try:
            ch = await server_handshake(stream, secret, node)
        except (HandshakeError, OSError) as e:
            log.warning("rpc: refused a connection: %s", e)
            await stream.aclose()
            return
        try:
            while True:
                req = await ch.recv(timeout=3600)
                try:
                    reply = await handler(req if isinstance(req, dict) else {})
                except KspeedfsError as e:
                    reply = {"error": str(e)}
                except Exception as e:   # a bug: answer, log, keep serving others
                    log.exception("rpc: %r failed", req)
                    reply = {"error": f"internal error: {e!r}"}
                await ch.send(reply)
        except HandshakeError:
            pass                          # the client went away
        finally:
            await ch.aclose()

    listeners = await trio.open_tcp_listeners(port, host=host)
    await trio.serve_listeners(conn, listeners, task_status=task_status)


class RpcClient:
    """Requests to one node, over a small pool of authenticated channels."""

    def __init__(self, secret: bytes, me: str, addrs: list[str], port: int,
                 timeout: float = 5.0) -> None:
        self.secret = secret
        self.me = me
        self.addrs = addrs
        self.port = port
        self.timeout = timeout
        self._idle: list[Channel] = []

    async def _open(self) -> Channel:
        async def attempt(addr: str) -> Channel:
            with trio.fail_after(min(self.timeout, 2.0)):
                stream = await trio.open_tcp_stream(addr, self.port)
            try:
                return await client_handshake(stream, self.secret, self.me)
            except BaseException:
                await stream.aclose()
                raise

        try:
            return await dial(self.addrs, attempt, close=Channel.aclose)   # every NIC at once
        except DialFailed as e:
            raise RpcUnavailable(f"no control connection to {self.addrs}:{self.port}: {e}") from None

    async def request(self, msg: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        ch = self._idle.pop() if self._idle else await self._open()
        try:
            await ch.send(msg)
            reply = await ch.recv(self.timeout if timeout is None else timeout)
        except HandshakeError as e:
            await ch.aclose()
            raise RpcUnavailable(f"{msg.get('op')} to {self.addrs}: {e}") from e
        except BaseException:
            await ch.aclose()             # cancelled mid-request: the channel is out of step
            raise
        if len(self._idle) < POOL:
            self._idle.append(ch)
        else:
            await ch.aclose()
        if not isinstance(reply, dict):
            raise RpcUnavailable(f"{msg.get('op')}: malformed reply")
        if "error" in reply:
            raise RpcUnavailable(f"{msg.get('op')} refused by {self.addrs}: {reply['error']}")
        return reply

    async def aclose(self) -> None:
        while self._idle:
            await self._idle.pop().aclose()
