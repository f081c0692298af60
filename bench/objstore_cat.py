"""A cold ``cat`` of one large object through a node-less mount against one GET of it,
on a server whose ranged GETs cost their own bytes: fake-gcs-server (``gs://``).

``python -m bench.objstore_cat [--mib 64] [--rounds 5]``: one object of ``--mib`` MiB is
put in a bucket, imported (4 MiB chunks) into an embedded store; each round, alternating:

* **get**: ``obstore.get`` of the whole object, the bytes read out (the client the
  ``gs://`` source uses, one request: what a plain download does);
* **cp**: the same GET streamed into a local file, as ``aws s3 cp`` (or ``gsutil cp``)
  leaves it (written, not synced; the file removed after the round): the issue's
  "``aws s3 cp``-equivalent GET with the same client";
* **cat**: a fresh mount (empty chunk cache), the page cache dropped, the file read
  with 1 MiB reads, as ``cat`` does: the mount's ranged GETs, one a chunk, its read-ahead
  keeping several in flight, every chunk's xxh3 checked.

``--arm KEY=VALUE[;KEY=VALUE]`` (repeatable) adds a mount configuration: each round then
cats once per arm (the default mount first, the order reversed every other round) and
each arm is reported against the first round by round, which on a shared machine is the
only comparison that holds (docs/design.md, "The cold cat").

Why this server: moto (``bench/s3.py``) copies the whole object for every ranged GET, so
there a range of a 64 MiB object costs what the object does and every range reader
loses to one GET (``docs/benchmarks.md``, "The s3 workload"). fake-gcs-server is a Go
process serving from memory. It shares the machine's 2 CPUs with the mount: the MB/s are
this machine's, the ratio (same rounds) is the figure. Nothing is asserted.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from kspeedfs import config
from kspeedfs.objstore import connect
from tests.fixtures.gcs import FakeGcsServer
from tests.fixtures.mounts import Cluster1, unmount

from .system import daemon_pid, drop_caches, process_cpu

BUCKET = "bench-cat"
KEY = "big/seq.0"


def _cat(path: Path) -> int:
    buf, n = bytearray(1 << 20), 0
    with open(path, "rb", buffering=0) as f:
        while k := f.readinto(buf):
            n += k
    return n


def _cp(store: object, path: Path) -> float:
    """Seconds to GET the object into a new local file (then removed)."""
    import obstore

    t = time.perf_counter()
    with open(path, "wb") as f:
        for piece in obstore.get(store, KEY).stream(min_chunk_size=1 << 20):  # type: ignore[arg-type]
            f.write(piece)
    took = time.perf_counter() - t
    path.unlink()
    return took


def main(argv: list[str] | None = None) -> None:
    import obstore

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config for the mount (e.g. fuse.prefetch_chunks=8)")
    ap.add_argument("--arm", action="append", default=[], metavar="KEY=VALUE[;KEY=VALUE]",
                    help="another mount config, catted in the same rounds (A/B)")
    args = ap.parse_args(argv)
    arms = [args.set, *([*args.set, *a.split(";")] for a in args.arm)]
    size = args.mib << 20
    with tempfile.TemporaryDirectory(prefix="kst-cat-") as tmp, FakeGcsServer() as server:
        os.environ.update(server.env())
        server.create_bucket(BUCKET)
        server.put(BUCKET, KEY, random.Random(44).randbytes(size))
        node = Cluster1(Path(tmp), chunk=4 << 20)
        node.import_(f"gs://{BUCKET}/big", "cat")          # type: ignore[arg-type]
        bucket = connect(f"gs://{BUCKET}/big", config.load(environ={}).source)
        store = bucket.store                                # type: ignore[attr-defined]
        rates: dict[str, list[float]] = {"get": [], "cp": [], "cat": []}
        cpu: list[float] = []               # the mount daemon's CPU-s per GB
        armed: list[list[float]] = [[] for _ in arms]    # cat MB/s by arm
        armed_cpu: list[list[float]] = [[] for _ in arms]
        get_cpu: list[float] = []           # this process's, for the GET
        served: dict[str, list[float]] = {"get": [], "cat": []}   # the server's CPU-s/GB
        spid = server.pid
        try:
            for r in range(args.rounds):
                s0 = process_cpu(spid) or 0.0
                c0, t = process_cpu(os.getpid()) or 0.0, time.perf_counter()
                got = len(obstore.get(store, KEY).bytes())
                rates["get"].append(got / (time.perf_counter() - t) / 1e6)
                get_cpu.append(((process_cpu(os.getpid()) or 0.0) - c0) / (size / 1e9))
                served["get"].append(((process_cpu(spid) or 0.0) - s0) / (size / 1e9))
                assert got == size, got
                rates["cp"].append(size / _cp(store, Path(tmp) / "cp.out") / 1e6)
                order = range(len(arms)) if r % 2 == 0 else range(len(arms) - 1, -1, -1)
                for i in order:
                    mp = node.mount("cat", None, *(x for kv in arms[i] for x in ("--set", kv)))
                    drop_caches()
                    pid = daemon_pid(mp)
                    s0 = process_cpu(spid) or 0.0
                    c0, t = process_cpu(pid) or 0.0, time.perf_counter()
                    got = _cat(mp / "seq.0")
                    armed[i].append(got / (time.perf_counter() - t) / 1e6)
                    armed_cpu[i].append(((process_cpu(pid) or 0.0) - c0) / (size / 1e9))
                    if i == 0:
                        served["cat"].append(((process_cpu(spid) or 0.0) - s0) / (size / 1e9))
                    assert got == size, got
                    unmount(mp, daemon_pid(mp), timeout=10.0)
                    node.mounts.remove(mp)
                rates["cat"].append(armed[0][-1])
                cpu.append(armed_cpu[0][-1])
        finally:
            node.close()
            bucket.close()
    for name, r in rates.items():
        print(f"{name}: {statistics.median(r):,.0f} MB/s [{min(r):,.0f}-{max(r):,.0f}]")
    print(f"CPU-s/GB: the GET {statistics.median(get_cpu):.2f}, the mount's daemon "
          f"{statistics.median(cpu):.2f}; the server's for the GET "
          f"{statistics.median(served['get']):.2f}, for the cat {statistics.median(served['cat']):.2f}")
    for base in ("get", "cp"):
        ratios = sorted(c / g for c, g in zip(rates["cat"], rates[base], strict=True))
        print(f"cat / {base} = {statistics.median(ratios):.2f}x "
              f"[{ratios[0]:.2f}-{ratios[-1]:.2f}]")
    for i, arm in enumerate(arms[1:], 1):
        per_round = sorted(b / a for a, b in zip(armed[0], armed[i], strict=True))
        over_cp = sorted(c / g for c, g in zip(armed[i], rates["cp"], strict=True))
        print(f"arm {';'.join(arm)}: cat {statistics.median(armed[i]):,.0f} MB/s, "
              f"/ the default's cat {statistics.median(per_round):.2f}x "
              f"[{per_round[0]:.2f}-{per_round[-1]:.2f}], / cp {statistics.median(over_cp):.2f}x, "
              f"the daemon {statistics.median(armed_cpu[i]):.2f} CPU-s/GB")


if __name__ == "__main__":
    main()
