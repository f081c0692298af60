"""Client-side readers that are not fio: ImageNet-like whole-file readers, stat, ls -l.

Each returns a dict of figures for one run against one directory. The readers are
separate processes (fork), not threads, so the client's GIL is never what is measured.
"""
from __future__ import annotations

import os
import random
import subprocess
import time
from collections.abc import Sequence


def read_paths(root: str | os.PathLike[str], paths: Sequence[str]) -> int:
    """Read every file whole, in order, into one 4 MiB buffer; returns bytes read."""
    total = 0
    buf = bytearray(4 << 20)
    for rel in paths:
        fd = os.open(os.path.join(root, rel), os.O_RDONLY)
        try:
            while n := os.readv(fd, [buf]):
                total += n
        finally:
            os.close(fd)
    return total


def _read_files(root: str, paths: Sequence[str], start_r: int, done_w: int) -> None:
    os.read(start_r, 1)                    # start barrier: the parent times from here
    os.write(done_w, f"{read_paths(root, paths)}\n".encode())


def whole_files(root: str, paths: Sequence[str], workers: int = 8, seed: int = 7) -> dict:
    """Every file read whole once, in one shuffled order dealt round-robin to ``workers``
    processes (an epoch of a map-style dataset with a shuffling sampler)."""
    order = list(paths)
    random.Random(seed).shuffle(order)
    start_r, start_w = os.pipe()
    done_r, done_w = os.pipe()
    pids = []
    for w in range(workers):
        pid = os.fork()
        if pid == 0:
            try:
                os.close(start_w)
                _read_files(root, order[w::workers], start_r, done_w)
                os._exit(0)
            except BaseException:
                os._exit(1)
        pids.append(pid)
    os.close(start_r)
    os.close(done_w)
    t0 = time.perf_counter()
    os.write(start_w, b"x" * workers)
    total = 0
    with os.fdopen(done_r) as f:
        for line in f:
            total += int(line)
    dt = time.perf_counter() - t0
    os.close(start_w)
    bad = sum(1 for pid in pids if os.waitpid(pid, 0)[1] != 0)
    if bad:
        raise RuntimeError(f"{bad} reader process(es) failed under {root}")
    return {"files/s": len(order) / dt, "MB/s": total / dt / 1e6, "seconds": dt, "bytes": total,
            "files": len(order)}


def records(root: str, paths: Sequence[str], size: int, seconds: float, seed: int = 7) -> dict:
    """Random ``size``-byte records read the way a Python map-style dataset over a record
    file does: ``open(path, "rb")`` with Python's default buffering, then seek + read per
    record, for ``seconds``, files in turn. The buffer Python picks is the file's
    ``st_blksize``, so this measures what the filesystem's reported block size costs a
    reader that never asked for one (fio's psync does not buffer)."""
    rnd = random.Random(seed)
    files = [open(os.path.join(root, rel), "rb") for rel in paths]
    sizes = [os.fstat(f.fileno()).st_size for f in files]
    n = total = 0
    t0 = time.perf_counter()
    try:
        while time.perf_counter() - t0 < seconds:
            for f, fsize in zip(files, sizes, strict=True):
                f.seek(rnd.randrange(0, max(1, fsize - size)))     # records sit anywhere
                total += len(f.read(size))
            n += len(files)
    finally:
        for f in files:
            f.close()
    dt = time.perf_counter() - t0
    return {"records/s": n / dt, "MB/s": total / dt / 1e6, "seconds": dt, "records": n,
            "buffer": os.stat(os.path.join(root, paths[0])).st_blksize}


def stat_all(root: str, paths: Sequence[str]) -> dict:
    """``stat`` of every file, one process, in listing order (a ``find -ls`` / a dataset
    index build): every path component a lookup when the dentry cache is cold."""
    t0 = time.perf_counter()
    for rel in paths:
        os.stat(os.path.join(root, rel))
    dt = time.perf_counter() - t0
    return {"stats/s": len(paths) / dt, "seconds": dt, "files": len(paths)}


def ls_l(directory: str) -> dict:
    """``ls -l`` of one directory (readdir + a stat per entry), output discarded."""
    t0 = time.perf_counter()
    p = subprocess.run(["ls", "-l", "--color=never", directory], capture_output=True)
    dt = time.perf_counter() - t0
    if p.returncode:
        raise RuntimeError(f"ls -l {directory}: {p.stderr.decode(errors='replace')}")
    entries = p.stdout.count(b"\n") - 1           # minus the "total" line
    return {"entries/s": entries / dt, "seconds": dt, "entries": entries}
