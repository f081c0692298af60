"""⑤′ The origin: the source the dataset was imported from, last resort.

:func:`open_origin` picks the class by the dataset's source: :class:`Origin` reads a
directory; ``objstore/origin.py``'s ``ObjectOrigin`` is the same class reading extents
with ranged GETs pinned to each object's ETag and version (a bucket prefix: ``s3://``,
``gs://``, ``az://``). Everything below about
checking, retrying and naming the changed file holds for both.

A chunk is assembled from the files it packs (one ``preadv`` per extent into one
buffer) and checked extent by extent, so a mismatch names the file. A mismatching
read is retried once (a torn read from NFS, a flaky disk); if the source still does
not match, the file changed after import and only a re-import can fix it:
:class:`SourceChanged`, which the reader turns into EIO with that message.

The source's pages are dropped from the page cache once read (``POSIX_FADV_DONTNEED``):
the bytes now live in the memory tier (and the mount's own page cache), so keeping the
source's copy too would hold every cold byte three times, and the daemon's CPU went to
reclaim (docs/design.md, "The origin drops the source's pages").

A random read that misses loads one block instead (``load_block``: the 128 KiB around
it, verified against the block's xxh3-64), not the whole chunk.

Blocking: every ``load*`` runs in a worker thread.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import xxhash

from .cache.memory import page_aligned
from .errors import ChunkUnavailable, SourceChanged, SourceError
from .manifest.index import ManifestIndex
from .manifest.model import Extent

if TYPE_CHECKING:
    from .config import SourceConfig

log = logging.getLogger(__name__)


def open_origin(source: str, index: ManifestIndex, dataset: str, required: bool = True,
                config: SourceConfig | None = None) -> Origin:
    """The origin of a dataset whose source is ``source`` (its recorded one, or a
    mount's ``--source``): an ``s3://``, ``gs://`` or ``az://`` URL reads the bucket,
    anything else a directory. ``config``: the ``[source]`` settings of an object store
    (defaults when None)."""
    from .objstore.url import is_object_url

    if is_object_url(source):
        from .config import SourceConfig
        from .objstore.origin import ObjectOrigin

        return ObjectOrigin(source, index, dataset, config or SourceConfig())
    return Origin(source, index, dataset, required)


class Origin:
    """The dataset's source directory, read for chunks, extents and blocks no tier or
    replica holds.

    Contract: every ``load*`` returns bytes verified against the manifest (extent
    digests; a block's xxh3-64), or raises ``SourceChanged`` naming the file that no
    longer matches (after one retry), or ``ChunkUnavailable``; never unverified bytes.
    Owns no open file between calls. Blocking: called from worker threads, any number
    at once."""

    def __init__(self, root: str | os.PathLike[str], index: ManifestIndex, dataset: str,
                 required: bool = True) -> None:
        """``required=False`` (a cluster mount, where replicas serve first): a missing
        source is logged, not fatal; only reads that reach it fail."""
        self.root = os.fsencode(root)
        self.index = index
        self.dataset = dataset
        if not os.path.isdir(self.root):
            msg = f"source {os.fsdecode(self.root)} of dataset {dataset} is missing"
            if required:
                raise SourceError(msg)
            log.warning("%s: chunks no replica holds cannot be read", msg)

    def _name(self, entry: int) -> bytes:
        """The source's name of file ``entry``, for messages."""
        return os.path.join(self.root, self.index.path(entry))

    def _pread(self, entry: int, offset: int, part: memoryview) -> str | None:
        """Fill ``part`` from file ``entry`` at ``offset``; why it failed, or None."""
        path = self._name(entry)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as err:
            return f"cannot be opened ({err.strerror})"
        try:
            got = os.preadv(fd, [part], offset)
            os.posix_fadvise(fd, offset, len(part), os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        if got != len(part):
            return f"is shorter than at import ({offset + got} bytes)"
        return None

    def _read_extent(self, e: Extent, part: memoryview) -> str | None:
        """Fill ``part`` with extent ``e`` from its source file; why it failed, or None."""
        return self._checked(e, part, self._pread(e.entry, e.file_offset, part))

    @staticmethod
    def _checked(e: Extent, part: memoryview, why: str | None) -> str | None:
        """``why`` the read of ``e`` into ``part`` failed, else whether it matches its digest."""
        if why is None and xxhash.xxh3_128_digest(part) != e.digest:
            return f"bytes {e.file_offset}..{e.file_offset + e.length} differ from the snapshot"
        return why

    def _read_once(self, chunk: int) -> tuple[memoryview, list[tuple[int, bytes, str]]]:
        ix = self.index
        view = page_aligned(ix.chunk_len[chunk])
        bad: list[tuple[int, bytes, str]] = []
        for e, why in self._read_extents(list(ix.chunk_extents(chunk)), view):
            if why:
                bad.append((e.entry, self._name(e.entry), why))
        return view, bad

    def _read_extents(self, extents: list[Extent], view: memoryview) -> list[tuple[Extent, str | None]]:
        """Each extent into its place in ``view`` (a chunk) and why it failed, or None;
        one after the other here (local reads), several in flight for an object store."""
        return [(e, self._read_extent(e, view[e.chunk_offset:e.chunk_offset + e.length]))
                for e in extents]

    def _check_root(self, what: str) -> None:
        if not os.path.isdir(self.root):
            raise ChunkUnavailable(f"{what} of {self.dataset}: no replica had it and the "
                                   f"source {os.fsdecode(self.root)} is missing")

    def _changed(self, path: bytes, why: str, entries: frozenset[int],
                 partial: bytes | None) -> SourceChanged:
        return SourceChanged(
            f"source file {os.fsdecode(path)} {why}: it changed after dataset "
            f"{self.dataset} was imported; re-import the dataset (kspeedfs import)",
            entries, partial)

    def load_extent(self, e: Extent) -> memoryview:
        """Verified bytes of one extent alone (a small file when the dataset is larger than
        the cache tiers: reading its whole chunk would read ~chunk/size times the bytes)."""
        self._check_root(f"file {os.fsdecode(self.index.path(e.entry))}")
        buf = page_aligned(e.length)
        why = self._read_extent(e, buf)
        if why:
            log.warning("extent of %s failed the checksum, retrying: %s",
                        os.fsdecode(self._name(e.entry)), why)
            why = self._read_extent(e, buf)
        if why:
            raise self._changed(self._name(e.entry), why,
                                frozenset((e.entry,)), None)
        return buf.toreadonly()

    def load_block(self, chunk: int, block: int) -> memoryview | None:
        """Verified bytes of one block of ``chunk`` (a random read's miss), read from the
        files it overlaps; None if they do not match even on a retry: then the caller
        loads the whole chunk, whose per-extent check names the file that changed."""
        ix = self.index
        self._check_root(f"chunk {chunk}")
        lo = block * ix.block_size
        hi = lo + ix.block_len(chunk, block)
        expected = ix.block_digest(chunk, block)
        for attempt in range(2):
            view = page_aligned(hi - lo)   # gaps between files are zeros
            failed = False
            for e in ix.chunk_extents(chunk):
                a, b = max(lo, e.chunk_offset), min(hi, e.chunk_offset + e.length)
                if a < b and self._pread(e.entry, e.file_offset + a - e.chunk_offset,
                                         view[a - lo:b - lo]) is not None:
                    failed = True
                    break
            if not failed and xxhash.xxh3_64_digest(view) == expected:
                return view.toreadonly()
            log.warning("block %d of chunk %d of %s failed its checksum%s", block, chunk,
                        self.dataset, ", retrying" if attempt == 0 else "")
        return None

    def load(self, chunk: int) -> tuple[memoryview, int]:
        """Verified bytes of ``chunk`` and the number of mismatching extents seen (retried)."""
        self._check_root(f"chunk {chunk}")
        buf, bad = self._read_once(chunk)
        mismatches = len(bad)
        if bad:
            log.warning("chunk %d of %s: %d source extent(s) failed the checksum, retrying: %s",
                        chunk, self.dataset, len(bad), os.fsdecode(bad[0][1]))
            buf, bad = self._read_once(chunk)
            mismatches += len(bad)
        if bad:
            _, path, why = bad[0]
            raise self._changed(path, why, frozenset(entry for entry, _, _ in bad), bytes(buf))
        # a read-only view, not bytes(buf): no 4 MiB copy under the GIL per chunk (14 % of
        # the daemon's samples in a cold random-read profile); nothing else holds ``buf``
        return buf.toreadonly(), mismatches
