"""The workloads: which dataset, which cases (one measured run each), which targets.

=================  =========================  =====================================================
workload           dataset                    cases (primary figure)
=================  =========================  =====================================================
``seq-1m``         files: seq.0..3            fio seq-read.fio, 1 MiB, psync and io_uring (QD 16),
                                              1 and 4 jobs, each job its own file (MB/s)
``rand-4k``        files                      fio rand-read.fio, 4 KiB, 1 and 4 jobs (IOPS); Python records
``rand-128k``      files                      fio rand-read.fio, 128 KiB, 1 and 4 jobs (MB/s)
``imagenet``       imagenet: log-normal       every file read whole once, shuffled, 8 worker
                   ~110 KB files, 16 dirs     processes (files/s; MB/s alongside)
``dataloader``     imagenet                   torch DataLoader, 4 workers, raw bytes (files/s)
``shards``         shards: a few big files    fio shards.fio, 4 readers, random 1-8 MiB reads (MB/s)
``stat``           imagenet                   stat() of every file, dentry cache cold (stats/s)
``ls-l``           bigdir: one huge dir       ls -l of it (entries/s)
``sweep-*``        files / imagenet           kspeedfs alone, one knob varied; ratio to the default
``transport``      none (memory to memory)    rdma.perf READ, 4 MiB / 128 KiB / 1 MiB, QD 8, soft
                                              provider vs one TCP stream, two netns hosts (MB/s)
``cluster``        cluster: 4 large files     a client mount reading from 3 peers over the soft
                   (+ ImageNet-like files)    transport: 4 sequential readers (MB/s); random
                                              4 KiB, 4 jobs (IOPS); 8 workers over the small
                                              files (files/s)
``cluster-flap``   cluster: 4 large files     the same readers, time based, one client NIC
                                              flapping (MB/s; errors, longest stall)
``library``        imagenet                   the Python library in 8 threads (``ds.read``)
                                              vs the mount (``open().read()``), warm and cold
                                              (files/s)
``library-dataloader`` imagenet               torch DataLoader, 4 workers, through
                                              ``kspeedfs.torch`` vs the native mount
``library-4k``     files                      random 4 KiB, one thread: ``readinto`` of the
                                              library vs ``pread`` on the mount, warm and
                                              cold (IOPS)
``s3``             s3: a moto bucket, mixed   every chunk through the S3 origin as a node's
                   objects + one of 64 MiB    preload loads it, and a cold cat through a
                                              mount, vs plain boto3 GETs (MB/s, CPU-s/GB;
                                              bench/s3.py)
=================  =========================  =====================================================

Sizes come from a :class:`Scale` (``--quick``, ``--scale medium``, full by default).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from . import cluster, datasets, library, readers, s3
from .datasets import Dataset
from .system import REPO, run_fio
from .targets import (
    ENABLE_URING,
    Kspeedfs,
    KspeedfsStore,
    RamFS,
    SourceCold,
    SourceWarm,
    Target,
    UringKspeedfs,
)


@dataclass(frozen=True)
class Scale:
    name: str
    reps: int
    seq_files: int = 4
    seq_size: int = 1 << 30
    runtime: int = 10
    imagenet_files: int = 50_000
    shard_count: int = 3
    shard_size: int = 2 << 30
    bigdir_entries: int = 1_000_000
    max_cases: int = 0            # quick: only the first cases of each workload (0 = all)


SCALES = {
    "quick": Scale("quick", reps=2, seq_size=32 << 20, runtime=1, imagenet_files=1_000,
                   shard_count=2, shard_size=64 << 20, bigdir_entries=5_000, max_cases=1),
    "medium": Scale("medium", reps=3, seq_size=256 << 20, runtime=5, imagenet_files=20_000,
                    shard_count=3, shard_size=512 << 20, bigdir_entries=100_000),
    "full": Scale("full", reps=5),
}


@dataclass
class Case:
    name: str
    run: Callable[[Path], dict]
    primary: str
    also: tuple[str, ...] = ()      # secondary figures worth a look in the progress lines


@dataclass
class Context:
    work: Path
    scale: Scale
    ramfs_c: Path | None = None
    ab_tree: Path | None = None     # --ab-tree: a second kspeedfs tree measured alongside
    cluster_chunk: str = "4MiB"     # --cluster-chunk-size: the cluster dataset's chunk size
    only: frozenset[str] = frozenset()  # --target: run only these targets (empty: all)
    # (numerator, denominator) target pairs reported as ratios of the primary figure
    ratios: list[tuple[str, str]] = field(default_factory=list)


AB_RATIOS = [("B:kspeedfs-cold", "kspeedfs-cold"), ("B:kspeedfs-warm", "kspeedfs-warm"),
             ("B:kspeedfs-warm", "ramfs-py")]
# kspeedfs-* run the default engine (native); pyfuse3:* the same mount with
# fuse.engine=pyfuse3. A pair whose target a run lacks (--no-c) is dropped
# (run_workload keeps the pairs whose both targets exist).
STANDARD_RATIOS = [
    ("kspeedfs-cold", "source-cold"),
    ("kspeedfs-warm", "source-warm"),
    ("kspeedfs-warm", "ramfs-py"),
    ("kspeedfs-warm", "ramfs-c"),
    ("kspeedfs-warm", "ramfs-c-mt"),
    ("kspeedfs-warm", "pyfuse3:kspeedfs-warm"),
    ("kspeedfs-cold", "pyfuse3:kspeedfs-cold"),     # cold paths: no slower than pyfuse3
    ("pyfuse3:kspeedfs-warm", "ramfs-c"),
    ("ramfs-py", "ramfs-c"),
    ("ramfs-c-mt", "ramfs-c"),
    ("io_uring:kspeedfs-warm", "kspeedfs-warm"),    # FUSE over io_uring vs /dev/fuse
    ("io_uring:kspeedfs-warm", "ramfs-c"),
    ("io_uring:kspeedfs-warm", "ramfs-c-mt"),
]
META_RATIOS = [("kspeedfs", "source-cold"), ("kspeedfs", "source-warm"), ("kspeedfs", "ramfs-py"),
               ("kspeedfs", "ramfs-c"), ("kspeedfs", "ramfs-c-mt"), ("kspeedfs", "pyfuse3:kspeedfs"),
               ("kspeedfs", "whole:kspeedfs"),
               ("pyfuse3:kspeedfs", "ramfs-c"), ("ramfs-py", "ramfs-c"), ("ramfs-c-mt", "ramfs-c")]


@dataclass
class Workload:
    name: str
    doc: str
    dataset: Callable[[Context], Dataset]
    cases: Callable[[Dataset, Context], list[Case]]
    targets: Callable[[Dataset, Context], list[Target]]
    ratios: list[tuple[str, str]] = field(default_factory=lambda: STANDARD_RATIOS + AB_RATIOS)
    needs: Callable[[], None] | None = None         # e.g. installs torch


# -- datasets ----------------------------------------------------------------------------

def _files(ctx: Context) -> Dataset:
    return datasets.big_files(ctx.work / "data", ctx.scale.seq_files, ctx.scale.seq_size)


def _imagenet(ctx: Context) -> Dataset:
    return datasets.imagenet(ctx.work / "data", ctx.scale.imagenet_files)


def _shards(ctx: Context) -> Dataset:
    return datasets.shards(ctx.work / "data", ctx.scale.shard_count, ctx.scale.shard_size)


def _bigdir(ctx: Context) -> Dataset:
    return datasets.bigdir(ctx.work / "data", ctx.scale.bigdir_entries)


# -- targets -----------------------------------------------------------------------------

PYFUSE3 = {"fuse.engine": "pyfuse3"}


def has_engines() -> bool:
    """The kspeedfs under test has ``fuse.engine`` (a --kspeedfs-rev from before the
    native engine has not, and is pyfuse3 anyway: no pyfuse3:* twins then)."""
    from kspeedfs import config

    return hasattr(config.Config().fuse, "engine")


def has_io_uring() -> bool:
    """The kspeedfs under test has ``fuse.io_uring`` and the kernel FUSE over io_uring."""
    from kspeedfs import config

    return hasattr(config.Config().fuse, "io_uring") and ENABLE_URING.exists() and os.geteuid() == 0


def ramfs_c_targets(ds: Dataset, ctx: Context) -> list[Target]:
    """ramfs-c (libfuse's single-threaded loop) and ramfs-c-mt (its multi-threaded loop,
    one worker per CPU, a cloned /dev/fuse fd each); none with --no-c."""
    if not ctx.ramfs_c:
        return []
    # at least 2: ramfs_c.c runs the single-threaded loop for RAMFS_C_THREADS <= 1
    mt = {"RAMFS_C_THREADS": str(max(2, os.cpu_count() or 1)), "RAMFS_C_CLONE_FD": "1"}
    return [RamFS(ds, "c", ctx.ramfs_c), RamFS(ds, "c", ctx.ramfs_c, env=mt, label="ramfs-c-mt")]


def standard_targets(ds: Dataset, ctx: Context) -> list[Target]:
    store = KspeedfsStore(ctx.work, ds)
    # kspeedfs-* run the default engine (native); pyfuse3:* the same store, old engine
    out: list[Target] = [SourceCold(ds), SourceWarm(ds), Kspeedfs(ds, store, warm=False),
                         Kspeedfs(ds, store, warm=True)]
    if has_engines():
        out += [Kspeedfs(ds, store, warm=False, label="pyfuse3:kspeedfs-cold", settings=PYFUSE3),
                Kspeedfs(ds, store, warm=True, label="pyfuse3:kspeedfs-warm", settings=PYFUSE3)]
    if has_io_uring():
        out.append(UringKspeedfs(ds, store, warm=True))
    if ctx.ab_tree:     # after the kspeedfs targets, before the ramfs ceilings
        out += [Kspeedfs(ds, store, warm=False, label="B:kspeedfs-cold", tree=ctx.ab_tree),
                Kspeedfs(ds, store, warm=True, label="B:kspeedfs-warm", tree=ctx.ab_tree)]
    out.append(RamFS(ds, "py"))
    out += ramfs_c_targets(ds, ctx)
    return out


def metadata_targets(ds: Dataset, ctx: Context) -> list[Target]:
    store = KspeedfsStore(ctx.work, ds)
    # as a user mounts it: no xattrs (ls -l would send 2 GETXATTRs per entry), no counters
    ks = Kspeedfs(ds, store, warm=True, label="kspeedfs", settings={"fuse.xattrs": "false"})
    ks.preload = False
    out: list[Target] = [SourceCold(ds), SourceWarm(ds), ks]
    # the same manifest kept whole: what paging it costs a mount (manifest/pages.py)
    whole = Kspeedfs(ds, KspeedfsStore(ctx.work, ds, whole=True), warm=True,
                     label="whole:kspeedfs", settings={"fuse.xattrs": "false"})
    whole.preload = False
    out.append(whole)
    if has_engines():
        py3 = Kspeedfs(ds, store, warm=True, label="pyfuse3:kspeedfs",
                       settings={"fuse.xattrs": "false", **PYFUSE3})
        py3.preload = False
        out.append(py3)
    out.append(RamFS(ds, "py"))
    out += ramfs_c_targets(ds, ctx)
    return out


# -- cases -------------------------------------------------------------------------------

def seq_case(ds: Dataset, engine: str, jobs: int) -> Case:
    size = ds.bytes // ds.files
    depth = 1 if engine == "psync" else 16

    def run(path: Path) -> dict:
        return run_fio("seq-read.fio", {"DIR": str(path), "SIZE": str(size), "JOBS": str(jobs),
                                        "ENGINE": engine, "IODEPTH": str(depth)})
    return Case(f"{engine}-j{jobs}" + (f"-qd{depth}" if depth > 1 else ""), run, "MB/s")


def fio_files(root: Path, rels: list[str]) -> str:
    """fio's ``filename=`` list: colon-separated, a colon inside a path escaped."""
    return ":".join(str(root / p).replace(":", "\\:") for p in rels)


