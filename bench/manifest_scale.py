"""Manifest scale: import N small files, then measure what a mount pays to load the index.

    python -m bench.manifest_scale --files 1000000 [--dir /dev/shm/kscale] [--keep]
    python -m bench.manifest_scale --synthetic --files 10000000 [--import-only]

``--synthetic`` feeds the importer generated entries (``SyntheticSource``: the same
names and sizes as the generated tree, bytes made up in memory) instead of files, so
10^7 entries and more are measured without a filesystem holding them; the mount then
serves the namespace only (``stat``, ``ls``: reads would find no source).

Prints, for the generated tree: import time and rate, manifest blob size, index load
time (store read + inflate + zero-copy casts), the index's bytes and the process RSS
growth per million files, and a mount's time-to-first-``ls`` with ``stat`` of every file.
``--import-only`` stops after the import: its rate, the process's peak RSS (VmHWM, total
and per entry above the RSS before the import) and the store's bytes per entry.
Each figure is printed next to its baseline from the same run where one exists (the
``os.walk``+``lstat`` of the source tree for the stat pass).
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import resource
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss() -> int:
    """The process's peak resident set (VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) << 10
    raise RuntimeError("no VmHWM in /proc/self/status")


def generate(root: Path, files: int, per_dir: int = 10_000) -> None:
    payload = os.urandom(256)
    for i in range(files):
        if i % per_dir == 0:
            d = root / f"d{i // per_dir:04d}"
            d.mkdir(parents=True, exist_ok=True)
        fd = os.open(d / f"img{i:08d}.jpg", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, payload[: 64 + i % 192])
        os.close(fd)


class SyntheticSource:
    """An ``ImportSource`` of ``files`` generated entries in directories of ``per_dir``:
    the tree :func:`generate` would write, with no file behind it."""

    threads = 0

    def __init__(self, files: int, per_dir: int = 10_000) -> None:
        self.files, self.per_dir = files, per_dir
        self.url = f"synthetic:{files}"
        self.payload = os.urandom(256)

    def scan(self, progress: object) -> Any:
        from kspeedfs.manifest.importer import _Tree

        tree, now = _Tree(), time.time_ns()
        tree.add_entry(0, b"", stat.S_IFDIR | 0o755, 0, 0, 0, now)
        ndirs = -(-self.files // self.per_dir)
        tree.data[0], tree.size[0] = 1, ndirs
        for d in range(ndirs):
            name = b"d%04d" % d
            tree.add_entry(0, name, stat.S_IFDIR | 0o755, 0, 0, 0, now)
        add, mode = tree.add_entry, stat.S_IFREG | 0o644
        for d in range(ndirs):
            first = d * self.per_dir
            stop = min(first + self.per_dir, self.files)
            tree.data[1 + d], tree.size[1 + d] = len(tree), stop - first
            for i in range(first, stop):
                add(1 + d, b"img%08d.jpg" % i, mode, 0, 0, 64 + i % 192, now)
        tree.flush()
        return tree

    def read_into(self, tree: Any, entry: int, offset: int, out: memoryview) -> None:
        out[:] = self.payload[offset:offset + len(out)]

    def record(self) -> None:
        return None


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
    ap.add_argument("--synthetic", action="store_true",
                    help="generated entries fed to the importer, no files (namespace only)")
    ap.add_argument("--per-dir", type=int, default=10_000, help="files per directory")
    ap.add_argument("--stat-all", action="store_true",
                    help="also stat every file through the mount, cold and warm")
    ap.add_argument("--import-only", action="store_true",
                    help="stop after the import: its rate, peak RSS and store bytes per entry")
    args = ap.parse_args()

    from kspeedfs.manifest.importer import import_tree
    from kspeedfs.manifest.load import load_index
    from kspeedfs.manifest.store.embedded import EmbeddedStore

    base = Path(args.dir)
    src, store_dir = base / "src", base / "store"
    marker = base / f"generated-{args.files}"
    source: Any = src
    if args.synthetic:
        shutil.rmtree(base, ignore_errors=True)
        src.mkdir(parents=True)                  # empty: the mount's --source
        source = SyntheticSource(args.files, args.per_dir)
    elif not marker.exists():
        shutil.rmtree(base, ignore_errors=True)
        t0 = time.perf_counter()
        generate(src, args.files, args.per_dir)
        marker.touch()
        print(f"generated {args.files:,} files in {time.perf_counter() - t0:.1f}s")
    shutil.rmtree(store_dir, ignore_errors=True)
    store = EmbeddedStore(store_dir)
    rss0 = rss()
    t0 = time.perf_counter()
    peak0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    at_publish = 0

    def progress(p: Any) -> None:
        nonlocal at_publish
        if p.phase == "publish" and not at_publish:
            at_publish = peak_rss()

    info = import_tree(source, "scale", store, 4 << 20, progress=progress)
    t_import = time.perf_counter() - t0
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak0) << 10
    stored = info.manifest_size + sum(p.stat().st_size for p in (store_dir / "pages").rglob("*")
                                      if p.is_file())
    print(f"import: {info.files:,} files, {info.entries:,} entries, {info.chunks:,} chunks in "
          f"{t_import:.1f}s ({info.entries / t_import:,.0f} entries/s, peak RSS +{peak / 1e6:,.0f} MB "
          f"= {peak / info.entries:.0f} B/entry); manifest {stored / 1e6:.1f} MB "
          f"= {stored / info.entries:.1f} B/entry in the store ({info.manifest_size:,} B of it "
          f"the store's blob, the rest pages)")
    if args.import_only:
        hwm = peak_rss()
        print(f"import only: {info.entries / t_import:,.0f} entries/s; peak RSS {hwm / 1e6:,.0f} MB "
              f"(+{(hwm - rss0) / 1e6:,.0f} MB over {rss0 / 1e6:.0f} MB before the import = "
              f"{(hwm - rss0) / info.entries:.1f} B/entry; before the store's publish "
              f"+{(at_publish - rss0) / 1e6:,.0f} MB = {(at_publish - rss0) / info.entries:.1f} "
              f"B/entry); store "
              f"{stored / info.entries:.2f} B/entry")
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
        return

    gc.collect()
    before = rss()
    t0 = time.perf_counter()
    ix = load_index(store, info)
    t_load = time.perf_counter() - t0
    gc.collect()
    grew = rss() - before
    kind = "paged" if ix.pages is not None else "whole"
    print(f"index load ({kind}): {t_load:.2f}s; raw {ix.nbytes / 1e6:.1f} MB, RSS "
          f"+{grew / 1e6:.1f} MB ({grew / info.entries:.1f} B/entry)")
    del ix
    mount_and_stat(args, base, store_dir, src, info)
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)


