"""Prometheus metrics of a mount daemon or a node, served over HTTP by ``prometheus-client``.

Nothing on the read path knows about Prometheus: the counters stay the plain ints of
the statistics records (``stats.ReadStatistics``, ``cluster.fetch.PeerStatistics``,
``cluster.node.NodeStatistics``, ``fuse.boundary.OpStats``). At scrape time the HTTP
thread asks the trio thread for one snapshot (``trio.from_thread.run_sync``, so no dict
is read while the loop mutates it) and a custom Collector turns it into families::

    serve(listen, snapshot, collect, labels) ── start_http_server (its own thread,
        its own CollectorRegistry: only kspeedfs_* names) ── _Collector.collect()
            └─ snapshot() in the trio thread ─→ collect(snap, labels) ─→ families

    mount_families   ReadStatistics + PeerStatistics + OpStats + the native engine's
                     counters; labels dataset, version, mountpoint (daemon.serve)
    node_families    NodeStatistics + SSD tier + membership; label node (cluster/node.serve)

Conventions: ``kspeedfs_`` prefix, counters end in ``_total``, base units
(``_bytes``, ``_seconds``); labels tier / peer / op / dataset / version — never a file.
The metric list and a Grafana dashboard: docs/operations.md, mount/grafana-kspeedfs.json.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import trio
from prometheus_client import start_http_server
from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from .config import parse_listen

log = logging.getLogger(__name__)

Families = Iterable[Metric]


class _Families:
    """Builds families whose every sample carries the process's constant labels."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.names = list(labels)
        self.values = list(labels.values())
        self.out: list[Metric] = []

    def counter(self, name: str, doc: str, value: float | None = None,
                by: str | None = None, values: dict[str, float] | None = None) -> None:
        self._add(CounterMetricFamily, name, doc, value, by, values)

    def gauge(self, name: str, doc: str, value: float | None = None,
              by: str | None = None, values: dict[str, float] | None = None) -> None:
        self._add(GaugeMetricFamily, name, doc, value, by, values)

    def _add(self, cls: Any, name: str, doc: str, value: float | None, by: str | None,
             values: dict[str, float] | None) -> None:
        fam = cls(f"kspeedfs_{name}", doc, labels=self.names + ([by] if by else []))
        if by is None:
            fam.add_metric(self.values, value or 0)
        else:
            for k, v in sorted((values or {}).items()):
                fam.add_metric(self.values + [k], v)
        self.out.append(fam)


def _peer_families(f: _Families, p: Any) -> None:
    """PeerStatistics (a mount's reads, or a node's re-replication reads)."""
    f.counter("peer_reads_total", "chunk READs from peer arenas that verified", p.peer_hits)
    f.counter("peer_read_bytes_total", "bytes READ from peer arenas, by peer", by="peer",
              values=dict(p.per_peer_bytes))
    f.counter("peer_misses_total", "chunks no replica held", p.peer_misses)
    f.counter("peer_loads_requested_total", "load-on-demand RPCs sent to owners",
              p.peer_loads_requested)
    f.counter("peer_unreachable_total", "peer READs that found no live path", p.peer_unreachable)
    f.gauge("peer_longest_stall_seconds", "longest replica stall seen (failover wait)",
            p.peer_longest_stall_ms / 1000)
    f.gauge("peer_connection_up",
            "1 if the vQP to the peer is up (reachable or degraded: a path is alive)", by="peer",
            values={n: float(s in ("reachable", "degraded")) for n, s in p.vqps.items()})
    for field, doc in (("peer_hedges", "second-replica READs issued (hedging)"),
                       ("peer_hedges_won", "hedged READs that verified first")):
        if hasattr(p, field):
            f.counter(f"{field}_total", doc, getattr(p, field))
    latency = getattr(p, "peer_latency", None)       # cluster/hedge.py PeerLatency, by peer
    if latency is not None:
        hist = HistogramMetricFamily("kspeedfs_peer_read_seconds",
                                     "peer READ latency (no _sum: the record keeps buckets only)",
                                     labels=f.names + ["peer"])
        bounds = [b / 1000 for b in p.peer_latency_buckets_ms] + [float("inf")]
        for peer, lat in sorted(latency.items()):
            acc, buckets = 0, []
            for bound, n in zip(bounds, lat.counts, strict=False):
                acc += n
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), acc))
            hist.add_metric(f.values + [peer], buckets, None)
        f.out.append(hist)
        f.gauge("peer_hedge_threshold_seconds", "hedge threshold of a 128 KiB READ now",
                by="peer", values={n: lat.threshold_ms / 1000 for n, lat in latency.items()})
        f.gauge("peer_suspected", "1 while the peer is tried last (two overruns in a row)",
                by="peer", values={n: float(lat.suspected) for n, lat in latency.items()})


