"""The Python library (``kspeedfs.open_dataset``) against the native FUSE mount of the
same store, in one run: the suite's workloads ``library`` and ``library-4k``
(``python -m bench -w library -w library-4k``: :class:`Library` is their target, beside
``kspeedfs-warm`` and the ramfs ceilings), and ``python -m bench.library``, the same two
cases standalone with CPU per operation.

    case        what each target does                                   figure
    small-8t    every ImageNet-like file read whole once, shuffled,     files/s
                8 threads: ``ds.read(p)`` / ``open(mnt/p).read()``
    rand-4k-1t  random 4 KiB reads of the big files for --seconds,      reads/s
                1 thread: ``DatasetFile.readinto`` / ``os.pread``

Both targets are warm: the mount's memory tier and the library's are filled by reading
everything once at setup; the page cache is dropped before every mount run (so the
mount answers from its tier, not the kernel's cache). Targets run interleaved, A B A B,
for ``--reps`` rounds; medians and the library/mount ratio are printed. CPU per
operation counts the whole cost: the bench process (readers; for the library also its
trio thread) plus the mount's daemon. Benchmarks are not tests: nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from . import datasets
from .datasets import Dataset
from .system import Mounts, drop_caches, process_cpu
from .targets import Kspeedfs, KspeedfsStore, Target

#: the open datasets of the Library targets, by the path the suite hands each case
_HANDLES: dict[Path, object] = {}
#: the Library targets by that path, for cases that read in other processes
_TARGETS: dict[Path, Library] = {}
RATIOS = [("library", "kspeedfs-warm"), ("library-cold", "kspeedfs-cold"),
          ("library", "ramfs-c"), ("kspeedfs-warm", "ramfs-c")]


class Library(Target):
    """``kspeedfs.open_dataset`` in the bench process, with a dataset-sized memory tier:
    warm, every file read once at setup; cold (``library-cold``), a fresh handle and
    the page cache dropped before each run, as ``kspeedfs-cold`` mounts afresh. Its
    ``path`` is a placeholder directory the cases look the handle up by
    (:func:`handle`); no daemon: its CPU is the bench process's, in the host figures."""

    holds_dataset = True

    def __init__(self, ds: Dataset, store: KspeedfsStore, warm: bool = True,
                 in_process: bool = True) -> None:
        """``in_process=False``: no handle in the bench process (the cases read in
        processes of their own, :meth:`loader_args`)."""
        super().__init__(ds)
        self.store = store
        self.warm = warm
        self.in_process = in_process
        self.name = "library" if warm else "library-cold"
        self.handle = None

    def setup(self, mounts: Mounts, work: Path) -> None:
        self.store.ensure()
        self.path = work / "library" / f"{self.ds.root.name}-{self.name}"
        self.path.mkdir(parents=True, exist_ok=True)
        _TARGETS[self.path] = self
        # closed with the workload's mounts: the suite calls this "pid" function then
        mounts.add(self.path, self._close)
        if self.warm and self.in_process:
            self._open()
            paths = self.ds.paths()
            for i in range(0, len(paths), 64):
                self.handle.read_many(paths[i:i + 64])     # type: ignore[attr-defined]

    def config(self) -> dict[str, str]:
        """The library's config: this store, a memory tier the dataset fits."""
        return {"store.path": str(self.store.dir / "store"),
                "cache.memory": str(max(256 << 20, int(self.ds.bytes * 1.3) + (64 << 20)))}

    def loader_args(self) -> list[str]:
        """``bench.dataloader``'s arguments that read this target's dataset."""
        return ["--library", self.store.name, "--config", json.dumps(self.config()),
                "--warm-epochs", "1"]

    def _open(self) -> None:
        import kspeedfs

        self.handle = kspeedfs.open_dataset(self.store.name, config=self.config())
        _HANDLES[self.path] = self.handle

    def _close(self) -> None:
        if self.handle is not None:
            _HANDLES.pop(self.path, None)
            self.handle.close()
            self.handle = None

    def prepare(self) -> None:
        # cold: the source's pages too (a cold read is a disk read)
        if not self.warm and self.in_process:
            self._close()
            drop_caches()
            self._open()

    def finish(self) -> None:
        if not self.warm:
            self._close()


def handle(path: Path):
    """The open dataset of the Library target at ``path``, or None (a mount or a directory)."""
    return _HANDLES.get(path)


def target(path: Path) -> Library | None:
    """The Library target at ``path``, or None (a mount or a directory)."""
    return _TARGETS.get(path)


