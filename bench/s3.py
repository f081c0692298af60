"""The ``s3`` workload: reading a bucket through kspeedfs against plain boto3, same server.

``python -m bench -w s3`` starts a moto server on loopback (``tests/fixtures/s3.py``),
uploads the workload's dataset to one bucket and imports the whole bucket (``kspeedfs
import s3://bench-s3/``) into an embedded store. The bucket holds

    mix/small/...   ImageNet-like objects (~110 KB, packed several to a chunk)
    mix/large/...   16 MiB objects (4 chunks each, one extent per chunk)
    big/seq.0       one 64 MiB object

    case            target            what runs                                     figure
    preload-mix     boto3             every extent of the mix/ chunks as one ranged  MB/s
                                      GET with If-Match, ``source.max_inflight``
                                      threads: the plain loop (the same requests
                                      the origin makes, none of its work)
                    boto3-get         every mix/ object in one GET, as many threads
                    boto3-cp          every mix/ object by s3transfer's
                                      ``download_fileobj`` (what ``aws s3 cp`` runs:
                                      8 MiB ranged parts, 10 at once), as many threads
                    kspeedfs-origin   ``origin.load(k)`` of every mix/ chunk from
                                      ``cluster.preload_workers`` threads: what a
                                      node's preload runs (``Reconciler._fill`` → TierChain
                                      → ``ObjectOrigin.load`` in a worker thread), the
                                      per-extent xxh3 check included
                    kspeedfs-cold     every mix/ file read whole through a fresh
                                      node-less mount, 8 threads
    cat-64MiB       (the same five over big/seq.0 alone: its 16 chunks; one GET;
                    one ``download_fileobj``; ``cat`` through a fresh mount, empty
                    chunk cache, page cache dropped)

The issue's targets are ``kspeedfs-origin / boto3`` on preload-mix and ``kspeedfs-cold
/ boto3-get`` on cat-64MiB. moto answers a ranged GET by copying the whole object and
slicing it (``moto/s3/responses.py``, ``_handle_range_header``), so on this server a
range of a large object costs what the object does: ``boto3`` on cat-64MiB (16 ranged
GETs of 4 MiB, the requests the mount makes) says what that leaves of any range reader.

Why the node's preload is driven at ``origin.load`` and not through a node: the node
adds the arena copy and etcd progress writes, none of it S3's, and a cluster bed (etcd,
netns hosts) would take the 2 CPUs the server needs; ``origin.load`` is the code the
node calls, from as many threads as it calls it.

Every run records ``cpu_s_per_GB``: the CPU of this process over the run (boto3 and
origin targets; the server is another process and is not counted), and for the mount
the daemon's CPU plus the reader's. moto is a Python server sharing the 2 CPUs, so the
absolute MB/s are its ceiling; the ratios (same server, same run, neighbouring runs)
are the figures to read.
"""
from __future__ import annotations

import os
import resource
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from . import datasets, library
from .datasets import Dataset
from .system import Mounts, daemon_pid, process_cpu
from .targets import KSPEEDFS, Kspeedfs, KspeedfsStore, Target, package_cwd

BUCKET = "bench-s3"
MiB = 1 << 20
RATIOS = [("kspeedfs-origin", "boto3"), ("kspeedfs-cold", "boto3-get"), ("kspeedfs-cold", "boto3"),
          ("kspeedfs-cold", "boto3-cp"), ("kspeedfs-origin", "boto3-get"), ("boto3", "boto3-get")]
#: (ImageNet-like objects, 16 MiB objects) of mix/ by scale: ~130 MB at medium and full
MIX = {"quick": (300, 2), "medium": (600, 4), "full": (600, 4)}

#: the in-process targets of the running workload, by the path the suite hands a case
_TARGETS: dict[Path, S3Target] = {}


