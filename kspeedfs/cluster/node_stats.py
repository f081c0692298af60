"""What a node reports about itself, and how ``kspeedfs status`` asks for it.

    NodeCounters         chunks loaded, spilled and dropped since start (``share.py`` and
                         ``reconcile.py`` count them)
    NodeStatistics       one snapshot (``Node.statistics``): ``asdict`` of it is the JSON of
                         the ``stats`` RPC, which ``lifecycle.node_stats`` reads back
    endpoint_statistics  the vQPs of the node's vRDMA endpoint, as the snapshot holds them
    gather               every live node's ``stats`` RPC answer, asked at once (the CLI)

Statistics are asked of the nodes when a command wants them, not published to etcd:
each node used to put its snapshot at ``stats/<node>`` every 2 s, 71 % of the
cluster's etcd writes, and 1.2 kB + 195 B per peer link each time (docs/design.md,
"1,000 nodes, simulated"). Nodes of earlier versions still publish it; ``cluster_plan``
reads their SSD capacity there.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import trio

from rdma.errors import RdmaError
from rdma.vrdma import Endpoint

from .arena import ArenaStatistics
from .fetch import PeerStatistics
from .membership import NodeRecord
from .rpc import RpcClient, RpcUnavailable

log = logging.getLogger(__name__)


@dataclass
class NodeCounters:
    """Chunks one node has loaded and spilled since it started (trio thread only)."""

    source_loads: int = 0
    source_bytes: int = 0
    peer_loads: int = 0
    peer_bytes: int = 0
    demand_loads: int = 0            # "load" RPCs from readers
    rereplicated: int = 0            # chunks copied because membership changed
    disk_loads: int = 0              # chunks promoted from the SSD tier back to the arena
    spilled: int = 0                 # evicted owned chunks written to the SSD tier
    spills_inline: int = 0           # ... written in the loop because the SSD queue was full
    unloaded: int = 0                # chunks dropped because their dataset was unloaded
    pages_from_peers: int = 0        # manifest pages copied from peers (page_copy.py) ...
    pages_from_store: int = 0        # ... and from store.pages
    pages_refused: int = 0           # peers' page replies that failed their checks
    pages_served: int = 0            # "page" RPCs answered with a page


@dataclass(frozen=True)
class LinkStatistics:
    """One vQP of a node's endpoint, as ``kspeedfs status`` prints it."""

    state: str
    reads_failed_over: int
    paths: dict[str, str]            # "local NIC->remote NIC" → path state


@dataclass(frozen=True)
class EndpointStatistics:
    nics: list[str]
    peers: dict[str, LinkStatistics]  # peer (node or mount) → its vQP


@dataclass(frozen=True)
class NodeStatistics:
    """A snapshot of one node, from :meth:`Node.statistics`.

    ``asdict`` of it is the JSON of the ``stats`` RPC and of the ``stats/<node>`` etcd
    key that ``kspeedfs status`` reads: field names are those JSON keys.
    """

    node: str
    time: float                      # wall clock of the snapshot, s since the epoch
    arena: ArenaStatistics
    counters: NodeCounters           # a copy
    reads: PeerStatistics            # this node's own peer reads (re-replication)
    endpoint: EndpointStatistics
    progress: dict[str, dict[str, int]]  # "<ds>@<v>" → owned/cached/... (reconcile)
    disk: dict[str, int]             # the SSD tier: capacity, used (bytes); zeros if none
    files: dict[str, int] = field(default_factory=dict)   # arena/index file → RAM it holds


def endpoint_statistics(ep: Endpoint) -> EndpointStatistics:
    peers = {}
    for v in list(ep.vqps):
        s = v.statistics()
        peers[s.peer] = LinkStatistics(s.state, s.reads_failed_over,
                                       {f"{p.local_nic}->{p.remote_nic}": p.state for p in s.paths})
    return EndpointStatistics(list(ep.nics), peers)


async def ask_all(secret: bytes, records: list[NodeRecord], timeout: float) -> dict[str, Any]:
    """Every node's answer to the ``stats`` RPC (``NodeStatistics`` as JSON: untrusted,
    read through ``lifecycle.node_stats``), by node name, asked at once. A node that
    does not answer within ``timeout`` s (down, cut, another secret) is left out."""
    out: dict[str, Any] = {}

    async def ask(rec: NodeRecord) -> None:
        c = RpcClient(secret, "status", rec.nics, rec.rpc_port, timeout=timeout)
        try:
            with trio.move_on_after(timeout):
                out[rec.node] = await c.request({"op": "stats"})
        except (RpcUnavailable, RdmaError, OSError) as e:
            log.info("no statistics from %s: %s", rec.node, e)
        finally:
            await c.aclose()

    async with trio.open_nursery() as n:
        for rec in records:
            n.start_soon(ask, rec)
    return out


def gather(secret: bytes, records: list[NodeRecord], timeout: float = 3.0) -> dict[str, Any]:
    """Blocking, for the CLI: :func:`ask_all` in a trio run of its own."""
    return trio.run(ask_all, secret, records, timeout)