def _path_families(f: _Families, links: list[Any] | None) -> None:
    """Every path of every vQP (``rdma.vrdma`` VQPStats): by ``peer`` and ``nic`` (the
    local NIC address; one per rail, so bounded). Failovers are READs this path lost to
    another path; rebuilds are its vRDMA reconnects."""
    if links is None:
        return
    rows = [(v.peer, p) for v in links for p in v.paths]
    for name, kind, doc, value in (
            ("path_up", GaugeMetricFamily, "1 while the path is UP (heartbeats answered)",
             lambda p: float(p.state == "UP")),
            ("path_reads_total", CounterMetricFamily, "peer READs completed on the path",
             lambda p: p.reads_ok),
            ("path_read_bytes_total", CounterMetricFamily, "bytes READ on the path",
             lambda p: p.bytes_ok),
            ("path_failovers_total", CounterMetricFamily,
             "READs moved off the path to a surviving one", lambda p: p.reads_failed_over),
            ("path_downs_total", CounterMetricFamily, "times the path went DOWN",
             lambda p: p.downs),
            ("path_reconnects_total", CounterMetricFamily, "vRDMA rebuilds of the path",
             lambda p: p.rebuilds)):
        fam = kind(f"kspeedfs_{name}", doc, labels=f.names + ["peer", "nic"])
        for peer, p in sorted(rows, key=lambda r: (r[0], r[1].local_nic, r[1].path_id)):
            fam.add_metric(f.values + [peer, p.local_nic], value(p))
        f.out.append(fam)


#: the native engine's counters (``NativeSession.transport_stats``) → (name, help)
ENGINE_COUNTERS = {
    "read_misses": ("fuse_read_misses_total", "READs the native engine's C threads could not "
                    "answer from the memory tier (waited for the native fetch, or Python)"),
    "late_hits": ("fuse_read_late_hits_total", "of those, READs answered from the memory "
                  "tier in C on a second look, once their chunks had landed"),
    "prefetch_hints": ("fuse_prefetch_hints_total", "chunks ahead of a reader the C threads "
                       "asked Python to load"),
    "fetch_posted": ("native_fetch_posted_total", "chunk READs from peers posted in C"),
    "fetch_started": ("native_fetch_started_total", "of those, chunks and small files' "
                      "extents C started itself from the routes Python gave it (no prefetch "
                      "hint or READ to Python)"),
    "fetch_started_parts": ("native_fetch_started_parts_total", "of those, small files' "
                            "extents (a READ that missed, started in C)"),
    "fetch_landed": ("native_fetch_landed_total", "chunk READs posted in C that landed verified"),
    "fetch_failed": ("native_fetch_failed_total", "chunk READs posted in C that stepped aside "
                     "(WC error, short READ, stale slot): Python's path took the chunk"),
    "fetch_redundant": ("native_fetch_redundant_total", "chunk READs posted in C that landed "
                        "after a hedge or Python's load had put the chunk"),
    "fetch_parked": ("native_fetch_parked_reads_total", "READs that waited in C for a chunk "
                     "the native fetch had in flight (a READ over several, once per chunk "
                     "it waited for)"),
    "shared_requests": ("fuse_shared_requests_total", "requests read by request threads "
                        "after the first (the solo gate open: several tasks send requests)"),
    "spliced": ("fuse_spliced_replies_total", "READ replies sent by vmsplice + splice "
                "(fuse.splice)"),
    "spliced_bytes": ("fuse_spliced_bytes_total", "bytes of READ replies sent by splice"),
    "ring_requests": ("fuse_ring_requests_total", "requests through FUSE io_uring queues"),
    "ring_copy_bytes": ("fuse_ring_copy_bytes_total", "READ bytes copied into io_uring "
                        "payload buffers"),
}


def _engine_families(f: _Families, engine: dict[str, Any] | None) -> None:
    """The native engine's counters, those it has (none for the pyfuse3 engine)."""
    for key, (name, doc) in ENGINE_COUNTERS.items():
        if engine and key in engine:
            f.counter(name, doc, engine[key])