def fio_random(root: Path, rels: list[str], nbytes: int, bs: str, jobs: int, runtime: int) -> dict:
    """rand-read.fio, psync, over the files ``rels`` below ``root`` (``nbytes`` in all)."""
    return run_fio("rand-read.fio", {"FILES": fio_files(root, rels), "SIZE": str(nbytes),
                                     "BS": bs, "JOBS": str(jobs), "RUNTIME": str(runtime),
                                     "ENGINE": "psync", "IODEPTH": "1"})


def rand_case(ds: Dataset, ctx: Context, bs: str, jobs: int, primary: str) -> Case:
    def run(path: Path) -> dict:
        return fio_random(path, ds.paths(), ds.bytes, bs, jobs, ctx.scale.runtime)
    return Case(f"{bs}-psync-j{jobs}", run, primary)     # names unique within a sweep


def _seq_cases(ds: Dataset, ctx: Context) -> list[Case]:
    return [seq_case(ds, e, j) for e, j in (("psync", 1), ("io_uring", 4), ("psync", 4), ("io_uring", 1))]


def _records_case(ds: Dataset, ctx: Context) -> Case:
    """Python's buffered ``open()``, seek + read of 4 KiB records (readers.records)."""
    paths = ds.paths()
    return Case("py-records-4k", lambda p: readers.records(str(p), paths, 4096, ctx.scale.runtime),
                "records/s")


