"""Issue 44 item 1: kspeedfs's parallel listing against a plain paginated listing loop
with the same client on the same server, for ``gs://`` (obstore, fake-gcs-server) and
``s3://`` (boto3, moto's server: ``--store s3``, a bucket per layout filled in its
backend before it listens, :mod:`.moto_filled`).

``python -m bench.objstore_listing [--objects 5000] [--rounds 3] [--store gs|s3]`` lays
out three prefixes of N one-byte objects: ``flat/`` (N keys in one "directory"),
``wide/`` (1,000 keys a directory) and ``small/`` (50 keys a directory), and starts
fake-gcs-server loading them as files (``tests/fixtures/gcs.py``), or moto's server.
Issue 44 asks for 10^5 keys; only moto fills that fast here (its backend, directly):
fake-gcs-server loads 10^4 files in ~30 s but 4 x 10^4 in ~400 s (superlinear), its
uploads run at ~250 objects/s, Azurite's fall from ~400/s to ~130/s as it fills. Each round,
alternating, lists each prefix with

* the plain loop: ``obstore.list(store, prefix)``, one page after another, counting; and
* kspeedfs: ``objstore.listing.list_objects`` (``source.max_inflight`` workers) over
  the same store,

and prints objects/s (median [min-max]) and the ratio kspeedfs / plain per layout (the
target: >= 0.8x). The server shares the machine's two cores with the client. Figures:
docs/design.md "Object-store sources".
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from kspeedfs import config
from kspeedfs.objstore import connect
from kspeedfs.objstore.listing import list_objects
from tests.fixtures.gcs import FakeGcsServer
from tests.fixtures.s3 import S3Server

BUCKET = "bench-listing"


LAYOUTS = {"flat": 0, "wide": 1000, "small": 50}   # prefix: objects a directory (0: none)


def layout_keys(prefix: str, n: int) -> list[str]:
    """n keys of one layout: ``flat/NNNNNNN``, ``wide/dDDDDD/NNNNNNN`` (1,000 a
    directory) or ``small/dDDDDD/NNNNNNN`` (50 a directory)."""
    per = LAYOUTS[prefix]
    return [f"{prefix}/d{i // per:05d}/{i:07d}" if per else f"{prefix}/{i:07d}" for i in range(n)]


def keys(n: int) -> list[str]:
    """Every layout's :func:`layout_keys`, n each."""
    return [key for prefix in LAYOUTS for key in layout_keys(prefix, n)]


def lay_out(root: Path, n: int) -> None:
    """:func:`keys` as files under ``root/BUCKET``, fake-gcs-server's -data."""
    for key in keys(n):
        path = root / BUCKET / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")


def report(n: int, rates: dict[str, list[float]]) -> None:
    med = {}
    for name, r in sorted(rates.items()):
        r.sort()
        med[name] = r[len(r) // 2]
        print(f"list {n:,} keys, {name}: {med[name]:,.0f} objects/s [{r[0]:,.0f}-{r[-1]:,.0f}]")
    for prefix in LAYOUTS:
        print(f"{prefix}: kspeedfs / plain loop = {med[prefix + ' kspeedfs'] / med[prefix + ' plain']:.2f}x")


class FilledS3Server(S3Server):
    """moto's server with the layouts already in it, a bucket each (:mod:`.moto_filled`)."""

    def __init__(self, objects: int) -> None:
        super().__init__(start_timeout=1800)
        self.objects = objects

    def command(self) -> list[str]:
        return [sys.executable, "-m", "bench.moto_filled", "--port", str(self.port),
                "--objects", str(self.objects)]


def s3_main(args: argparse.Namespace) -> None:
    """The same layouts on moto's server, a bucket each, filled before it listens; the
    rounds with boto3's paginator (list_objects_v2, 1,000 a page) as the plain loop."""
    from .moto_filled import bucket_name

    t0 = time.perf_counter()
    with FilledS3Server(args.objects) as server:
        print(f"{len(LAYOUTS) * args.objects:,} objects filled in {time.perf_counter() - t0:.0f}s")
        client = server.client()
        os.environ.update(server.env())
        cfg = config.load(environ={}).source
        rates: dict[str, list[float]] = {}
        pages = client.get_paginator("list_objects_v2")
        for _ in range(args.rounds):
            for prefix in LAYOUTS:
                name = bucket_name(prefix)
                t = time.perf_counter()
                got = sum(len(p.get("Contents", ())) for p in pages.paginate(Bucket=name,
                                                                              Prefix=prefix + "/"))
                rates.setdefault(f"{prefix} plain", []).append(got / (time.perf_counter() - t))
                assert got == args.objects, got
                bucket = connect(f"s3://{name}/{prefix}", cfg)
                t = time.perf_counter()
                got = len(list_objects(bucket, cfg.max_inflight))
                rates.setdefault(f"{prefix} kspeedfs", []).append(got / (time.perf_counter() - t))
                assert got == args.objects, got
                bucket.close()
    report(args.objects, rates)


def main(argv: list[str] | None = None) -> None:
    import obstore

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--objects", type=int, default=5000, help="objects per prefix")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--store", choices=("gs", "s3"), default="gs")
    args = ap.parse_args(argv)
    if args.store == "s3":
        s3_main(args)
        return
    with tempfile.TemporaryDirectory(prefix="kst-listing-") as tmp:
        t0 = time.perf_counter()
        lay_out(Path(tmp), args.objects)
        t1 = time.perf_counter()
        with FakeGcsServer(start_timeout=1800, data=tmp) as server:
            print(f"{len(LAYOUTS) * args.objects:,} objects laid out in {t1 - t0:.0f}s, loaded in "
                  f"{time.perf_counter() - t1:.0f}s")
            os.environ.update(server.env())
            cfg = config.load(environ={}).source
            rates: dict[str, list[float]] = {}
            for _ in range(args.rounds):
                for prefix in LAYOUTS:
                    bucket = connect(f"gs://{BUCKET}/{prefix}", cfg)
                    store = bucket.store        # type: ignore[attr-defined]
                    t = time.perf_counter()
                    got = sum(len(page) for page in obstore.list(store, prefix + "/", chunk_size=1000))
                    rates.setdefault(f"{prefix} plain", []).append(got / (time.perf_counter() - t))
                    assert got == args.objects, got
                    t = time.perf_counter()
                    got = len(list_objects(bucket, cfg.max_inflight))
                    rates.setdefault(f"{prefix} kspeedfs", []).append(got / (time.perf_counter() - t))
                    assert got == args.objects, got
    report(args.objects, rates)

if __name__ == "__main__":
    main()
