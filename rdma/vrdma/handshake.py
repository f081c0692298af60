"""The vRDMA control channel: mutual HMAC-SHA256 challenge–response, then MAC'd messages.

Why it exists: an rkey is a capability.  Whoever holds ``(addr, rkey)`` *and* a QP
connected to ours can read that memory, so QPs are only ever connected through this
channel, and only after both ends proved they know the cluster's shared secret.  The
secret never crosses the wire, and nothing an *unauthenticated* party can make a node
send depends on it.

Wire format: every frame is a 4-byte big-endian length, then that many bytes of UTF-8
JSON.  After authentication each frame's JSON is ``{"m": <msg>, "t": <tag>}`` with
``tag = HMAC(K, dir ‖ seq ‖ json(msg))``: the session key ``K`` binds every later message
to this handshake, the per-direction sequence number stops replay and reordering.

::

    client                                                 server (a listener)
      | HELLO  {proto, node, nonce_c}                           |
      |------------------------------------------------------->|
      |      {proto, node, nonce_s}      (nothing keyed on S)  |   T = nonce_c ‖ nonce_s ‖
      |<-------------------------------------------------------|       node_c ‖ node_s
      | {mac_c = H(S, "cli"‖T)}                                |
      |------------------------------------------------------->|   server checks mac_c;
      |      {mac_s = H(S, "srv"‖T)}     (client checks it)    |   wrong: close, nothing sent
      |<-------------------------------------------------------|
      | requests ⇄ replies, each MAC'd with K = H(S, "key"‖T)  |

* **The client proves first** (``PROTO`` 2; 1 had the server prove first).  Anyone can
  connect to a node, and what they get back before proving anything is a random nonce
  and the node's name: no value keyed on the secret, so nothing to test secret guesses
  against offline (with protocol 1 one connection gave ``mac_s`` = a dictionary attack
  on a passphrase-like secret).  The client's ``mac_c`` does go to whoever it dialled,
  unverified; but a client only dials the addresses of node records read from etcd
  (which are signed with the cluster secret), so a server it talks to already proved
  the secret through its record.  The labels ``cli``/``srv``/``key`` differ, so no MAC
  can be reflected as another (a server's proof is never a client's), fresh nonces on
  both sides stop replays of old sessions, comparisons are constant time
  (``hmac.compare_digest``).
* A peer that fails the proof gets nothing: the connection is closed (the client side
  raises :class:`~rdma.errors.AuthenticationError`).
* Not provided: confidentiality.  The data path is RDMA, which is cleartext anyway.

Limits on what arrives from the network (a frame of deeply nested ``[`` made
``json.loads`` raise ``RecursionError``, which escaped and took a node down, and
connections sending near-1 MiB frames ran a node's memory up: docs/design.md, "The
vRDMA control channel's limits").  Every byte is parsed by :func:`decode` and one schema
per handshake message; any failure is a :class:`~rdma.errors.HandshakeError` that closes
that one connection:

* ``PREAUTH_FRAME`` = 4 KiB before authentication: the largest handshake message is the
  hello (a 256-character node name, ≤ 1.6 KB even with every character ``\\uXXXX``
  escaped).  A larger length prefix is refused before a byte of the body is read, and
  reads are sized to what the frame still needs, so an unauthenticated connection holds
  at most ~8 KiB of buffer.  ``MAX_FRAME`` = 1 MiB after authentication (a peer that
  holds the secret; the largest reply is ``have``, ~7 bytes per chunk number).
* Nesting depth: ``PREAUTH_DEPTH`` = 1 (handshake messages are flat objects, and each
  must have exactly its keys, of their types); ``MAX_DEPTH`` = 32 after authentication
  (the deepest message, ``info``, nests 5 levels: ``mrs`` → name → ``keys`` → NIC).  ``json.loads`` is
  safe against depth in CPython (its scanner raises ``RecursionError``, caught here, at
  ~970 levels); the cap is there so that nothing downstream (``json.dumps`` of the body
  for its MAC, a ``repr`` in a log line) ever meets a structure that deep.  Checking it
  costs nothing for ordinary frames: it only walks the decoded value when the frame has
  more ``[``/``{`` bytes than the cap.
* A deadline for the whole handshake (``timeout``, 2 s by default), not per read: a
  slowloris client sending one byte at a time is dropped at 2 s, and a real handshake
  is over in about a millisecond, far inside it (docs/design.md, "The vRDMA control
  channel's limits").
* :class:`PreAuthGate`, per listener: at most ``PREAUTH_PER_SOURCE`` = 32
  unauthenticated connections from one address (a further one is closed at once) and
  ``PREAUTH_TOTAL`` = 128 in all (the oldest pending handshake is then dropped for the
  new one: a real client is through in about a millisecond, an idle attacker's
  connection is what gets old). Each is one fd: a node has two listeners (vRDMA and
  RPC), so at most 256 of its 1,024 fds are ever held by unauthenticated peers (a flood
  of idle connections had taken them all).  32 from one address is above what one host's
  processes open at once (one mount: a path per NIC pair (≤ 16) plus its dials and
  kspeedfs's ``RPC_OPENING`` = 8 RPC handshakes).  Refusals are logged at most once per
  ``REFUSAL_LOG_EVERY`` = 10 s, with a count of the lines skipped.
  ``tests/rdma/test_vrdma_hostile.py`` floods both ends in one process with the caps
  lifted, so that only the frame cap bounds memory: it stays bounded while the flood is
  held, and every fd comes back when it closes (docs/design.md, "The vRDMA control
  channel's limits").
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import itertools
import json
import logging
import os
import socket
import struct
import time
from collections import Counter
from typing import Any

import trio

from ..errors import AuthenticationError, HandshakeError
from ..tuning import PREAUTH_PER_SOURCE, PREAUTH_TOTAL, REFUSAL_LOG_EVERY

log = logging.getLogger(__name__)

PROTO = "kspeedfs-vrdma/2"
MAX_FRAME = 1 << 20          #: authenticated frames
PREAUTH_FRAME = 4 << 10      #: frames before the peer proved the secret
MAX_DEPTH = 32               #: JSON nesting of an authenticated message (inside {"m", "t"})
PREAUTH_DEPTH = 1            #: handshake messages are flat objects
NONCE_BYTES = 32
MAC_BYTES = 32
NODE_NAME_MAX = 256


def _mac(key: bytes, *parts: bytes) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(struct.pack(">I", len(p)))
        h.update(p)
    return h.digest()


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def _depth_exceeds(obj: Any, limit: int) -> bool:
    """Whether containers nest more than ``limit`` deep (``{}`` is 1), without recursion."""
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        children = o.values() if isinstance(o, dict) else o
        if d > limit:
            return True
        stack.extend((c, d + 1) for c in children if isinstance(c, (dict, list)))
    return False


def decode(raw: bytes, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value of one frame's body; :class:`HandshakeError` for anything that is
    not UTF-8 JSON nested at most ``max_depth`` deep (never another exception)."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError, TypeError, MemoryError) as e:  # UnicodeDecodeError
        raise HandshakeError(f"malformed frame: {type(e).__name__}") from None  # is a ValueError
    if (isinstance(obj, (dict, list)) and raw.count(b"[") + raw.count(b"{") > max_depth
            and _depth_exceeds(obj, max_depth)):
        raise HandshakeError(f"frame nested deeper than {max_depth}")
    return obj


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
    """Length-prefixed JSON frames over a trio stream, with a deadline per receive.

    Starts with the pre-authentication limits (``PREAUTH_FRAME``, ``PREAUTH_DEPTH``);
    :class:`Channel` raises them to ``MAX_FRAME``/``MAX_DEPTH`` once the peer is proven."""

    def __init__(self, stream: trio.abc.Stream, timeout: float) -> None:
        self.stream = stream
        self.timeout = timeout
        self.max_frame = PREAUTH_FRAME
        self.max_depth = PREAUTH_DEPTH
        self._buf = bytearray()

    async def _recv_exactly(self, n: int) -> bytes:
        while len(self._buf) < n:
            chunk = await self.stream.receive_some(max(n - len(self._buf), 4096))
            if not chunk:
                raise HandshakeError("control connection closed by peer", errno.ECONNRESET)
            self._buf += chunk
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    async def recv(self, timeout: float | None = None) -> Any:
        try:
            with trio.fail_after(self.timeout if timeout is None else timeout):
                (n,) = struct.unpack(">I", await self._recv_exactly(4))
                if n > self.max_frame:
                    raise HandshakeError(f"frame of {n} bytes (max {self.max_frame})",
                                         errno.EMSGSIZE)
                raw = await self._recv_exactly(n)
        except trio.TooSlowError as e:
            raise HandshakeError("control peer too slow", errno.ETIMEDOUT) from e
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            raise HandshakeError(f"control connection lost: {e}") from e
        return decode(raw, self.max_depth)

    async def send(self, obj: Any) -> None:
        raw = _dumps(obj)
        if len(raw) > MAX_FRAME:
            raise HandshakeError(f"frame of {len(raw)} bytes not sent (max {MAX_FRAME})",
                                 errno.EMSGSIZE)
        try:
            with trio.fail_after(self.timeout):
                await self.stream.send_all(struct.pack(">I", len(raw)) + raw)
        except trio.TooSlowError as e:
            raise HandshakeError("control peer not reading", errno.ETIMEDOUT) from e
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            raise HandshakeError(f"control connection lost: {e}") from e

    async def aclose(self) -> None:
        self._buf = bytearray()
        await aclose_quietly(self.stream)


def keepalive(stream: trio.SocketStream) -> None:
    """TCP options of every control connection, both ends: keepalive probes that give up
    within a few seconds (a server's lease of a client that vanished without a FIN is
    reaped by them) and no Nagle delay on the small request/reply frames."""
    sock = stream.socket
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 2)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 5000)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (OSError, AttributeError):  # pragma: no cover - non-Linux
        pass


async def aclose_quietly(stream: trio.abc.AsyncResource) -> None:
    """Close ``stream`` within 1 s, even when cancelled, whatever state it is in."""
    with trio.move_on_after(1) as cs:
        cs.shield = True
        try:
            await stream.aclose()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass


class Channel:
    """An authenticated control connection: ``await send(msg)`` / ``await recv()``.

    ``recv`` returns a decoded JSON value or raises :class:`HandshakeError` (its subclass
    :class:`AuthenticationError` for a bad tag): what the message *means* is the caller's
    to check, as with any peer input."""

    def __init__(self, frames: FrameStream, key: bytes, is_client: bool, peer_node: str,
                 nonce_c: bytes, nonce_s: bytes) -> None:
        self.frames = frames
        frames.max_frame = MAX_FRAME
        frames.max_depth = MAX_DEPTH + 1            # the {"m", "t"} envelope
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
        await self.frames.send({"m": msg, "t": tag.hex()})
        self._out_seq += 1                  # not before: a refused (too large) frame

    async def recv(self, timeout: float | None = None) -> Any:
        frame = await self.frames.recv(timeout)
        if not isinstance(frame, dict) or set(frame) != {"m", "t"} \
                or not isinstance(frame["t"], str):
            raise HandshakeError("unauthenticated frame on an authenticated channel")
        body = _dumps(frame["m"])
        want = _mac(self.key, self._in_dir, str(self._in_seq).encode(), body)
        if not hmac.compare_digest(want, _unhex(frame["t"])):
            raise AuthenticationError("bad message MAC on control channel")
        self._in_seq += 1
        return frame["m"]

    async def request(self, msg: Any, timeout: float | None = None) -> Any:
        await self.send(msg)
        reply = await self.recv(timeout)
        if isinstance(reply, dict) and "error" in reply:
            op = msg.get("op") if isinstance(msg, dict) else msg
            raise HandshakeError(f"peer refused {op!r}: {str(reply['error'])[:200]}")
        return reply

    async def aclose(self) -> None:
        await self.frames.aclose()


def _unhex(s: str) -> bytes:
    try:
        return bytes.fromhex(s)
    except ValueError:
        return b""


def _message(obj: Any, what: str, **fields: type) -> dict[str, Any]:
    """``obj`` if it is an object with exactly ``fields`` (name → type), else
    HandshakeError: each handshake message has one schema, nothing else is accepted."""
    if isinstance(obj, dict) and obj.get("proto", PROTO) != PROTO and "proto" in fields:
        raise HandshakeError(f"not a {PROTO} peer (proto={str(obj['proto'])[:40]!r})")
    if not isinstance(obj, dict) or set(obj) != set(fields) \
            or not all(isinstance(obj[k], t) for k, t in fields.items()):
        raise HandshakeError(f"malformed {what}")
    if "node" in obj:
        node = obj["node"]
        if not 0 < len(node) <= NODE_NAME_MAX or not node.isprintable():
            raise HandshakeError(f"{what} with an invalid node name")
    return obj


def _hex_field(obj: dict[str, Any], key: str, size: int) -> bytes:
    b = _unhex(obj[key])
    if len(b) != size:
        raise HandshakeError(f"{key} of the wrong size")
    return b


def _hello(obj: Any, what: str) -> tuple[str, bytes]:
    msg = _message(obj, what, proto=str, node=str, nonce=str)
    return msg["node"], _hex_field(msg, "nonce", NONCE_BYTES)


def _proof(obj: Any, what: str) -> bytes:
    return _hex_field(_message(obj, what, mac=str), "mac", MAC_BYTES)


def _deadline(timeout: float) -> HandshakeError:
    return HandshakeError(f"handshake not finished within {timeout} s", errno.ETIMEDOUT)


async def client_handshake(stream: trio.abc.Stream, secret: bytes, node: str,
                           timeout: float = 2.0) -> Channel:
    """Authenticate ``stream`` (already connected to a peer's listener) as a client, all
    within ``timeout`` seconds."""
    try:
        with trio.fail_after(timeout):
            fs = FrameStream(stream, timeout)
            nonce_c = os.urandom(NONCE_BYTES)
            await fs.send({"proto": PROTO, "node": node, "nonce": nonce_c.hex()})
            peer, nonce_s = _hello(await fs.recv(), "server hello")
            t = transcript(nonce_c, nonce_s, node, peer)
            await fs.send({"mac": client_proof(secret, t).hex()})
            try:
                got = _proof(await fs.recv(), "server proof")
            except HandshakeError as e:
                if e.errno != errno.ECONNRESET:      # the server closes on a bad proof
                    raise
                raise AuthenticationError(f"peer {peer!r} rejected our proof "
                                          f"(wrong cluster secret?)") from e
            if not hmac.compare_digest(server_proof(secret, t), got):
                raise AuthenticationError(f"peer {peer!r} does not know the cluster secret")
            return Channel(fs, session_key(secret, t), True, peer, nonce_c, nonce_s)
    except trio.TooSlowError:
        raise _deadline(timeout) from None


async def server_handshake(stream: trio.abc.Stream, secret: bytes, node: str,
                           timeout: float = 2.0) -> Channel:
    """Authenticate an accepted ``stream`` as the server, all within ``timeout`` seconds.
    Raises :class:`AuthenticationError` (after sending nothing: the caller closes) on a
    bad proof, :class:`HandshakeError` on anything else."""
    try:
        with trio.fail_after(timeout):
            fs = FrameStream(stream, timeout)
            peer, nonce_c = _hello(await fs.recv(), "hello")
            nonce_s = os.urandom(NONCE_BYTES)
            t = transcript(nonce_c, nonce_s, peer, node)
            await fs.send({"proto": PROTO, "node": node, "nonce": nonce_s.hex()})
            got = _proof(await fs.recv(), "client proof")
            if not hmac.compare_digest(client_proof(secret, t), got):
                raise AuthenticationError(f"client {peer!r} failed the challenge")
            await fs.send({"mac": server_proof(secret, t).hex()})
            return Channel(fs, session_key(secret, t), False, peer, nonce_c, nonce_s)
    except trio.TooSlowError:
        raise _deadline(timeout) from None


class _Throttled:
    """A log line at most once per ``every`` seconds; the next one counts the skipped."""

    def __init__(self, level: int, every: float) -> None:
        self.level, self.every = level, every
        self._next = 0.0
        self._skipped = 0

    def __call__(self, fmt: str, *args: Any) -> None:
        now = time.monotonic()
        if now < self._next:
            self._skipped += 1
            return
        if self._skipped:
            fmt, args = fmt + " (and %d more since)", (*args, self._skipped)
        self._next, self._skipped = now + self.every, 0
        log.log(self.level, fmt, *args)


class PreAuthGate:
    """Admission of unauthenticated connections for one listener (see the module
    docstring): ``per_source`` from one address, ``total`` in all; counters for stats."""

    def __init__(self, name: str, per_source: int = PREAUTH_PER_SOURCE, total: int = PREAUTH_TOTAL,
                 log_every: float = REFUSAL_LOG_EVERY) -> None:
        self.name = name
        self.per_source, self.total = per_source, total
        self._pending: dict[int, tuple[str, trio.CancelScope]] = {}   # oldest first
        self._by_source: Counter[str] = Counter()
        self._ids = itertools.count()
        self.refused = self.evicted = self.failed = 0
        self._warn = _Throttled(logging.WARNING, log_every)
        self._info = _Throttled(logging.INFO, log_every)

    @property
    def pending(self) -> int:
        """Connections in their handshake now."""
        return len(self._pending)

    def _enter(self, source: str) -> tuple[int, trio.CancelScope] | None:
        if self._by_source[source] >= self.per_source:
            self.refused += 1
            self._warn("%s: refused a connection from %s: %d unauthenticated connections "
                       "from it already", self.name, source, self.per_source)
            return None
        if len(self._pending) >= self.total:
            oldest = next(iter(self._pending))
            self._leave(oldest)[1].cancel()
            self.evicted += 1
            self._warn("%s: %d unauthenticated connections: dropped the oldest for one "
                       "from %s", self.name, self.total, source)
        token, scope = next(self._ids), trio.CancelScope()
        self._pending[token] = (source, scope)
        self._by_source[source] += 1
        return token, scope

    def _leave(self, token: int) -> tuple[str, trio.CancelScope]:
        source, scope = self._pending.pop(token)
        self._by_source[source] -= 1
        if not self._by_source[source]:
            del self._by_source[source]
        return source, scope

    async def accept(self, stream: trio.SocketStream, secret: bytes, node: str,
                     timeout: float = 2.0) -> Channel | None:
        """:func:`server_handshake` on an accepted connection, under the caps.  Returns
        the channel, or None once the connection is refused and closed; never raises
        (but Cancelled), so a bad client cannot end the accept loop."""
        try:
            source = str(stream.socket.getpeername()[0])
        except (OSError, AttributeError, IndexError, TypeError):
            source = "?"
        entered = self._enter(source)
        if entered is None:
            await aclose_quietly(stream)
            return None
        token, scope = entered
        try:
            with scope:
                return await server_handshake(stream, secret, node, timeout)
            why = "dropped (too many unauthenticated connections)"
        except HandshakeError as e:
            self.failed += 1
            why = e.msg
        except Exception as e:   # a bug here must not take the listener down
            self.failed += 1
            why = repr(e)
            log.exception("%s: handshake with %s failed unexpectedly", self.name, source)
        finally:
            if token in self._pending:
                self._leave(token)
        self._info("%s: refused a control connection from %s: %s", self.name, source, why)
        await aclose_quietly(stream)
        return None