def _etcd_family(f: _Families, reachable: bool | None) -> None:
    if reachable is not None:
        f.gauge("etcd_reachable", "1 if the last etcd request was answered", float(reachable))


def mount_families(snap: dict[str, Any], labels: dict[str, str]) -> Families:
    """``snap``: {"read": ReadStatistics, "peers": PeerStatistics | None,
    "ops": {op: [count, errors, seconds, *buckets]}, "bounds": OpStats.BOUNDS,
    "members": int | None, optional "links": [VQPStats], "etcd_reachable": bool,
    "engine": the native engine's counters}."""
    f = _Families(labels)
    r = snap["read"]
    f.counter("read_requests_total", "FUSE read requests", r.reads)
    f.counter("python_read_requests_total", "FUSE read requests answered by the Python thread "
              "(the native engine answers the rest in C)", r.python_reads)
    f.counter("read_bytes_total", "bytes returned to readers", r.read_bytes)
    f.counter("chunk_requests_total", "chunk requests served, by the tier that served them",
              by="tier", values={"memory": r.memory_hits, "disk": r.disk_hits,
                                 "peer": r.peer_hits, "source": r.source_loads})
    f.counter("tier_read_bytes_total", "bytes loaded into the memory tier, by tier read",
              by="tier", values={"peer": r.peer_bytes, "source": r.source_bytes})
    f.counter("cache_hits_total", "chunk requests served by a cache tier (memory, disk, peer)",
              r.memory_hits + r.disk_hits + r.peer_hits)
    f.counter("cache_misses_total", "chunk requests that went to the source", r.source_loads)
    f.counter("checksum_failures_total", "data that failed its checksum, by where it came from",
              by="tier", values={"cache": r.corrupt_discarded, "source": r.source_mismatches,
                                 "block": r.block_fallbacks,
                                 "peer": snap["peers"].peer_checksum_retries if snap["peers"] else 0})
    f.counter("source_changed_total", "chunk loads that found a changed source file",
              r.source_changed)
    f.counter("prefetched_chunks_total", "chunk loads started by the prefetcher", r.prefetched)
    f.counter("single_flight_joins_total", "requests that joined an in-flight load",
              r.waited_in_flight)
    f.counter("page_cache_pushed_bytes_total", "bytes stored into the kernel page cache ahead",
              r.pushed_bytes)
    f.gauge("cache_used_bytes", "cache tier occupancy", by="tier",
            values={"memory": r.memory_bytes, "disk": r.disk_bytes})
    f.gauge("cache_resident_bytes", "memory tier bytes kept for the mount's life",
            r.memory_resident_bytes)
    if snap["peers"] is not None:
        _peer_families(f, snap["peers"])
    if snap.get("members") is not None:
        f.gauge("membership_nodes", "nodes in this process's membership view", snap["members"])
    _path_families(f, snap.get("links"))
    _etcd_family(f, snap.get("etcd_reachable"))
    _engine_families(f, snap.get("engine"))
    ops: dict[str, list[Any]] = snap["ops"]
    f.counter("fuse_operations_total", "FUSE operations answered", by="op",
              values={op: row[0] for op, row in ops.items()})
    f.counter("fuse_errors_total", "FUSE operations answered with an errno", by="op",
              values={op: row[1] for op, row in ops.items()})
    hist = HistogramMetricFamily("kspeedfs_fuse_operation_seconds", "FUSE operation latency",
                                 labels=f.names + ["op"])
    for op, row in sorted(ops.items()):
        if not row[0]:
            continue
        acc, buckets = 0, []
        for bound, n in zip([*snap["bounds"], float("inf")], row[3:], strict=False):
            acc += n
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), acc))
        hist.add_metric(f.values + [op], buckets, row[2])
    f.out.append(hist)
    return f.out


