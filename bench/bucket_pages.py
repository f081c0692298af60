"""``python -m bench.bucket_pages``: manifest pages written to and read from a bucket.

Starts a moto server on loopback (tests/fixtures/s3.py), then writes the pages of a
random raw manifest of ``--pages`` 64 KiB pages to ``s3://BUCKET/pages``
(``pages.write_pages`` into ``objstore/pages.py``'s BucketPages) with one PUT at a time
and with ``PAGE_PUTS`` at once, each into a fresh prefix; then the same stream again
(every page already there: HEADs only); then reads every page back (GET, inflate,
SHA-256) as a node's copy fill does, one at a time. Prints pages/s of each arm and the
ratio to the one-at-a-time write of the same run (docs/benchmarks.md, "Manifest pages
in a bucket"). moto is Python on the same 2 CPUs: a real store's round trips are
longer, which favours overlap more, not less.
"""
from __future__ import annotations

import argparse
import os
import random
import time

from kspeedfs.config import SourceConfig
from kspeedfs.manifest.pages import PAGE_SIZE, Root, read_all, read_table, write_pages
from kspeedfs.objstore.pages import BucketPages
from kspeedfs.tuning import PAGE_PUTS
from tests.fixtures.s3 import S3Server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=300)
    args = ap.parse_args()
    raw = random.Random(1).randbytes(args.pages * PAGE_SIZE)
    with S3Server() as s3:
        for k, v in s3.env().items():
            os.environ[k] = v
        s3.client().create_bucket(Bucket="bench-pages")
        rates: dict[str, float] = {}
        root = b""
        for arm, prefix, workers in (("put x1", "one", 1), (f"put x{PAGE_PUTS}", "many", PAGE_PUTS),
                                     (f"again x{PAGE_PUTS}", "many", PAGE_PUTS)):
            sink = BucketPages(f"s3://bench-pages/{prefix}", SourceConfig())
            t0 = time.perf_counter()
            root, stored = write_pages([raw], sink, workers=workers)
            rates[arm] = args.pages / (time.perf_counter() - t0)
            print(f"{arm:>10}: {rates[arm]:7.0f} pages/s ({stored} bytes stored)")
        r = Root.parse(root)
        t0 = time.perf_counter()
        assert read_all(r, read_table(r, [sink]), [sink]) == raw
        rates["get x1"] = args.pages / (time.perf_counter() - t0)
        print(f"{'get x1':>10}: {rates['get x1']:7.0f} pages/s")
        base = rates["put x1"]
        print("ratios to put x1: " + ", ".join(f"{k} {v / base:.2f}" for k, v in rates.items()))


if __name__ == "__main__":
    main()