def _cold_rand_cases(ds: Dataset, ctx: Context) -> list[Case]:
    """The random-read cases of the chunk and block size sweeps."""
    return [rand_case(ds, ctx, "4k", 1, "IOPS"), rand_case(ds, ctx, "4k", 4, "IOPS"),
            rand_case(ds, ctx, "128k", 4, "MB/s")]


def _imagenet_cases(ds: Dataset, ctx: Context) -> list[Case]:
    paths = ds.paths()
    return [Case("8-workers", lambda p: readers.whole_files(str(p), paths, 8), "files/s")]


def _shards_cases(ds: Dataset, ctx: Context) -> list[Case]:
    paths = ds.paths()
    jobs = 4
    # each job's share of every file, whole MiBs (the tail of a file beyond jobs x PART
    # is left unread, under 4 MiB per file)
    part = min(os.path.getsize(ds.root / p) for p in paths) // jobs >> 20 << 20

    def run(path: Path) -> dict:
        return run_fio("shards.fio", {"FILES": fio_files(path, paths), "JOBS": str(jobs),
                                      "PART": str(part), "JOBSIZE": str(part * len(paths))})
    return [Case("psync-j4-1to8m", run, "MB/s")]


def _stat_cases(ds: Dataset, ctx: Context) -> list[Case]:
    paths = ds.paths()
    return [Case("stat-every-file", lambda p: readers.stat_all(str(p), paths), "stats/s")]


