"""What FUSE over io_uring's reply copy costs for 1 MiB reads:
``python -m bench.uring_copy [STORE_DIR]``.

A READ hit on /dev/fuse is one writev from the memory tier's buffers; on an io_uring
queue the engine first copies the bytes into the ring entry's payload buffer (the kernel
then copies them out, as it does from writev's iovecs). This mounts one warm dataset
twice, ``fuse.io_uring=off`` then ``auto`` (``enable_uring`` set to Y for the second
mount only, then put back), reads one large file with 1 MiB O_DIRECT reads (every read
a FUSE READ answered from the tier), and prints the time per read and, on io_uring, the
engine's own count of the copy (``ring_copy_ns`` / ``ring_copy_bytes`` of the stats
xattr). The store is a bench store (``python -m bench -w rand-4k`` makes
``WORKDIR/stores/files-4x256M-f2``).
"""
from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

from .system import daemon_pid, unmount
from .targets import ENABLE_URING, KSPEEDFS

MIB = 1 << 20


def _read_direct(path: Path) -> tuple[int, float]:
    """Read ``path`` whole with 1 MiB O_DIRECT reads: (reads, seconds)."""
    buf = mmap.mmap(-1, MIB)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    n, off, t0 = 0, 0, time.perf_counter()
    try:
        while got := os.preadv(fd, [buf], off):
            off += got
            n += 1
    finally:
        os.close(fd)
    return n, time.perf_counter() - t0


def measure(store: Path, mode: str, work: Path, reps: int = 5) -> list[str]:
    mp = work / f"mnt-{mode}"
    mp.mkdir(parents=True, exist_ok=True)
    before = ENABLE_URING.read_text().strip()
    if mode == "auto":
        ENABLE_URING.write_text("Y")
    try:
        subprocess.run([*KSPEEDFS, "mount", "ds", str(mp), "--store", str(store / "store"),
                        "--set", f"log.dir={work / 'log'}", "--set", "fuse.xattrs=true",
                        "--set", f"fuse.io_uring={mode}", "--cache-mem", "2GiB"], check=True)
    finally:
        ENABLE_URING.write_text(before)
    lines = []
    try:
        big = max((p for p in mp.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
        _read_direct(big)                                  # into the memory tier
        for _ in range(reps):
            a = json.loads(os.getxattr(mp, "user.kspeedfs.stats"))
            n, secs = _read_direct(big)
            b = json.loads(os.getxattr(mp, "user.kspeedfs.stats"))
            copied = b.get("ring_copy_bytes", 0) - a.get("ring_copy_bytes", 0)
            ns = b.get("ring_copy_ns", 0) - a.get("ring_copy_ns", 0)
            copy = (f"ring copy {ns / 1e3 / (copied / MIB):6.1f} us per MiB ({copied / MIB:.0f} MiB)"
                    if copied else "no ring copy")
            lines.append(f"{b['transport']:<18} {n} x 1 MiB O_DIRECT reads: "
                         f"{secs / n * 1e6:7.1f} us per read, {n * MIB / secs / 1e9:5.2f} GB/s; {copy}")
    finally:
        unmount(mp, daemon_pid(mp), timeout=10.0)
    return lines


def main(argv: list[str]) -> int:
    store = Path(argv[0] if argv else "/tmp/kspeedfs-bench/stores/files-4x256M-f2")
    work = Path("/tmp/kspeedfs-bench/uring-copy")
    (work / "log").mkdir(parents=True, exist_ok=True)
    for mode in ("off", "auto"):
        for line in measure(store, mode, work):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
