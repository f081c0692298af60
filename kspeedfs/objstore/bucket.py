"""What every store gives the importer and the origin: :class:`Bucket`, four calls.

``list_keys``, keys in order from a point (``listing.py`` lists key ranges with it in
parallel) and ``list_level``, one "directory" (where to split them); ``get_range``,
bytes of one object pinned to the identity recorded at import; ``record``, where the
bucket is (never a credential) for the manifest. ``s3.py`` (boto3) and
``object_store.py`` (obstore, for ``gs://`` and ``az://``) implement it, so ``source.py``
and ``origin.py`` hold no branch per store. Both implement :class:`WholeObjects` too:
get, head, put and delete of whole objects, for manifest pages in a bucket (``pages.py``).

An object's identity is its ETag and a version: S3's ``VersionId`` in a versioned
bucket, GCS's generation, Azure's version id where the account keeps versions. Each
store's listing gives what it can; GCS and Azure list no version, so the importer
takes the one its first ranged GET of the object was served from (``Read.version``)
and every later GET pins it.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple, Protocol

from .url import ObjectUrl


class ObjectInfo(NamedTuple):
    """One listed object (a tuple: a listing makes 10^5 of them, a frozen dataclass costs
    ~1 us more each)."""

    key: str
    size: int
    etag: str
    mtime_ns: int     # Last-Modified
    version_id: str = ""


class Read(NamedTuple):
    """What one ranged GET came to."""

    changed: str | None    # why the object is no longer the imported one; None: filled
    version: str = ""      # the version the store served, when it names one


class Bucket(Protocol):
    """One bucket (container) of one store, connected with this host's credentials."""

    url: ObjectUrl
    endpoint: str          # where requests go, for logs and the record

    def list_keys(self, prefix: str, start_after: str = "", expect: int = 0) -> Iterator[list[ObjectInfo]]:
        """The objects below ``prefix`` whose keys sort after ``start_after`` (all when
        ""), in key order, a page at a time (no delimiter: every level); a store may give
        keys before ``start_after`` too (fake-gcs-server and Azurite ignore it). ``expect``:
        the keys the caller guesses it wants (0: unknown), for a store that can size its
        pages to end one past them. ``SourceError`` (one line) as ``list_level``."""

    def splits(self) -> bool:
        """Whether ``list_keys`` from ``start_after`` can start a key range: every key
        after it, none skipped."""

    def list_level(self, prefix: str) -> tuple[list[ObjectInfo], list[str]]:
        """The objects directly under ``prefix`` (a key ending in ``/``, or "") and its
        common prefixes (its "subdirectories", each ending in ``/``); ``SourceError``
        (one line) if the store refuses or cannot be reached."""

    def get_range(self, key: str, offset: int, out: memoryview, etag: str,
                  version: str = "") -> Read:
        """Fill ``out`` with bytes [offset, offset + len(out)) of object ``key``, only if
        it still has ``etag`` (and is ``version``, when given): ``Read(None, ...)``; the
        reason when the object changed, is gone or is shorter; ``SourceError`` (one line)
        for anything else, after the client's retries."""

    def record(self) -> dict[str, str]:
        """The manifest's source record: the URL and where the bucket is, no secret."""

    def close(self) -> None:
        """Let go of the client's connections."""


class WholeObjects(Protocol):
    """Whole-object calls on one bucket, for what kspeedfs keeps there itself (manifest
    pages, ``pages.py``), not for a source's objects. Each raises ``SourceError`` (one
    line) when the store refuses or cannot be reached."""

    url: ObjectUrl

    def list_keys(self, prefix: str, start_after: str = "", expect: int = 0) -> Iterator[list[ObjectInfo]]:
        """As ``Bucket.list_keys``."""

    def get_object(self, key: str, limit: int) -> bytes | None:
        """Object ``key``'s bytes; None when there is none, or it is over ``limit`` bytes."""

    def head_object(self, key: str) -> float | None:
        """When object ``key`` was last written (unix seconds); None when there is none."""

    def put_object(self, key: str, data: bytes) -> None:
        """Write object ``key`` (a store makes it visible whole or not at all)."""

    def delete_object(self, key: str) -> None:
        """Delete object ``key`` (none: no error)."""

    def close(self) -> None:
        """Let go of the client's connections."""


def connections(max_inflight: int) -> int:
    """Requests one client keeps connections for: an origin's GETs (``max_inflight`` a
    chunk, and the single extents and blocks its callers read at the same time, all on
    its pool, ``origin.py``); past the pool, clients drop connections."""
    return 2 * max_inflight + 16


def unquoted(etag: str) -> str:
    """An ETag without its quotes or weak mark: listings and headers differ in both."""
    return etag.strip('"').removeprefix("W/").strip('"')
