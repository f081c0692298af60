"""The responder side of an endpoint: its listener, and the peer's half of every path.

::

    Responder.listen()            TCP, all NICs, in the endpoint's nursery
      └─ one task per control connection: handshake under ``gate``, then
           "info"  ─► the endpoint's info (NICs, incarnation, heartbeat words, vMRs)
           "path"  ─► create our QP, exchange ConnInfos, check the session token,
                      connect, then hold the *lease*: the connection stays open as long as
                      the client's path does; when it closes, our QP is destroyed

Nothing happens here per READ: the provider serves one-sided READs.  The listener only
creates, connects and destroys QPs, so a peer that is not authenticated never gets a QP
connected to ours, and an rkey alone reads nothing.  A served QP is connected only after
the control channel authenticated the client, and it stays in INIT (serving nothing)
until the connection that attached to it carried the session's token (``private_data`` =
HMAC(session key, client QPN)); a connection that raced the client onto it is refused and
the QP destroyed.

Before a client is authenticated, its connection is held to the limits of
:mod:`.handshake` (frames ≤ 4 KiB and flat, the whole handshake within
``handshake_timeout``, at most 32 such connections per source address and 128 in all:
``Responder.gate``); any failure closes that one connection, never the listener.

Leases are keyed ``(client node, vqp, path)``: a client that rebuilds a path while its old
control connection is stuck on a dead NIC replaces the old lease; TCP keepalive (a few
seconds, :func:`.handshake.keepalive`) reaps leases of clients that vanished without a FIN.
"""
from __future__ import annotations

import hmac
import logging
import math
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import trio

from ..api import ConnInfo, QPAttr, QPCap, QPInitAttr
from ..enums import IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_READ
from ..errors import HandshakeError, RdmaError
from .handshake import Channel, PreAuthGate, keepalive, qp_token
from .heartbeat import HeartbeatConfig
from .nic import LocalNIC

#: the endpoint's log lines keep the logger name they always had (operators filter on it)
log = logging.getLogger("rdma.vrdma.endpoint")


