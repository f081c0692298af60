"""Which S3 client the object-store source uses: boto3 against obstore, measured.

``python -m bench.s3_clients`` starts a moto server on loopback (tests/fixtures/s3.py),
fills a bucket, then for each client measures what the origin and the importer do:

* ranged GETs of 4 MiB pinned with ``If-Match`` (the origin's chunk-extent read), at 4,
  8, 16 and 32 in flight from a thread pool (the origin runs in worker threads): MB/s,
  and this process's CPU-s per GB (the server's CPU is not counted: it is the same
  server for both);
* a paginated listing of ``--small`` objects: objects/s.

``--listing N`` measures instead what ``kspeedfs/objstore/listing.py`` does against a plain
paginated ``ListObjectsV2`` loop over the same N keys (flat, and spread over 100
"directories"), alternating, objects/s.

Rounds alternate the clients so that drift in the machine hits both alike. Every byte a
GET returns is counted; a short read fails the run. The server is moto (Python), so
absolute MB/s are the server's ceiling here; CPU per GB on the client side is the
figure that carries over to a real object store.
"""
from __future__ import annotations

import argparse
import logging
import resource
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tests.fixtures.s3 import ACCESS_KEY, REGION, SECRET_KEY, S3Server

log = logging.getLogger(__name__)

MiB = 1 << 20
BUCKET = "bench-clients"


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Boto3:
    name = "boto3"

    def __init__(self, endpoint: str, pool: int) -> None:
        import boto3
        from botocore.config import Config

        self.c = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY,
                              aws_secret_access_key=SECRET_KEY, region_name=REGION,
                              config=Config(max_pool_connections=pool))

    def get(self, key: str, etag: str, lo: int, hi: int) -> int:
        r = self.c.get_object(Bucket=BUCKET, Key=key, IfMatch=etag, Range=f"bytes={lo}-{hi - 1}")
        return len(r["Body"].read())

    def list(self, prefix: str) -> int:
        n = 0
        for page in self.c.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
            n += len(page.get("Contents", ()))
        return n


class Obstore:
    name = "obstore"

    def __init__(self, endpoint: str, pool: int) -> None:
        from obstore.store import S3Store

        self.s = S3Store(BUCKET, endpoint=endpoint, access_key_id=ACCESS_KEY,
                         secret_access_key=SECRET_KEY, region=REGION,
                         client_options={"allow_http": True, "pool_max_idle_per_host": str(pool)})

    def get(self, key: str, etag: str, lo: int, hi: int) -> int:
        import obstore

        return len(obstore.get(self.s, key, options={"if_match": etag, "range": (lo, hi)}).bytes())

    def list(self, prefix: str) -> int:
        import obstore

        return sum(len(batch) for batch in obstore.list(self.s, prefix, chunk_size=1000))


def fill(s3: S3Server, large: int, large_mib: int, small: int) -> list[tuple[str, str, int]]:
    c = s3.client()
    c.create_bucket(Bucket=BUCKET)
    objs = []
    for i in range(large):
        body = bytes([i % 251]) * (large_mib * MiB)
        r = c.put_object(Bucket=BUCKET, Key=f"large/{i:04d}", Body=body)
        objs.append((f"large/{i:04d}", r["ETag"], len(body)))
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: c.put_object(Bucket=BUCKET, Key=f"small/{i:06d}", Body=b"x" * 100),
                      range(small)))
    return objs


def get_round(client: Any, objs: list[tuple[str, str, int]], inflight: int,
              part: int) -> tuple[float, float, int]:
    """(seconds, CPU-seconds, bytes) for reading every object once in ``part`` ranges."""
    tasks = [(k, e, lo, min(lo + part, size)) for k, e, size in objs for lo in range(0, size, part)]
    cpu0, t0 = _cpu(), time.perf_counter()
    with ThreadPoolExecutor(inflight) as pool:
        got = sum(pool.map(lambda t: client.get(*t), tasks))
    dt, cpu = time.perf_counter() - t0, _cpu() - cpu0
    want = sum(hi - lo for _, _, lo, hi in tasks)
    if got != want:
        raise RuntimeError(f"{client.name}: read {got} bytes of {want}")
    return dt, cpu, got


