"""A node's vRDMA endpoint: its NICs, its exported memory, its listener, its virtual QPs.

::

    Endpoint(secret)                      one per process (the composition root owns it)
      ├─ nics[addr] = LocalNIC            one RDMA device per local NIC: Context, PD, and
      │                                   the control vMR (heartbeat word = incarnation)
      ├─ exports[name] = VMR              memory peers may READ (after authenticating)
      ├─ listener (TCP, all NICs)         control connections: handshake, then "info" or
      │                                   "path" (one per physical path; the connection
      │                                   is the *lease* of the peer's QP: when it closes,
      │                                   the QP is destroyed)
      └─ vqps                             virtual QPs to peers (client side)

Responder side: nothing happens per READ; the provider serves one-sided READs.  The
listener only creates, connects and destroys QPs, so a peer that is not authenticated
never gets a QP connected to ours, and an rkey alone reads nothing.

Bootstrap: :meth:`Endpoint.connect` opens one control connection to any address of the
peer, asks for ``info`` (its NICs, incarnation, heartbeat words, exported vMRs, all per
NIC) and closes it.  Then it picks the NIC pairs (``pairs="routed"``: for each remote NIC,
the local NIC the kernel routes to it from, i.e. one path per rail; ``"all"``: the full
mesh) and builds every path as a *rebuild from DOWN*: the first build and the recovery of
a failed path are the same code (:meth:`_connect_path`).  A path's control connection is
opened from its own local NIC to its own remote NIC, so a control channel that works is
itself evidence the path's network works.

Who can read what (the rkey is a capability; these keep it one):

* Only :meth:`export`-ed vMRs are remotely readable (``alloc(remote_read=True)``);
  landing buffers, scratch and everything else are ``LOCAL_WRITE`` only.
* A served QP is connected only after the control channel authenticated the client, and
  it stays in INIT (serving nothing) until the connection that attached to it carried the
  session's token (``private_data`` = HMAC(session key, client QPN)); a connection that
  raced the client onto it is refused and the QP destroyed.
* Client path QPs have no REMOTE_READ access at all: a connection that sneaks onto one
  (between its RTS and the server's attach) can read nothing, not even this node's
  exports.  ``tests/rdma/test_vrdma_api.py`` forges both attacks at the soft wire level.

Before a client is authenticated, its connection is held to the limits of
:mod:`.handshake` (frames ≤ 4 KiB and flat, the whole handshake within
``handshake_timeout``, at most 32 such connections per source address and 128 in all:
``Endpoint.gate``); any failure closes that one connection, never the listener.  An
``info`` reply that does not parse makes that address a failed dial, like a dead one.

Server-side leases are keyed ``(client node, vqp, path)``: a client that rebuilds a path
while its old control connection is stuck on a dead NIC replaces the old lease; TCP
keepalive (a few seconds) reaps leases of clients that vanished without a FIN.
"""
from __future__ import annotations

import hmac
import itertools
import logging
import math
import mmap
import os
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import trio

from ..api import PD, ConnInfo, Context, Device, QPAttr, QPCap, QPInitAttr, get_device_list
from ..enums import IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_READ, IBV_QPS_RESET
from ..errors import HandshakeError, PathClosed, PeerUnreachable, RdmaError, RdmaUserError
from .dial import DialFailed, dial
from .handshake import Channel, PreAuthGate, aclose_quietly, client_handshake, qp_token
from .heartbeat import HEARTBEAT_BYTES, HeartbeatConfig
from .path import NATIVE_SQ_DEPTH, SQ_DEPTH, Path, Transition
from .peer import Peer
from .vmr import VMR
from .vqp import VQP, VQPStats

log = logging.getLogger(__name__)

#: outstanding READs one path QP keeps in flight (``max_rd_atomic``), capped by the device
MAX_RD_ATOMIC = 16

_VQP_IDS = itertools.count(1)


@dataclass
class LocalNIC:
    addr: str
    device: Device
    ctx: Context
    pd: PD


