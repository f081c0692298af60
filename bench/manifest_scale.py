"""Manifest scale: import N small files, then measure what a mount pays to load the index.

    python -m bench.manifest_scale --files 1000000 [--dir /dev/shm/kscale] [--keep]

Prints, for the generated tree: import time and rate, manifest blob size, index load
time (store read + inflate + zero-copy casts), the index's bytes and the process RSS
growth per million files, and a mount's time-to-first-``ls`` with ``stat`` of every file.
Each figure is printed next to its baseline from the same run where one exists (the
``os.walk``+``lstat`` of the source tree for the stat pass).
"""
from __future__ import annotations

import argparse
import gc
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def generate(root: Path, files: int, per_dir: int = 10_000) -> None:
    payload = os.urandom(256)
    for i in range(files):
        if i % per_dir == 0:
            d = root / f"d{i // per_dir:04d}"
            d.mkdir(parents=True, exist_ok=True)
        fd = os.open(d / f"img{i:08d}.jpg", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, payload[: 64 + i % 192])
        os.close(fd)


def stat_all(root: Path) -> tuple[int, float]:
    t0 = time.perf_counter()
    n = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            os.lstat(os.path.join(dirpath, name))
            n += 1
    return n, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=1_000_000)
    ap.add_argument("--dir", default="/dev/shm/kspeedfs-scale")
    ap.add_argument("--keep", action="store_true", help="keep the generated tree for the next run")
    args = ap.parse_args()

    from kspeedfs.manifest.importer import import_tree
    from kspeedfs.manifest.index import ManifestIndex
    from kspeedfs.manifest.store.embedded import EmbeddedStore

    base = Path(args.dir)
    src, store_dir, mnt = base / "src", base / "store", base / "mnt"
    marker = base / f"generated-{args.files}"
    if not marker.exists():
        shutil.rmtree(base, ignore_errors=True)
        t0 = time.perf_counter()
        generate(src, args.files)
        marker.touch()
        print(f"generated {args.files:,} files in {time.perf_counter() - t0:.1f}s")
    shutil.rmtree(store_dir, ignore_errors=True)
    store = EmbeddedStore(store_dir)
    t0 = time.perf_counter()
    info = import_tree(src, "scale", store, 4 << 20)
    t_import = time.perf_counter() - t0
    print(f"import: {info.files:,} files, {info.chunks:,} chunks in {t_import:.1f}s "
          f"({info.files / t_import:,.0f} files/s); manifest blob {info.manifest_size / 1e6:.1f} MB")

    gc.collect()
    before = rss()
    t0 = time.perf_counter()
    blob = store.manifest("scale", info.version)
    t_fetch = time.perf_counter() - t0
    ix = ManifestIndex.from_blob(blob)
    del blob
    t_load = time.perf_counter() - t0
    gc.collect()
    grew = rss() - before
    per_m = 1e6 / info.entries
    print(f"index load: {t_load:.2f}s (store read {t_fetch:.2f}s); index {ix.nbytes / 1e6:.1f} MB, "
          f"RSS +{grew / 1e6:.1f} MB = {grew * per_m / 1e6:.0f} MB per million entries "
          f"({grew / info.entries:.0f} B/entry)")

    mnt.mkdir(exist_ok=True)
    common = ["--store", str(store_dir), "--set", f"log.dir={base / 'log'}"]
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "kspeedfs.cli.app", "mount", "scale", str(mnt), *common],
                   check=True)
    t_mount = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        first = os.listdir(mnt)
        t_ls = time.perf_counter() - t0
        print(f"mount: live after {t_mount:.2f}s, first ls ({len(first)} dirs) {t_ls * 1e3:.0f} ms")
        for label, root in (("source", src), ("mount (cold)", mnt), ("mount (warm)", mnt)):
            n, dt = stat_all(root)
            print(f"stat of every file, {label}: {n:,} in {dt:.1f}s = {n / dt:,.0f}/s")
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)])
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
