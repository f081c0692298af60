"""vRDMA: LubeRDMA-style virtual QPs over several NICs (READ only, failure-transparent).

A virtual QP to a peer spans one physical RC QP per usable path (local NIC × remote NIC);
a virtual MR is registered on every local NIC; per-path heartbeats and completion errors
decide each path's state (:mod:`.path`, :mod:`.heartbeat`); READs in flight on a failed
path are re-posted on a healthy one; failed paths are rebuilt in the background; only
when every path is dead does the caller get :class:`~rdma.errors.PeerUnreachable`, within
a bound.  QPs are connected only through an authenticated control channel
(:mod:`.handshake`, HMAC-SHA256 challenge–response with the cluster secret).

Modules, one concept each: :mod:`.heartbeat` (interval/miss arithmetic), :mod:`.path`
(one physical QP and its state machine), :mod:`.handshake` (control channel),
:mod:`.vmr` (one buffer on every NIC), :mod:`.vqp` (the virtual QP, composed of
:mod:`.pathset` (its paths' states, peer-dead clock), :mod:`.dispatch` (posting and
failover of READs), :mod:`.monitor` (the heartbeat task), :mod:`.rebuild` (rebuilding a
failed path), :mod:`.native` (paths for READs posted in C) and :mod:`.peer` (what the
peer told us)), :mod:`.endpoint` (a node's NICs, exports and vQPs, composed of
:mod:`.nic` (opening the local devices), :mod:`.responder` (the listener and served
paths), :mod:`.requester` (bootstrap and path builds) and :mod:`.dial` (every address of
a peer at once)), :mod:`.paths` (``python -m rdma.vrdma.paths``).

Written against :mod:`rdma.api` only: runs unchanged on the ``soft`` and ``verbs``
providers.  NICs are IPv4-addressed (soft, RoCE v2): each path's control connection is TCP
from its local NIC to its remote NIC.

Use::

    async with Endpoint(secret) as server:               # node B
        arena = server.alloc(1 << 30, name="arena", remote_read=True)
        server.export("arena", arena)
        port = await server.listen()
        ad = server.advertisement()                      # → etcd: nics, port, vMRs

    async with Endpoint(secret) as client:               # node A
        vqp = await client.connect(ad["nics"], ad["port"])
        buf = client.alloc(4 << 20)
        await vqp.read(buf, 0, "arena", 1 << 20, remote_off=off)   # or PeerUnreachable
        vqp.statistics()                                 # frozen dataclasses, per path
"""
from .dispatch import wait_noting_overrun
from .endpoint import Endpoint, EndpointStats, routed_pairs
from .heartbeat import HeartbeatConfig
from .path import PathState, PathStats
from .vmr import VMR, RemoteVMR
from .vqp import VQP, VQPStats

__all__ = ["Endpoint", "EndpointStats", "HeartbeatConfig", "PathState", "PathStats", "VMR",
           "RemoteVMR", "VQP", "VQPStats", "routed_pairs", "wait_noting_overrun"]
