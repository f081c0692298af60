"""``kspeedfs stats`` without a mount or a cluster: rates from synthetic readings (a
mount's ``stats`` xattr records, nodes' ``stats/<node>`` etcd records) and the plain
and rich forms of a sample."""
from __future__ import annotations

import io
from dataclasses import asdict, replace
from typing import Any

from kspeedfs.cli import stats, terminal
from kspeedfs.stats import ReadStatistics

T0 = 1_700_000_000.0


def mount_record(t: float, **counters: int) -> dict[str, Any]:
    ops = {"read": counters.get("reads", 0), "lookup": counters.pop("lookups", 0)}
    return asdict(replace(ReadStatistics(), **counters)) | {"ops": ops, "time": t}


def test_mount_rates_per_tier_and_hit_ratio() -> None:
    before = mount_record(T0, reads=100, python_reads=10, read_bytes=10 << 20, memory_hits=50,
                          source_loads=5)
    after = mount_record(T0 + 2, reads=300, python_reads=30, read_bytes=(10 << 20) + 4_000_000,
                         memory_hits=140,
                         disk_hits=4, disk_hit_bytes=2_000_000, source_loads=11,
                         source_bytes=6_000_000, lookups=40, memory_bytes=3 << 30)
    s = stats.mount_sample(before, after, 2.0)
    assert s["reads_per_s"] == 100 and s["read_mb_per_s"] == 2.0
    assert s["python_reads_per_s"] == 10 and s["totals"]["python_reads"] == 30
    assert s["ops_per_s"] == 120                           # 200 reads + 40 lookups in 2 s
    assert s["tiers"]["memory"] == {"chunks_per_s": 45, "mb_per_s": None}
    assert s["tiers"]["disk"] == {"chunks_per_s": 2, "mb_per_s": 1.0}
    assert s["tiers"]["source"] == {"chunks_per_s": 3, "mb_per_s": 3.0}
    assert s["hit_ratio"] == round(94 / 100, 4)            # 90 + 4 hits, 6 source loads
    assert s["totals"]["reads"] == 300 and "peer" not in s  # not a cluster mount


def test_a_counter_that_went_backwards_counts_as_zero() -> None:
    before = mount_record(T0, reads=500, read_bytes=1 << 30)
    after = mount_record(T0 + 1, reads=3, read_bytes=4096)    # a new daemon (an upgrade)
    s = stats.mount_sample(before, after, 1.0)
    assert s["reads_per_s"] == 0 and s["read_mb_per_s"] == 0 and s["ops_per_s"] == 0
    assert s["hit_ratio"] is None


def test_a_cluster_mount_shows_its_peer_reads() -> None:
    peer = {"vqps": {"n1": "reachable", "n2": "degraded"}, "peer_hedges": 10, "peer_hedges_won": 4,
            "peer_unreachable": 0, "peer_checksum_retries": 0, "peer_longest_wait_ms": 12.5,
            "peer_latency": {"n2": {"suspected": True, "counts": [1]}}}
    s = stats.mount_sample(mount_record(T0) | peer, mount_record(T0 + 1) | peer | {"peer_hedges": 14},
                           1.0)
    assert s["peer"]["hedges_per_s"] == 4 and s["peer"]["suspected"] == ["n2"]
    line = stats._peer_line(s["peer"])
    assert "hedged 4.0/s" in line and "n2 degraded (suspected)" in line


def test_mount_plain_output_is_one_line_per_sample_under_one_header() -> None:
    s = stats.mount_sample(mount_record(T0), mount_record(T0 + 1, reads=7, read_bytes=7 << 20), 1.0)
    first, later = stats.mount_lines(s, first=True), stats.mount_lines(s, first=False)
    assert len(first) == 2 and len(later) == 1 and first[1] == later[0]
    assert first[0].split() == stats.MOUNT_COLUMNS
    assert len(first[0]) == len(first[1])                 # the columns line up
    assert later[0].split()[1:4] == ["7.0", "7.0", "7.3"]   # ops/s, reads/s, MB/s


