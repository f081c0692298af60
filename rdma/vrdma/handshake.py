"""The vRDMA control channel: mutual HMAC-SHA256 challenge–response, then MAC'd messages.

Why it exists: an rkey is a capability.  Whoever holds ``(addr, rkey)`` *and* a QP
connected to ours can read that memory, so QPs are only ever connected through this
channel, and only after both ends proved they know the cluster's shared secret.  The
secret never crosses the wire; neither does anything from which it could be computed
offline more cheaply than brute force on HMAC-SHA256.

Wire format: every frame is a 4-byte big-endian length, then that many bytes of JSON
(≤ ``MAX_FRAME``).  After authentication each frame's JSON is ``{"m": <msg>, "t": <tag>}``
with ``tag = HMAC(K, dir ‖ seq ‖ json(msg))``: the session key ``K`` binds every later
message to this handshake, the per-direction sequence number stops replay and reordering.

::

    client                                                 server (endpoint listener)
      | HELLO  {proto, node, nonce_c}                           |
      |------------------------------------------------------->|
      |      {proto, node, nonce_s, mac_s = H(S, "srv"‖T)}     |   T = nonce_c ‖ nonce_s ‖
      |<-------------------------------------------------------|       node_c ‖ node_s
      | {mac_c = H(S, "cli"‖T)}    (client checked mac_s)      |
      |------------------------------------------------------->|
      |      {"ok": true}  (MAC'd: K = H(S, "key"‖T))          |   or close: wrong secret
      |<-------------------------------------------------------|
      | requests ⇄ replies, each MAC'd with K                  |

* The server proves first; the labels ``srv``/``cli`` differ, so a server's answer can
  never be replayed as a client's proof (reflection), and fresh nonces on both sides stop
  replays of old sessions.  Comparisons are constant time (``hmac.compare_digest``).
* A peer that fails the proof gets no information: the connection is closed (the client
  side raises :class:`~rdma.errors.AuthenticationError`).
* Every read has a deadline (``timeout``), frames are bounded, malformed JSON is a
  :class:`~rdma.errors.HandshakeError`: a hostile or slow peer costs one task for at most
  ``timeout`` seconds.
* Not provided: confidentiality.  The data path is RDMA, which is cleartext anyway.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import struct
from typing import Any

import trio

from ..errors import AuthenticationError, HandshakeError

log = logging.getLogger(__name__)

PROTO = "kspeedfs-vrdma/1"
MAX_FRAME = 1 << 20
NONCE_BYTES = 32


def _mac(key: bytes, *parts: bytes) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(struct.pack(">I", len(p)))
        h.update(p)
    return h.digest()


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def transcript(nonce_c: bytes, nonce_s: bytes, node_c: str, node_s: str) -> bytes:
    return b"".join(struct.pack(">I", len(x)) + x
                    for x in (nonce_c, nonce_s, node_c.encode(), node_s.encode()))


def server_proof(secret: bytes, t: bytes) -> bytes:
    return _mac(secret, b"srv", t)


def client_proof(secret: bytes, t: bytes) -> bytes:
    return _mac(secret, b"cli", t)


def session_key(secret: bytes, t: bytes) -> bytes:
    return _mac(secret, b"key", t)


def qp_token(key: bytes, qp_num: int) -> bytes:
    """``private_data`` a client puts on its INIT→RTR: binds the data QP connection to this
    authenticated session (the soft provider hands it to the responder QP, which checks)."""
    return _mac(key, b"qp", str(qp_num).encode())[:16]


class FrameStream:
    """Length-prefixed JSON frames over a trio stream, with a deadline per receive."""

    def __init__(self, stream: trio.abc.Stream, timeout: float) -> None:
        self.stream = stream
        self.timeout = timeout
        self._buf = bytearray()

    async def _recv_exactly(self, n: int) -> bytes:
        while len(self._buf) < n:
            chunk = await self.stream.receive_some(max(65536, n - len(self._buf)))
            if not chunk:
                raise HandshakeError("control connection closed by peer")
            self._buf += chunk
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    async def recv(self, timeout: float | None = None) -> Any:
        try:
            with trio.fail_after(self.timeout if timeout is None else timeout):
                (n,) = struct.unpack(">I", await self._recv_exactly(4))
                if n > MAX_FRAME:
                    raise HandshakeError(f"frame of {n} bytes (max {MAX_FRAME})")
                raw = await self._recv_exactly(n)
        except trio.TooSlowError as e:
            raise HandshakeError("control peer too slow", 110) from e
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            raise HandshakeError(f"control connection lost: {e}") from e
        try:
            return json.loads(raw)
        except ValueError as e:
            raise HandshakeError("malformed frame") from e

    async def send(self, obj: Any) -> None:
        raw = _dumps(obj)
        try:
            with trio.fail_after(self.timeout):
                await self.stream.send_all(struct.pack(">I", len(raw)) + raw)
        except trio.TooSlowError as e:
            raise HandshakeError("control peer not reading", 110) from e
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            raise HandshakeError(f"control connection lost: {e}") from e

    async def aclose(self) -> None:
        with trio.move_on_after(1) as cs:
            cs.shield = True
            try:
                await self.stream.aclose()
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass


class Channel:
    """An authenticated control connection: ``await send(msg)`` / ``await recv()``."""

    def __init__(self, frames: FrameStream, key: bytes, is_client: bool, peer_node: str,
                 nonce_c: bytes, nonce_s: bytes) -> None:
        self.frames = frames
        self.key = key
        self.peer_node = peer_node
        self._out_dir = b"c" if is_client else b"s"
        self._in_dir = b"s" if is_client else b"c"
        self._out_seq = 0
        self._in_seq = 0
        self.session_id = hashlib.sha256(nonce_c + nonce_s).hexdigest()[:16]

    async def send(self, msg: Any) -> None:
        body = _dumps(msg)
        tag = _mac(self.key, self._out_dir, str(self._out_seq).encode(), body)
        self._out_seq += 1
        await self.frames.send({"m": msg, "t": tag.hex()})

    async def recv(self, timeout: float | None = None) -> Any:
        frame = await self.frames.recv(timeout)
        if not isinstance(frame, dict) or "m" not in frame or not isinstance(frame.get("t"), str):
            raise HandshakeError("unauthenticated frame on an authenticated channel")
        body = _dumps(frame["m"])
        want = _mac(self.key, self._in_dir, str(self._in_seq).encode(), body)
        try:
            got = bytes.fromhex(frame["t"])
        except ValueError:
            got = b""
        if not hmac.compare_digest(want, got):
            raise AuthenticationError("bad message MAC on control channel")
        self._in_seq += 1
        return frame["m"]

    async def request(self, msg: Any, timeout: float | None = None) -> Any:
        await self.send(msg)
        reply = await self.recv(timeout)
        if isinstance(reply, dict) and "error" in reply:
            op = msg.get("op") if isinstance(msg, dict) else msg
            raise HandshakeError(f"peer refused {op!r}: {reply['error']}")
        return reply

    async def aclose(self) -> None:
        await self.frames.aclose()


def _nonce(obj: Any) -> bytes:
    try:
        n = bytes.fromhex(obj["nonce"])
    except (KeyError, TypeError, ValueError) as e:
        raise HandshakeError("hello without a valid nonce") from e
    if len(n) != NONCE_BYTES:
        raise HandshakeError("nonce of the wrong size")
    return n


def _check_proto(obj: Any) -> None:
    if not isinstance(obj, dict) or obj.get("proto") != PROTO:
        proto = obj.get("proto") if isinstance(obj, dict) else None
        raise HandshakeError(f"not a {PROTO} peer (proto={proto!r})")
    if not isinstance(obj.get("node"), str) or len(obj["node"]) > 256:
        raise HandshakeError("hello without a node name")


async def client_handshake(stream: trio.abc.Stream, secret: bytes, node: str,
                           timeout: float = 2.0) -> Channel:
    """Authenticate ``stream`` (already connected to a peer's listener) as a client."""
    fs = FrameStream(stream, timeout)
    nonce_c = os.urandom(NONCE_BYTES)
    await fs.send({"proto": PROTO, "node": node, "nonce": nonce_c.hex()})
    srv = await fs.recv()
    if isinstance(srv, dict) and "error" in srv:
        raise HandshakeError(f"peer refused the handshake: {srv['error']}")
    _check_proto(srv)
    nonce_s = _nonce(srv)
    t = transcript(nonce_c, nonce_s, node, srv["node"])
    try:
        got = bytes.fromhex(srv.get("mac", ""))
    except (TypeError, ValueError):
        got = b""
    if not hmac.compare_digest(server_proof(secret, t), got):
        raise AuthenticationError(f"peer {srv['node']!r} does not know the cluster secret")
    await fs.send({"mac": client_proof(secret, t).hex()})
    ch = Channel(fs, session_key(secret, t), True, srv["node"], nonce_c, nonce_s)
    try:
        ok = await ch.recv()
    except HandshakeError as e:
        raise AuthenticationError(f"peer {srv['node']!r} rejected our proof "
                                  f"(wrong cluster secret?)") from e
    if ok != {"ok": True}:
        raise HandshakeError(f"unexpected handshake reply {ok!r}")
    return ch


async def server_handshake(stream: trio.abc.Stream, secret: bytes, node: str,
                           timeout: float = 2.0) -> Channel:
    """Authenticate an accepted ``stream`` as the server.  Raises
    :class:`AuthenticationError` (after closing nothing: the caller closes) on a bad proof."""
    fs = FrameStream(stream, timeout)
    hello = await fs.recv()
    _check_proto(hello)
    nonce_c = _nonce(hello)
    nonce_s = os.urandom(NONCE_BYTES)
    t = transcript(nonce_c, nonce_s, hello["node"], node)
    await fs.send({"proto": PROTO, "node": node, "nonce": nonce_s.hex(),
                   "mac": server_proof(secret, t).hex()})
    proof = await fs.recv()
    try:
        got = bytes.fromhex(proof.get("mac", "")) if isinstance(proof, dict) else b""
    except (TypeError, ValueError):
        got = b""
    if not hmac.compare_digest(client_proof(secret, t), got):
        raise AuthenticationError(f"client {hello['node']!r} failed the challenge")
    ch = Channel(fs, session_key(secret, t), False, hello["node"], nonce_c, nonce_s)
    await ch.send({"ok": True})
    return ch
