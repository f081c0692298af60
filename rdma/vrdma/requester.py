"""The requester side of an endpoint: control connections to peers, and building paths.

Bootstrap (:meth:`Requester.peer_info`): one control connection to any address of the
peer (every address dialled at once, :mod:`.dial`) asks for ``info`` (its NICs,
incarnation, heartbeat words, exported vMRs, all per NIC) and closes.  The endpoint then
picks the NIC pairs (:func:`routed_pairs`, one path per rail; or the full mesh) and hands
its new vQP :meth:`Requester.connect_path`, which builds every path as a *rebuild from
DOWN*: the first build and the recovery of a failed path are the same code.  A path's
control connection is opened from its own local NIC to its own remote NIC, so a control
channel that works is itself evidence the path's network works; it stays open as the
lease of the peer's QP (:mod:`.responder`).

Client path QPs have no REMOTE_READ access at all: a connection that sneaks onto one
(between its RTS and the server's attach) can read nothing, not even this node's exports.
``tests/rdma/test_vrdma_api.py`` forges that attack, and the one on the served QP, at the
soft wire level.  An ``info`` reply that does not parse makes that address a failed dial,
like a dead one.
"""
from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from ..api import ConnInfo, QPCap, QPInitAttr
from ..enums import IBV_ACCESS_LOCAL_WRITE, IBV_QPS_RESET
from ..errors import HandshakeError, PeerUnreachable
from ..tuning import NATIVE_SQ_DEPTH, SQ_DEPTH
from .dial import DialFailed, dial
from .handshake import Channel, aclose_quietly, client_handshake, keepalive, qp_token
from .heartbeat import HeartbeatConfig
from .nic import LocalNIC
from .path import Path
from .peer import Peer

if TYPE_CHECKING:
    from ..api import CQ

#: the endpoint's log lines keep the logger name they always had (operators filter on it)
log = logging.getLogger("rdma.vrdma.endpoint")


def routed_pairs(local: list[str], remote: list[str]) -> list[tuple[str, str]]:
    """For each remote NIC, the local NIC the kernel would send from (no packet is sent:
    a connected UDP socket only does the route lookup).  Rail-optimised clusters get one
    path per rail; if routing says nothing useful, fall back to the full mesh."""
    pairs = []
    for r in remote:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.connect((r, 9))
            src = s.getsockname()[0]
        except OSError:
            continue
        finally:
            s.close()
        if src in local and (src, r) not in pairs:
            pairs.append((src, r))
    return pairs or [(l_, r) for l_ in local for r in remote]