def _ls_cases(ds: Dataset, ctx: Context) -> list[Case]:
    return [Case(f"ls-l-{ds.files}", lambda p: readers.ls_l(str(p / "d")), "entries/s")]


def ensure_torch() -> None:
    """torch into the venv, only when the DataLoader workload runs."""
    probe = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True)
    if probe.returncode == 0:
        return
    print("installing torch==2.13.0 (CPU) into the venv for the dataloader workload", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "torch==2.13.0"], check=True)


def _dataloader_cases(ds: Dataset, ctx: Context) -> list[Case]:
    ds.paths()
    listing = ds.listing()

    def run(path: Path, collate: str = "list") -> dict:
        lib = library.target(path)
        p = subprocess.run([sys.executable, "-m", "bench.dataloader", str(path), str(listing),
                            "--workers", "4", "--collate", collate,
                            *(lib.loader_args() if lib else ())],
                           capture_output=True, text=True, cwd=REPO)
        if p.returncode:
            raise RuntimeError(f"dataloader failed: {p.stderr.strip()[-2000:]}")
        return json.loads(p.stdout.strip().splitlines()[-1])
    also = ("loader_cpu_us_per_file", "host_cpu_us_per_file")
    return [Case("torch-4-workers", run, "files/s", also=also),
            Case("torch-4-workers-packed", lambda p: run(p, "packed"), "files/s", also=also)]


