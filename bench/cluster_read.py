"""Cluster read throughput and re-replication, each figure next to its in-run baseline.

    python -m bench.cluster_read [--mb 600] [--rounds 2]

On netns test hosts (etcd + 3 nodes × 2 NICs + a client, ``tests/fixtures/cluster.py``):

* sequential whole-file reads with 4 readers of a preloaded dataset through the mount
  (chunks from the peers' memory over the soft vRDMA transport), against the same files
  read directly from the source directory (page cache dropped before each pass, so the
  source is read from disk, as NFS/Lustre would be) and, as the upper bound of this
  machine, the source read again warm from the page cache. Rounds are interleaved.
* one node SIGKILLed: time until every chunk has R copies again, per GB re-replicated.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def read_files(root: Path, rels: list[Path], workers: int = 4) -> tuple[int, float]:
    def one(rel: Path) -> int:
        n = 0
        with open(root / rel, "rb", buffering=0) as f:
            while chunk := f.read(1 << 20):
                n += len(chunk)
        return n

    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        total = sum(pool.map(one, rels))
    return total, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=600, help="dataset size")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    sys.path.insert(0, str(CHECKOUT))
    from tests.fixtures.cluster import Cluster

    work = Path(tempfile.mkdtemp(prefix="kspeedfs-bench-cluster-", dir="/var/tmp"))
    src = work / "source"
    src.mkdir()
    for i in range(args.mb // 50):
        (src / f"shard{i:03d}.bin").write_bytes(os.urandom(50 << 20))
    rels = sorted(p.relative_to(src) for p in src.iterdir())
    c = Cluster(work / "c", nodes=3, chunk_size="4MiB", node_memory=f"{args.mb + 256}MiB")
    try:
        c.start()
        c.ks(["import", str(src), "--name", "bench", "-q"])
        t0 = time.monotonic()
        c.ks(["preload", "bench", "--timeout", "600"])
        preload_s = time.monotonic() - t0
        results: dict[str, list[float]] = {"source cold": [], "source warm": [], "kspeedfs peers": []}
        for _ in range(args.rounds):
            drop_caches()
            n, dt = read_files(src, rels)
            results["source cold"].append(n / dt)
            n, dt = read_files(src, rels)
            results["source warm"].append(n / dt)
            mnt = c.mount("bench", "--cache-mem", "64MiB")
            drop_caches()
            n, dt = read_files(mnt, rels)
            results["kspeedfs peers"].append(n / dt)
            stats = json.loads(os.getxattr(mnt, "user.kspeedfs.stats"))
            assert stats["source_loads"] == 0, stats
            c.unmount(mnt)
        med = {k: statistics.median(v) for k, v in results.items()}
        print(f"dataset {args.mb} MB, 4 sequential readers, {args.rounds} interleaved rounds (median):")
        for k, v in med.items():
            print(f"  {k:<16} {v / 1e6:8.0f} MB/s   {v / med['source cold']:5.2f}x source cold   "
                  f"{v / med['source warm']:5.2f}x source warm")
        print(f"preload of {args.mb * 2} MB of replicas by 3 nodes: {preload_s:.1f}s")
        t_kill = time.monotonic()
        c.kill_node(2)
        c.wait_nodes(2, timeout=60)
        t_gone = time.monotonic()
        while c.ks(["preload", "bench", "--check"], check=False).returncode != 0:
            time.sleep(0.2)
        t_done = time.monotonic()
        moved = args.mb * 2 / 3 / 1024        # GB: n2's share of the replicas
        print(f"node killed: lease expired after {t_gone - t_kill:.1f}s; R copies again "
              f"{t_done - t_gone:.1f}s later = {(t_done - t_gone) / moved:.1f} s per GB re-replicated")
    finally:
        c.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
