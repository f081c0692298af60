"""``s3://``: the :class:`~.bucket.Bucket` of an S3 (or S3-compatible) store, over boto3.

Settings, highest first: the ``source.*`` keys (config file, ``KSPEEDFS_SOURCE_*``,
``--set``), then what boto3 reads itself (``AWS_ENDPOINT_URL``, ``AWS_REGION`` /
``AWS_DEFAULT_REGION``, ``AWS_PROFILE``, ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``
/ ``AWS_SESSION_TOKEN``, ``~/.aws/config`` and ``~/.aws/credentials``, an instance role),
then, for a dataset being read back, the endpoint and region its manifest recorded at
import. Credentials are only ever handed to boto3: :class:`S3Bucket` keeps the endpoint
and region, which is all a manifest records. botocore's own loggers are held at
WARNING: at DEBUG they print request headers, which carry the access key id.

Retries are boto3's ``standard`` mode (``source.retries`` attempts): 5xx, SlowDown and
429 throttling, timeouts and connection resets, with jittered exponential backoff; each
attempt is bounded by ``source.timeout``, so a request gives up after at most about
retries x (timeout + backoff). A body cut short after the headers arrived is not
retried by botocore (the response was already returned), so :meth:`S3Bucket.get_range`
retries that itself, as often.

Listing: ``ListObjectsV2`` from ``StartAfter`` (a key range, ``listing.py``) or with
``Delimiter='/'`` (one level), or, in a versioned bucket, ``ListObjectVersions``
(the latest version of each key that is not a delete marker; never split into key
ranges, ``S3Bucket.splits``):
the origin then reads that version, which stays readable after the key is overwritten.
Versioning suspended counts as versioned (older versions keep their ids).

Errors: every client failure becomes a :class:`SourceError` with one line naming the
bucket or object, what S3 said and its HTTP status (EACCES for 401/403, EIO otherwise),
except what means "the object is no longer what was imported" (412 on If-Match, 404),
which ``get_range`` returns as the reason, for the caller to raise ``SourceChanged``.
"""
from __future__ import annotations

import errno
import logging
import random
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..errors import SourceError
from ..tuning import LIST_PAGE
from .bucket import ObjectInfo, Read, connections
from .url import ObjectUrl

if TYPE_CHECKING:
    from ..config import SourceConfig

log = logging.getLogger(__name__)

DEFAULT_REGION = "us-east-1"   # S3's global region: what boto3 signs with when none is set


def connect(url: ObjectUrl, cfg: SourceConfig, record: dict[str, str] | None = None) -> S3Bucket:
    """A bucket from ``cfg`` and the AWS settings; the ``endpoint``/``region`` of a
    manifest's ``record`` apply only where neither names one."""
    import boto3
    import botocore.exceptions
    from botocore.config import Config

    record = record or {}
    for name in ("botocore", "boto3", "urllib3"):
        if logging.getLogger(name).getEffectiveLevel() < logging.WARNING:
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        session = boto3.Session(
            profile_name=cfg.profile or None, region_name=cfg.region or None,
            aws_access_key_id=cfg.access_key_id or None,
            aws_secret_access_key=cfg.secret_access_key or None,
            aws_session_token=cfg.session_token or None)
        configured = cfg.endpoint or session._session.get_config_variable("endpoint_url")
        client = session.client(
            "s3", endpoint_url=cfg.endpoint or (None if configured else record.get("endpoint") or None),
            region_name=session.region_name or record.get("region") or DEFAULT_REGION,
            config=Config(retries={"mode": "standard", "max_attempts": cfg.retries},
                          connect_timeout=cfg.timeout, read_timeout=cfg.timeout,
                          max_pool_connections=connections(cfg.max_inflight)))
    except botocore.exceptions.BotoCoreError as e:
        raise SourceError(f"S3 client: {e}", errno=errno.EINVAL) from None
    return S3Bucket(url, client, cfg.retries)