def listing(s3: S3Server, n: int, rounds: int) -> None:
    """kspeedfs's parallel listing against a plain paginated loop, N keys."""
    import os

    from kspeedfs import config
    from kspeedfs.objstore import connect
    from kspeedfs.objstore.listing import list_objects

    c = s3.client()
    c.create_bucket(Bucket=BUCKET)
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: c.put_object(Bucket=BUCKET, Key=f"flat/{i:07d}", Body=b"x"),
                      range(n)))
        list(pool.map(lambda i: c.put_object(Bucket=BUCKET, Key=f"tree/d{i % 100:03d}/{i:07d}",
                                             Body=b"x"), range(n)))
    os.environ.update(s3.env())
    cfg = config.load(environ={}).source
    rates: dict[str, list[float]] = {}
    for _ in range(rounds):
        for prefix in ("flat", "tree"):
            t0 = time.perf_counter()
            got = Boto3(s3.endpoint, 8).list(prefix + "/")
            rates.setdefault(f"{prefix} plain loop", []).append(got / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            got = len(list_objects(connect(f"s3://{BUCKET}/{prefix}", cfg), 16))
            rates.setdefault(f"{prefix} kspeedfs", []).append(got / (time.perf_counter() - t0))
            assert got == n
    for name, r in sorted(rates.items()):
        r.sort()
        print(f"list {n} keys, {name}: {r[len(r) // 2]:,.0f} objects/s [{r[0]:,.0f}-{r[-1]:,.0f}]")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--large", type=int, default=16, help="large objects")
    ap.add_argument("--large-mib", type=int, default=16, help="MiB per large object")
    ap.add_argument("--small", type=int, default=5000, help="small objects to list")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--inflight", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--listing", type=int, metavar="N", default=0,
                    help="only the listing comparison, over N keys")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.listing:
        with S3Server() as s3:
            listing(s3, args.listing, args.rounds)
        return
    with S3Server() as s3:
        objs = fill(s3, args.large, args.large_mib, args.small)
        clients: list[Callable[[str, int], Any]] = [Boto3, Obstore]
        results: dict[tuple[str, int], list[tuple[float, float, int]]] = {}
        lists: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for make in clients:
                for q in args.inflight:
                    c = make(s3.endpoint, q)
                    results.setdefault((c.name, q), []).append(get_round(c, objs, q, 4 * MiB))
                c = make(s3.endpoint, 8)
                t0 = time.perf_counter()
                n = c.list("small/")
                if n != args.small:
                    raise RuntimeError(f"{c.name}: listed {n} of {args.small}")
                lists.setdefault(c.name, []).append(n / (time.perf_counter() - t0))
        print(f"ranged 4 MiB GETs with If-Match, {args.large} x {args.large_mib} MiB objects, "
              f"{args.rounds} rounds (median; range)")
        print(f"{'client':8} {'in flight':>9} {'MB/s':>18} {'client CPU-s/GB':>22}")
        for (name, q), rs in sorted(results.items()):
            mbs = sorted(b / dt / 1e6 for dt, _, b in rs)
            cpg = sorted(cpu / (b / 1e9) for _, cpu, b in rs)
            print(f"{name:8} {q:>9} {mbs[len(mbs) // 2]:>7.0f} [{mbs[0]:.0f}-{mbs[-1]:.0f}] "
                  f"{cpg[len(cpg) // 2]:>10.2f} [{cpg[0]:.2f}-{cpg[-1]:.2f}]")
        for name, rates in sorted(lists.items()):
            rates.sort()
            print(f"list {args.small} objects, {name}: {rates[len(rates) // 2]:,.0f} objects/s "
                  f"[{rates[0]:,.0f}-{rates[-1]:,.0f}]")


if __name__ == "__main__":
    main()
