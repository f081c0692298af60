"""A node's vRDMA endpoint: its NICs, its exported memory, its listener, its virtual QPs.

::

    Endpoint(secret)                      one per process (the composition root owns it)
      ├─ nics[addr] = LocalNIC            one RDMA device per local NIC: Context, PD
      │                                   (:mod:`.nic`), and the control vMR (heartbeat
      │                                   word = incarnation)
      ├─ exports[name] = VMR              memory peers may READ (after authenticating)
      ├─ responder (:mod:`.responder`)    the listener (TCP, all NICs): control
      │                                   connections, handshake, then "info" or "path"
      │                                   (one per physical path; the connection is the
      │                                   *lease* of the peer's QP)
      ├─ requester (:mod:`.requester`)    control connections to peers: bootstrap
      │                                   ``info``, then the build of every path
      └─ vqps                             virtual QPs to peers (client side, :mod:`.vqp`)

:class:`Endpoint` is the façade the rest of the system uses: it owns the NICs, the memory
registered on them and the lifetime of everything (its nursery), and composes a vQP from
the requester's seams in :meth:`Endpoint.connect`.  What happens on the wire, and why it
is safe, is told where it happens: :mod:`.responder` (served QPs, leases, the limits on
unauthenticated connections), :mod:`.requester` (bootstrap, path builds, client QPs that
serve nothing), :mod:`.handshake` (the authenticated control channel).

Who can read what (the rkey is a capability; these keep it one): only :meth:`export`-ed
vMRs are remotely readable (``alloc(remote_read=True)``); landing buffers, scratch and
everything else are ``LOCAL_WRITE`` only.  A QP is connected to a peer's only through an
authenticated control channel, bound to that session (:mod:`.responder`).
"""
from __future__ import annotations

import itertools
import logging
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

from ..enums import IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_READ
from ..errors import PathClosed, RdmaUserError
from .handshake import Channel, PreAuthGate
from .heartbeat import HEARTBEAT_BYTES, HeartbeatConfig
from .nic import LocalNIC, close_nics, open_nics
from .path import Transition
from .peer import Peer
from .requester import Requester, routed_pairs
from .responder import Responder
from .vmr import VMR
from .vqp import VQP, VQPStats

__all__ = ["Endpoint", "EndpointStats", "LocalNIC", "NicStats", "routed_pairs"]

log = logging.getLogger(__name__)

_VQP_IDS = itertools.count(1)


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


class Endpoint:
    """``async with Endpoint(secret) as ep:`` — see the module docstring.

    ``addrs``: the local NIC addresses to use (default: every device of the provider
    except loopback, or loopback if that is all there is).  ``node``: this endpoint's
    name in handshakes and logs.

    Contract: usable only inside ``async with``, from trio tasks.  Leaving it closes every
    vQP (their pending READs fail with PathClosed), then cancels the listener and lease
    tasks, then releases every vMR allocated here and the NICs.  A vQP reaches its
    endpoint only through the callables :meth:`connect` hands it (``create_cq``,
    ``connect_path``, ``close_channel``, ``on_closed``).

    Attributes:
        node, incarnation: this endpoint's name, and its heartbeat word (random per start).
        secret, handshake_timeout: the cluster secret, and the handshake's deadline.
        cfg: the heartbeat and failure knobs every vQP gets.
        nics: local NIC address → :class:`LocalNIC` (device, context, PD).
        exports: name → vMR authenticated peers may READ.
        vqps: the open virtual QPs (client side).
        control: the vMR holding the heartbeat word, readable on every NIC.
        responder: its listener and the paths it serves (:mod:`.responder`).
        requester: its control connections and path builds (:mod:`.requester`).
        gate: the caps on unauthenticated control connections (the responder's).
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
        self.responder = Responder(self.secret, self.node, self.cfg, handshake_timeout,
                                   self.nics, self._info)
        self.requester = Requester(self.secret, self.node, self.cfg, handshake_timeout,
                                   self.nic)
        self.gate: PreAuthGate = self.responder.gate
        self._nursery: trio.Nursery | None = None
        self._lifetime: Any = None
        self._vmrs: list[VMR] = []

    @property
    def listening(self) -> list[tuple[str, int]]:
        """``(host, port)`` of the listener once :meth:`listen` ran."""
        return self.responder.listening

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
        self.nics.update(open_nics(self._provider, self._want_addrs))
        try:
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
        close_nics(self.nics)

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
        """The ``info`` reply (the responder's seam): name, incarnation, NICs, the
        heartbeat word and the exported vMRs, per NIC."""
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
        """Start accepting control connections (:mod:`.responder`); returns the TCP port."""
        assert self._nursery is not None, "use `async with Endpoint(...)`"
        return await self.responder.listen(self._nursery, host, port)

    def served_qp_nums(self) -> list[int]:
        """QPNs of the QPs this endpoint serves to peers (tests, diagnostics)."""
        return self.responder.served_qp_nums()

    # ------------------------------------------------------------------ client side
    async def connect(self, addrs: list[str], port: int, *, pairs: str = "routed",
                      timeout: float | None = None,
                      on_transition: Callable[[Transition], None] | None = None) -> VQP:
        """A virtual QP to the peer listening on ``port`` at any of ``addrs``.  Returns
        once at least one path is UP (the others keep coming up in the background);
        PeerUnreachable if none can be built within ``timeout``.  ``pairs``: the NIC
        pairs, ``"routed"`` (:func:`routed_pairs`: one path per rail) or ``"all"``."""
        assert self._nursery is not None, "use `async with Endpoint(...)`"
        timeout = self.cfg.connect_timeout * 2 if timeout is None else timeout
        info = await self.requester.peer_info(addrs, port, timeout)
        local = list(self.nics)
        remote = [str(n) for n in info["nics"]]
        chosen = routed_pairs(local, remote) if pairs == "routed" else \
            [(l_, r) for l_ in local for r in remote]
        peer = Peer(str(info["node"]), port, info)
        vqp_id = next(_VQP_IDS)
        scratch = self.alloc(max(1, len(chosen)) * HEARTBEAT_BYTES, name=f"vqp{vqp_id}-scratch")
        vqp = VQP(vqp_id, peer, chosen, self.cfg, scratch=scratch,
                  create_cq=self.requester.create_cq,
                  connect_path=partial(self.requester.connect_path, peer, vqp_id),
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
            exports=tuple(self.exports), leases=self.responder.leases,
            refused=self.responder.refused,
            peers=tuple(v.statistics() for v in self.vqps))
