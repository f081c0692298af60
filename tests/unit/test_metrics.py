"""The exposition of ``metrics.py`` from synthetic statistics records: names, labels,
the config's address validation, and the boundary's per-op counters."""
from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest
import trio
from prometheus_client import generate_latest
from prometheus_client.core import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kspeedfs import metrics
from kspeedfs.cluster.arena import ArenaStatistics
from kspeedfs.cluster.node_stats import NodeCounters
from kspeedfs.config import parse_listen
from kspeedfs.errors import ConfigError
from kspeedfs.fuse.boundary import OpStats, fuse_op
from kspeedfs.stats import ReadStatistics

ALLOWED = {"dataset", "version", "mountpoint", "node", "peer", "nic", "tier", "op", "le"}


def peers() -> SimpleNamespace:
    return SimpleNamespace(peer_hits=3, per_peer_bytes={"n1": 10, "n2": 20}, peer_misses=1,
                           peer_loads_requested=2, peer_unreachable=0, peer_longest_stall_ms=1.5,
                           vqps={"n1": "reachable", "n2": "unreachable"}, peer_checksum_retries=1,
                           peer_hedges=4, peer_hedges_won=2, peer_latency_buckets_ms=(1.0, 10.0),
                           peer_latency={"n1": SimpleNamespace(counts=(2, 1, 1), threshold_ms=4.0,
                                                               suspected=False)})


def links() -> list:
    """Two vQPs as rdma.vrdma reports them: n1 with both paths UP, n2 with rail 2 DOWN."""
    def path(nic: str, state: str, fo: int, rebuilds: int) -> SimpleNamespace:
        return SimpleNamespace(path_id=int(nic[-1]), local_nic=nic, state=state, reads_ok=5,
                               bytes_ok=500, reads_failed_over=fo, downs=rebuilds,
                               rebuilds=rebuilds)
    return [SimpleNamespace(peer="n1", paths=(path("198.18.1.1", "UP", 0, 0),
                                              path("198.18.2.1", "UP", 0, 0))),
            SimpleNamespace(peer="n2", paths=(path("198.18.1.1", "UP", 0, 0),
                                              path("198.18.2.1", "DOWN", 3, 2)))]


def exposition(families: list) -> str:
    class C:
        def collect(self):
            return families
    reg = CollectorRegistry(auto_describe=False)
    reg.register(C())
    return generate_latest(reg).decode()


