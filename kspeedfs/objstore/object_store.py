"""``gs://`` and ``az://``: the :class:`~.bucket.Bucket` over obstore (Rust ``object_store``).

One client for both stores (``gcs.py`` and ``azure.py`` only turn each platform's
settings into an obstore store): a key range is ``list`` from an ``offset`` (GCS's
``start-after``, Azure's ``startFrom``; the emulators ignore it), one level
``list_with_delimiter`` (pagination inside both); a ranged read is ``get`` with
``if_match`` (the ETag) and ``version`` (GCS's generation, Azure's version id) when
recorded. The response's own
ETag and version are checked against the record too, so a server that ignores
``If-Match`` (fake-gcs-server does) still never hands over another object's bytes.

Retries are obstore's (5xx, 429, timeouts, dropped connections; exponential backoff
with jitter), ``source.retries`` attempts within a deadline (``client_options``); a
body cut short after the headers is read again here, as often.

object_store's paths cannot hold an empty, ``.`` or ``..`` component: a key such as
``a//b`` makes the listing of its prefix fail (one line naming the prefix), where
boto3 lists it and the S3 import skips it. It also drops a "directory marker"'s
trailing ``/`` (GCS lists ``d/`` as ``d`` inside ``d/``; Azure not at all): a listed
prefix with nothing under it but its marker is given back as the marker, and an empty
object of a flat listing that a HEAD does not find is one (a HEAD per empty object), so
the directory exists as it does from S3.

Errors: obstore's exceptions become one line, ``URL: Code (HTTP status): Message``
when the server answered (EACCES for 401/403, EIO otherwise), else the client's first line;
query strings are cut from it (a SAS token's signature rides in the URL). 412 and 404
on a ranged GET are the object's change, returned for ``SourceChanged``.
"""
from __future__ import annotations

import errno
import logging
import random
import re
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..errors import SourceError
from ..tuning import LIST_PAGE
from .bucket import ObjectInfo, Read, connections, unquoted
from .url import ObjectUrl

if TYPE_CHECKING:
    from obstore import ObjectMeta
    from obstore.store import ClientConfig, RetryConfig

    from ..config import SourceConfig

log = logging.getLogger(__name__)

_STATUS = re.compile(r"status code: (\d{3})(?: ([A-Za-z ]+))?")
_CODE = re.compile(r"<Code>([^<]{1,80})</Code>")
_MESSAGE = re.compile(r"<Message>([^<\n]{1,200})")
_QUERY = re.compile(r"\?[^\s\"']*")


def client_settings(cfg: SourceConfig, endpoint: str) -> tuple[ClientConfig, RetryConfig]:
    """obstore's client and retry options from ``[source]``: ``timeout`` per connect and
    per read, ``retries`` attempts within ``retries x (timeout + 2 s)``."""
    from datetime import timedelta

    client: ClientConfig = {
        "allow_http": endpoint.startswith("http://"),
        "connect_timeout": timedelta(seconds=cfg.timeout),
        "read_timeout": timedelta(seconds=cfg.timeout),
        "timeout": timedelta(seconds=10 * cfg.timeout),
        "pool_max_idle_per_host": str(connections(cfg.max_inflight)),
    }
    retry: RetryConfig = {
        "max_retries": cfg.retries - 1,
        "retry_timeout": timedelta(seconds=cfg.retries * (cfg.timeout + 2)),
        "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=2)},
    }
    return client, retry


def require_obstore(url: ObjectUrl) -> None:
    """``SourceError`` naming the extra to install when obstore is missing."""
    try:
        import obstore  # noqa: F401
    except ImportError:
        extra = "gcs" if url.scheme == "gs" else "azure"
        raise SourceError(f"{url}: {url.scheme}:// needs obstore: pip install 'kspeedfs[{extra}]'",
                          errno=errno.EINVAL) from None


def first_line(e: Exception) -> str:
    """The first line of an obstore error, without query strings (a SAS signature)."""
    return _QUERY.sub("", str(e).split("\n", 1)[0]).strip()[:300]


