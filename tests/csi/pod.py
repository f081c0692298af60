"""A "pod" for the CSI tests (a program, not a test): run inside its own mount namespace
(``unshare --mount``), it reads every file of a published target path with O_DIRECT
(each read a FUSE READ, never a page-cache hit) from several threads, checks each file
against the source's SHA-256, until a stop file appears; then prints one JSON report:
reads, files, errors, wrong files, the longest read.

    pod.py TARGET SOURCE STOPFILE READYFILE THREADS

READYFILE is written once the first file of each thread has been read and verified.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import random
import sys
import threading
import time
from pathlib import Path

READ = 128 << 10


def main() -> int:
    target, source, stopfile, readyfile = (Path(a) for a in sys.argv[1:5])
    threads = int(sys.argv[5])
    files = sorted(p.relative_to(source) for p in source.rglob("*") if p.is_file())
    digest = {p: hashlib.sha256((source / p).read_bytes()).digest() for p in files}
    lock = threading.Lock()
    report = {"reads": 0, "files": 0, "bytes": 0, "errors": [], "wrong": 0, "longest_read": 0.0,
              "mount_ns": os.readlink("/proc/self/ns/mnt")}
    started = threading.Barrier(threads + 1)

    def reader(seed: int) -> None:
        rnd = random.Random(seed)
        buf = mmap.mmap(-1, READ)
        first = True
        while first or not stopfile.exists():
            rel = rnd.choice(files)
            h = hashlib.sha256()
            reads = size = 0
            longest = 0.0
            try:
                fd = os.open(target / rel, os.O_RDONLY | os.O_DIRECT)
                try:
                    while True:
                        t0 = time.monotonic()
                        n = os.preadv(fd, [buf], size)
                        longest = max(longest, time.monotonic() - t0)
                        if n == 0:
                            break
                        h.update(buf[:n])
                        size += n
                        reads += 1
                finally:
                    os.close(fd)
            except OSError as e:
                with lock:
                    report["errors"].append(f"{rel}: {e}")
                time.sleep(0.01)
            else:
                with lock:
                    report["reads"] += reads
                    report["files"] += 1
                    report["bytes"] += size
                    report["longest_read"] = max(report["longest_read"], longest)
                    report["wrong"] += h.digest() != digest[rel]
            if first:
                first = False
                started.wait()

    workers = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(threads)]
    for w in workers:
        w.start()
    started.wait()
    readyfile.touch()
    for w in workers:
        w.join(timeout=120)
    report["hung"] = sum(w.is_alive() for w in workers)
    report["errors"] = report["errors"][:20] + ([f"... {len(report['errors'])} in all"]
                                                if len(report["errors"]) > 20 else [])
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