def loader_targets(ds: Dataset, ctx: object) -> list[Target]:
    """The DataLoader through the library (each worker its own handle) beside the warm
    mount and the C ceiling."""
    from .workloads import ramfs_c_targets

    store = KspeedfsStore(ctx.work, ds)          # type: ignore[attr-defined]
    return [Kspeedfs(ds, store, warm=True), Library(ds, store, in_process=False),
            *ramfs_c_targets(ds, ctx)]


def targets(ds: Dataset, ctx: object) -> list[Target]:
    from .workloads import ramfs_c_targets

    store = KspeedfsStore(ctx.work, ds)          # type: ignore[attr-defined]
    return [Kspeedfs(ds, store, warm=True), Library(ds, store), Kspeedfs(ds, store, warm=False),
            Library(ds, store, warm=False), *ramfs_c_targets(ds, ctx)]


def imagenet_cases(ds: Dataset, ctx: object) -> list:
    from .workloads import Case

    paths = ds.paths()

    def run(path: Path) -> dict:
        h = handle(path)
        read = (lambda rel: len(h.read(rel))) if h is not None else _opener(path)
        fig = small_files(read, paths, 8, seed=7)
        return {"files/s": fig["ops/s"], "MB/s": fig["MB/s"], "seconds": fig["seconds"],
                "bytes": fig["bytes"], "files": fig["ops"]}
    return [Case("8-threads", run, "files/s", also=("MB/s",))]


def rand_cases(ds: Dataset, ctx: object) -> list:
    from .workloads import Case

    paths = ds.paths()
    sizes = [os.path.getsize(ds.root / rel) for rel in paths]
    seconds = ctx.scale.runtime                  # type: ignore[attr-defined]

    def run(path: Path) -> dict:
        h = handle(path)
        if h is not None:
            files = [h.open(rel, buffering=0) for rel in paths]

            def read(f: int, off: int, buf: bytearray) -> int:
                files[f].seek(off)
                return files[f].readinto(buf)
            close = [f.close for f in files]
        else:
            fds = [os.open(os.path.join(path, rel), os.O_RDONLY) for rel in paths]

            def read(f: int, off: int, buf: bytearray) -> int:
                return os.preadv(fds[f], [buf], off)
            close = [lambda fd=fd: os.close(fd) for fd in fds]
        try:
            fig = random_reads(read, sizes, seconds, seed=7)
        finally:
            for c in close:
                c()
        return {"IOPS": fig["ops/s"], "MB/s": fig["MB/s"], "seconds": fig["seconds"],
                "bytes": fig["bytes"]}
    return [Case("4k-1-thread", run, "IOPS")]


def _opener(root: Path) -> Callable[[str], int]:
    def read(rel: str) -> int:
        with open(os.path.join(root, rel), "rb") as f:
            return len(f.read())
    return read


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _threads(n: int, work: Callable[[int], int]) -> tuple[int, float]:
    """Run ``work(i)`` in ``n`` threads from one start; (sum of results, seconds)."""
    out = [0] * n
    start = threading.Barrier(n + 1)

    def run(i: int) -> None:
        start.wait()
        out[i] = work(i)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    return sum(out), time.perf_counter() - t0


def small_files(read: Callable[[str], int], paths: list[str], threads: int, seed: int) -> dict:
    order = list(paths)
    random.Random(seed).shuffle(order)
    nbytes, dt = _threads(threads, lambda i: sum(read(p) for p in order[i::threads]))
    return {"ops/s": len(order) / dt, "MB/s": nbytes / dt / 1e6, "ops": len(order),
            "seconds": dt, "bytes": nbytes}