def node_record(t: float, source_loads: int, evictions: int, failed_over: int,
                path2: str = "UP") -> dict[str, Any]:
    """A ``stats/<node>`` record as nodes publish it (``asdict(NodeStatistics)``)."""
    return {"node": "n1", "time": t,
            "arena": {"slots": 64, "used_slots": 32, "used_bytes": 128 << 20, "capacity": 256 << 20,
                      "evictions": evictions, "puts": 40},
            "counters": {"source_loads": source_loads, "source_bytes": source_loads * (4 << 20),
                         "peer_loads": 0, "peer_bytes": 0, "demand_loads": 2, "rereplicated": 0},
            "reads": {"peer_hits": 0},
            "endpoint": {"nics": ["198.18.1.11", "198.18.2.11"], "peers": {
                "n2": {"state": "reachable" if path2 == "UP" else "degraded",
                       "reads_failed_over": failed_over,
                       "paths": {"198.18.1.11->198.18.1.12": "UP",
                                 "198.18.2.11->198.18.2.12": path2}}}},
            "progress": {}}


def reading(t: float, **records: dict[str, Any]) -> dict[str, Any]:
    return {"time": t, "live": {"n1": 256 << 20, "n2": 256 << 20}, "stats": records}


def test_cluster_rates_per_node_from_their_own_timestamps() -> None:
    rates = stats.ClusterRates()
    rates.start(reading(T0, n1=node_record(T0, 10, 0, 0)))
    s = rates.update(reading(T0 + 1, n1=node_record(T0 + 2, 30, 4, 3, path2="DOWN")))
    n1 = s["nodes"]["n1"]
    assert n1["source_loads_per_s"] == 10 and n1["load_mb_per_s"] == round(20 * (4 << 20) / 2e6, 2)
    assert n1["evictions_per_s"] == 2 and n1["failovers_per_s"] == 1.5
    assert (n1["paths_up"], n1["paths"]) == (1, 2) and n1["used_bytes"] == 128 << 20
    assert s["nodes"]["n2"] == {"published": False, "capacity": 256 << 20}
    again = rates.update(reading(T0 + 2, n1=node_record(T0 + 2, 30, 4, 3, path2="DOWN")))
    assert again["nodes"]["n1"]["source_loads_per_s"] == 10     # the same record: rates kept


def test_cluster_plain_output_names_the_paths_that_are_down() -> None:
    rates = stats.ClusterRates()
    rates.start(reading(T0, n1=node_record(T0, 10, 0, 0)))
    lines = stats.cluster_lines(rates.update(reading(T0 + 1, n1=node_record(T0 + 2, 30, 4, 3, "DOWN"))))
    assert lines[0].endswith("2 live node(s)")
    assert lines[1].split() == ["NODE", *stats.CLUSTER_COLUMNS[1:]]
    assert lines[2].split()[:2] == ["n1", "10.0"] and "1/2" in lines[2].split()
    assert "n1 to n2: degraded (198.18.1.11->198.18.1.12 UP, 198.18.2.11->198.18.2.12 DOWN)" in lines[-2]
    assert lines[-1].strip() == "n2: no stats record yet"
    assert all("\x1b" not in line for line in lines)


def test_both_views_render_on_a_terminal_console() -> None:
    out = io.StringIO()
    console = terminal.console(out)
    ms = stats.mount_sample(mount_record(T0), mount_record(T0 + 1, reads=5), 1.0)
    console.print(stats._mount_view(ms, "ds@1 at /mnt/ds", 1.0, first=True)[0])
    rates = stats.ClusterRates()
    rates.start(reading(T0, n1=node_record(T0, 10, 0, 0)))
    console.print(stats._cluster_view(rates.update(reading(T0 + 1, n1=node_record(T0 + 2, 30, 4, 3))),
                                      "", 1.0, first=True)[0])
    text = out.getvalue()
    assert "ds@1 at /mnt/ds" in text and "source" in text and "every vQP reachable" not in text
    assert "n2: no stats record yet" in text