def check(text: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        assert fam.name.startswith("kspeedfs_"), fam.name
        for s in fam.samples:
            assert set(s.labels) <= ALLOWED, (s.name, s.labels)
            assert "file" not in s.name and "path" not in s.labels
            out[s.name + str(sorted(s.labels.items()))] = s.value
    return out


def test_mount_exposition() -> None:
    ops = OpStats()
    ops.record("read", 0.0003, 0)
    ops.record("read", 3.0, 0)
    ops.record("lookup", 0.00001, 2)
    engine = {"transport": "native /dev/fuse", "read_misses": 9, "fetch_landed": 7,
              "fetch_redundant": 2, "ring_lost": 0}
    snap = {"read": ReadStatistics(reads=5, read_bytes=100, memory_hits=2, source_loads=1),
            "peers": peers(), "ops": ops.rows, "bounds": OpStats.BOUNDS, "members": 3,
            "engine": engine}
    text = exposition(list(metrics.mount_families(
        snap, {"dataset": "ds", "version": "1", "mountpoint": "/mnt/x"})))
    v = check(text)
    lab = "('dataset', 'ds'), ('mountpoint', '/mnt/x'), "
    assert v["kspeedfs_fuse_read_misses_total[" + lab + "('version', '1')]"] == 9
    assert v["kspeedfs_native_fetch_landed_total[" + lab + "('version', '1')]"] == 7
    assert v["kspeedfs_native_fetch_redundant_total[" + lab + "('version', '1')]"] == 2
    assert "kspeedfs_native_fetch_failed_total" not in text      # only what the engine has
    assert "transport" not in text and "ring_lost" not in text
    assert v["kspeedfs_read_bytes_total[" + lab + "('version', '1')]"] == 100
    assert v["kspeedfs_chunk_requests_total[" + lab + "('tier', 'memory'), ('version', '1')]"] == 2
    assert v["kspeedfs_peer_read_bytes_total[" + lab + "('peer', 'n2'), ('version', '1')]"] == 20
    assert v["kspeedfs_peer_connection_up[" + lab + "('peer', 'n2'), ('version', '1')]"] == 0
    assert v["kspeedfs_peer_connection_up[" + lab + "('peer', 'n1'), ('version', '1')]"] == 1
    assert v["kspeedfs_fuse_errors_total[" + lab + "('op', 'lookup'), ('version', '1')]"] == 1
    b = "kspeedfs_fuse_operation_seconds_bucket[('dataset', 'ds'), ('le', '{}'), " \
        "('mountpoint', '/mnt/x'), ('op', 'read'), ('version', '1')]"
    assert v[b.format("0.0005")] == 1 and v[b.format("2.5")] == 1 and v[b.format("+Inf")] == 2
    assert v["kspeedfs_membership_nodes[" + lab + "('version', '1')]"] == 3
    p = "kspeedfs_peer_read_seconds_bucket[('dataset', 'ds'), ('le', '{}'), " \
        "('mountpoint', '/mnt/x'), ('peer', 'n1'), ('version', '1')]"
    assert v[p.format("0.01")] == 3 and v[p.format("+Inf")] == 4


def test_node_exposition() -> None:
    fields = {f.name: 1 for f in dataclasses.fields(ArenaStatistics)}
    s = SimpleNamespace(arena=ArenaStatistics(**fields),
                        counters=NodeCounters(source_loads=7, pages_from_peers=11, pages_served=2),
                        reads=peers(),
                        progress={"imagenet@3": {"owned": 10, "cached": 4, "owned_bytes": 99}})
    text = exposition(list(metrics.node_families({"node": s, "members": 3, "disk_bytes": 5,
                                                  "links": links(), "etcd_reachable": False},
                                                 {"node": "n1"})))
    v = check(text)
    assert v["kspeedfs_preload_cached_chunks[('dataset', 'imagenet'), ('node', 'n1'), "
             "('version', '3')]"] == 4
    assert v["kspeedfs_node_chunk_loads_total[('node', 'n1'), ('tier', 'source')]"] == 7
    assert v["kspeedfs_node_manifest_pages_copied_total[('node', 'n1'), ('tier', 'peer')]"] == 11
    assert v["kspeedfs_node_manifest_pages_served_total[('node', 'n1')]"] == 2
    assert v["kspeedfs_cache_used_bytes[('node', 'n1'), ('tier', 'disk')]"] == 5
    path = "[('nic', '198.18.2.1'), ('node', 'n1'), ('peer', 'n2')]"
    assert v["kspeedfs_path_up" + path] == 0 and v["kspeedfs_path_failovers_total" + path] == 3
    assert v["kspeedfs_path_reconnects_total" + path] == 2
    assert v["kspeedfs_path_up[('nic', '198.18.2.1'), ('node', 'n1'), ('peer', 'n1')]"] == 1
    assert v["kspeedfs_etcd_reachable[('node', 'n1')]"] == 0


@pytest.mark.parametrize("value,want", [("", None), (":9470", ("0.0.0.0", 9470)),
                                        ("127.0.0.1:1", ("127.0.0.1", 1)),
                                        ("localhost:65535", ("127.0.0.1", 65535))])
def test_listen_addresses(value: str, want: object) -> None:
    assert parse_listen("metrics.listen", value) == want


@pytest.mark.parametrize("value", ["9470", ":0", ":65536", "host:x", "example.com:80", "::1:80"])
def test_bad_listen_addresses(value: str) -> None:
    with pytest.raises(ConfigError, match="metrics.listen"):
        parse_listen("metrics.listen", value)


async def test_a_port_in_use_is_logged_not_fatal(caplog: pytest.LogCaptureFixture) -> None:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with metrics.serve("metrics.listen", f"127.0.0.1:{port}", dict,
                           lambda snap, labels: [], {}) as addr:
            assert addr is None
    assert "cannot serve metrics" in caplog.text
    await trio.sleep(0)


def test_the_grafana_dashboard_queries_only_exported_names() -> None:
    import json
    import re
    from pathlib import Path
    dash = Path(__file__).resolve().parents[2] / "mount" / "grafana-kspeedfs.json"
    exprs = [t["expr"] for p in json.loads(dash.read_text())["panels"] for t in p.get("targets", [])]
    used = {re.sub(r"_(bucket|count|sum)$", "", n) for e in exprs for n in re.findall(r"kspeedfs_\w+", e)}
    ops = OpStats()
    ops.record("read", 0.001, 0)
    mount = metrics.mount_families({"read": ReadStatistics(), "peers": peers(), "ops": ops.rows,
                                    "bounds": OpStats.BOUNDS, "members": 1, "links": links(),
                                    "etcd_reachable": True,
                                    "engine": dict.fromkeys(metrics.ENGINE_COUNTERS, 0)}, {})
    node = metrics.node_families({"node": SimpleNamespace(
        arena=ArenaStatistics(**{f.name: 0 for f in dataclasses.fields(ArenaStatistics)}),
        counters=NodeCounters(), reads=peers(), progress={}), "members": 1, "disk_bytes": 0}, {})
    exported = {f.name for f in [*mount, *node]}
    exported |= {n + "_total" for n in exported}     # CounterMetricFamily drops the suffix
    assert used and used <= exported, used - exported


class _Queued:
    """A handler whose request waited before it ran (the native engine's queue)."""

    slow_op = 0.2

    def __init__(self) -> None:
        self.op_stats = OpStats()

    @fuse_op
    async def read(self, entry: int) -> bytes:
        return b""


async def test_a_queued_request_counts_its_wait_in_its_latency(
        caplog: pytest.LogCaptureFixture) -> None:
    ops = _Queued()
    await ops.read(1)                                  # answered at once: no wait
    await ops.read(1, since=time.monotonic() - 0.3)    # arrived 0.3 s before it ran
    count, errors, seconds, *buckets = ops.op_stats.rows["read"]
    assert (count, errors) == (2, 0) and 0.3 <= seconds < 0.4, ops.op_stats.rows["read"]
    fast = OpStats.BOUNDS.index(0.01) + 1
    assert sum(buckets[:fast]) == 1 and buckets[OpStats.BOUNDS.index(0.5)] == 1, buckets
    assert "slow operation: read took 0.3" in caplog.text    # the warning sees the wait
