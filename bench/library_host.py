"""The Python library on a node's host, with and without that node's grant: a dataset
preloaded into 2 nodes' memory (R=2, so the node "on the host" holds every chunk), read
by a library process on the client host (``python -m bench.library_host [--files 2000]
[--big-mb 64] [--reps 3]``).

    case        what the reader does                                       figure
    small-8t    every ImageNet-like file whole once, shuffled, 8 threads   files/s
    seq-4t      the 4 large files, one thread each, 1 MiB readinto         MB/s

Each round, alternating, a fresh ``kspeedfs.open_dataset`` handle (empty chunk cache of
``CLIENT_CACHE``, smaller than the data, as the cluster bench's) reads both cases:

* **grant**: the nodes serve ``cluster.grant_socket`` and grant the dataset; the library
  finds n1's socket (the test bed shares one filesystem: every node is "on this host")
  and copies chunks out of its mapped segments (``cluster/granted.py``);
* **vrdma**: the same process with ``cluster.grant_socket = ""``: every chunk READ from
  the nodes over the soft vRDMA provider, as before;
* **mount**: a fresh kspeedfs mount of the client host (the native engine, the same
  config and chunk cache; a mount takes no grant), read with ``open()``/``readinto``
  by a process in the same namespace: what the library is held against.

``--modes`` picks some (``vrdma,mount``: the library against the mount, both from the
peers); ``--ab-tree PATH`` with a mode ending ``@ab`` (``vrdma@ab``, ``mount@ab``) runs
that reader, or mounts, from another checkout built in place, in the same rounds: a
before/after of the client's code on the same nodes. CPU per GB: the reader process (all
its threads: the trio thread, the vRDMA endpoint's), plus the mount's daemon for
``mount``; beside it, that plus both nodes' CPU over the same case (a node answers
``locate`` for the grant; its soft provider serves READs for vRDMA); and the reader's
CPU µs per file (or per large file) by thread (``trio``: the library's trio thread;
``ks-soft-nic``: the soft engines' threads; ``callers``: the rest, mostly the 8 reading
threads). Nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from . import datasets
from .cluster import CLIENT_CACHE, _fixtures
from .system import REPO, daemon_pid, drop_caches, process_cpu

#: one reader process; argv: spec.json. One JSON line per case, then waits for a line.
READER = r"""
import json, os, random, resource, sys, threading, time
spec = json.load(open(sys.argv[1]))
if spec["root"]:                  # a mount
    class Files:
        def open(self, rel, buffering=0):
            return open(os.path.join(spec["root"], rel), "rb", buffering=buffering)
        def read(self, rel):
            with self.open(rel) as f:
                return f.read()
        def statistics(self):
            return None
        def close(self):
            pass
    ds = Files()
else:
    import kspeedfs
    ds = kspeedfs.open_dataset(spec["dataset"], etcd=spec["etcd"], config=spec["config"])

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

def by_thread():
    # CPU-s of each live thread by its OS name (ks-soft-nic...), the library's trio
    # thread as "trio"; the callers have exited when it is read: report() adds them
    trio_tid = {str(t.native_id) for t in threading.enumerate() if t.name.startswith("kspeedfs-")}
    out, tick = {}, os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        name = "trio" if tid in trio_tid else name.rstrip("0123456789")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out

def threads(n, work):
    out = [0] * n
    def run(i):
        out[i] = work(i)
    ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    global threads0
    threads0 = by_thread()
    t0, c0 = time.perf_counter(), cpu()
    for t in ts: t.start()
    for t in ts: t.join()
    return sum(out), time.perf_counter() - t0, cpu() - c0

def seq(rel):
    buf, n = bytearray(1 << 20), 0
    with ds.open(rel, buffering=0) as f:
        while k := f.readinto(buf):
            n += k
    return n

def report(case, nbytes, ops, dt, c):
    now = by_thread()
    per = {k: round(v - threads0.get(k, 0.0), 3) for k, v in now.items()}
    per = {k: v for k, v in per.items() if v > 0}
    per["callers"] = round(c - sum(per.values()), 3)   # exited: the rest of the process
    s = ds.statistics()
    print(json.dumps({"case": case, "bytes": nbytes, "ops": ops, "seconds": dt, "cpu": c,
                      "threads": per,
                      "host_hits": s.host_hits if s else 0, "peer_hits": s.peer_hits if s else 0}),
          flush=True)
    sys.stdin.readline()          # the bench reads the nodes' CPU between cases