# -- sweeps: kspeedfs alone, one knob at a time, ratio to the configured default ----------

def _default(key: str) -> str:
    from kspeedfs import config

    cfg = config.Config()
    section, _, name = key.partition(".")
    v = getattr(getattr(cfg, "import_" if section == "import" else section), name)
    sizes = ("import.chunk_size", "import.block_size", "cache.memory")
    return config.format_size(v) if key in sizes else str(v)


def sweep(name: str, key: str, values: list[str], warm: bool, dataset: Callable[[Context], Dataset],
          cases: Callable[[Dataset, Context], list[Case]], doc: str,
          also: Callable[[str], dict[str, str]] = lambda v: {},
          fixed: Callable[[Dataset], dict[str, str]] = lambda ds: {}) -> Workload:
    """``also(value)``: settings that must move with the knob (congestion_threshold
    with max_background, as kspeedfs's own default keeps it at 3/4); ``fixed(ds)``:
    settings every value runs with."""
    default = _default(key)

    def targets(ds: Dataset, ctx: Context) -> list[Target]:
        out: list[Target] = []
        vals = values if default in values else [default, *values]
        for v in vals:
            label = f"{key.split('.')[-1]}={v}" + (" (default)" if v == default else "")
            if key == "import.chunk_size":
                t = Kspeedfs(ds, KspeedfsStore(ctx.work, ds, chunk=v), warm=warm,
                             settings=fixed(ds), label=label)
            elif key == "import.block_size":
                t = Kspeedfs(ds, KspeedfsStore(ctx.work, ds, block=v), warm=warm,
                             settings=fixed(ds), label=label)
            else:
                t = Kspeedfs(ds, KspeedfsStore(ctx.work, ds), warm=warm,
                             settings={key: v, **also(v), **fixed(ds)}, label=label)
            out.append(t)
        return out

    def ratios(ds_targets: list[str]) -> list[tuple[str, str]]:
        base = next(t for t in ds_targets if t.endswith("(default)"))
        return [(t, base) for t in ds_targets if t != base]

    wl = Workload(name, doc, dataset, cases, targets, ratios=[])
    wl.sweep_ratios = ratios        # type: ignore[attr-defined]
    return wl


def _cache_sweep() -> Workload:
    """cache.memory as fractions of the dataset: re-read after one pass, page cache dropped."""
    def targets(ds: Dataset, ctx: Context) -> list[Target]:
        out: list[Target] = []
        for frac in ("0.25", "0.5", "1.0", "1.5"):
            size = max(16 << 20, int(ds.bytes * float(frac)))
            label = f"memory={frac}x dataset" + (" (reference)" if frac == "1.5" else "")
            out.append(Kspeedfs(ds, KspeedfsStore(ctx.work, ds), warm=True,
                                settings={"cache.memory": str(size)}, label=label))
        return out

    wl = Workload("sweep-cache", "memory tier size vs dataset size; 2nd pass re-read", _files,
                  lambda ds, ctx: [seq_case(ds, "psync", 4)], targets, ratios=[])
    wl.sweep_ratios = lambda names: [(t, names[-1]) for t in names[:-1]]   # type: ignore[attr-defined]
    return wl


def _seq_and_rand(ds: Dataset, ctx: Context) -> list[Case]:
    return [seq_case(ds, "psync", 1), seq_case(ds, "io_uring", 4),
            rand_case(ds, ctx, "128k", 4, "MB/s")]