@dataclass(frozen=True)
class NicStats:
    addr: str
    device: str
    provider: str


@dataclass(frozen=True)
class EndpointStats:
    node: str
    incarnation: int
    listening: tuple[str, ...]
    nics: tuple[NicStats, ...]
    exports: tuple[str, ...]
    leases: int
    refused: int
    peers: tuple[VQPStats, ...] = field(default=())


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


def _keepalive(stream: trio.SocketStream) -> None:
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


class Endpoint:
    """``async with Endpoint(secret) as ep:`` — see the module docstring.

    ``addrs``: the local NIC addresses to use (default: every device of the provider
    except loopback, or loopback if that is all there is).  ``node``: this endpoint's
    name in handshakes and logs.

    Contract: usable only inside ``async with``.  Leaving it closes every vQP (their
    pending READs fail with PathClosed), then cancels the listener and lease tasks, then
    releases every vMR allocated here and the NICs.  A vQP reaches its endpoint only
    through the callables :meth:`connect` hands it (``create_cq``, ``connect_path``,
    ``close_channel``, ``on_closed``).

    Attributes:
        node, incarnation: this endpoint's name, and its heartbeat word (random per start).
        cfg: the heartbeat and failure knobs every vQP gets.
        nics: local NIC address → :class:`LocalNIC` (device, context, PD).
        exports: name → vMR authenticated peers may READ.
        vqps: the open virtual QPs (client side).
        control: the vMR holding the heartbeat word, readable on every NIC.
        listening: ``(host, port)`` of the listener once :meth:`listen` ran.
        gate: the caps on unauthenticated control connections.
    """

    def __init__(self, secret: bytes, *, node: str | None = None,
                 addrs: list[str] | None = None, provider: str | None = None,
                 cfg: HeartbeatConfig | None = None, handshake_timeout: float = 2.0) -> None:
        if not secret:
            raise ValueError("a vRDMA endpoint needs the cluster's shared secret")
        self.secret = bytes(secret)
        self.node = node or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.cfg = cfg or HeartbeatConfig()
        self.handshake_timeout = handshake_timeout
        self._want_addrs = addrs
        self._provider = provider
        self.incarnation = int.from_bytes(os.urandom(8), "little") or 1
        self.nics: dict[str, LocalNIC] = {}
        self.exports: dict[str, VMR] = {}
        self.vqps: list[VQP] = []
        self.control: VMR | None = None
        self.listening: list[tuple[str, int]] = []
        #: served paths: (client node, vqp, path) → (lease scope, our QP)
        self._leases: dict[tuple[str, str, int], tuple[trio.CancelScope, Any]] = {}
        self._refused = 0
        #: caps on unauthenticated control connections (handshake.PreAuthGate)
        self.gate = PreAuthGate(f"endpoint {self.node}")
        self._nursery: trio.Nursery | None = None
        self._lifetime: Any = None
        self._vmrs: list[VMR] = []

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> Endpoint:
        lifetime = self._running()
        self._lifetime = lifetime
        return await lifetime.__aenter__()

    async def __aexit__(self, *exc: Any) -> bool | None:
        suppress: bool | None = await self._lifetime.__aexit__(*exc)
        return suppress

    @asynccontextmanager
    async def _running(self) -> AsyncIterator[Endpoint]:
        """The endpoint's lifetime: NICs open, its nursery (listener, vQP tasks, lease
        closes) running.  On the way out: every vQP closed, then the nursery cancelled,
        then the NICs and vMRs released."""
        self._open_nics()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                try:
                    yield self
                finally:
                    for v in list(self.vqps):
                        await v.aclose()
                    nursery.cancel_scope.cancel()
        finally:
            self._close_resources()

    def _open_nics(self) -> None:
        devs = get_device_list(self._provider)
        want = self._want_addrs
        if want is None:
            want = [d.ipv4 for d in devs if d.ipv4 and not d.ipv4.startswith("127.")]
            if not want:
                want = [d.ipv4 for d in devs if d.ipv4]
        try:
            for addr in want:
                dev = next((d for d in devs if d.ipv4 == addr), None)
                if dev is None:
                    raise RdmaError(f"no RDMA device for local address {addr} "
                                    f"(devices: {[(d.name, d.ipv4) for d in devs]})", 19)
                ctx = dev.open()
                self.nics[addr] = LocalNIC(addr, dev, ctx, ctx.alloc_pd())
            if not self.nics:
                raise RdmaError("no RDMA devices with an IPv4 address", 19)
            self.control = self.alloc(max(HEARTBEAT_BYTES, 64), name="control",
                                      remote_read=True)
            self.control.write(self.incarnation.to_bytes(HEARTBEAT_BYTES, "little"))
        except BaseException:
            self._close_resources()
            raise
        log.info("endpoint %s: NICs %s", self.node,
                 ", ".join(f"{n.addr}={n.device.name}" for n in self.nics.values()))

    def _close_resources(self) -> None:
        for v in self._vmrs:
            v.close()
        self._vmrs.clear()
        for nic in self.nics.values():
            try:
                nic.ctx.close()
            except Exception:
                log.debug("close %s", nic.device.name, exc_info=True)
        self.nics.clear()

    def nic(self, addr: str) -> LocalNIC:
        try:
            return self.nics[addr]
        except KeyError:
            raise PathClosed(f"endpoint has no (open) NIC {addr}") from None

    # ------------------------------------------------------------------ memory
    def alloc(self, length: int, name: str = "", *, remote_read: bool = False,
              memory: mmap.mmap | None = None) -> VMR:
        """A buffer registered on every local NIC (``memory``: this mapping, else fresh
        anonymous memory).  Landing buffers stay local (``LOCAL_WRITE`` only): nobody can
        READ them, whatever QP they reach.  Memory to :meth:`export` needs
        ``remote_read=True``."""
        access = IBV_ACCESS_LOCAL_WRITE | (IBV_ACCESS_REMOTE_READ if remote_read else 0)
        v = VMR({a: n.pd for a, n in self.nics.items()}, length, access=access, name=name,
                memory=memory)
        self._vmrs.append(v)
        return v

    def export(self, name: str, vmr: VMR) -> None:
        """Let authenticated peers READ ``vmr`` (made with ``remote_read=True``) as
        ``name``."""
        if not vmr.access & IBV_ACCESS_REMOTE_READ:
            raise RdmaUserError(f"vMR {name!r} is not remotely readable: "
                                "alloc(..., remote_read=True)")
        self.exports[name] = vmr

    def _info(self) -> dict[str, Any]:
        assert self.control is not None
        return {"node": self.node, "incarnation": self.incarnation, "nics": list(self.nics),
                "control": {n: [a, k] for n, (a, k) in self.control.remote().keys.items()},
                "mrs": {name: v.remote(name).to_dict() for name, v in self.exports.items()
                        if not v.closed}}

    def advertisement(self) -> dict[str, Any]:
        """What a peer needs to find this endpoint, JSON-able (for a registry such as
        etcd): node, incarnation, NIC addresses, listener port, per-NIC heartbeat words
        and exported vMRs.  Knowing it grants nothing: QPs still need the handshake."""
        port = self.listening[0][1] if self.listening else 0
        return {**self._info(), "port": port}

    # ------------------------------------------------------------------ server side
    async def listen(self, host: str = "0.0.0.0", port: int = 0) -> int:
        """Start accepting control connections; returns the TCP port."""
        assert self._nursery is not None, "use `async with Endpoint(...)`"
        listeners = await trio.open_tcp_listeners(port, host=host)
        self.listening = [(host, ln.socket.getsockname()[1]) for ln in listeners]
        await self._nursery.start(trio.serve_listeners, self._serve_conn, listeners)
        return self.listening[0][1]

    async def _serve_conn(self, stream: trio.SocketStream) -> None:
        """One control connection: the handshake under ``self.gate`` (its caps, deadline
        and frame limits: :mod:`.handshake`), then ``info``/``path`` requests.  Nothing a
        client sends ends the accept loop: a failure closes this connection only."""
        _keepalive(stream)
        try:
            host, port = stream.socket.getpeername()[:2]
            peer = f"{host}:{port}"
        except OSError:
            peer = "?"
        ch = await self.gate.accept(stream, self.secret, self.node, self.handshake_timeout)
        if ch is None:
            self._refused += 1
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
            nic = self.nics[str(msg["nic"])]
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
                self._refused += 1
                log.info("endpoint %s: path %s: the connection attached to QP %#x is not "
                         "%s's; refused", self.node, key, qp.qp_num, ch.peer_node)
                await ch.send({"error": "QP connection not bound to this session"})
                return
            rd = self._rd_atomic(nic)
            await trio.to_thread.run_sync(partial(
                qp.connect, remote, max_rd_atomic=rd, max_dest_rd_atomic=rd,
                timeout=self.cfg.qp_timeout_exp, retry_cnt=self.cfg.qp_retry_cnt,
                timeout_ms=self.cfg.qp_timeout_ms))
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

    @staticmethod
    def _rd_atomic(nic: LocalNIC) -> int:
        try:
            return max(1, min(MAX_RD_ATOMIC, nic.ctx.query_device().max_qp_rd_atom))
        except Exception:
            return 1

    # ------------------------------------------------------------------ client side
    async def connect(self, addrs: list[str], port: int, *, pairs: str = "routed",
                      timeout: float | None = None,
                      on_transition: Callable[[Transition], None] | None = None) -> VQP:
        """A virtual QP to the peer listening on ``port`` at any of ``addrs``.  Returns
        once at least one path is UP (the others keep coming up in the background);
        PeerUnreachable if none can be built within ``timeout``."""
        assert self._nursery is not None, "use `async with Endpoint(...)`"
        timeout = self.cfg.connect_timeout * 2 if timeout is None else timeout

        async def ask(addr: str) -> dict[str, Any]:
            with trio.fail_after(self.cfg.connect_timeout):
                ch = await self._open_channel(addr, port, None)
                try:
                    return _checked_info(await ch.request({"op": "info"}))
                finally:
                    await ch.aclose()

        try:
            with trio.fail_after(timeout):
                info = await dial(addrs, ask)     # every NIC of the peer at once
        except (DialFailed, trio.TooSlowError) as e:
            raise PeerUnreachable(f"no control connection to {addrs}:{port}: {str(e) or 'timed out'}",
                                  ",".join(addrs)) from None
        local = list(self.nics)
        remote = [str(n) for n in info["nics"]]
        chosen = routed_pairs(local, remote) if pairs == "routed" else \
            [(l_, r) for l_ in local for r in remote]
        peer = Peer(str(info["node"]), port, info)
        vqp_id = next(_VQP_IDS)
        scratch = self.alloc(max(1, len(chosen)) * HEARTBEAT_BYTES, name=f"vqp{vqp_id}-scratch")
        vqp = VQP(vqp_id, peer, chosen, self.cfg, scratch=scratch,
                  create_cq=self._create_path_cq,
                  connect_path=partial(self._connect_path, peer, vqp_id),
                  close_channel=self._close_later, on_closed=self._forget,
                  on_transition=on_transition)
        self.vqps.append(vqp)
        await self._nursery.start(vqp.run, name=f"vqp{vqp.id}")
        try:
            await vqp.wait_connected(timeout)
        except BaseException:
            await vqp.aclose()
            raise
        return vqp

    async def _open_channel(self, addr: str, port: int, local: str | None) -> Channel:
        stream = await trio.open_tcp_stream(addr, port, local_address=local)
        _keepalive(stream)
        try:
            return await client_handshake(stream, self.secret, self.node,
                                          self.handshake_timeout)
        except BaseException:
            await aclose_quietly(stream)
            raise

    def _create_path_cq(self, local_nic: str) -> Any:
        """The CQ of one client path QP (a vQP's ``create_cq`` seam)."""
        return self.nic(local_nic).ctx.create_cq(SQ_DEPTH * 2)

    async def _connect_path(self, peer: Peer, vqp_id: int, path: Path) -> None:
        """(Re)build one path: QP to RESET, fresh control connection on this NIC pair,
        exchange ConnInfos, RESET → INIT → RTR → RTS on both sides, keep the lease.
        Handed to a vQP, bound to its peer and id, as its ``connect_path`` seam; the
        peer's reply refreshes ``peer`` (incarnation, NICs, vMRs)."""
        nic = self.nic(path.local_nic)
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
            # 8 × connect_timeout) and stays: a fixed 1 s that a slow host never meets
            # (a one-vCPU TCG guest after a NIC flap: every rebuild took longer) kept a
            # repaired path down forever, and a budget reset after each success cost
            # every later repair one timed-out build first (2.6–5.6 s instead of ~2).
            with trio.fail_after(path.build_budget):
                ch = await self._open_channel(path.remote_nic, peer.port, path.local_nic)
                info = path.qp.local_info()
                reply = await ch.request({"op": "path", "vqp": str(vqp_id), "path": path.id,
                                          "nic": path.remote_nic, "conn": info.to_dict()})
                if int(reply["incarnation"]) != peer.incarnation:
                    log.info("vqp %s: peer restarted (incarnation changed)", peer.node)
                peer.update(reply)
                remote = ConnInfo.from_dict(reply["conn"])
                rd = self._rd_atomic(nic)
                await trio.to_thread.run_sync(partial(   # our QP only requests: it
                    path.qp.connect, remote, max_rd_atomic=rd, max_dest_rd_atomic=rd,
                    qp_access_flags=IBV_ACCESS_LOCAL_WRITE,  # serves no READ, ever
                    timeout=self.cfg.qp_timeout_exp, retry_cnt=self.cfg.qp_retry_cnt,
                    timeout_ms=self.cfg.qp_timeout_ms,
                    private_data=qp_token(ch.key, info.qp_num)))
                await ch.request({"op": "ready"})
        except BaseException as e:
            if isinstance(e, trio.TooSlowError):
                path.build_budget = min(path.build_budget * 2, 8 * self.cfg.connect_timeout)
            if ch is not None:
                await ch.aclose()
            if path.qp is not None and not path.qp.closed \
                    and path.qp.qp_state != IBV_QPS_RESET:
                path.qp.to_reset()
            raise
        path.control = ch

    def served_qp_nums(self) -> list[int]:
        """QPNs of the QPs this endpoint serves to peers (tests, diagnostics)."""
        return [qp.qp_num for _, qp in self._leases.values() if not qp.closed]

    def _close_later(self, ch: Channel) -> None:
        """Close a lease connection from synchronous code (a vQP's ``close_channel``
        seam, used while it shuts down)."""
        if self._nursery is not None:
            try:
                self._nursery.start_soon(ch.aclose)
                return
            except RuntimeError:        # the endpoint is going away: close it bluntly
                pass
        try:
            ch.frames.stream.socket.close()     # type: ignore[attr-defined]
        except (AttributeError, OSError):
            pass

    def _forget(self, vqp: VQP) -> None:
        """A vQP closed (its ``on_closed`` seam)."""
        if vqp in self.vqps:
            self.vqps.remove(vqp)

    # ------------------------------------------------------------------ introspection
    def statistics(self) -> EndpointStats:
        return EndpointStats(
            node=self.node, incarnation=self.incarnation,
            listening=tuple(f"{h}:{p}" for h, p in self.listening),
            nics=tuple(NicStats(n.addr, n.device.name, n.device.provider)
                       for n in self.nics.values()),
            exports=tuple(self.exports), leases=len(self._leases), refused=self._refused,
            peers=tuple(v.statistics() for v in self.vqps))


def _checked_info(info: Any) -> dict[str, Any]:
    """A peer's ``info`` reply if it parses the way :meth:`connect` and
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
