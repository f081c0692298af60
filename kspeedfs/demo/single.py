"""The single-node demo: one machine, no cluster, end to end, in about a minute.

    ./run demo --single-node      (= python -m kspeedfs.demo --single-node [--files N] [--keep])

1. generate a sample training set: ImageNet-like JPEG-sized files (log-normal, ~110 KB)
   in a few class directories, plus two large shards;
2. ``kspeedfs import`` it into an embedded store (chunked, every extent checksummed);
3. ``kspeedfs mount`` it read-only (the daemon, exactly as a user runs it);
4. read every file through the mount twice — the first epoch misses and loads chunks
   from the source, the second is served from the daemon's memory tier — and compare
   every byte with the source;
5. print what happened (counters from the mount's ``user.kspeedfs.stats``), unmount and
   clean up, also on Ctrl-C.

With ``--s3`` (``./run demo --s3``) the source is a bucket instead: a local S3 server
(moto, from the test extra ``./run setup`` installs) on 127.0.0.1, the files uploaded to
it, ``kspeedfs import s3://kspeedfs-demo/`` and every miss a ranged GET pinned to the
object's ETag; the local copies are only what the read-back is compared with.

The cluster demo (``cluster.py``) is the default ``./run demo``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any


def _say(msg: str) -> None:
    print(msg, flush=True)


def generate(root: Path, files: int, seed: int = 7) -> int:
    """ImageNet-like files (log-normal around 110 KB) in 10 class dirs, plus 2 shards."""
    rnd = random.Random(seed)
    total = 0
    blob = rnd.randbytes(1 << 20)
    for i in range(files):
        d = root / "train" / f"class{i % 10:02d}"
        d.mkdir(parents=True, exist_ok=True)
        size = min(int(rnd.lognormvariate(math.log(110_000), 0.5)), len(blob))
        start = rnd.randrange(0, len(blob) - size + 1)
        (d / f"img{i:06d}.jpg").write_bytes(blob[start:start + size] + i.to_bytes(8, "little"))
        total += size + 8
    shards = root / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    for s in range(2):
        data = rnd.randbytes(48 << 20)
        (shards / f"shard-{s:02d}.tar").write_bytes(data)
        total += len(data)
    return total


def read_all(mnt: Path, src: Path, rels: list[Path], workers: int = 8) -> tuple[int, float]:
    """Read every file through the mount with ``workers`` threads; compare with the source."""
    def one(rel: Path) -> int:
        got = (mnt / rel).read_bytes()
        if got != (src / rel).read_bytes():
            raise AssertionError(f"{rel}: bytes differ from the source")
        return len(got)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        n = sum(pool.map(one, rels))
    return n, time.perf_counter() - t0


def _drop_page_cache() -> None:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass


def upload(s3: Any, src: Path, bucket: str) -> None:
    """Every file below ``src`` as an object of ``bucket``, its path the key."""
    c = s3.client()
    c.create_bucket(Bucket=bucket)
    rels = [p.relative_to(src) for p in src.rglob("*") if p.is_file()]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda rel: c.put_object(Bucket=bucket, Key=str(rel),
                                               Body=(src / rel).read_bytes()), rels))


def main(args: argparse.Namespace) -> int:
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kspeedfs-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    src, mnt = work / "source", work / "mnt"
    ks = [sys.executable, "-m", "kspeedfs.cli.app"]
    common = ["--store", str(work / "store"), "--set", f"log.dir={work / 'log'}"]
    mounted = False
    env = None
    stack = contextlib.ExitStack()          # the S3 server, with --s3
    try:
        _say(f"== kspeedfs single-node demo in {work}")
        t0 = time.perf_counter()
        nbytes = generate(src, args.files)
        _say(f"1. generated {args.files:,} ImageNet-like files + 2 shards: {nbytes / 1e6:,.0f} MB "
             f"in {time.perf_counter() - t0:.1f}s")
        source = str(src)
        if getattr(args, "s3", False):
            sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the checkout
            from tests.fixtures.s3 import S3Server

            s3 = stack.enter_context(S3Server())
            t0 = time.perf_counter()
            upload(s3, src, "kspeedfs-demo")
            env = {**os.environ, **s3.env()}           # its endpoint, dummy credentials
            source = "s3://kspeedfs-demo/"
            _say(f"   uploaded them to {source} on a local S3 server ({s3.endpoint}) in "
                 f"{time.perf_counter() - t0:.1f}s")
        _say(f"2. kspeedfs import {source} (chunk, checksum every extent with xxh3-128, "
             "publish a manifest):")
        subprocess.run([*ks, "import", source, "--name", "demo", *common], check=True, env=env)
        subprocess.run([*ks, "ls", *common], check=True)
        mnt.mkdir(exist_ok=True)
        t0 = time.perf_counter()
        subprocess.run([*ks, "mount", "demo", str(mnt), "--set", "fuse.xattrs=true", *common],
                       check=True, env=env)
        mounted = True
        _say(f"3. kspeedfs mount demo {mnt}: live after {time.perf_counter() - t0:.2f}s")
        rels = sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file())
        _drop_page_cache()
        n1, t1 = read_all(mnt, src, rels)
        _drop_page_cache()
        n2, t2 = read_all(mnt, src, rels)
        _say("4. read every file through the mount with 8 readers, compared byte for byte:")
        _say(f"   epoch 1 (chunks loaded from the source): {n1 / 1e6:,.0f} MB in {t1:.2f}s "
             f"= {n1 / t1 / 1e6:,.0f} MB/s, {len(rels) / t1:,.0f} files/s")
        _say(f"   epoch 2 (daemon memory tier, kernel page cache dropped): {n2 / 1e6:,.0f} MB in "
             f"{t2:.2f}s = {n2 / t2 / 1e6:,.0f} MB/s, {len(rels) / t2:,.0f} files/s "
             f"({t1 / t2:.1f}x epoch 1)")
        s = json.loads(os.getxattr(mnt, "user.kspeedfs.stats"))
        _say("5. the mount's counters (getfattr -n user.kspeedfs.stats):")
        _say(f"   bytes to readers {s['read_bytes'] / 1e6:,.0f} MB in {s['reads']:,} FUSE reads; "
             f"chunks from source {s['source_loads']:,} ({s['source_bytes'] / 1e6:,.0f} MB, each "
             f"verified), memory-tier hits {s['memory_hits']:,}, prefetched {s['prefetched']:,}, "
             f"joined in-flight loads {s['waited_in_flight']:,}")
        _say(f"   checksum failures: {s['corrupt_discarded'] + s['source_mismatches']} "
             f"(every byte above matched its xxh3-128 and the source)")
        return 0
    finally:
        if mounted:
            subprocess.run([*ks, "umount", str(mnt)], check=False)
            for _ in range(100):
                if not os.path.ismount(mnt):
                    break
                time.sleep(0.05)
            _say("6. unmounted")
        stack.close()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

