"""Nodes serve Prometheus metrics by default (``metrics.node_listen``, loopback of their
own host); a clustered mount with ``metrics.listen`` reports its peer READs.

Each scrape runs inside the scraped process's network namespace (a python snippet
with urllib), and is parsed here with prometheus_client's parser.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.cluster import cluster

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, FUSE)")

SCRAPE = ("import sys, urllib.request; sys.stdout.write(urllib.request.urlopen("
          "'http://127.0.0.1:%d/metrics', timeout=10).read().decode())")


def parse(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        assert fam.name.startswith("kspeedfs_"), fam.name
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def total(m: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    return sum(v for ls, v in m.get(name, []) if set(labels.items()) <= set(ls.items()))


def test_nodes_and_a_mount_serve_metrics(tmp_path: Path) -> None:
    src = tmp_path / "source"
    src.mkdir()
    rnd = random.Random(5)
    files = {f"f{i}.bin": rnd.randbytes(600_000) for i in range(6)}
    for rel, data in files.items():
        (src / rel).write_bytes(data)
    with cluster(tmp_path / "c", nodes=2) as c:
        c.ks(["import", str(src), "--name", "met", "--chunk-size", c.chunk_size, "-q"])
        c.ks(["preload", "met", "--timeout", "60"])
        nodes = {}
        for i in (1, 2):
            r = c.node_host(i).run([sys.executable, "-c", SCRAPE % 9470])
            nodes[i] = parse(r.stdout)
        owned = sum(total(m, "kspeedfs_preload_owned_chunks", dataset="met") for m in nodes.values())
        cached = sum(total(m, "kspeedfs_preload_cached_chunks", dataset="met") for m in nodes.values())
        assert owned > 0 and cached == owned                     # R=2 of 2: each owns all
        for i, m in nodes.items():
            assert total(m, "kspeedfs_membership_nodes", node=f"n{i}") == 2
            assert total(m, "kspeedfs_arena_used_bytes") > 0
            assert total(m, "kspeedfs_arena_puts_total") >= total(m, "kspeedfs_arena_used_slots") > 0
        assert sum(total(m, "kspeedfs_node_chunk_loads_total", tier="source")
                   for m in nodes.values()) > 0
        mnt = c.mount("met", "--set", "metrics.listen=127.0.0.1:9480")
        for rel, data in files.items():
            assert (mnt / rel).read_bytes() == data
        r = subprocess.run(c.client_argv([sys.executable, "-c", SCRAPE % 9480]),
                           capture_output=True, text=True, timeout=30, check=True)
        m = parse(r.stdout)
        assert total(m, "kspeedfs_read_bytes_total", dataset="met") >= sum(map(len, files.values()))
        assert total(m, "kspeedfs_chunk_requests_total", tier="peer") > 0
        assert total(m, "kspeedfs_peer_reads_total") > 0
        per_peer = {ls["peer"]: v for ls, v in m["kspeedfs_peer_read_bytes_total"]}
        assert set(per_peer) <= {"n1", "n2"} and sum(per_peer.values()) > 0
        assert total(m, "kspeedfs_membership_nodes") == 2
        assert total(m, "kspeedfs_peer_read_seconds_bucket", le="+Inf") \
            >= total(m, "kspeedfs_peer_reads_total") > 0                   # the hedger's view
        assert total(m, "kspeedfs_chunk_requests_total", tier="source") == 0
        # per NIC: both paths to each peer up, etcd answered; then rail 1 of the client
        # dies: its paths go down (and count it) while rail 2 and etcd stay up
        rail1, rail2 = c.client.address(1), c.client.address(2)
        for nic in (rail1, rail2):
            assert total(m, "kspeedfs_path_up", nic=nic) == 2, m.get("kspeedfs_path_up")
        assert total(m, "kspeedfs_etcd_reachable") == 1
        assert total(m, "kspeedfs_peer_connection_up") == 2
        c.client.nic_down(1)
        try:
            deadline = time.monotonic() + 10
            while True:
                r = subprocess.run(c.client_argv([sys.executable, "-c", SCRAPE % 9480]),
                                   capture_output=True, text=True, timeout=30, check=True)
                m = parse(r.stdout)
                # not UP comes first (SUSPECT), then DOWN, which is what is counted
                if (total(m, "kspeedfs_path_up", nic=rail1) == 0
                        and total(m, "kspeedfs_path_downs_total", nic=rail1) >= 2) \
                        or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert total(m, "kspeedfs_path_up", nic=rail1) == 0
            assert total(m, "kspeedfs_path_up", nic=rail2) == 2
            assert total(m, "kspeedfs_path_downs_total", nic=rail1) >= 2
            assert total(m, "kspeedfs_peer_connection_up") == 2          # degraded, not down
        finally:
            c.client.nic_up(1)
