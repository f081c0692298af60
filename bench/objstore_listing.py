"""Issue 44 item 1: kspeedfs's parallel listing against a plain paginated listing loop
with the same client on the same server, for ``gs://`` (obstore, fake-gcs-server) and
``s3://`` (boto3, moto's server: ``--store s3``, which fills 10^5 keys in minutes).

``python -m bench.objstore_listing [--objects 5000] [--dirs 100] [--rounds 3]`` lays
out two prefixes of N one-byte objects as files and starts fake-gcs-server on loopback
loading them (``tests/fixtures/gcs.py``): ``flat/`` (N keys in one "directory") and
``tree/`` (N keys over ``--dirs`` "directories"). Issue 44 asks for 10^5 keys; no
emulator here fills that fast: fake-gcs-server loads 10^4 files in ~30 s but 4 x 10^4
in ~400 s (superlinear), its uploads run at ~250 objects/s, Azurite's fall from ~400/s
to ~130/s as it fills. ``--dirs N/1000`` gives the request count of 10^5 keys over 100
directories (one page a directory). Each round, alternating, lists each prefix with

* the plain loop: ``obstore.list(store, prefix)``, one page after another, counting; and
* kspeedfs: ``objstore.listing.list_objects`` (one ``list_with_delimiter`` per common
  prefix, ``source.max_inflight`` at once) over the same store,

and prints objects/s (median [min-max]) and the ratio kspeedfs / plain per layout (the
target: >= 0.8x). The server shares the machine's two cores with the client. Figures:
docs/design.md "Object-store sources".
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from kspeedfs import config
from kspeedfs.objstore import connect
from kspeedfs.objstore.listing import list_objects
from tests.fixtures.gcs import FakeGcsServer
from tests.fixtures.s3 import S3Server

BUCKET = "bench-listing"


def lay_out(root: Path, n: int, dirs: int) -> None:
    """``flat/NNNNNNN`` and ``tree/dDDD/NNNNNNN``, n each, as fake-gcs-server's -data."""
    flat, tree = root / BUCKET / "flat", root / BUCKET / "tree"
    flat.mkdir(parents=True)
    for d in range(dirs):
        (tree / f"d{d:03d}").mkdir(parents=True)
    for i in range(n):
        (flat / f"{i:07d}").write_bytes(b"x")
        (tree / f"d{i % dirs:03d}" / f"{i:07d}").write_bytes(b"x")


def keys(n: int, dirs: int) -> list[str]:
    """The same layout as :func:`lay_out`, as S3 keys."""
    return [f"flat/{i:07d}" for i in range(n)] + [f"tree/d{i % dirs:03d}/{i:07d}" for i in range(n)]


def report(n: int, rates: dict[str, list[float]]) -> None:
    med = {}
    for name, r in sorted(rates.items()):
        r.sort()
        med[name] = r[len(r) // 2]
        print(f"list {n:,} keys, {name}: {med[name]:,.0f} objects/s [{r[0]:,.0f}-{r[-1]:,.0f}]")
    for prefix in ("flat", "tree"):
        print(f"{prefix}: kspeedfs / plain loop = {med[prefix + ' kspeedfs'] / med[prefix + ' plain']:.2f}x")


def s3_main(args: argparse.Namespace) -> None:
    """The same two layouts on moto's server: put with 32 threads, then the rounds with
    boto3's paginator (list_objects_v2, 1,000 a page) as the plain loop."""
    from concurrent.futures import ThreadPoolExecutor

    with S3Server() as server:
        client = server.client()
        client.create_bucket(Bucket=BUCKET)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(lambda k: client.put_object(Bucket=BUCKET, Key=k, Body=b"x"),
                          keys(args.objects, args.dirs)))
        print(f"{2 * args.objects:,} objects put in {time.perf_counter() - t0:.0f}s")
        os.environ.update(server.env())
        cfg = config.load(environ={}).source
        rates: dict[str, list[float]] = {}
        pages = client.get_paginator("list_objects_v2")
        for _ in range(args.rounds):
            for prefix in ("flat", "tree"):
                t = time.perf_counter()
                got = sum(len(p.get("Contents", ())) for p in pages.paginate(Bucket=BUCKET,
                                                                              Prefix=prefix + "/"))
                rates.setdefault(f"{prefix} plain", []).append(got / (time.perf_counter() - t))
                assert got == args.objects, got
                bucket = connect(f"s3://{BUCKET}/{prefix}", cfg)
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
    ap.add_argument("--dirs", type=int, default=100, help="directories of tree/")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--store", choices=("gs", "s3"), default="gs")
    args = ap.parse_args(argv)
    if args.store == "s3":
        s3_main(args)
        return
    with tempfile.TemporaryDirectory(prefix="kst-listing-") as tmp:
        t0 = time.perf_counter()
        lay_out(Path(tmp), args.objects, args.dirs)
        t1 = time.perf_counter()
        with FakeGcsServer(start_timeout=1800, data=tmp) as server:
            print(f"{2 * args.objects:,} objects laid out in {t1 - t0:.0f}s, loaded in "
                  f"{time.perf_counter() - t1:.0f}s")
            os.environ.update(server.env())
            cfg = config.load(environ={}).source
            rates: dict[str, list[float]] = {}
            for _ in range(args.rounds):
                for prefix in ("flat", "tree"):
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
