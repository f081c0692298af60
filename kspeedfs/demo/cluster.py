"""The cluster demo: a whole kspeedfs cluster on this one machine, and what it survives.

    ./run demo            (= python -m kspeedfs.demo [--files N] [--keep])

1. build five test hosts (network namespaces, two NICs each on two rails, addresses in
   198.18.0.0/15): one runs etcd, three run ``kspeedfs node``, one is the client;
2. generate an ImageNet-like dataset and ``kspeedfs import`` it (etcd store);
3. ``kspeedfs preload`` it: every node loads its share (R = 2) into its memory arena;
4. ``kspeedfs mount`` it on the client with a deliberately small memory tier, so that
   reads keep going to the peers, and read files at random with 8 readers, checking
   every byte against the source, while
   - one NIC of node n1 is cut (vRDMA moves its READs to the other rail), and then
   - node n2 is killed with SIGKILL (reads go to the other replica; once n2's lease
     expires the survivors re-replicate its chunks back to R copies);
5. print what happened, and tear everything down (also on Ctrl-C or failure).

Needs root (namespaces, FUSE) and this checkout (the test-host harness lives in
``tests/fixtures/``).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .single import generate

CHECKOUT = Path(__file__).resolve().parents[2]


def _say(msg: str) -> None:
    print(msg, flush=True)


class ReadRun:
    """``workers`` threads reading random whole files through the mount, verifying each."""

    def __init__(self, mnt: Path, src: Path, rels: list[Path], workers: int = 8) -> None:
        self.mnt, self.src, self.rels, self.workers = mnt, src, rels, workers
        self.bytes = self.files = 0
        self.errors: list[str] = []
        self.max_gap = 0.0
        self._last = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(workers)

    def _worker(self, seed: int) -> None:
        rnd = random.Random(seed)
        while not self._stop.is_set():
            rel = rnd.choice(self.rels)
            try:
                with open(self.mnt / rel, "rb") as f:
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                    got = f.read()
                ok = got == (self.src / rel).read_bytes()
            except OSError as e:
                ok, got = False, b""
                self.errors.append(f"{rel}: {e}")
            now = time.monotonic()
            with self._lock:
                if not ok and not self.errors:
                    self.errors.append(f"{rel}: bytes differ")
                self.files += 1
                self.bytes += len(got)
                self.max_gap = max(self.max_gap, now - self._last)
                self._last = now

    def start(self) -> ReadRun:
        self.t0 = time.monotonic()
        for i in range(self.workers):
            self._pool.submit(self._worker, i)
        return self

    def stop(self) -> float:
        self._stop.set()
        self._pool.shutdown(wait=True)
        return time.monotonic() - self.t0


def main(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        _say("the cluster demo needs root (network namespaces, FUSE); try ./run demo as root")
        return 1
    if not (CHECKOUT / "tests" / "fixtures" / "cluster.py").exists():
        _say(f"the cluster demo needs the kspeedfs checkout (not found at {CHECKOUT}); "
             "use --single-node")
        return 1
    sys.path.insert(0, str(CHECKOUT))
    from tests.fixtures.cluster import Cluster

    work = Path(args.workdir or tempfile.mkdtemp(prefix="kspeedfs-cluster-demo-"))
    src = work / "source"
    c = Cluster(work / "cluster", nodes=3, chunk_size="4MiB", node_memory="512MiB")
    try:
        _say(f"== kspeedfs cluster demo in {work}")
        t0 = time.monotonic()
        c.start()
        h = c.bed.hosts
        _say(f"1. test hosts up in {time.monotonic() - t0:.1f}s: etcd on {h[0].name} "
             f"({', '.join(h[0].addresses)}); nodes n1-n3 on {h[1].name}-{h[3].name}, two NICs "
             f"each (n1: {', '.join(h[1].addresses)}); client {h[4].name}")
        nbytes = generate(src, args.files)
        c.ks(["import", str(src), "--name", "imagenet", "-q"])
        _say(f"2. generated and imported {args.files:,} ImageNet-like files + 2 shards "
             f"({nbytes / 1e6:,.0f} MB) into etcd")
        t0 = time.monotonic()
        c.ks(["preload", "imagenet", "--timeout", "300"])
        check = c.ks(["preload", "imagenet", "--check"]).stdout
        _say(f"3. preload: every chunk in the memory of 2 of the 3 nodes after "
             f"{time.monotonic() - t0:.1f}s\n" + _indent(check))
        mnt = c.mount("imagenet", "--cache-mem", "96MiB")
        rels = sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file())
        _say(f"4. mounted on the client ({mnt}); 8 readers read random files, each checked "
             "byte for byte:")
        run = ReadRun(mnt, src, rels).start()
        time.sleep(3)
        c.node_host(1).nic_down(1)
        _say(f"   t={time.monotonic() - run.t0:4.1f}s  cut NIC {c.node_host(1).address(1)} of n1")
        time.sleep(3)
        c.kill_node(2)
        t_kill = time.monotonic()
        _say(f"   t={time.monotonic() - run.t0:4.1f}s  killed node n2 (SIGKILL)")
        time.sleep(4)
        elapsed = run.stop()
        stats = json.loads(os.getxattr(mnt, "user.kspeedfs.stats"))
        _say(f"   t={elapsed:4.1f}s  stopped: {run.files:,} files, {run.bytes / 1e6:,.0f} MB "
             f"read and verified, {len(run.errors)} errors; longest pause between two "
             f"completed reads: {run.max_gap * 1e3:.0f} ms")
        c.wait_nodes(2, timeout=60)
        while c.ks(["preload", "imagenet", "--check"], check=False).returncode != 0:
            if time.monotonic() - t_kill > 120:
                break
            time.sleep(0.5)
        t_rerep = time.monotonic() - t_kill
        recheck = c.ks(["preload", "imagenet", "--check"], check=False)
        _say(f"5. n2's lease expired; the survivors re-replicated its chunks: R copies again "
             f"{t_rerep:.1f}s after the kill\n" + _indent(recheck.stdout))
        _summary(stats, run)
        c.node_host(1).nic_up(1)
        return 0 if not run.errors and recheck.returncode == 0 else 1
    finally:
        c.close()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        _say("6. torn down: mounts, nodes, etcd, namespaces")


def _indent(text: str) -> str:
    return "\n".join("   " + line for line in text.strip().splitlines())


def _summary(s: dict[str, Any], run: ReadRun) -> None:
    mem = s["memory_hits"] + s["waited_in_flight"]
    chunks = (mem + s["peer_hits"] + s["source_loads"]) or 1
    _say("== summary")
    _say(f"   bytes to readers: {s['read_bytes'] / 1e6:,.0f} MB, every one verified "
         f"(xxh3 of its chunk, file or block); errors seen by readers: {len(run.errors)}")
    _say(f"   chunk and small-file requests served by: the mount's memory tier {mem / chunks:.0%}, "
         f"peers over vRDMA {s['peer_hits'] / chunks:.0%} ({s['peer_bytes'] / 1e6:,.0f} MB), the source "
         f"{s['source_loads'] / chunks:.0%}")
    _say("   per peer: " + ", ".join(f"{n} {b / 1e6:,.0f} MB"
                                     for n, b in sorted(s["per_peer_bytes"].items())))
    _say(f"   failovers: NIC cut -> READs moved to the other rail inside vRDMA (readers saw "
         f"nothing); node killed -> {s['peer_unreachable']} chunk reads went to the other "
         f"replica; longest replica stall {s['peer_longest_stall_ms']:.0f} ms")
