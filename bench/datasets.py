"""Deterministic benchmark datasets, generated once per size under the work directory.

Every dataset is a pure function of its parameters (and a seed): the same
parameters give byte-identical trees, so figures from two runs describe the same
bytes. A tree is reused when its ``.complete`` marker records the same parameters.

Bytes are made unique at 64 KiB granularity (a 16-byte stamp: dataset, file, block)
over a seeded random pool, so no two chunks of any chunk size from 64 KiB up share a
digest: kspeedfs's chunk cache is keyed by digest and would otherwise deduplicate the
data and flatter itself.

- ``files``   : ``seq.0 .. seq.N-1``, large files for sequential and random fio jobs
                (fio ``filename_format=seq.$jobnum``: job *i* reads its own file).
- ``imagenet``: ``train/cNN/img-XXXXXXX.jpg``, log-normal sizes with mean ~110 KB
                (sigma 0.6, clamped to 4 KB..2 MB) in a few directories.
- ``shards``  : ``shard-N.tar``, a few multi-GB files.
- ``bigdir``  : ``d/f-XXXXXXX``, one directory of empty files (for ``ls -l``).
"""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

STAMP = 64 << 10          # uniqueness granularity
POOL = 16 << 20           # random bytes the files are cut from


@dataclass(frozen=True)
class Dataset:
    kind: str
    root: Path
    files: int
    bytes: int

    def listing(self) -> Path:
        return self.root.parent / f"{self.root.name}.paths"

    def paths(self) -> list[str]:
        """Relative paths of every regular file, sorted (cached next to the tree)."""
        listing = self.listing()
        if listing.exists():
            return listing.read_text().splitlines()
        out = sorted(os.path.relpath(os.path.join(d, f), self.root)
                     for d, _, fs in os.walk(self.root) for f in fs if not f.startswith("."))
        listing.write_text("\n".join(out) + "\n")
        return out


class _Writer:
    def __init__(self, seed: int, tag: int) -> None:
        self.pool = random.Random(seed).randbytes(POOL + STAMP)
        self.tag = tag

    def content(self, file_no: int, size: int, rnd: random.Random) -> bytes:
        base = rnd.randrange(0, POOL - STAMP) if size < POOL else 0
        parts = []
        for blk, off in enumerate(range(0, size, STAMP)):
            n = min(STAMP, size - off)
            src = (base + off) % POOL
            parts.append(struct.pack("<IIQ", self.tag, file_no, blk)[:n] + self.pool[src + 16:src + n])
        return b"".join(parts)[:size]

    def write(self, path: Path, file_no: int, size: int, rnd: random.Random) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            for off in range(0, size, 64 << 20):      # bounded memory for multi-GB files
                n = min(64 << 20, size - off)
                f.write(self.content(file_no, n, rnd) if off == 0 else
                        self._more(file_no, off, n))

    def _more(self, file_no: int, off: int, n: int) -> bytes:
        parts = []
        for o in range(off, off + n, STAMP):
            m = min(STAMP, off + n - o)
            src = o % POOL
            parts.append(struct.pack("<IIQ", self.tag, file_no, o // STAMP)[:m] + self.pool[src + 16:src + m])
        return b"".join(parts)


def _ready(root: Path, params: dict) -> bool:
    marker = root / ".complete"
    return marker.exists() and json.loads(marker.read_text()) == params


def _finish(root: Path, params: dict, files: int, nbytes: int, kind: str) -> Dataset:
    (root / ".complete").write_text(json.dumps(params))
    return Dataset(kind, root, files, nbytes)


def _fresh(root: Path) -> None:
    if root.exists():
        shutil.rmtree(root)
    (root.parent / f"{root.name}.paths").unlink(missing_ok=True)
    root.mkdir(parents=True)


def _load(kind: str, root: Path, params: dict) -> Dataset:
    st = json.loads((root / ".complete").read_text())
    return Dataset(kind, root, st["_files"], st["_bytes"])


def _same_size(root: Path, kind: str, name: str, count: int, size: int, seed: int,
               tag: int) -> Dataset:
    """``count`` files of ``size`` bytes named ``name.format(i)``, made once under ``root``."""
    params = {"kind": kind, "count": count, "size": size, "seed": seed}
    full = {**params, "_files": count, "_bytes": count * size}
    if _ready(root, full):
        return _load(kind, root, full)
    _fresh(root)
    w = _Writer(seed, tag)
    rnd = random.Random(seed)
    for i in range(count):
        w.write(root / name.format(i), i, size, rnd)
    return _finish(root, full, count, count * size, kind)


def big_files(workdir: Path, count: int, size: int, seed: int = 1) -> Dataset:
    return _same_size(workdir / f"files-{count}x{size >> 20}M", "files", "seq.{}", count, size,
                      seed, 1)


def imagenet(workdir: Path, files: int, dirs: int = 16, mean: int = 110_000, seed: int = 2) -> Dataset:
    root = workdir / f"imagenet-{files}"
    params = {"kind": "imagenet", "files": files, "dirs": dirs, "mean": mean, "seed": seed}
    if (root / ".complete").exists():
        st = json.loads((root / ".complete").read_text())
        if {k: v for k, v in st.items() if not k.startswith("_")} == params:
            return Dataset("imagenet", root, st["_files"], st["_bytes"])
    _fresh(root)
    rnd = random.Random(seed)
    w = _Writer(seed, 2)
    sigma = 0.6
    mu = math.log(mean) - sigma * sigma / 2          # mean of the log-normal = ``mean``
    total = 0
    for i in range(files):
        size = int(min(max(rnd.lognormvariate(mu, sigma), 4096), 2 << 20))
        path = root / "train" / f"c{i % dirs:02d}" / f"img-{i:07d}.jpg"
        if i < dirs:
            path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(w.content(i, size, rnd))
        total += size
    return _finish(root, {**params, "_files": files, "_bytes": total}, files, total, "imagenet")


def shards(workdir: Path, count: int, size: int, seed: int = 3) -> Dataset:
    return _same_size(workdir / f"shards-{count}x{size >> 20}M", "shards", "shard-{}.tar", count,
                      size, seed, 3)


def bigdir(workdir: Path, entries: int) -> Dataset:
    root = workdir / f"bigdir-{entries}"
    params = {"kind": "bigdir", "entries": entries, "_files": entries, "_bytes": 0}
    if _ready(root, params):
        return _load("bigdir", root, params)
    _fresh(root)
    d = root / "d"
    d.mkdir()
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(entries):
            os.close(os.open(f"f-{i:07d}", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=dfd))
    finally:
        os.close(dfd)
    return _finish(root, params, entries, 0, "bigdir")


def describe(ds: Dataset) -> dict:
    d = asdict(ds)
    d["root"] = str(ds.root)
    return d