def dataset(ctx: Any) -> Dataset:
    """A local tree of what goes into the bucket: links to the suite's generated sets."""
    small_n, large_n = MIX[ctx.scale.name]
    data = ctx.work / "data"
    parts = {"mix/small": datasets.imagenet(data, small_n),
             "mix/large": datasets.big_files(data, large_n, 16 * MiB),
             "big": datasets.big_files(data, 1, 64 * MiB, seed=5)}
    root = data / f"s3-{small_n}-{large_n}"
    root.mkdir(parents=True, exist_ok=True)
    for rel, ds in parts.items():
        link = root / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(ds.root)
    return Dataset("s3", root, sum(d.files for d in parts.values()),
                   sum(d.bytes for d in parts.values()))


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class S3Bed:
    """The server, the bucket and the store every target of the workload shares. While
    it is up this process's environment names the server (``S3Server.env``), so the
    CLI it runs (import, mounts) and its own boto3 clients reach it and nothing else."""

    def __init__(self, ds: Dataset, work: Path) -> None:
        self.ds = ds
        self.store = S3Store(work, ds, self)
        self.server: Any = None
        self._saved: dict[str, str | None] = {}
        self.index: Any = None
        self.source = ""
        self.mix: list[int] = []          # chunks of mix/ objects
        self.big: list[int] = []          # chunks of big/seq.0
        self.objects: dict[int, tuple[str, str]] = {}     # entry -> (key, etag)

    def ensure(self) -> None:
        if self.server is not None:
            return
        from tests.fixtures.s3 import S3Server

        self.server = S3Server().start()
        for k, v in self.server.env().items():
            self._saved.setdefault(k, os.environ.get(k))
            os.environ[k] = v
        self._upload()

    def _upload(self) -> None:
        c = self.server.client()
        c.create_bucket(Bucket=BUCKET)
        files = [(os.path.join(d, f), os.path.relpath(os.path.join(d, f), self.ds.root))
                 for d, _, fs in os.walk(self.ds.root, followlinks=True)
                 for f in fs if not f.startswith(".")]

        def put(item: tuple[str, str]) -> None:
            with open(item[0], "rb") as f:
                c.put_object(Bucket=BUCKET, Key=item[1], Body=f.read())
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(put, files))

    def opened(self) -> None:
        """The imported manifest: which chunks are whose (after ``store.ensure``)."""
        from kspeedfs.manifest.load import load_index
        from kspeedfs.manifest.store.embedded import EmbeddedStore

        with EmbeddedStore(self.store.dir / "store") as st:
            info = st.dataset(self.store.name)
            self.index = ix = load_index(st, info)
            self.source = info.source
        for e in ix.walk():
            if ix.is_file(e):
                path = ix.path(e).decode()
                self.objects[e] = (path, ix.object_identity(e)[0])
                span = list(ix.chunk_range(e, 0, ix.size[e]))
                (self.big if path.startswith("big/") else self.mix).extend(span)
        self.mix = sorted(set(self.mix))
        self.big = sorted(set(self.big))
        assert not set(self.mix) & set(self.big), "big/seq.0 shares a chunk with mix/"

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self._saved.clear()


class S3Store(KspeedfsStore):
    """The bucket imported into an embedded store; afresh each run (the server is)."""

    def __init__(self, work: Path, ds: Dataset, bed: S3Bed) -> None:
        super().__init__(work, ds)
        self.bed = bed
        self._imported = False

    def ensure(self) -> None:
        self.bed.ensure()
        if self._imported:
            return
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        cmd = [*KSPEEDFS, "import", f"s3://{BUCKET}/", "--name", self.name, "-q", *self.common()]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=package_cwd())
        if r.returncode:
            raise RuntimeError(f"kspeedfs import s3://{BUCKET}/ failed: {r.stderr.strip()}")
        self._imported = True
        self.bed.opened()


class _Sink:
    """A file s3transfer writes to, counting: ``download_fileobj`` seeks and writes its
    parts at their offsets."""

    def __init__(self) -> None:
        self.n = 0

    def write(self, b: bytes) -> int:
        self.n += len(b)
        return len(b)

    def seek(self, offset: int, whence: int = 0) -> int:
        return offset

    def tell(self) -> int:
        return 0


