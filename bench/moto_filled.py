"""moto's S3 server with buckets filled before it listens, for listing benchmarks.

``python -m bench.moto_filled --port P --objects N`` creates one bucket per layout of
:mod:`bench.objstore_listing` (``bench-listing-flat``, ``-wide``, ``-small``), puts N
one-byte objects in each straight into moto's in-memory backend, then serves HTTP on
127.0.0.1:P until killed. Why not PUTs over HTTP: moto takes them at ~230 objects/s
(871 s for 2 x 10^5), and only the listing is measured; filling the backend takes ~4 s
per 10^5. Why a bucket per layout: moto's ListObjectsV2 walks every key of the bucket
for each page (~0.5 s a page at 10^5 keys), so one bucket holding all three would
triple every page's cost.
"""
from __future__ import annotations

import argparse
import time

from moto.core import DEFAULT_ACCOUNT_ID
from moto.s3.models import s3_backends
from moto.server import ThreadedMotoServer

from .objstore_listing import LAYOUTS, layout_keys

REGION = "us-east-1"


def bucket_name(layout: str) -> str:
    return f"bench-listing-{layout}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--objects", type=int, required=True, help="objects per layout")
    args = ap.parse_args(argv)
    backend = s3_backends[DEFAULT_ACCOUNT_ID]["global"]
    for layout in LAYOUTS:
        backend.create_bucket(bucket_name(layout), REGION)
        for key in layout_keys(layout, args.objects):
            backend.put_object(bucket_name(layout), key, b"x")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=args.port, verbose=False)
    server.start()
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