def mount_and_stat(args: argparse.Namespace, base: Path, store_dir: Path, src: Path,
                   info: Any) -> None:
    """A real mount of the dataset: time to live, first entries of the root and of the
    first directory (streamed), cold single stats of random files, the daemon's RSS after
    ``stat`` of a random 1 % of the files, and (``--stat-all``) every file cold and warm."""
    from bench.system import daemon_pid

    mnt = base / "mnt"
    mnt.mkdir(exist_ok=True)
    common = ["--store", str(store_dir), "--set", f"log.dir={base / 'log'}"]
    if args.synthetic:
        common += ["--source", str(src)]
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "kspeedfs.cli.app", "mount", "scale", str(mnt), *common],
                   check=True)
    t_mount = time.perf_counter() - t0
    pid = daemon_pid(mnt)
    try:
        rss_live = proc_rss(pid)
        t0 = time.perf_counter()
        top = os.listdir(mnt)
        t_ls = time.perf_counter() - t0
        first_dir = mnt / sorted(top)[0]
        t0 = time.perf_counter()
        with os.scandir(first_dir) as it:
            next(it)
            t_first = time.perf_counter() - t0
            n = 1 + sum(1 for _ in it)
        t_dir = time.perf_counter() - t0
        print(f"mount: live after {t_mount:.2f}s (daemon RSS {rss_live / 1e6:.0f} MB); ls / "
              f"({len(top)} entries) {t_ls * 1e3:.0f} ms; {first_dir.name}/ ({n:,} entries): "
              f"first entry {t_first * 1e3:.1f} ms, all {t_dir:.2f}s")
        rng = random.Random(1)
        paths = [synthetic_path(rng.randrange(args.files), args.per_dir) for _ in range(200)]
        lat = []
        for p in paths:
            t0 = time.perf_counter()
            os.stat(mnt / p)
            lat.append(time.perf_counter() - t0)
        lat.sort()
        print(f"cold stat of a random file (200): median {lat[100] * 1e3:.2f} ms, "
              f"p90 {lat[180] * 1e3:.2f} ms, max {lat[-1] * 1e3:.2f} ms")
        k = max(1, args.files // 100)
        sample = rng.sample(range(args.files), k)
        before = proc_rss(pid)
        t0 = time.perf_counter()
        for i in sample:
            os.stat(mnt / synthetic_path(i, args.per_dir))
        dt = time.perf_counter() - t0
        print(f"stat of a random 1 % ({k:,}): {k / dt:,.0f}/s; daemon RSS {before / 1e6:.0f} -> "
              f"{proc_rss(pid) / 1e6:.0f} MB (+{(proc_rss(pid) - rss_live) / 1e6:.0f} MB since live)")
        if args.stat_all:
            passes = (("source", src),) if not args.synthetic else ()
            for label, root in (*passes, ("mount (cold)", mnt), ("mount (warm)", mnt)):
                n, dt = stat_all(root)
                print(f"stat of every file, {label}: {n:,} in {dt:.1f}s = {n / dt:,.0f}/s")
            print(f"daemon RSS after: {proc_rss(pid) / 1e6:.0f} MB")
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)])


def synthetic_path(i: int, per_dir: int) -> str:
    """Where file ``i`` of :func:`generate`'s (and ``SyntheticSource``'s) tree is."""
    return f"d{i // per_dir:04d}/img{i:08d}.jpg"


def proc_rss(pid: int | None) -> int:
    if pid is None:
        return 0
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()

if __name__ == "__main__":
    main()
