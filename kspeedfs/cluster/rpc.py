"""The node control RPC: the few things that need the owner's CPU (never a chunk's bytes).

Requests (JSON, one per round trip, on vRDMA's authenticated control channel —
``rdma.vrdma.handshake``: HMAC challenge–response with the cluster secret, every
message MAC'd — so only cluster members can make a node load or report anything)::

    {"op": "load", "dataset": D, "version": N, "chunk": k}  → {"ok": true, "source": "peer"|"source"|"cache"}
    {"op": "have", "dataset": D, "version": N}              → {"chunks": [k, ...]}   (preload --check)
    {"op": "page", "hash": H}                               → {"page": base64 of zlib} | {"absent": true}
    {"op": "stats"}                                         → node statistics

``load`` is the cache-miss path: a reader found the chunk missing in the owner's
index, so it asks the owner to fetch it (from another replica, else the source) into
its arena, then READs it one-sidedly like any hit. The bytes never travel over RPC.
``page`` is the exception, and small: one manifest page file (``cluster/page_copy.py``,
at most ``PAGE_REPLY_MAX`` zlib'd bytes), which the asker verifies against its hash.

A client keeps up to ``RPC_POOL`` idle channels per node and opens more under load (at most
``RPC_OPENING`` = 8 handshakes at once, well under a server's 32 unauthenticated connections
per source address); a channel that fails is dropped, and the request fails with
:class:`RpcUnavailable` so the reader moves to the next replica.

Hostile input.  Before authentication the server holds every connection to
the limits of :class:`~rdma.vrdma.handshake.PreAuthGate` (frames ≤ 4 KiB and flat, the
whole handshake in 2 s, 32 unauthenticated connections per source address and 128 in
all); whatever a client sends, only its own connection is closed.  After it, a request
is any JSON value ≤ 1 MiB nested ≤ 32 deep: one that is not an object is answered as
``{}`` (an unknown op), a handler's exception becomes an ``error`` reply, a reply too
large for a frame becomes an ``error`` reply.  On the client, everything a node can get
wrong — refusing the handshake, a wrong secret, a malformed, oversized, deep or non-object
reply, a bad MAC, silence — is :class:`RpcUnavailable`, which the reader treats as a
failed replica.
"""
from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from rdma.errors import AuthenticationError, HandshakeError
from rdma.vrdma.dial import DialFailed, dial
from rdma.vrdma.handshake import Channel, PreAuthGate, aclose_quietly, client_handshake

from ..errors import KspeedfsError
from ..tuning import RPC_OPENING, RPC_POOL

log = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class RpcUnavailable(KspeedfsError):
    """The node did not answer a control request (down, unreachable, or refused it)."""


async def serve(secret: bytes, node: str, handler: Handler, port: int, host: str = "0.0.0.0",
                *, gate: PreAuthGate | None = None,
                task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Accept authenticated control connections on ``port`` until cancelled.  ``gate``:
    the caps on unauthenticated connections (default: ``PreAuthGate``'s)."""
    gate = gate or PreAuthGate(f"rpc {node}")

    async def conn(stream: trio.SocketStream) -> None:
        ch = await gate.accept(stream, secret, node)
        if ch is None:
            return
        try:
            while True:
                req = await ch.recv(timeout=3600)
                reply = await _answer(handler, req if isinstance(req, dict) else {})
                try:
                    await ch.send(reply)
                except HandshakeError as e:
                    if e.errno != errno.EMSGSIZE:
                        raise
                    await ch.send({"error": e.msg})
        except HandshakeError:
            pass                          # the client went away, or sent a bad frame
        except Exception:                 # a bug: drop this client, keep serving others
            log.exception("rpc: connection from %s failed", ch.peer_node)
        finally:
            await ch.aclose()

    listeners = await trio.open_tcp_listeners(port, host=host)
    await trio.serve_listeners(conn, listeners, task_status=task_status)


async def _answer(handler: Handler, req: dict[str, Any]) -> dict[str, Any]:
    try:
        return await handler(req)
    except KspeedfsError as e:
        return {"error": str(e)}
    except Exception as e:   # a bug: answer, log, keep serving others
        log.exception("rpc: %.200r failed", req)
        return {"error": f"internal error: {e!r}"}


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
        self._opening = trio.Semaphore(RPC_OPENING)

    async def _open(self) -> Channel:
        async def attempt(addr: str) -> Channel:
            with trio.fail_after(min(self.timeout, 2.0)):
                stream = await trio.open_tcp_stream(addr, self.port)
            try:
                return await client_handshake(stream, self.secret, self.me)
            except BaseException:
                await aclose_quietly(stream)
                raise

        async with self._opening:
            if self._idle:                # another request's channel came back meanwhile
                return self._idle.pop()
            try:
                return await dial(self.addrs, attempt, close=Channel.aclose)  # every NIC at once
            except DialFailed as e:
                raise RpcUnavailable(f"no control connection to {self.addrs}:{self.port}: "
                                     f"{e}") from None
            except AuthenticationError as e:
                raise RpcUnavailable(f"{self.addrs}:{self.port} refused us: {e}") from e

    async def request(self, msg: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """The node's reply (a JSON object); :class:`RpcUnavailable` for anything else."""
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
        if len(self._idle) < RPC_POOL:
            self._idle.append(ch)
        else:
            await ch.aclose()
        if not isinstance(reply, dict):
            raise RpcUnavailable(f"{msg.get('op')}: malformed reply")
        if "error" in reply:
            raise RpcUnavailable(f"{msg.get('op')} refused by {self.addrs}: "
                                 f"{str(reply['error'])[:200]}")
        return reply

    async def aclose(self) -> None:
        while self._idle:
            await self._idle.pop().aclose()
