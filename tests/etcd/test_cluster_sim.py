"""A small run of the cluster simulator (``bench.cluster_sim``) yields every report field.

The big runs (N = 100, 300, 1000) are a bench; this runs N = 10 nodes and 5 mounts for a
few seconds against its own 3-member etcd, to keep the simulator working: agents
register, views list and watch, a killed node's lease lapses and every view sees it
go (within the TTL and the simulator's slack), a join is seen, and placement moves are
counted without foreign movement."""
from __future__ import annotations

import json
from pathlib import Path

from bench.cluster_sim import main


def test_a_small_simulation_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    assert main(["--nodes", "10", "--mounts-per-node", "0.5", "--ttl", "2", "--window", "1.5",
                 "--settle", "0.5", "--put-seconds", "1", "--list-seconds", "0.5",
                 "--chunks", "300", "--json", str(out), "--log-dir", str(tmp_path)]) == 0
    doc = json.loads(out.read_text())
    assert doc["baseline"]["ops_s"] > 0
    (run,) = doc["runs"]
    assert (run["nodes"], run["mounts"], run["views"]) == (10, 5, 14)
    steady, quiet = run["steady"], run["no_stats"]
    assert steady["puts_s"] > 0 and steady["keepalives_s"] > 0 and steady["etcd_cpu"] > 0
    assert steady["stats_puts_s"] > 0 and steady["sim_cpu"] > 0
    assert quiet["puts_s"] < steady["puts_s"]          # the stats' share is visible
    assert run["list_loop"]["ops_s"] > 0
    for change in ("leave", "join"):
        c = run[change]
        assert c["seen_by"] == c["of"] == 14 and c["stale_views"] == 0, change
        assert c["events_per_view"] >= 1
        assert c["moves"]["foreign"] == 0 and c["moves"]["moved"] > 0
    assert 0.5 < run["leave"]["first_s"] < 2 + 10        # ttl 2 s, and a loaded machine
