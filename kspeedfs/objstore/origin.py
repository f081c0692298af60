"""The origin of a dataset imported from a bucket prefix: ``origin.Origin`` over ranged GETs.

What changes from a directory is only how bytes arrive: each extent of a chunk is one
ranged GET pinned to the ETag (and version, when recorded) the manifest holds for its
object, up to ``source.max_inflight`` at once (a chunk of packed small files is tens of
objects; one after the other, each would pay a round trip). Everything else is the base
class's: each extent is checked against its xxh3-128 before anyone sees it, a mismatch
is retried once, and an object that no longer matches (412 on If-Match, 404, another
ETag or version served, or different bytes) is ``SourceChanged`` naming it: EIO for its
readers, while the files packed beside it in the same chunk are served from the extents
that verified. Any other failure (credentials, the endpoint unreachable after the
client's retries) is ``ChunkUnavailable``: EIO, and the next read tries again.

One read (``load``, ``load_extent``, ``load_block``: what a reader waits on) ends within
``source.read_deadline``, every GET's attempts, timeouts and backoff included: the GETs
run on the origin's pool and the reading thread waits for them that long at most, then
raises ``SourceTimeout`` (ETIMEDOUT) naming an object still unanswered. A GET left behind
keeps its pool thread until the client gives up on it (``source.retries`` x
``source.timeout`` or so); reads queued behind such threads meet their own deadline.

The same class serves every store (``Bucket``, ``bucket.py``). The node's preload and a
mount's misses both come here (``open_origin``): one read path.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait

from ..config import SourceConfig
from ..errors import ChunkUnavailable, SourceError, SourceTimeout
from ..manifest.index import ManifestIndex
from ..manifest.model import Extent
from ..origin import Origin
from . import connect
from .bucket import connections
from .url import ObjectUrl

log = logging.getLogger(__name__)


class ObjectOrigin(Origin):
    """``Origin`` over a bucket prefix: extents by ranged GETs pinned to each object's
    recorded identity, each read bounded by ``source.read_deadline`` (module docstring),
    the same contract otherwise, plus ``SourceTimeout``. Owns the bucket's client and the
    pool its GETs run on."""

    def __init__(self, source: str, index: ManifestIndex, dataset: str,
                 config: SourceConfig) -> None:
        """``source``: the dataset's bucket URL; where the bucket is comes from ``config``
        and the platform's settings first, else from the manifest's source record."""
        self.url = ObjectUrl.parse(source)
        self.root = str(self.url).rstrip("/").encode()
        self.index = index
        self.dataset = dataset
        self.read_deadline = config.read_deadline
        self.bucket = connect(source, config, index.source_record or {})
        self._pool = ThreadPoolExecutor(connections(config.max_inflight),
                                        thread_name_prefix="kspeedfs-objstore")
        self._until = threading.local()       # this thread's read's deadline (monotonic)
        log.info("dataset %s: source %s at %s", dataset, self.url, self.bucket.endpoint)

    def _check_root(self, what: str) -> None:
        """A bucket has no "missing" state worth a request before each read: a read that
        fails says why."""

    # -- one read, one deadline ------------------------------------------------------------

    def load(self, chunk: int) -> tuple[memoryview, int]:
        with self._deadline():
            return super().load(chunk)

    def load_extent(self, e: Extent) -> memoryview:
        with self._deadline():
            return super().load_extent(e)

    def load_block(self, chunk: int, block: int) -> memoryview | None:
        with self._deadline():
            return super().load_block(chunk, block)

    @contextlib.contextmanager
    def _deadline(self) -> Iterator[None]:
        self._until.at = time.monotonic() + self.read_deadline
        try:
            yield
        finally:
            self._until.at = None

    def _left(self) -> float:
        at = getattr(self._until, "at", None)
        return self.read_deadline if at is None else max(0.0, at - time.monotonic())

    # -- GETs ------------------------------------------------------------------------------

    def _get(self, entry: int, offset: int, part: memoryview) -> str | None:
        """One ranged GET (on the pool): why the object no longer matches, or None."""
        etag, version = self.index.object_identity(entry)
        return self.bucket.get_range(self.url.key(self.index.path(entry)), offset, part,
                                     etag, version).changed

    def _pread(self, entry: int, offset: int, part: memoryview) -> str | None:
        return self._wait([(entry, self._pool.submit(self._get, entry, offset, part))])[0]

    def _read_extents(self, extents: list[Extent], view: memoryview) -> list[tuple[Extent, str | None]]:
        parts = [view[e.chunk_offset:e.chunk_offset + e.length] for e in extents]
        whys = self._wait([(e.entry, self._pool.submit(self._get, e.entry, e.file_offset, part))
                           for e, part in zip(extents, parts, strict=True)])
        return [(e, self._checked(e, part, why)) for e, part, why in zip(extents, parts, whys, strict=True)]

    def _wait(self, gets: list[tuple[int, Future[str | None]]]) -> list[str | None]:
        """Each GET's outcome (``SourceError`` as ``ChunkUnavailable``), or
        ``SourceTimeout`` naming the first object unanswered when the read's time is up."""
        _, late = wait([f for _, f in gets], timeout=self._left())
        if late:
            for f in late:
                f.cancel()
            entry = next(entry for entry, f in gets if f in late)
            name = self.url.name(self.url.key(self.index.path(entry)))
            raise SourceTimeout(f"dataset {self.dataset}: {name}: no answer within "
                                f"source.read_deadline ({self.read_deadline:g} s)")
        try:
            return [f.result() for _, f in gets]
        except SourceError as e:
            raise ChunkUnavailable(f"dataset {self.dataset}: {e}") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.bucket.close()
