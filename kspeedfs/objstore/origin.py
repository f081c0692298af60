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

The same class serves every store (``Bucket``, ``bucket.py``). The node's preload and a
mount's misses both come here (``open_origin``): one read path.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from ..config import SourceConfig
from ..errors import ChunkUnavailable, SourceError
from ..manifest.index import ManifestIndex
from ..manifest.model import Extent
from ..origin import Origin
from . import connect
from .url import ObjectUrl

log = logging.getLogger(__name__)


class ObjectOrigin(Origin):
    """``Origin`` over a bucket prefix: extents by ranged GETs pinned to each object's
    recorded identity (module docstring), the same contract otherwise. Owns the bucket's
    client and a pool of ``source.max_inflight`` threads for one chunk's extents."""

    def __init__(self, source: str, index: ManifestIndex, dataset: str,
                 config: SourceConfig) -> None:
        """``source``: the dataset's bucket URL; where the bucket is comes from ``config``
        and the platform's settings first, else from the manifest's source record."""
        self.url = ObjectUrl.parse(source)
        self.root = str(self.url).rstrip("/").encode()
        self.index = index
        self.dataset = dataset
        self.bucket = connect(source, config, index.source_record or {})
        self._pool = ThreadPoolExecutor(config.max_inflight, thread_name_prefix="kspeedfs-objstore")
        log.info("dataset %s: source %s at %s", dataset, self.url, self.bucket.endpoint)

    def _check_root(self, what: str) -> None:
        """A bucket has no "missing" state worth a request before each read: a read that
        fails says why."""

    def _pread(self, entry: int, offset: int, part: memoryview) -> str | None:
        etag, version = self.index.object_identity(entry)
        try:
            return self.bucket.get_range(self.url.key(self.index.path(entry)), offset, part,
                                         etag, version).changed
        except SourceError as e:
            raise ChunkUnavailable(f"dataset {self.dataset}: {e}") from None

    def _read_extents(self, extents: list[Extent], view: memoryview) -> list[tuple[Extent, str | None]]:
        if len(extents) == 1:
            e = extents[0]
            return [(e, self._read_extent(e, view[e.chunk_offset:e.chunk_offset + e.length]))]
        futures = [(e, self._pool.submit(self._read_extent, e,
                                         view[e.chunk_offset:e.chunk_offset + e.length]))
                   for e in extents]
        return [(e, f.result()) for e, f in futures]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.bucket.close()