small = list(spec["small"])
random.Random(7).shuffle(small)
n, dt, c = threads(8, lambda i: sum(len(ds.read(p)) for p in small[i::8]))
report("small-8t", n, len(small), dt, c)
big = spec["big"]
n, dt, c = threads(len(big), lambda i: seq(big[i]))
report("seq-4t", n, len(big), dt, c)
ds.close()
"""

CASES = (("small-8t", "files/s"), ("seq-4t", "MB/s"))


def _run(c: Any, mode: str, spec: dict[str, Any], work: Path) -> dict[str, dict[str, float]]:
    """One fresh reader: per case files/s or MB/s, CPU-s per GB (reader; reader + nodes)."""
    config = dict(spec["config"])
    if mode.startswith("vrdma"):
        config["cluster.grant_socket"] = ""
    tree = Path(spec["ab_tree"]) if mode.endswith("@ab") else REPO
    mp = c.mount("bench", "--cache-mem", CLIENT_CACHE, tree=tree) if mode.startswith("mount") else None
    path = work / f"spec-{mode}.json"
    path.write_text(json.dumps({**spec, "config": config, "root": str(mp or "")}))
    drop_caches()
    nodes = [p.pid for name, p in c.procs.items() if name.startswith("n")]
    daemon = daemon_pid(mp) if mp is not None else None
    env = dict(os.environ, PYTHONPATH=str(tree))     # the reader's code: this checkout or --ab-tree
    proc = subprocess.Popen(c.client_argv([sys.executable, "-c", READER, str(path)]),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tree, env=env)
    assert proc.stdin is not None and proc.stdout is not None
    out: dict[str, dict[str, float]] = {}
    n0, d0 = sum(process_cpu(pid) or 0.0 for pid in nodes), process_cpu(daemon) or 0.0
    for line in proc.stdout:
        fig = json.loads(line)
        n1, d1 = sum(process_cpu(pid) or 0.0 for pid in nodes), process_cpu(daemon) or 0.0
        gb = fig["bytes"] / 1e9
        per = dict(CASES)[fig["case"]]
        rate = fig["ops"] / fig["seconds"] if per == "files/s" else fig["bytes"] / fig["seconds"] / 1e6
        mine = fig["cpu"] + d1 - d0
        out[fig["case"]] = {per: rate, "cpu_s_per_GB": mine / gb,
                            "with_nodes_cpu_s_per_GB": (mine + n1 - n0) / gb,
                            "host_hits": fig["host_hits"], "peer_hits": fig["peer_hits"],
                            "thread_cpu_us_per_op": {k: round(v / fig["ops"] * 1e6)
                                                     for k, v in fig["threads"].items()}}
        proc.stdin.write("\n")
        proc.stdin.flush()
        n0, d0 = sum(process_cpu(pid) or 0.0 for pid in nodes), process_cpu(daemon) or 0.0
    if proc.wait() != 0:
        raise RuntimeError(f"{mode} reader failed ({proc.returncode})")
    if mp is not None:
        c.unmount(mp)
    return out


def _dataset(work: Path, files: int, big_mb: int) -> tuple[Path, list[str], list[str]]:
    root = work / "data"
    big = datasets.big_files(root, 4, big_mb << 20)
    small = datasets.imagenet(root, files)
    return (root, [f"{small.root.name}/{p}" for p in small.paths()],
            [f"{big.root.name}/{p}" for p in big.paths()])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=2000, help="ImageNet-like small files")
    ap.add_argument("--big-mb", type=int, default=64, help="size of each of the 4 large files")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--modes", default="grant,vrdma,mount",
                    help="comma-separated: grant, vrdma, mount (the first is the ratios' numerator);"
                         " grant@ab, vrdma@ab: the same reader run from --ab-tree")
    ap.add_argument("--ab-tree", type=Path, default=None,
                    help="another checkout, built in place (a baseline for the @ab modes)")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    _fixtures()
    from tests.fixtures.cluster import Cluster

    with tempfile.TemporaryDirectory(prefix="kst-libhost-") as tmp:
        work = Path(tmp)
        root, small, big = _dataset(work, args.files, args.big_mb)
        nbytes = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
        c = Cluster(work / "cluster", nodes=2, chunk_size="4MiB",
                    node_memory=f"{(nbytes + (256 << 20)) >> 20}MiB",
                    extra=["--set", "cluster.host_readers=bench=*", "--set", "cluster.replicas=2",
                           "--set", f"cluster.grant_socket={work}/run/{{cluster}}-{{node}}.grant"])
        try:
            c.start()
            c.ks(["import", str(root), "--name", "bench", "--chunk-size", "4MiB", "-q"],
                 timeout=1800)
            c.ks(["preload", "bench", "--timeout", "900"], timeout=1000)
            common = c.common()
            config = dict(common[i + 1].split("=", 1) for i in range(len(common))
                          if common[i] == "--set")
            config["cache.memory"] = CLIENT_CACHE
            spec = {"dataset": "bench", "etcd": c.etcd_urls, "config": config,
                    "small": small, "big": big, "ab_tree": str(args.ab_tree or REPO)}
            runs: dict[str, list[dict[str, dict[str, float]]]] = {m: [] for m in modes}
            for _ in range(args.reps):
                for mode in runs:
                    runs[mode].append(_run(c, mode, spec, work))
                    print(mode, json.dumps(runs[mode][-1]), flush=True)
        finally:
            c.close()
    print(f"{len(small)} small files, 4 x {args.big_mb} MiB; {nbytes / 1e6:,.0f} MB in all")
    _report(runs)


def _report(runs: dict[str, list[dict[str, dict[str, float]]]]) -> None:
    first, *others = list(runs)
    for case, per in CASES:
        for fig in (per, "cpu_s_per_GB", "with_nodes_cpu_s_per_GB"):
            med = {m: statistics.median(r[case][fig] for r in runs[m]) for m in runs}
            line = f"{case} {fig}: " + ", ".join(f"{m} {v:,.3g}" for m, v in med.items())
            for other in others:
                ratios = sorted(a[case][fig] / b[case][fig]
                                for a, b in zip(runs[first], runs[other], strict=True))
                line += (f"; {first} / {other} {statistics.median(ratios):.2f} "
                         f"[{ratios[0]:.2f}-{ratios[-1]:.2f}]")
            print(line)


if __name__ == "__main__":
    main()