def node_families(snap: dict[str, Any], labels: dict[str, str]) -> Families:
    """``snap``: {"node": NodeStatistics, "disk_bytes": int | None, "members": int,
    optional "links": [VQPStats], "etcd_reachable": bool}."""
    f = _Families(labels)
    s = snap["node"]
    a, c = s.arena, s.counters
    f.gauge("arena_capacity_bytes", "memory arena registered for RDMA", a.capacity)
    f.gauge("arena_used_bytes", "memory arena bytes holding chunks", a.used_bytes)
    f.gauge("arena_slots", "arena slots", a.slots)
    f.gauge("arena_used_slots", "arena slots holding a chunk", a.used_slots)
    f.counter("arena_evictions_total", "chunks evicted from the arena", a.evictions)
    f.counter("arena_puts_total", "chunks stored into the arena", a.puts)
    f.counter("arena_refused_total", "chunks not stored: room would have evicted a higher "
              "priority (cluster/lifecycle.py), or a chunk of their own rank in both their "
              "full index buckets or, without an SSD tier, a full arena (cluster/arena.py)",
              a.refused)
    f.counter("node_unloaded_chunks_total", "chunks dropped because their dataset was unloaded",
              c.unloaded)
    f.counter("node_chunk_loads_total", "chunks this node loaded into its arena, by tier read",
              by="tier", values={"source": c.source_loads, "peer": c.peer_loads,
                                 "disk": c.disk_loads})
    f.counter("node_load_bytes_total", "bytes this node loaded, by tier read", by="tier",
              values={"source": c.source_bytes, "peer": c.peer_bytes})
    f.counter("node_demand_loads_total", "load RPCs from readers", c.demand_loads)
    f.counter("node_rereplicated_chunks_total", "chunks copied because membership changed",
              c.rereplicated)
    f.counter("ssd_spilled_chunks_total", "evicted owned chunks written to the SSD tier",
              c.spilled)
    f.counter("node_manifest_pages_copied_total", "manifest pages copied into this host's page "
              "copy (cluster/page_copy.py), by where they came from", by="tier",
              values={"peer": c.pages_from_peers, "store": c.pages_from_store})
    f.counter("node_manifest_pages_refused_total", "peers' manifest page replies that failed "
              "their checks", c.pages_refused)
    f.counter("node_manifest_pages_served_total", "manifest pages this node sent to peers",
              c.pages_served)
    if snap["disk_bytes"] is not None:
        f.gauge("cache_used_bytes", "cache tier occupancy", by="tier",
                values={"disk": snap["disk_bytes"]})
    f.gauge("membership_nodes", "nodes in this process's membership view", snap["members"])
    prog = {tag.rpartition("@"): p for tag, p in s.progress.items()}
    for key, doc in (("owned", "chunks this node owns"), ("cached", "owned chunks it holds")):
        fam = GaugeMetricFamily(f"kspeedfs_preload_{key}_chunks", f"preload: {doc}",
                                labels=f.names + ["dataset", "version"])
        for (ds, _, v), p in sorted(prog.items()):
            fam.add_metric(f.values + [ds, v], p.get(key, 0))
        f.out.append(fam)
    fam = GaugeMetricFamily("kspeedfs_preload_owned_bytes", "preload: bytes of owned chunks",
                            labels=f.names + ["dataset", "version"])
    for (ds, _, v), p in sorted(prog.items()):
        fam.add_metric(f.values + [ds, v], p.get("owned_bytes", 0))
    f.out.append(fam)
    _peer_families(f, s.reads)
    _path_families(f, snap.get("links"))
    _etcd_family(f, snap.get("etcd_reachable"))
    return f.out


class _Collector:
    def __init__(self, token: trio.lowlevel.TrioToken, snapshot: Callable[[], Any],
                 collect: Callable[[Any, dict[str, str]], Families], labels: dict[str, str]) -> None:
        self.token, self.snapshot, self.collect_fn, self.labels = token, snapshot, collect, labels

    def collect(self) -> Families:
        try:
            snap = trio.from_thread.run_sync(self.snapshot, trio_token=self.token)
        except trio.RunFinishedError:
            return []
        return self.collect_fn(snap, self.labels)


@contextmanager
def serve(key: str, listen: str, snapshot: Callable[[], Any],
          collect: Callable[[Any, dict[str, str]], Families],
          labels: dict[str, str]) -> Iterator[tuple[str, int] | None]:
    """Serve ``collect(snapshot(), labels)`` at ``listen`` until the block exits; call from
    the trio thread. Yields the bound (host, port), or None when off or the bind failed
    (logged: metrics are never worth the daemon)."""
    addr = parse_listen(key, listen)
    if addr is None:
        yield None
        return
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(trio.lowlevel.current_trio_token(), snapshot, collect, labels))
    try:
        server, thread = start_http_server(addr[1], addr[0], registry=registry)
    except OSError as e:
        log.error("%s: cannot serve metrics at %s: %s", key, listen, e)
        yield None
        return
    log.info("metrics at http://%s:%d/metrics", *addr)
    try:
        yield addr
    finally:
        server.shutdown()
        server.server_close()