class S3Target(Target):
    """An in-process reader of the bucket: ``boto3`` (the plain ranged loop),
    ``boto3-get`` (whole objects), ``boto3-cp`` (s3transfer) or ``kspeedfs-origin``
    (``ObjectOrigin.load``). Its ``path`` is a placeholder directory the
    cases look the target up by."""

    def __init__(self, ds: Dataset, bed: S3Bed, name: str) -> None:
        super().__init__(ds)
        self.bed = bed
        self.name = name
        self.origin: Any = None
        self.conn: Any = None
        self.cfg: Any = None

    def setup(self, mounts: Mounts, work: Path) -> None:
        from kspeedfs import config
        from kspeedfs.objstore import connect
        from kspeedfs.origin import open_origin

        self.bed.store.ensure()
        self.cfg = config.load(environ={})
        self.path = work / "s3" / self.name
        self.path.mkdir(parents=True, exist_ok=True)
        _TARGETS[self.path] = self
        if self.name.startswith("boto3"):
            self.conn = connect(f"s3://{BUCKET}/", self.cfg.source)
        else:
            self.origin = open_origin(self.bed.source, self.bed.index, self.bed.store.name,
                                      config=self.cfg.source)

    def prepare(self) -> None:
        """No page cache between this process and the server."""

    def load_chunks(self, chunks: list[int]) -> int:
        """What a node's preload does with its share: ``origin.load`` from
        ``preload_workers`` threads."""
        def one(k: int) -> int:
            data, mismatches = self.origin.load(k)
            if mismatches:
                raise RuntimeError(f"chunk {k}: {mismatches} extents failed their checksum")
            return len(data)
        with ThreadPoolExecutor(self.cfg.cluster.preload_workers) as pool:
            return sum(pool.map(one, chunks))

    def get_extents(self, chunks: list[int]) -> int:
        """The plain loop: the same ranged GETs, ``source.max_inflight`` threads."""
        ix, c = self.bed.index, self.conn.client
        tasks = [(*self.bed.objects[e.entry], e.file_offset, e.length)
                 for k in chunks for e in ix.chunk_extents(k)]

        def get(t: tuple[str, str, int, int]) -> int:
            key, etag, lo, n = t
            r = c.get_object(Bucket=BUCKET, Key=key, IfMatch=etag, Range=f"bytes={lo}-{lo + n - 1}")
            got = len(r["Body"].read())
            if got != n:
                raise RuntimeError(f"{key}: {got} of {n} bytes")
            return got
        with ThreadPoolExecutor(self.cfg.source.max_inflight) as pool:
            return sum(pool.map(get, tasks))

    def get_objects(self, keys: list[str]) -> int:
        """Whole objects, one GET each (``boto3-get``) or by s3transfer (``boto3-cp``),
        ``source.max_inflight`` at once."""
        c = self.conn.client

        def get(key: str) -> int:
            return len(c.get_object(Bucket=BUCKET, Key=key)["Body"].read())

        def cp(key: str) -> int:
            sink = _Sink()
            c.download_fileobj(BUCKET, key, sink)
            return sink.n
        if len(keys) == 1:
            return (get if self.name == "boto3-get" else cp)(keys[0])
        with ThreadPoolExecutor(self.cfg.source.max_inflight) as pool:
            return sum(pool.map(get if self.name == "boto3-get" else cp, keys))

    def read(self, chunks: list[int]) -> int:
        """This target's reader over ``chunks`` (whole objects: the objects they hold)."""
        if self.name == "boto3":
            return self.get_extents(chunks)
        if self.name == "kspeedfs-origin":
            return self.load_chunks(chunks)
        ix = self.bed.index
        keys = sorted({self.bed.objects[e.entry][0] for k in chunks for e in ix.chunk_extents(k)})
        return self.get_objects(keys)

    def close(self) -> None:
        _TARGETS.pop(self.path, None)
        if self.origin is not None:
            self.origin.close()
            self.origin = None
        self.bed.close()


def targets(ds: Dataset, ctx: Any) -> list[Target]:
    bed = S3Bed(ds, ctx.work)
    return [S3Target(ds, bed, "boto3"), S3Target(ds, bed, "boto3-get"), S3Target(ds, bed, "boto3-cp"),
            S3Target(ds, bed, "kspeedfs-origin"),
            Kspeedfs(ds, bed.store, warm=False)]


def _figures(nbytes: int, seconds: float, cpu: float) -> dict:
    return {"MB/s": nbytes / seconds / 1e6, "seconds": seconds, "bytes": nbytes,
            "cpu_s_per_GB": cpu / (nbytes / 1e9)}


def _timed(path: Path, in_process: Any, mounted: Any) -> dict:
    """Run one target's reader; CPU: this process's, plus the daemon and children for a
    mount."""
    t = _TARGETS.get(path)
    pid = None if t is not None else daemon_pid(path)
    cpu0, d0, c0 = library._self_cpu(), process_cpu(pid) or 0.0, _children_cpu()
    t0 = time.perf_counter()
    nbytes = in_process(t) if t is not None else mounted(path)
    dt = time.perf_counter() - t0
    cpu = library._self_cpu() - cpu0 + (process_cpu(pid) or 0.0) - d0 + _children_cpu() - c0
    return _figures(nbytes, dt, cpu)


def cases(ds: Dataset, ctx: Any) -> list:
    from .workloads import Case

    def mix_paths() -> list[str]:
        t = next(iter(_TARGETS.values()))
        return sorted(p for p, _ in t.bed.objects.values() if p.startswith("mix/"))

    def preload(path: Path) -> dict:
        def in_process(t: S3Target) -> int:
            return t.read(t.bed.mix)

        def mounted(mp: Path) -> int:
            fig = library.small_files(library._opener(mp), mix_paths(), 8, seed=7)
            return int(fig["bytes"])
        return _timed(path, in_process, mounted)

    def cat(path: Path) -> dict:
        def in_process(t: S3Target) -> int:
            return t.read(t.bed.big)

        def mounted(mp: Path) -> int:
            subprocess.run(["cat", str(mp / "big" / "seq.0")], stdout=subprocess.DEVNULL,
                           check=True)
            return os.path.getsize(mp / "big" / "seq.0")
        return _timed(path, in_process, mounted)

    return [Case("preload-mix", preload, "MB/s", also=("cpu_s_per_GB",)),
            Case("cat-64MiB", cat, "MB/s", also=("cpu_s_per_GB",))]
