"""Listing a bucket prefix in parallel: one task per common prefix (``Delimiter='/'``).

A flat ``ListObjectsV2`` over a prefix is one page of 1,000 keys after another, each
waiting for the last (its continuation token); listing "directory" by "directory" lets
pages of sibling prefixes be in flight at once, which is what makes large prefixes list
in minutes instead of hours (mountpoint-s3's users measured 45 min for 96 k objects
listed flat). The pagination within one prefix is boto3's paginator.

Keys become paths (``source.py``); this module only collects them, with what the
manifest records of each: size, ETag, last-modified.
"""
from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable

from .client import Connection, client_error
from .url import S3Url

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str
    mtime_ns: int     # Last-Modified


def _list_one(conn: Connection, bucket: str, prefix: str) -> tuple[list[ObjectInfo], list[str]]:
    """Objects directly under ``prefix`` and its common prefixes (its "subdirectories")."""
    objects: list[ObjectInfo] = []
    prefixes: list[str] = []
    pages = conn.client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=prefix, Delimiter="/")
    for page in pages:
        for o in page.get("Contents", ()):
            objects.append(ObjectInfo(o["Key"], o["Size"], o["ETag"],
                                      int(o["LastModified"].timestamp() * 1e9)))
        prefixes.extend(p["Prefix"] for p in page.get("CommonPrefixes", ()))
    return objects, prefixes


def list_objects(conn: Connection, url: S3Url, workers: int,
                 progress: Callable[[int, int], None] | None = None) -> list[ObjectInfo]:
    """Every object below ``url``'s prefix; ``progress(objects, bytes)`` after each
    prefix; ``SourceError`` (one line) if a listing request fails."""
    import botocore.exceptions

    found: list[ObjectInfo] = []
    nbytes = 0
    with ThreadPoolExecutor(workers, thread_name_prefix="kspeedfs-list") as pool:
        pending: set[Future[tuple[list[ObjectInfo], list[str]]]] = {
            pool.submit(_list_one, conn, url.bucket, url.prefix)}
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in done:
                    objects, prefixes = f.result()
                    found.extend(objects)
                    nbytes += sum(o.size for o in objects)
                    pending |= {pool.submit(_list_one, conn, url.bucket, p) for p in prefixes}
                if progress:
                    progress(len(found), nbytes)
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as e:
            for f in pending:
                f.cancel()
            raise client_error(e, str(url)) from None
    return found