WORKLOADS: dict[str, Workload] = {w.name: w for w in [
    Workload("seq-1m", "sequential 1 MiB reads, one file per job", _files, _seq_cases, standard_targets),
    Workload("rand-4k", "random 4 KiB reads over the large files (fio; Python records)", _files,
             lambda ds, ctx: [*(rand_case(ds, ctx, "4k", j, "IOPS") for j in (4, 1)),
                              _records_case(ds, ctx)], standard_targets),
    Workload("rand-128k", "random 128 KiB reads over the large files", _files,
             lambda ds, ctx: [rand_case(ds, ctx, "128k", j, "MB/s") for j in (4, 1)], standard_targets),
    Workload("imagenet", "ImageNet-like: every small file read whole once, shuffled, 8 workers",
             _imagenet, _imagenet_cases, standard_targets),
    Workload("dataloader", "torch DataLoader epoch over the ImageNet-like files, raw bytes",
             _imagenet, _dataloader_cases, standard_targets, needs=ensure_torch),
    Workload("shards", "large shards: 4 readers, random 1-8 MiB reads", _shards, _shards_cases,
             standard_targets),
    Workload("stat", "stat() of every ImageNet-like file, dentry cache cold", _imagenet, _stat_cases,
             metadata_targets, ratios=list(META_RATIOS)),
    Workload("ls-l", "ls -l of one huge directory", _bigdir, _ls_cases, metadata_targets,
             ratios=list(META_RATIOS)),
    sweep("sweep-chunk", "import.chunk_size", ["1MiB", "4MiB", "16MiB"], False,
          _imagenet, lambda ds, ctx: _imagenet_cases(ds, ctx), "chunk size, cold: small files"),
    sweep("sweep-chunk-seq", "import.chunk_size", ["1MiB", "4MiB", "16MiB"], False,
          _files, lambda ds, ctx: [seq_case(ds, "psync", 1), seq_case(ds, "psync", 4)],
          "chunk size, cold: sequential"),
    sweep("sweep-chunk-rand", "import.chunk_size", ["1MiB", "4MiB", "16MiB"], False, _files,
          _cold_rand_cases,
          "chunk size, cold random reads (blocks, then whole chunks: the tier fits the data)"),
    sweep("sweep-chunk-shards", "import.chunk_size", ["1MiB", "4MiB", "16MiB"], False, _shards,
          _shards_cases, "chunk size, cold: 4 readers at random 1-8 MiB offsets of large shards"),
    sweep("sweep-block", "import.block_size", ["32KiB", "128KiB", "4MiB"], False, _files,
          _cold_rand_cases,
          "block size (4MiB = whole chunks only), cold random reads, memory tier half the dataset",
          fixed=lambda ds: {"cache.memory": str(ds.bytes // 2)}),
    sweep("sweep-prefetch", "fuse.prefetch_chunks", ["0", "2", "4", "8", "16"], False, _files,
          lambda ds, ctx: [seq_case(ds, "psync", 1), seq_case(ds, "psync", 4)],
          "prefetch depth, cold sequential readers"),
    sweep("sweep-max_background", "fuse.max_background", ["12", "32", "64", "128"], True, _files,
          _seq_and_rand, "FUSE max_background, warm (chunk cache) reads",
          also=lambda v: {"fuse.congestion_threshold": str(max(1, int(v) * 3 // 4))}),
    sweep("sweep-threads", "fuse.threads", ["1", "2", "4"], True, _files,
          lambda ds, ctx: [seq_case(ds, "psync", 1), seq_case(ds, "psync", 4),
                           seq_case(ds, "io_uring", 1), rand_case(ds, ctx, "4k", 4, "IOPS")],
          "native engine request threads (0 = one per core), warm (chunk cache) reads"),
    sweep("sweep-read_ahead_kb", "fuse.read_ahead_kb", ["128", "1024", "4096", "16384"], True, _files,
          lambda ds, ctx: [seq_case(ds, "psync", 1), seq_case(ds, "psync", 4),
                           rand_case(ds, ctx, "4k", 1, "IOPS")],
          "bdi read_ahead_kb, warm (chunk cache) reads"),
    _cache_sweep(),
    sweep("sweep-blksize", "fuse.blksize", ["128KiB", "4MiB"], True, _files,
          lambda ds, ctx: [rand_case(ds, ctx, "4k", 1, "IOPS"), rand_case(ds, ctx, "4k", 4, "IOPS"),
                           seq_case(ds, "psync", 1), _records_case(ds, ctx)],
          "st_blksize reported (0 = automatic: 4 KiB native, the block size on pyfuse3; "
          "128KiB = the block size; 4MiB = the chunk size), warm reads"),
    sweep("sweep-blksize-cold", "fuse.blksize", ["128KiB", "4MiB"], False, _files,
          lambda ds, ctx: [_records_case(ds, ctx), rand_case(ds, ctx, "4k", 1, "IOPS")],
          "st_blksize reported, cold random reads, memory tier half the dataset",
          fixed=lambda ds: {"cache.memory": str(ds.bytes // 2)}),
    sweep("sweep-push", "fuse.push_pages", ["False", "True"], False, _files,
          lambda ds, ctx: [seq_case(ds, "psync", 1), seq_case(ds, "psync", 4)],
          "page-cache push of prefetched chunks (FUSE_NOTIFY_STORE), cold sequential readers"),
    Workload("library", "the Python library, 8 threads, vs the native mount: every ImageNet-like "
             "file whole, warm and cold", _imagenet, library.imagenet_cases, library.targets,
             ratios=library.RATIOS),
    Workload("library-dataloader", "a torch DataLoader, 4 workers, through the library "
             "(kspeedfs.torch) vs through the native mount, warm", _imagenet, _dataloader_cases,
             library.loader_targets, ratios=library.RATIOS, needs=ensure_torch),
    Workload("library-4k", "the Python library vs the native mount: random 4 KiB, one thread, warm and cold",
             _files, library.rand_cases, library.targets, ratios=library.RATIOS),
    Workload("transport", "soft RDMA READ vs plain TCP between two netns hosts (rdma.perf)",
             cluster.transport_dataset, cluster.transport_cases, cluster.transport_targets,
             ratios=cluster.TRANSPORT_RATIOS),
    Workload("cluster", "a client mount reading a dataset preloaded into 3 peers (soft transport)",
             cluster.cluster_dataset, cluster.cluster_cases, cluster.cluster_targets,
             ratios=cluster.CLUSTER_RATIOS),
    Workload("cluster-flap", "reads from 3 peers while one client NIC flaps (down 1 s, up, repeat)",
             cluster.cluster_dataset, cluster.flap_cases, cluster.flap_targets, ratios=cluster.FLAP_RATIOS),
    Workload("s3", "a bucket on a loopback moto server: the S3 origin's preload and a cold cat "
             "through a mount vs plain boto3 GETs", s3.dataset, s3.cases, s3.targets,
             ratios=s3.RATIOS),
]}

GROUPS = {
    "cluster-all": ["transport", "cluster", "cluster-flap"],
    "metadata": ["stat", "ls-l"],
    "sweep": ["sweep-chunk", "sweep-chunk-seq", "sweep-chunk-rand", "sweep-chunk-shards",
              "sweep-block", "sweep-prefetch", "sweep-max_background", "sweep-threads",
              "sweep-read_ahead_kb", "sweep-cache", "sweep-push",
              "sweep-blksize", "sweep-blksize-cold"],
}
DEFAULT_QUICK = ["seq-1m", "rand-4k", "imagenet", "shards", "stat", "ls-l"]
DEFAULT_FULL = ["seq-1m", "rand-4k", "rand-128k", "imagenet", "dataloader", "shards", "stat", "ls-l",
                *GROUPS["cluster-all"],
                *GROUPS["sweep"]]


def expand(names: list[str]) -> list[str]:
    out: list[str] = []
    for n in names:
        for w in GROUPS.get(n, [n]):
            if w not in WORKLOADS:
                raise SystemExit(f"unknown workload {w!r}; known: {', '.join([*WORKLOADS, *GROUPS])}")
            if w not in out:
                out.append(w)
    return out


def scale_with(scale: Scale, **kw: int) -> Scale:
    return replace(scale, **{k: v for k, v in kw.items() if v})
