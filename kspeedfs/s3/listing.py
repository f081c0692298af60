"""Listing a bucket prefix in parallel: one task per common prefix (``Delimiter='/'``).

A flat ``ListObjectsV2`` over a prefix is one page of 1,000 keys after another, each
waiting for the last (its continuation token); listing "directory" by "directory" lets
pages of sibling prefixes be in flight at once, which is what makes large prefixes list
in minutes instead of hours (mountpoint-s3's users measured 45 min for 96 k objects
listed flat). The pagination within one prefix is boto3's paginator.

Keys become paths (``source.py``); this module only collects them, with what the
manifest records of each: size, ETag, last-modified, and the version id when the bucket
is versioned (``ListObjectVersions``, the latest version of each key that is not a
delete marker): the origin then reads that version, which stays readable after the key
is overwritten. Versioning suspended counts as versioned (older versions keep their ids).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from .client import Connection, client_error
from .url import S3Url

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str
    mtime_ns: int     # Last-Modified
    version_id: str = ""


def versioned(conn: Connection, url: S3Url) -> bool:
    """Whether the bucket keeps versions (``GetBucketVersioning``); a caller without
    ``s3:GetBucketVersioning`` gets False and a log line (ETags alone still pin the bytes)."""
    import botocore.exceptions

    try:
        status = conn.client.get_bucket_versioning(Bucket=url.bucket).get("Status", "")
    except botocore.exceptions.ClientError as e:
        if e.response.get("Error", {}).get("Code") == "AccessDenied":   # not a bad key
            log.warning("s3://%s: versioning unknown (AccessDenied): version ids not recorded",
                        url.bucket)
            return False
        raise client_error(e, str(url)) from None
    except botocore.exceptions.BotoCoreError as e:
        raise client_error(e, str(url)) from None
    return status in ("Enabled", "Suspended")


def _list_one(conn: Connection, bucket: str, prefix: str,
              versions: bool) -> tuple[list[ObjectInfo], list[str]]:
    """Objects directly under ``prefix`` and its common prefixes (its "subdirectories")."""
    objects: list[ObjectInfo] = []
    prefixes: list[str] = []
    op, field = ("list_object_versions", "Versions") if versions else ("list_objects_v2", "Contents")
    for page in conn.client.get_paginator(op).paginate(Bucket=bucket, Prefix=prefix, Delimiter="/"):
        for o in page.get(field, ()):
            if versions and not o["IsLatest"]:
                continue        # older versions; a deleted key (latest: a delete marker) has none
            objects.append(ObjectInfo(o["Key"], o["Size"], o["ETag"],
                                      int(o["LastModified"].timestamp() * 1e9),
                                      o.get("VersionId", "") if versions else ""))
        prefixes.extend(p["Prefix"] for p in page.get("CommonPrefixes", ()))
    return objects, prefixes


def list_objects(conn: Connection, url: S3Url, workers: int,
                 progress: Callable[[int, int], None] | None = None) -> list[ObjectInfo]:
    """Every object below ``url``'s prefix; ``progress(objects, bytes)`` after each
    prefix; ``SourceError`` (one line) if a listing request fails."""
    import botocore.exceptions

    found: list[ObjectInfo] = []
    nbytes = 0
    versions = versioned(conn, url)
    with ThreadPoolExecutor(workers, thread_name_prefix="kspeedfs-list") as pool:
        pending: set[Future[tuple[list[ObjectInfo], list[str]]]] = {
            pool.submit(_list_one, conn, url.bucket, url.prefix, versions)}
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in done:
                    objects, prefixes = f.result()
                    found.extend(objects)
                    nbytes += sum(o.size for o in objects)
                    pending |= {pool.submit(_list_one, conn, url.bucket, p, versions)
                                for p in prefixes}
                if progress:
                    progress(len(found), nbytes)
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as e:
            for f in pending:
                f.cancel()
            raise client_error(e, str(url)) from None
    return found