def store_error(e: Exception, what: str) -> SourceError:
    """One line for a failed obstore call about ``what`` (a bucket or object URL)."""
    from obstore.exceptions import PermissionDeniedError, UnauthenticatedError

    text = str(e)
    status = _STATUS.search(text)
    if status is not None:
        code, message = _CODE.search(text), _MESSAGE.search(text)
        n = int(status.group(1))
        said = (code.group(1) if code and not code.group(1).isdigit()
                else (status.group(2) or "error").strip())
        told = f": {message.group(1).strip()}" if message else ""
        return SourceError(f"{what}: {said} (HTTP {n}){told}",
                           errno=errno.EACCES if n in (401, 403) else errno.EIO)
    denied = isinstance(e, PermissionDeniedError | UnauthenticatedError)
    return SourceError(f"{what}: {first_line(e)}", errno=errno.EACCES if denied else errno.EIO)


def open_bucket(url: ObjectUrl, kind: type[Any], config: dict[str, Any], cfg: SourceConfig,
                endpoint: str, record: dict[str, str]) -> ObjectStoreBucket:
    """An obstore store of class ``kind`` (``GCSStore``, ``AzureStore``) on ``url``'s
    bucket with ``config`` and the ``[source]`` client settings; ``SourceError``
    (EACCES, one line) if obstore refuses them (a credentials file it cannot parse)."""
    from obstore.exceptions import BaseError

    client, retry = client_settings(cfg, endpoint)
    try:
        store = kind(url.bucket, config=config, client_options=client, retry_config=retry)
    except (BaseError, ValueError) as e:
        raise SourceError(str(store_error(e, f"{url}: client")), errno=errno.EACCES) from None
    return ObjectStoreBucket(url, store, endpoint, cfg.retries, record)


def _info(o: ObjectMeta) -> ObjectInfo:
    return ObjectInfo(o["path"], o["size"], o["e_tag"] or "", int(o["last_modified"].timestamp() * 1e9),
                      o["version"] or "")