class Requester:
    """Opens this endpoint's control connections and builds its side of each path.

    Contract: every method runs in the caller's trio task (the endpoint's ``connect``, a
    vQP's tasks); it keeps no state between calls but what it is built with.  A channel it
    returns, or leaves in ``path.control``, is the caller's to close.

    Seam to the endpoint: ``nic(addr)``, the open :class:`LocalNIC` at ``addr``
    (PathClosed once the endpoint closed it).
    """

    def __init__(self, secret: bytes, node: str, cfg: HeartbeatConfig,
                 handshake_timeout: float, nic: Callable[[str], LocalNIC]) -> None:
        self._secret = secret
        self._node = node
        self._cfg = cfg
        self._handshake_timeout = handshake_timeout
        self._nic = nic

    async def open_channel(self, addr: str, port: int, local: str | None) -> Channel:
        """An authenticated control connection to ``addr:port`` (from local address
        ``local``, or wherever the kernel routes)."""
        stream = await trio.open_tcp_stream(addr, port, local_address=local)
        keepalive(stream)
        try:
            return await client_handshake(stream, self._secret, self._node,
                                          self._handshake_timeout)
        except BaseException:
            await aclose_quietly(stream)
            raise

    async def peer_info(self, addrs: list[str], port: int, timeout: float) -> dict[str, Any]:
        """The ``info`` of the peer listening on ``port`` at any of ``addrs`` (checked to
        parse); PeerUnreachable if no address gives one within ``timeout``."""
        async def ask(addr: str) -> dict[str, Any]:
            with trio.fail_after(self._cfg.connect_timeout):
                ch = await self.open_channel(addr, port, None)
                try:
                    return _checked_info(await ch.request({"op": "info"}))
                finally:
                    await ch.aclose()

        try:
            with trio.fail_after(timeout):
                return await dial(addrs, ask)     # every NIC of the peer at once
        except (DialFailed, trio.TooSlowError) as e:
            raise PeerUnreachable(f"no control connection to {addrs}:{port}: {str(e) or 'timed out'}",
                                  ",".join(addrs)) from None

    def create_cq(self, local_nic: str) -> CQ:
        """The CQ of one client path QP (a vQP's ``create_cq`` seam)."""
        return self._nic(local_nic).ctx.create_cq(SQ_DEPTH * 2)

    async def connect_path(self, peer: Peer, vqp_id: int, path: Path) -> None:
        """(Re)build one path: QP to RESET, fresh control connection on this NIC pair,
        exchange ConnInfos, RESET → INIT → RTR → RTS on both sides, keep the lease.
        Handed to a vQP, bound to its peer and id, as its ``connect_path`` seam; the
        peer's reply refreshes ``peer`` (incarnation, NICs, vMRs)."""
        nic = self._nic(path.local_nic)
        if path.control is not None:
            old, path.control = path.control, None
            await old.aclose()
        if path.qp is None:
            assert path.cq is not None
            path.qp = nic.pd.create_qp(QPInitAttr(
                send_cq=path.cq, cap=QPCap(max_send_wr=SQ_DEPTH + NATIVE_SQ_DEPTH,
                                           max_recv_wr=1)))
        elif path.qp.qp_state != IBV_QPS_RESET:
            path.qp.to_reset()
        ch: Channel | None = None
        try:
            # The budget of one build doubles after a build that ran out of it (up to
            # 8 × connect_timeout) and stays: a slow host that never meets a fixed budget
            # would keep a repaired path down forever (:mod:`.rebuild` has the numbers).
            with trio.fail_after(path.build_budget):
                ch = await self.open_channel(path.remote_nic, peer.port, path.local_nic)
                info = path.qp.local_info()
                reply = await ch.request({"op": "path", "vqp": str(vqp_id), "path": path.id,
                                          "nic": path.remote_nic, "conn": info.to_dict()})
                if int(reply["incarnation"]) != peer.incarnation:
                    log.info("vqp %s: peer restarted (incarnation changed)", peer.node)
                peer.update(reply)
                remote = ConnInfo.from_dict(reply["conn"])
                rd = nic.rd_atomic()
                await trio.to_thread.run_sync(partial(   # our QP only requests: it
                    path.qp.connect, remote, max_rd_atomic=rd, max_dest_rd_atomic=rd,
                    qp_access_flags=IBV_ACCESS_LOCAL_WRITE,  # serves no READ, ever
                    timeout=self._cfg.qp_timeout_exp, retry_cnt=self._cfg.qp_retry_cnt,
                    timeout_ms=self._cfg.qp_timeout_ms,
                    private_data=qp_token(ch.key, info.qp_num)))
                await ch.request({"op": "ready"})
        except BaseException as e:
            if isinstance(e, trio.TooSlowError):
                path.build_budget = min(path.build_budget * 2, 8 * self._cfg.connect_timeout)
            if ch is not None:
                await ch.aclose()
            if path.qp is not None and not path.qp.closed \
                    and path.qp.qp_state != IBV_QPS_RESET:
                path.qp.to_reset()
            raise
        path.control = ch


def _checked_info(info: Any) -> dict[str, Any]:
    """A peer's ``info`` reply if it parses the way the endpoint's ``connect`` and
    :meth:`Peer.update` read it, else :class:`HandshakeError`: a peer sending nonsense is
    an unreachable address (the next one, then ``PeerUnreachable``), not a crash."""
    try:
        str(info["node"])
        [str(n) for n in info["nics"]]
        Peer.check(info)
    except (LookupError, TypeError, ValueError, AttributeError, ArithmeticError) as e:
        raise HandshakeError(f"malformed info reply: {type(e).__name__}: {e}"[:300]) from None
    checked: dict[str, Any] = info
    return checked