def client_error(e: Exception, what: str) -> SourceError:
    """One line for a failed request about ``what`` (a bucket or object URL)."""
    import botocore.exceptions

    if isinstance(e, botocore.exceptions.ClientError):
        err = e.response.get("Error", {})
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        code = err.get("Code", "error")
        msg = err.get("Message") or ""
        return SourceError(f"{what}: {code} (HTTP {status}){': ' + msg if msg else ''}",
                           errno=errno.EACCES if status in (401, 403) else errno.EIO)
    if isinstance(e, botocore.exceptions.NoCredentialsError):
        return SourceError(f"{what}: no S3 credentials: set AWS_ACCESS_KEY_ID and "
                           "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or source.access_key_id",
                           errno=errno.EACCES)
    return SourceError(f"{what}: {e}", errno=errno.EIO)


def changed_reason(e: Exception) -> str | None:
    """Why a GET's object is no longer the imported one (412, 404), else None."""
    import botocore.exceptions

    if not isinstance(e, botocore.exceptions.ClientError):
        return None
    status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    if status == 412:
        return "no longer has the ETag recorded at import (HTTP 412)"
    if status == 404:
        return "is gone (HTTP 404)"
    return None


class S3Bucket:
    """A boto3 S3 client on one bucket, and where it points (never its credentials)."""

    def __init__(self, url: ObjectUrl, client: Any, attempts: int = 3) -> None:
        self.url = url
        self.client = client
        self.endpoint: str = client.meta.endpoint_url
        self.region: str = client.meta.region_name
        self.attempts = attempts        # reads of a body cut short (source.retries)
        self._versioned: bool | None = None

    def record(self) -> dict[str, str]:
        return {"url": str(self.url), "endpoint": self.endpoint, "region": self.region}

    def close(self) -> None:
        self.client.close()

    def versioned(self) -> bool:
        """Whether the bucket keeps versions (``GetBucketVersioning``, asked once); a caller
        without ``s3:GetBucketVersioning`` gets False and a log line (ETags alone still
        pin the bytes)."""
        import botocore.exceptions

        if self._versioned is not None:
            return self._versioned
        try:
            status = self.client.get_bucket_versioning(Bucket=self.url.bucket).get("Status", "")
        except botocore.exceptions.ClientError as e:
            if e.response.get("Error", {}).get("Code") == "AccessDenied":   # not a bad key
                log.warning("s3://%s: versioning unknown (AccessDenied): version ids not "
                            "recorded", self.url.bucket)
                status = ""
            else:
                raise client_error(e, str(self.url)) from None
        except botocore.exceptions.BotoCoreError as e:
            raise client_error(e, str(self.url)) from None
        self._versioned = status in ("Enabled", "Suspended")
        return self._versioned

    def _pages(self, prefix: str, expect: int = 0,
               **kw: str) -> Iterator[tuple[list[ObjectInfo], list[str]]]:
        """Each listing page's latest objects and common prefixes (``kw``: ``Delimiter``,
        ``StartAfter``, the latter as ``KeyMarker`` in a versioned bucket); with ``expect``,
        pages end one key past that many, where a key range's end is (``listing.py``)."""
        import botocore.exceptions

        versions = self.versioned()
        op = self.client.list_object_versions if versions else self.client.list_objects_v2
        if versions and "StartAfter" in kw:
            kw["KeyMarker"] = kw.pop("StartAfter")
        given = 0
        try:
            while True:
                left = expect + 1 - given
                page = op(Bucket=self.url.bucket, Prefix=prefix, **kw,
                          MaxKeys=min(LIST_PAGE, left) if expect and left > 0 else LIST_PAGE)
                objects = [ObjectInfo(o["Key"], o["Size"], o["ETag"],
                                      int(o["LastModified"].timestamp() * 1e9),
                                      o.get("VersionId", "") if versions else "")
                           # older versions skipped; a deleted key (latest: a delete marker) has none
                           for o in page.get("Versions" if versions else "Contents", ())
                           if not versions or o["IsLatest"]]
                given += len(objects)
                yield objects, [p["Prefix"] for p in page.get("CommonPrefixes", ())]
                if not page.get("IsTruncated"):
                    return
                if versions:
                    kw.update(KeyMarker=page["NextKeyMarker"], VersionIdMarker=page["NextVersionIdMarker"])
                else:
                    kw["ContinuationToken"] = page["NextContinuationToken"]
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as e:
            raise client_error(e, str(self.url)) from None

    def list_keys(self, prefix: str, start_after: str = "", expect: int = 0) -> Iterator[list[ObjectInfo]]:
        for objects, _ in self._pages(prefix, expect,
                                      **({"StartAfter": start_after} if start_after else {})):
            yield objects

    def splits(self) -> bool:
        """Not in a versioned bucket: ``KeyMarker`` on a key that does not exist is read
        differently by servers (moto skips the first key after it; S3 starts after it)."""
        return not self.versioned()

    def list_level(self, prefix: str) -> tuple[list[ObjectInfo], list[str]]:
        objects: list[ObjectInfo] = []
        prefixes: list[str] = []
        for page, under in self._pages(prefix, Delimiter="/"):
            objects += page
            prefixes += under
        return objects, prefixes

    def get_range(self, key: str, offset: int, out: memoryview, etag: str,
                  version: str = "") -> Read:
        """As ``Bucket.get_range``; a body cut short is read again up to ``attempts`` times."""
        import botocore.exceptions

        what = self.url.name(key)
        kw: dict[str, Any] = {"Bucket": self.url.bucket, "Key": key, "IfMatch": etag,
                              "Range": f"bytes={offset}-{offset + len(out) - 1}"}
        if version:
            kw["VersionId"] = version
        for attempt in range(self.attempts):
            try:
                r = self.client.get_object(**kw)        # botocore's retries are inside this call
            except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as e:
                why = changed_reason(e)
                if why is not None:
                    return Read(why)
                raise client_error(e, what) from None
            try:
                data = r["Body"].read()                 # ... and none inside this one
            except (botocore.exceptions.ResponseStreamingError,
                    botocore.exceptions.IncompleteReadError, botocore.exceptions.ReadTimeoutError) as e:
                if attempt + 1 == self.attempts:
                    raise client_error(e, what) from None
                log.warning("%s: body cut short (%s), retrying", what, e)
                time.sleep(random.uniform(0, 0.1 * 2 ** attempt))   # full jitter, as botocore's
                continue
            if len(data) != len(out):
                return Read(f"is shorter than at import ({offset + len(data)} bytes)")
            out[:] = data
            return Read(None)
        raise AssertionError("unreachable")

    # -- whole objects (bucket.WholeObjects: manifest pages) -------------------------------

    def get_object(self, key: str, limit: int) -> bytes | None:
        import botocore.exceptions

        try:
            r = self.client.get_object(Bucket=self.url.bucket, Key=key)
            with r["Body"] as body:
                if r.get("ContentLength", 0) > limit:
                    return None
                data: bytes = body.read(limit + 1)
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as e:
            if changed_reason(e) == "is gone (HTTP 404)":
                return None
            raise client_error(e, self.url.name(key)) from None
        return data if len(data) <= limit else None

    def head_object(self, key: str) -> float | None:
        import botocore.exceptions

        try:
            r = self.client.head_object(Bucket=self.url.bucket, Key=key)
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as e:
            if changed_reason(e) == "is gone (HTTP 404)":
                return None
            raise client_error(e, self.url.name(key)) from None
        return float(r["LastModified"].timestamp())

    def put_object(self, key: str, data: bytes) -> None:
        self._call(self.client.put_object, key, Body=data)

    def delete_object(self, key: str) -> None:
        self._call(self.client.delete_object, key)

    def _call(self, op: Any, key: str, **kw: Any) -> None:
        import botocore.exceptions

        try:
            op(Bucket=self.url.bucket, Key=key, **kw)
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as e:
            raise client_error(e, self.url.name(key)) from None