class ObjectStoreBucket:
    """An obstore store on one bucket (container), and where it points (never its
    credentials: obstore holds them)."""

    def __init__(self, url: ObjectUrl, store: Any, endpoint: str, attempts: int,
                 record: dict[str, str]) -> None:
        self.url = url
        self.store = store
        self.endpoint = endpoint
        self.attempts = attempts
        self._record = {"url": str(url), "endpoint": endpoint, **record}

    def record(self) -> dict[str, str]:
        return dict(self._record)

    def close(self) -> None:
        """obstore closes its connections when the store is dropped."""

    def _listing_error(self, e: Exception, prefix: str) -> SourceError:
        import obstore

        if isinstance(e, obstore.exceptions.InvalidPathError | ValueError):
            return SourceError(f"{self.url.name(prefix)}: a key below it has an empty, . or .. "
                               f"component, which the client cannot list ({first_line(e)})",
                               errno=errno.EIO)
        return store_error(e, self.url.name(prefix))

    def list_keys(self, prefix: str, start_after: str = "", expect: int = 0) -> Iterator[list[ObjectInfo]]:
        """As ``Bucket.list_keys`` (``expect`` unused: object_store sets no page size); a
        listed empty object that a HEAD does not find was a directory marker (its ``/``
        dropped by object_store) and is given back as one."""
        import obstore

        try:
            for chunk in obstore.list(self.store, prefix or None, offset=start_after or None,
                                      chunk_size=LIST_PAGE):
                yield [self._marker(info) if info.size == 0 else info
                       for info in (_info(o) for o in chunk)]
        except (obstore.exceptions.BaseError, ValueError) as e:
            raise self._listing_error(e, prefix) from None

    def splits(self) -> bool:
        return True

    def _marker(self, info: ObjectInfo) -> ObjectInfo:
        """``info`` as listed, or as the marker ``key/`` when no object has its key."""
        import obstore

        try:
            obstore.head(self.store, info.key)
        except FileNotFoundError:
            return info._replace(key=info.key + "/")
        return info

    def list_level(self, prefix: str) -> tuple[list[ObjectInfo], list[str]]:
        import obstore

        try:
            level = obstore.list_with_delimiter(self.store, prefix or None)
        except (obstore.exceptions.BaseError, ValueError) as e:
            raise self._listing_error(e, prefix) from None
        objects = [_info(o) for o in level["objects"]]
        objects = [o._replace(key=prefix) if o.key + "/" == prefix else o for o in objects]
        prefixes = [p + "/" for p in level["common_prefixes"]]
        if prefix != self.url.prefix and not objects and not prefixes:   # a marker it hid
            objects.append(ObjectInfo(prefix, 0, "", 0))
        return objects, prefixes

    def get_range(self, key: str, offset: int, out: memoryview, etag: str,
                  version: str = "") -> Read:
        import obstore

        what = self.url.name(key)
        options: dict[str, Any] = {"range": (offset, offset + len(out))}
        if etag:
            options["if_match"] = etag if etag.startswith(('"', "W/")) else f'"{etag}"'
        if version:
            options["version"] = version
        for attempt in range(self.attempts):
            try:
                r = obstore.get(self.store, key, options=options)   # type: ignore[arg-type]
                got = _into(r, out)
            except obstore.exceptions.PreconditionError:
                return Read("no longer has the ETag recorded at import (HTTP 412)")
            except FileNotFoundError:                   # obstore's NotFoundError
                return Read("is gone (HTTP 404)" if not version else
                            f"is gone, or no longer version {version} (HTTP 404)")
            except obstore.exceptions.BaseError as e:
                if _STATUS.search(str(e)) or attempt + 1 == self.attempts:
                    raise store_error(e, what) from None
                log.warning("%s: read cut short (%s), retrying", what, first_line(e))
                time.sleep(random.uniform(0, 0.1 * 2 ** attempt))
                continue
            meta = r.meta
            if etag and meta["e_tag"] and unquoted(meta["e_tag"]) != unquoted(etag):
                return Read(f"no longer has the ETag recorded at import (served {meta['e_tag']})")
            if version and meta["version"] and meta["version"] != version:
                return Read(f"is no longer version {version} (served {meta['version']})")
            if got != len(out):
                return Read(f"is shorter than at import ({offset + got} bytes)")
            return Read(None, meta["version"] or "")
        raise AssertionError("unreachable")

    # -- whole objects (bucket.WholeObjects: manifest pages) -------------------------------

    def get_object(self, key: str, limit: int) -> bytes | None:
        import obstore

        try:
            r = obstore.get(self.store, key)
            if r.meta["size"] > limit:
                return None
            return bytes(r.bytes())
        except FileNotFoundError:
            return None
        except obstore.exceptions.BaseError as e:
            raise store_error(e, self.url.name(key)) from None

    def head_object(self, key: str) -> float | None:
        import obstore

        try:
            return float(obstore.head(self.store, key)["last_modified"].timestamp())
        except FileNotFoundError:
            return None
        except obstore.exceptions.BaseError as e:
            raise store_error(e, self.url.name(key)) from None

    def put_object(self, key: str, data: bytes) -> None:
        import obstore

        try:
            obstore.put(self.store, key, data)
        except obstore.exceptions.BaseError as e:
            raise store_error(e, self.url.name(key)) from None

    def delete_object(self, key: str) -> None:
        import obstore

        try:
            obstore.delete(self.store, key)
        except FileNotFoundError:
            pass
        except obstore.exceptions.BaseError as e:
            raise store_error(e, self.url.name(key)) from None


#: the body's pieces ``_into`` copies: a few a chunk (each crosses from Rust to Python),
#: small enough that their buffers are reused memory, not fresh pages
STREAM_PIECE = 256 << 10


def _into(r: Any, out: memoryview) -> int:
    """The body of GET result ``r`` copied into ``out`` as it arrives; how many bytes it
    had (more than ``len(out)`` are counted, not copied). Why not ``r.bytes()``: that
    gathers the body into a buffer of its own, one more copy into fresh pages, before
    ours (``docs/design.md``, "Chunk buffers faulted in without the GIL")."""
    got = 0
    for piece in r.stream(min_chunk_size=STREAM_PIECE):
        n = len(piece)
        if got + n <= len(out):
            out[got:got + n] = memoryview(piece)
        got += n
    return got
