"""Manifest pages in a bucket: ``store.pages = s3://BUCKET/PREFIX`` (or ``gs://``, ``az://``).

A :class:`~kspeedfs.manifest.pages.PageStore` over the bucket client the sources use
(:func:`~kspeedfs.objstore.connect`: the same ``source.*`` settings and AWS_* /
GOOGLE_* / AZURE_* environment, credentials only inside the client). The names are a
page directory's: object ``<PREFIX>/<hh>/<SHA-256 hex>``, one zlib stream each, so
``aws s3 sync`` between a bucket and a directory moves pages either way::

    importer / migrate ─► PageWriter ─► BucketPages.has (HEAD) ─► put (PUT), PAGE_PUTS at once
    node's copy fill   ─► peers, then BucketPages.get (GET ≤ limit) ─► inflate_page, verified
    store's sweep      ─► BucketPages.listing (LIST the prefix) ─► remove (DELETE)

* **Reuse.** An object cannot be touched as a file is: a page the bucket has is skipped
  unless it was written more than ``PAGE_REWRITE_AGE`` ago, then written again, which
  restarts the sweep's grace for the import reusing it.
* **Only pages.** The listing gives only keys that are page names below the prefix
  (``pages.parse_page_name``); anything else in the bucket is never deleted.
* **Lazy.** The client is made at the first call: a store opened to list datasets does
  not import boto3 nor look for credentials.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

from ..manifest.pages import page_name, parse_page_name
from ..tuning import PAGE_REWRITE_AGE
from .url import ObjectUrl

if TYPE_CHECKING:
    from ..config import SourceConfig
    from .bucket import WholeObjects


class BucketPages:
    """Manifest pages below one bucket prefix (``PageStore``). Thread-safe: one client,
    made once, shared by the writer's threads."""

    def __init__(self, url: str, cfg: SourceConfig) -> None:
        self.url = ObjectUrl.parse(url)
        self.where = str(self.url)
        self._cfg = cfg
        self._bucket: WholeObjects | None = None
        self._lock = threading.Lock()

    @property
    def bucket(self) -> WholeObjects:
        with self._lock:
            if self._bucket is None:
                from . import connect

                # every store's bucket (s3.py, object_store.py) writes whole objects too
                self._bucket = cast("WholeObjects", connect(self.where, self._cfg))
            assert self._bucket is not None
            return self._bucket

    def key(self, digest: bytes) -> str:
        return self.url.prefix + page_name(digest)

    def get(self, digest: bytes, limit: int) -> bytes | None:
        return self.bucket.get_object(self.key(digest), limit)

    def has(self, digest: bytes) -> bool:
        written = self.bucket.head_object(self.key(digest))
        return written is not None and time.time() - written < PAGE_REWRITE_AGE

    def put(self, digest: bytes, data: bytes) -> None:
        self.bucket.put_object(self.key(digest), data)

    def listing(self) -> Iterator[tuple[str, bytes | None, float]]:
        for objects in self.bucket.list_keys(self.url.prefix):
            for o in objects:
                digest = parse_page_name(o.key[len(self.url.prefix):])
                if o.key.startswith(self.url.prefix) and digest is not None:
                    yield o.key, digest, o.mtime_ns / 1e9

    def remove(self, name: str) -> None:
        if not name.startswith(self.url.prefix) or parse_page_name(name[len(self.url.prefix):]) is None:
            raise ValueError(f"{self.url.name(name)} is not a manifest page")
        self.bucket.delete_object(name)

    def close(self) -> None:
        with self._lock:
            if self._bucket is not None:
                self._bucket.close()
                self._bucket = None