class Responder:
    """Accepts and serves the control connections of one endpoint.

    Contract: :meth:`listen` starts the accept loop in the nursery it is given (the
    endpoint's), and every connection's task runs there; cancelling that nursery ends them
    all and destroys every served QP.  Nothing a client sends ends the accept loop: a
    failure closes that client's connection only.

    Attributes:
        node: the endpoint's name in handshakes and logs.
        gate: the caps on unauthenticated control connections (:class:`PreAuthGate`).
        listening: ``(host, port)`` of the listener once :meth:`listen` ran.
        refused: connections refused (by the gate, or a path whose QP a stranger took).

    Seams to the endpoint: ``nics`` (address → :class:`LocalNIC`, read at each request)
    and ``info()`` (the ``info`` reply, sent again with every served path).
    """

    def __init__(self, secret: bytes, node: str, cfg: HeartbeatConfig,
                 handshake_timeout: float, nics: Mapping[str, LocalNIC],
                 info: Callable[[], dict[str, Any]]) -> None:
        self._secret = secret
        self.node = node
        self._cfg = cfg
        self._handshake_timeout = handshake_timeout
        self._nics = nics
        self._info = info
        self.gate = PreAuthGate(f"endpoint {node}")
        self.listening: list[tuple[str, int]] = []
        self.refused = 0
        #: served paths: (client node, vqp, path) → (lease scope, our QP)
        self._leases: dict[tuple[str, str, int], tuple[trio.CancelScope, Any]] = {}

    @property
    def leases(self) -> int:
        """Paths served now."""
        return len(self._leases)

    def served_qp_nums(self) -> list[int]:
        """QPNs of the QPs served to peers (tests, diagnostics)."""
        return [qp.qp_num for _, qp in self._leases.values() if not qp.closed]

    async def listen(self, nursery: trio.Nursery, host: str, port: int) -> int:
        """Start accepting control connections in ``nursery``; returns the TCP port."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        self.listening = [(host, ln.socket.getsockname()[1]) for ln in listeners]
        await nursery.start(trio.serve_listeners, self._serve_conn, listeners)
        return self.listening[0][1]

    async def _serve_conn(self, stream: trio.SocketStream) -> None:
        """One control connection: the handshake under ``self.gate`` (its caps, deadline
        and frame limits: :mod:`.handshake`), then ``info``/``path`` requests."""
        keepalive(stream)
        try:
            host, port = stream.socket.getpeername()[:2]
            peer = f"{host}:{port}"
        except OSError:
            peer = "?"
        ch = await self.gate.accept(stream, self._secret, self.node, self._handshake_timeout)
        if ch is None:
            self.refused += 1
            return
        try:
            while True:
                msg = await ch.recv(timeout=math.inf)
                op = msg.get("op") if isinstance(msg, dict) else None
                if op == "info":
                    await ch.send(self._info())
                elif op == "path":
                    await self._serve_path(ch, msg)
                    return
                else:
                    await ch.send({"error": f"unknown op {op!r}"})
        except HandshakeError as e:
            log.debug("endpoint %s: control connection from %s ended: %s", self.node, peer, e)
        except Exception as e:  # an authenticated peer sent nonsense: drop it, keep serving
            log.warning("endpoint %s: control connection from %s (%s) failed: %r", self.node,
                        peer, ch.peer_node, e)
            log.debug("exception information", exc_info=True)
        finally:
            await ch.aclose()

    async def _serve_path(self, ch: Channel, msg: dict[str, Any]) -> None:
        """Create and connect our half of one path, then hold it until the control
        connection (the lease) closes or the same path is rebuilt over a new one."""
        try:
            key = (ch.peer_node, str(msg["vqp"]), int(msg["path"]))
            nic = self._nics[str(msg["nic"])]
            remote = ConnInfo.from_dict(msg["conn"])
        except (KeyError, TypeError, ValueError) as e:
            await ch.send({"error": f"bad path request: {e!r}"})
            return
        old = self._leases.pop(key, None)
        if old is not None:
            old[0].cancel()
        cq = nic.ctx.create_cq(16)
        qp = None
        lease: trio.CancelScope | None = None
        try:
            qp = nic.pd.create_qp(QPInitAttr(send_cq=cq, cap=QPCap(max_send_wr=4,
                                                                   max_recv_wr=1)))
            # Our QP waits in INIT (it serves nothing before RTR) while the client
            # connects to it; only once the connection that attached is proven to be the
            # authenticated client's (its private_data token) does our QP go to RTR/RTS.
            qp.to_init(QPAttr(qp_access_flags=IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ))
            expect = getattr(qp, "expect_peer", None)  # soft: other HELLOs refused at once
            if expect is not None:
                expect(remote, qp_token(ch.key, remote.qp_num))
            info = qp.local_info()
            await ch.send({**self._info(), "conn": info.to_dict()})
            ready = await ch.recv()
            if ready != {"op": "ready"}:
                raise HandshakeError(f"expected ready, got {ready!r}")
            if not await self._token_ok(qp, qp_token(ch.key, remote.qp_num)):
                self.refused += 1
                log.info("endpoint %s: path %s: the connection attached to QP %#x is not "
                         "%s's; refused", self.node, key, qp.qp_num, ch.peer_node)
                await ch.send({"error": "QP connection not bound to this session"})
                return
            rd = nic.rd_atomic()
            await trio.to_thread.run_sync(partial(
                qp.connect, remote, max_rd_atomic=rd, max_dest_rd_atomic=rd,
                timeout=self._cfg.qp_timeout_exp, retry_cnt=self._cfg.qp_retry_cnt,
                timeout_ms=self._cfg.qp_timeout_ms))
            await ch.send({"ok": True})
            lease = trio.CancelScope()
            with lease:
                self._leases[key] = (lease, qp)
                log.debug("endpoint %s: path %s up for %s", self.node, key, ch.peer_node)
                try:
                    while True:       # the lease: held until the client closes it
                        await ch.recv(timeout=math.inf)
                except HandshakeError:
                    pass
        except (RdmaError, OSError) as e:
            log.info("endpoint %s: path %s for %s failed: %s", self.node, msg.get("path"),
                     ch.peer_node, e)
        finally:
            if lease is not None and self._leases.get(key, (None,))[0] is lease:
                del self._leases[key]
            for obj in (qp, cq):
                if obj is not None:
                    try:
                        obj.close()
                    except Exception:
                        log.debug("close %r", obj, exc_info=True)

    async def _token_ok(self, qp: Any, want: bytes) -> bool:
        """The client's INIT→RTR private_data must be this session's token for its QP.
        Providers without a private_data channel (verbs) report None: nothing to check,
        the QP is then bound to the authenticated peer by its dest QPN/GID alone."""
        if qp.pd.ctx.device.provider == "verbs":
            return True
        for _ in range(100):
            got = qp.remote_private_data
            if got is not None:
                return hmac.compare_digest(bytes(got), want)
            await trio.sleep(0.01)
        return False
