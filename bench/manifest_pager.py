"""The page map's cost of one fault: a paged raw blob read on first touch, against the same
bytes read again once resident.

    python -m bench.manifest_pager [--mib 256] [--entries 1000000] [--dir /dev/shm/kspeedfs-pager]

The blob is a real manifest's raw bytes (``--entries`` generated entries imported as
``bench.manifest_scale --synthetic`` does), repeated up to ``--mib``, cut into 64 KiB
pages written as page files on ``--dir`` (tmpfs by default, so a fault's read is a page
cache copy, not a disk's). Then, for each handler thread count, one reader touches one
byte per 4 KiB in order: the first pass takes every fault (read + inflate + SHA-256 +
UFFDIO_COPY of 64 KiB), the second pass reads the same bytes resident. Printed per
page: the first pass, the second, the handler's wall time per fill (``fill_ns``) and
its CPU time in each part of one (``read_ns`` ...: on a busy machine, these are what a
fill costs, the wall times what it waited too). Figures: docs/design.md, "The page map".
"""
from __future__ import annotations

import argparse
import hashlib
import shutil
import time
import zlib
from pathlib import Path

PS = 64 << 10


def manifest_raw(entries: int, work: Path) -> bytes:
    """The inflated blob of a generated ``entries``-entry manifest."""
    from bench.manifest_scale import SyntheticSource
    from kspeedfs.manifest.importer import import_tree
    from kspeedfs.manifest.store.embedded import EmbeddedStore

    store = EmbeddedStore(work / "store")
    store.paged_above = 1 << 62         # whole: this bench cuts the pages itself
    info = import_tree(SyntheticSource(entries), "pager", store, 4 << 20)
    return zlib.decompress(store.manifest("pager", info.version))


def touch(view: memoryview, step: int = 4096) -> float:
    t0 = time.perf_counter()
    for off in range(0, len(view), step):
        view[off]
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--dir", default="/dev/shm/kspeedfs-pager")
    ap.add_argument("--threads", default="1,2", help="handler thread counts to run")
    args = ap.parse_args()

    from kspeedfs.manifest.pager import PageMap, page_path

    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    raw = manifest_raw(args.entries, work)
    size = args.mib << 20
    data = (raw * (size // len(raw) + 1))[:size]
    print(f"blob: {args.entries:,}-entry manifest, {len(raw) / 2**20:.1f} MiB raw, repeated to "
          f"{size >> 20} MiB = {size // PS:,} pages of 64 KiB")
    pages = work / "pages"
    hashes = []
    stored = 0
    for off in range(0, size, PS):
        page = data[off:off + PS]
        digest = hashlib.sha256(page).digest()
        hashes.append(digest)
        path = Path(page_path(str(pages), digest))
        path.parent.mkdir(parents=True, exist_ok=True)
        z = zlib.compress(page)
        path.write_bytes(z)
        stored += len(z)
    n = len(hashes)
    print(f"page files: {stored / n / 1024:.1f} KiB each on average ({stored / size:.0%} of raw)")
    for threads in (int(t) for t in args.threads.split(",")):
        pm = PageMap(size, PS, b"".join(hashes), [str(pages)], size, threads)
        v = pm.view()
        first = touch(v)
        second = touch(v)
        st = pm.stats()
        assert st["fills"] == n and pm.failure is None, (st, pm.failure)
        assert hashlib.sha256(v).digest() == hashlib.sha256(data).digest()
        v.release()
        pm.close()
        us = {k: st[k] / st["fills"] / 1e3 for k in ("fill_ns", "read_ns", "inflate_ns",
                                                        "sha_ns", "copy_ns")}
        print(f"{threads} handler thread(s): first touch {first / n * 1e6:.1f} us/page "
              f"({size / first / 1e9:.2f} GB/s), resident {second / n * 1e6:.2f} us/page; "
              f"handler {us['fill_ns']:.1f} us/fill wall, CPU: read {us['read_ns']:.1f}, "
              f"inflate {us['inflate_ns']:.1f}, SHA-256 {us['sha_ns']:.1f} "
              f"({PS / us['sha_ns'] / 1e3:.2f} GB/s), UFFDIO_COPY {us['copy_ns']:.1f} us")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
