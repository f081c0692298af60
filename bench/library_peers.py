"""The Python library against the native mount, both reading from peers: a dataset
preloaded into 3 nodes' memory, read on the client host (``python -m bench.library_peers
[--scale medium] [--reps 3]``).

    case        what both readers do                                       figure
    small-8t    every ImageNet-like file whole once, shuffled, 8 threads   files/s
    seq-4t      the 4 large files, one thread each, 1 MiB reads            MB/s

Each round, alternating, a fresh reader starts with an empty chunk cache of
``CLIENT_CACHE`` (the cluster bench's: smaller than the data, so small files come
alone and random reads as blocks) and the page cache dropped:

* **mount**: a new kspeedfs mount of the client host, read by a process in the client's
  network namespace with ``open().read()``/``readinto``;
* **library**: a process in the same namespace, ``kspeedfs.open_dataset(..., etcd=[...])``
  with the mount's cluster config, reading with ``ds.read`` / ``DatasetFile.readinto``.

CPU per GB is the whole client-side cost: the reader process (for the library, its trio
thread and vRDMA endpoint too) plus, for the mount, its daemon. The soft RDMA provider's
NIC threads are in both (a real NIC does that work). Issue 45 asks the library for
>= 1.0x the mount's throughput at <= its CPU per GB. Benchmarks are not tests: nothing
is asserted.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from . import workloads
from .cluster import CLIENT_CACHE, ClusterBed, cluster_dataset
from .system import REPO, Mounts, daemon_pid, drop_caches, process_cpu

#: one reader process; argv: spec.json. Prints one JSON line per case.
READER = r"""
import json, os, random, resource, sys, threading, time
spec = json.load(open(sys.argv[1]))
mode, root = spec["mode"], spec["root"]
if mode == "library":
    import kspeedfs
    ds = kspeedfs.open_dataset(spec["dataset"], etcd=spec["etcd"], config=spec["config"])
    read_file = lambda rel: len(ds.read(rel))
    opener = lambda rel: ds.open(rel, buffering=0)
else:
    def read_file(rel):
        with open(os.path.join(root, rel), "rb", buffering=0) as f:
            return len(f.read())
    opener = lambda rel: open(os.path.join(root, rel), "rb", buffering=0)

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

def threads(n, work):
    out = [0] * n
    def run(i):
        out[i] = work(i)
    ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    t0, c0 = time.perf_counter(), cpu()
    for t in ts: t.start()
    for t in ts: t.join()
    return sum(out), time.perf_counter() - t0, cpu() - c0

def seq(rel):
    buf, n = bytearray(1 << 20), 0
    with opener(rel) as f:
        while k := f.readinto(buf):
            n += k
    return n

def report(case, nbytes, ops, dt, c):
    print(json.dumps({"case": case, "bytes": nbytes, "ops": ops, "seconds": dt, "cpu": c}),
          flush=True)
    sys.stdin.readline()          # the bench reads the daemon's CPU between cases

small = list(spec["small"])
random.Random(7).shuffle(small)
n, dt, c = threads(8, lambda i: sum(read_file(p) for p in small[i::8]))
report("small-8t", n, len(small), dt, c)
big = spec["big"]
n, dt, c = threads(len(big), lambda i: seq(big[i]))
report("seq-4t", n, len(big), dt, c)
"""


def _run(bed: ClusterBed, mounts: Mounts, mode: str, spec: dict[str, Any],
         work: Path) -> dict[str, dict[str, float]]:
    """One fresh reader of ``mode``; per case: files/s or MB/s and client CPU-s per GB."""
    c = bed.ensure()
    mp = bed.mount(mounts) if mode == "mount" else None
    daemon = daemon_pid(mp) if mp else None
    drop_caches()
    path = work / f"spec-{mode}.json"
    path.write_text(json.dumps({**spec, "mode": mode, "root": str(mp or "")}))
    proc = subprocess.Popen(c.client_argv([sys.executable, "-c", READER, str(path)]),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdin is not None and proc.stdout is not None
    out: dict[str, dict[str, float]] = {}
    d0 = process_cpu(daemon) or 0.0
    for line in proc.stdout:
        fig = json.loads(line)
        d1 = process_cpu(daemon) or 0.0
        cpu = fig["cpu"] + (d1 - d0)
        per = "files/s" if fig["case"] == "small-8t" else "MB/s"
        rate = fig["ops"] / fig["seconds"] if per == "files/s" else fig["bytes"] / fig["seconds"] / 1e6
        out[fig["case"]] = {per: rate, "cpu_s_per_GB": cpu / (fig["bytes"] / 1e9),
                            "daemon_cpu_s": d1 - d0}
        proc.stdin.write("\n")
        proc.stdin.flush()
        d0 = process_cpu(daemon) or 0.0
    if proc.wait() != 0:
        raise RuntimeError(f"{mode} reader failed ({proc.returncode})")
    if mp is not None:
        mounts.remove(mp)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=list(workloads.SCALES), default="medium")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kst-libpeers-") as tmp:
        work = Path(tmp)
        ctx = workloads.Context(work=work, scale=workloads.SCALES[args.scale])
        ds = cluster_dataset(ctx)
        bed = ClusterBed(work / "cluster", ds, chunk="4MiB")
        mounts = Mounts()
        try:
            c = bed.ensure()
            common = c.common()
            config = dict(common[i + 1].split("=", 1) for i in range(len(common))
                          if common[i] == "--set")
            config["cache.memory"] = CLIENT_CACHE
            spec = {"dataset": bed.dataset, "etcd": c.etcd_urls, "config": config,
                    "small": [p for p in ds.paths() if p.startswith("imagenet-")],
                    "big": [p for p in ds.paths() if p.startswith("files-")]}
            runs: dict[str, list[dict[str, dict[str, float]]]] = {"mount": [], "library": []}
            for _ in range(args.reps):
                for mode in runs:
                    runs[mode].append(_run(bed, mounts, mode, spec, work))
                    print(mode, json.dumps(runs[mode][-1]), flush=True)
        finally:
            mounts.close()
            bed.close()
    _report(runs)


def _report(runs: dict[str, list[dict[str, dict[str, float]]]]) -> None:
    for case, per in (("small-8t", "files/s"), ("seq-4t", "MB/s")):
        for fig in (per, "cpu_s_per_GB"):
            ratios = sorted(lib[case][fig] / mnt[case][fig]
                            for lib, mnt in zip(runs["library"], runs["mount"], strict=True))
            med = {m: statistics.median(r[case][fig] for r in runs[m]) for m in runs}
            print(f"{case} {fig}: library {med['library']:,.3g}, mount {med['mount']:,.3g}, "
                  f"library / mount {statistics.median(ratios):.2f} [{ratios[0]:.2f}-{ratios[-1]:.2f}]")


if __name__ == "__main__":
    main()