def random_reads(read: Callable[[int, int, bytearray], int], sizes: list[int], seconds: float,
                 seed: int, size: int = 4096) -> dict:
    rnd = random.Random(seed)
    buf = bytearray(size)
    n = 0
    t0 = time.perf_counter()
    deadline = t0 + seconds
    while time.perf_counter() < deadline:
        for _ in range(256):
            f = rnd.randrange(len(sizes))
            read(f, rnd.randrange(0, sizes[f] - size) & ~(size - 1), buf)
        n += 256
    dt = time.perf_counter() - t0
    return {"ops/s": n / dt, "MB/s": n * size / dt / 1e6, "ops": n, "seconds": dt,
            "bytes": n * size}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.library", description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=5000, help="ImageNet-like files (~110 KB each)")
    p.add_argument("--big", type=int, default=2, help="big files for the random reads")
    p.add_argument("--big-size", type=int, default=256, help="MiB per big file")
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--seconds", type=float, default=5.0, help="random-read run length")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--workdir", default="/tmp/kspeedfs-bench")
    args = p.parse_args(argv)

    import kspeedfs

    work = Path(args.workdir)
    small = datasets.imagenet(work / "data", args.files)
    big = datasets.big_files(work / "data", args.big, args.big_size << 20)
    mounts = Mounts()
    rows: dict[str, dict[str, list[dict]]] = {}
    try:
        sets = {}
        for ds in (small, big):
            store = KspeedfsStore(work, ds)
            mount = Kspeedfs(ds, store, warm=True, label=f"kspeedfs-warm-{ds.kind}")
            mount.setup(mounts, work)         # imports once, mounts, reads every file once
            lib = kspeedfs.open_dataset(store.name, config={
                "store.path": str(store.dir / "store"),
                "cache.memory": str(max(256 << 20, int(ds.bytes * 1.3) + (64 << 20)))})
            lib.read_many(ds.paths())          # warm: every chunk in the library's tier
            sets[ds.kind] = (ds, mount, lib)

        ds, mount, lib = sets["imagenet"]
        paths = ds.paths()

        cases = {"small-8t": {
            "library": lambda rep: small_files(lambda rel: len(lib.read(rel)), paths, args.threads, rep),
            "mount": lambda rep: small_files(_opener(mount.path), paths, args.threads, rep)}}

        bds, bmount, blib = sets["files"]
        bpaths = bds.paths()
        sizes = [os.path.getsize(bds.root / rel) for rel in bpaths]
        files = [blib.open(rel, buffering=0) for rel in bpaths]
        fds = [os.open(os.path.join(bmount.path, rel), os.O_RDONLY) for rel in bpaths]

        def lib_rand(f: int, off: int, buf: bytearray) -> int:
            files[f].seek(off)
            return files[f].readinto(buf)

        cases["rand-4k-1t"] = {
            "library": lambda rep: random_reads(lib_rand, sizes, args.seconds, rep),
            "mount": lambda rep: random_reads(lambda f, off, buf: os.preadv(fds[f], [buf], off),
                                              sizes, args.seconds, rep)}

        for case, targets in cases.items():
            rows[case] = {name: [] for name in targets}
            for rep in range(args.reps):
                for name, run in targets.items():
                    if name == "mount":
                        drop_caches()
                    daemon = (mount if case == "small-8t" else bmount).daemon()
                    cpu0, d0 = _self_cpu(), process_cpu(daemon) or 0.0
                    fig = run(rep)
                    cpu = _self_cpu() - cpu0 + (process_cpu(daemon) or 0.0) - d0 \
                        if name == "mount" else _self_cpu() - cpu0
                    fig["cpu_us/op"] = cpu / fig["ops"] * 1e6
                    rows[case][name].append(fig)
                    print(f"  {case:<11} {name:<8} rep {rep}: {fig['ops/s']:>10,.0f} ops/s "
                          f"{fig['MB/s']:>8,.0f} MB/s  {fig['cpu_us/op']:>6.1f} µs CPU/op", flush=True)
        for f in files:
            f.close()
        for fd in fds:
            os.close(fd)
        for _, _, lib in sets.values():
            lib.close()
    finally:
        mounts.close()

    print(f"\nmedians of {args.reps} interleaved rounds ({args.files} small files, "
          f"{args.big} x {args.big_size} MiB, {args.threads} threads; {os.cpu_count()} CPUs)")
    print(f"{'case':<11} {'library ops/s':>14} {'mount ops/s':>12} {'lib/mount':>10} "
          f"{'lib µs CPU/op':>14} {'mount µs CPU/op':>16}")
    for case, by in rows.items():
        med = {n: statistics.median(r["ops/s"] for r in rs) for n, rs in by.items()}
        cpu = {n: statistics.median(r["cpu_us/op"] for r in rs) for n, rs in by.items()}
        ratios = [a["ops/s"] / b["ops/s"] for a, b in zip(by["library"], by["mount"], strict=False)]
        print(f"{case:<11} {med['library']:>14,.0f} {med['mount']:>12,.0f} "
              f"{med['library'] / med['mount']:>10.2f} {cpu['library']:>14.1f} {cpu['mount']:>16.1f}"
              f"   (per round {', '.join(f'{r:.2f}' for r in ratios)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
