"""What a node reports about itself, and its publication for ``kspeedfs status``.

    NodeCounters         chunks loaded, spilled and dropped since start (``share.py`` and
                         ``reconcile.py`` count them)
    NodeStatistics       one snapshot (``Node.statistics``): ``asdict`` of it is the JSON of
                         the ``stats`` RPC and of ``stats/<node>``, which
                         ``lifecycle.node_stats`` reads back
    endpoint_statistics  the vQPs of the node's vRDMA endpoint, as the snapshot holds them
    publish_forever      ``stats/<node>`` on the node's lease, every 2 s
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import trio

from rdma.vrdma import Endpoint

from ..errors import KspeedfsError
from .arena import ArenaStatistics
from .fetch import PeerStatistics
from .membership import Registration

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


async def publish_forever(registration: Registration, key: str,
                          snapshot: Callable[[], NodeStatistics], interval: float = 2.0) -> None:
    """Put ``snapshot()`` at ``key`` on the node's lease every ``interval`` s, until
    cancelled; a failure is a log line, never the node's."""
    while True:
        try:
            await trio.to_thread.run_sync(registration.put, key,
                                          json.dumps(asdict(snapshot())).encode())
        except KspeedfsError as e:
            log.debug("cannot publish stats: %s", e)
        except Exception:                   # statistics are never worth the node
            log.exception("publishing statistics failed")
        await trio.sleep(interval)
