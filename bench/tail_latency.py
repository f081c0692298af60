"""Tail latency of reads through a mount, with and without hedged peer READs.

    python -m bench.tail_latency [--reps 2] [--readers 8] [--seconds 4] [--plot FILE.png]

The cluster and readers of ``tests/cluster/test_cluster_tail.py`` (etcd + 3 nodes on
netns hosts, R = 2, 256 KiB chunks, ~47 MiB preloaded; two mounts with an 8 MiB memory
tier, ``cluster.hedge`` off and on; readers verify every byte of random 64 KiB reads and
time each one). Per repetition and mount: no fault for ``--seconds``; then no fault with
both mounts read at once (half the readers each: one window, the same noise, so the
reads ratio on/off is hedging's throughput cost; printed at the end); node 2 slowed but
alive (stopped 20 ms of every 25 ms) for ``--seconds``; node 2 SIGSTOPped
for 1.5 s inside a 3.5 s window; then node 2 SIGKILLed while both mounts read (half the
readers each) and restarted. Prints p50 / p99 / p99.9 / max per case, and the hedged
share of the bytes READ.

What it measured, run by run, and what changed between the runs: docs/benchmarks.md,
"Tail latency with a hung or dead replica".
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from tests.cluster.test_cluster_tail import Readers, Stutter, _make_source
from tests.fixtures.cluster import cluster, mount_stats

QUANTILES = (("p50", 0.5), ("p99", 0.99), ("p99.9", 0.999))


def _row(case: str, mode: str, rd: Readers, hedged: float | None = None) -> str:
    q = [rd.quantile(x) * 1e3 for _, x in QUANTILES]
    share = "" if hedged is None else f"{hedged:.2%}"
    return (f"| {case} | {mode} | {len(rd.latencies)} | {q[0]:.1f} | {q[1]:.1f} | {q[2]:.1f} | "
            f"{max(rd.latencies, default=0) * 1e3:.0f} | {len(rd.errors)} | {share} |")


def plot(runs: dict[tuple[str, str], list[Readers]], path: Path) -> Path | None:
    """Grouped bars, log scale: p50 / p99 / p99.9 / max per case, hedging off and on
    (the median over repetitions). None where matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    cases = list(dict.fromkeys(case for case, _ in runs))
    stats = [*QUANTILES, ("max", 1.0)]
    fig, axes = plt.subplots(1, len(cases), figsize=(3.2 * len(cases), 3.6), sharey=True)
    for ax, case in zip(axes, cases, strict=False):
        for k, mode in enumerate(("off", "on")):
            rds = runs.get((case, mode), [])
            ys = []
            for _, q in stats:
                vals = sorted((r.quantile(q) if q < 1 else max(r.latencies, default=0)) * 1e3
                              for r in rds)
                ys.append(vals[len(vals) // 2] if vals else 0)
            ax.bar([i + 0.4 * k for i in range(len(stats))], ys, 0.4, label=f"hedging {mode}")
        ax.set_xticks([i + 0.2 for i in range(len(stats))])
        ax.set_xticklabels([name for name, _ in stats], fontsize=8)
        ax.set_yscale("log")
        ax.set_title(case, fontsize=9)
    axes[0].set_ylabel("read latency, ms (open + 64 KiB, verified)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--readers", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--plot", type=Path, default=None, help="write the figure to this PNG")
    args = ap.parse_args()
    runs: dict[tuple[str, str], list[Readers]] = {}
    ratios: list[float] = []

    def record(case: str, mode: str, rd: Readers, hedged: float | None = None) -> None:
        runs.setdefault((case, mode), []).append(rd)
        rows.append(_row(case, mode, rd, hedged))

    base = Path(tempfile.mkdtemp(prefix="kspeedfs-bench-tail-", dir="/var/tmp"))
    files = _make_source(base / "source")
    rows = ["| case | hedging | reads | p50 | p99 | p99.9 | max | errors | hedged bytes |",
            "|---|---|---|---|---|---|---|---|---|"]
    with cluster(base / "c") as c:
        c.ks(["import", str(base / "source"), "--name", "tail", "--chunk-size", c.chunk_size, "-q"])
        c.ks(["preload", "tail", "--timeout", "60"])
        small = ("--set", "cache.memory=8MiB")
        mounts = {"off": c.mount("tail", *small, "--set", "cluster.hedge=false"),
                  "on": c.mount("tail", *small)}
        for rep in range(args.reps):
            for mode, mnt in mounts.items():
                b = mount_stats(mnt)
                with Readers(mnt, files, args.readers, seed=rep) as rd:
                    time.sleep(args.seconds)
                s = mount_stats(mnt)
                share = (s["peer_hedge_bytes"] - b["peer_hedge_bytes"]) / max(
                    1, s["peer_read_bytes"] - b["peer_read_bytes"])
                record("no fault", mode, rd, share)
            # the same, both mounts at once (half the readers each): one window, the same
            # noise for both, so the reads ratio on/off is the throughput cost of hedging
            half = max(1, args.readers // 2)
            b = {mode: mount_stats(mnt) for mode, mnt in mounts.items()}
            with Readers(mounts["off"], files, half, seed=rep + 100) as r_off, \
                    Readers(mounts["on"], files, half, seed=rep + 150) as r_on:
                time.sleep(args.seconds)
            s = mount_stats(mounts["on"])
            share = (s["peer_hedge_bytes"] - b["on"]["peer_hedge_bytes"]) / max(
                1, s["peer_read_bytes"] - b["on"]["peer_read_bytes"])
            record(f"no fault, together ({half} readers)", "off", r_off, 0.0)
            record(f"no fault, together ({half} readers)", "on", r_on, share)
            ratios.append(len(r_on.latencies) / max(1, len(r_off.latencies)))
            for mode, mnt in mounts.items():
                with Readers(mnt, files, args.readers, seed=rep) as rd, Stutter(c.procs["n2"]):
                    time.sleep(args.seconds)
                record("n2 slowed (20/25 ms)", mode, rd)
            for mode, mnt in mounts.items():
                with Readers(mnt, files, args.readers, seed=rep) as rd:
                    time.sleep(1.0)
                    c.procs["n2"].stop()
                    time.sleep(1.5)
                    c.procs["n2"].cont()
                    time.sleep(1.0)
                record("SIGSTOP 1.5 s", mode, rd)
                time.sleep(1.0)
            half = max(1, args.readers // 2)
            with Readers(mounts["off"], files, half, seed=rep) as r_off, \
                    Readers(mounts["on"], files, half, seed=rep + 50) as r_on:
                time.sleep(1.0)
                c.kill_node(2)
                time.sleep(2.5)
            record(f"SIGKILL ({half} readers)", "off", r_off)
            record(f"SIGKILL ({half} readers)", "on", r_on)
            if rep + 1 < args.reps:
                c.wait_nodes(2, timeout=30)
                c.start_node(2)
                c.wait_nodes(3)
                c.ks(["preload", "tail", "--timeout", "60"])
    print("\n".join(rows), flush=True)
    if ratios:
        print("no fault, both mounts at once: reads with hedging / without = "
              + ", ".join(f"{r:.3f}" for r in ratios)
              + f" (median {sorted(ratios)[len(ratios) // 2]:.3f})", flush=True)
    if args.plot and plot(runs, args.plot):
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
