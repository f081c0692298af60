"""Read-path counters. Mutated only from the trio thread; read as a frozen snapshot.

``kspeedfs`` exposes the snapshot as JSON in the ``user.kspeedfs.stats`` xattr of the
mount root (``getfattr -n user.kspeedfs.stats /mnt/x``), the way JuiceFS serves
``.stats``; logs and the benchmark suite read the same object.

Every ``statistics()`` in kspeedfs returns a frozen dataclass like this one, and JSON
is made from it with ``dataclasses.asdict`` only where it leaves the process:

    ReadStatistics      here            Reader.statistics()    the mount's read path
    PeerStatistics      cluster/fetch   Peers.statistics()     reads from peer arenas
    ArenaStatistics     cluster/arena   Arena.statistics()     a node's memory arena
    NodeStatistics      cluster/node_stats  Node.statistics()      a node: the ``stats`` RPC
                                                               (``kspeedfs status``)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING


@dataclass(frozen=True)
class ReadStatistics:
    reads: int = 0                 # FUSE read requests
    python_reads: int = 0          # ... of them answered by the trio thread (native engine: not in C)
    read_bytes: int = 0            # bytes returned to readers
    memory_hits: int = 0           # chunk requests served by the memory tier
    disk_hits: int = 0             # ... by the disk tier (verified on load)
    disk_hit_bytes: int = 0
    peer_hits: int = 0             # ... READ from a replica's arena over vRDMA (verified)
    peer_bytes: int = 0
    host_hits: int = 0             # ... (or extents, blocks) copied from the granted segments of
    host_bytes: int = 0            #     the node on this host (verified; cluster/granted.py)
    source_loads: int = 0          # chunks assembled from the source
    source_bytes: int = 0
    source_extents: int = 0        # small files read alone from the source (dataset > tiers)
    block_reads: int = 0           # random reads served by blocks, not their whole chunk
    source_blocks: int = 0         # blocks read alone from the source (random-read misses)
    block_fallbacks: int = 0       # blocks that failed their checksum: the chunk was loaded
    prefetched: int = 0            # chunk loads started by the prefetcher
    prefetch_skipped: int = 0      # ... not started: half the memory tier already ahead
    pushed_bytes: int = 0          # bytes stored into the kernel page cache ahead of readers
    push_failures: int = 0         # page-cache stores the kernel refused (reader used READ)
    waited_in_flight: int = 0      # requests that joined an in-flight load (single-flight)
    corrupt_discarded: int = 0     # chunks from a tier that failed their checksum
    source_mismatches: int = 0     # source extents that failed their checksum
    source_changed: int = 0        # chunk loads that found a changed source file
    source_partial_reads: int = 0  # reads served from a chunk whose *neighbour* changed
    memory_bytes: int = 0          # memory tier occupancy
    memory_resident_bytes: int = 0  # ... of which resident (kept for the mount's life)
    disk_bytes: int = 0            # disk tier occupancy


class Counters:
    """The mutable side. Field names match :class:`ReadStatistics`."""

    def __init__(self) -> None:
        for f in dataclasses.fields(ReadStatistics):
            setattr(self, f.name, 0)

    if TYPE_CHECKING:
        # the fields set in __init__, one int per ReadStatistics field
        def __getattr__(self, name: str) -> int: ...

    def add(self, name: str, n: int = 1) -> None:
        setattr(self, name, getattr(self, name) + n)

    def snapshot(self, **gauges: int) -> ReadStatistics:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(ReadStatistics)}
        values.update(gauges)
        return ReadStatistics(**values)
