"""Cluster read throughput, then re-replication after a node is lost (stand-alone).

    python -m bench.cluster_read [--mb 600] [--rounds 2]

The reads are the suite's ``cluster`` workload (``python -m bench -w cluster``, which
interleaves them with the source and ramfs-py baselines and writes the usual
results); this script keeps them for a quick look and adds what the suite does not
measure: one node SIGKILLed, time until every chunk has R copies again, per GB
re-replicated. The test-bed, the readers and the cleanup are those of :mod:`bench.cluster`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from . import datasets
from .cluster import ClusterBed, seq_read
from .system import Mounts, drop_caches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=600, help="dataset size")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kspeedfs-bench-cluster-", dir="/var/tmp"))
    ds = datasets.big_files(work / "data", max(1, args.mb // 50), 50 << 20)
    paths = ds.paths()
    bed = ClusterBed(work / "c", ds)
    mounts = Mounts()
    try:
        c = bed.ensure()
        results: dict[str, list[float]] = {"source cold": [], "source warm": [], "kspeedfs peers": []}
        for _ in range(args.rounds):
            drop_caches()
            results["source cold"].append(seq_read(ds.root, paths)["MB/s"])
            results["source warm"].append(seq_read(ds.root, paths)["MB/s"])
            mnt = bed.mount(mounts)
            drop_caches()
            results["kspeedfs peers"].append(seq_read(mnt, paths)["MB/s"])
            stats = json.loads(os.getxattr(mnt, "user.kspeedfs.stats"))
            assert stats["source_loads"] == 0, stats
            mounts.remove(mnt)
        med = {k: statistics.median(v) for k, v in results.items()}
        print(f"dataset {ds.bytes // 10**6} MB, 4 sequential readers, "
              f"{args.rounds} interleaved rounds (median):")
        for k, v in med.items():
            print(f"  {k:<16} {v:8.0f} MB/s   {v / med['source cold']:5.2f}x source cold   "
                  f"{v / med['source warm']:5.2f}x source warm")
        print(f"preload of {ds.bytes * 2 // 10**6} MB of replicas by 3 nodes: {bed.preload_s:.1f}s")
        t_kill = time.monotonic()
        c.kill_node(2)
        c.wait_nodes(2, timeout=60)
        t_gone = time.monotonic()
        while c.ks(["preload", ClusterBed.dataset, "--check"], check=False).returncode != 0:
            time.sleep(0.2)
        t_done = time.monotonic()
        moved = ds.bytes * 2 / 3 / 2**30        # GB: n2's share of the replicas
        print(f"node killed: lease expired after {t_gone - t_kill:.1f}s; R copies again "
              f"{t_done - t_gone:.1f}s later = {(t_done - t_gone) / moved:.1f} s per GB re-replicated")
    finally:
        mounts.close()
        bed.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
