"""⑤′ The origin: the source directory the dataset was imported from, last resort.

A chunk is assembled from the files it packs (one ``preadv`` per extent into one
buffer) and checked extent by extent, so a mismatch names the file. A mismatching
read is retried once (a torn read from NFS, a flaky disk); if the source still does
not match, the file changed after import and only a re-import can fix it:
:class:`SourceChanged`, which the reader turns into EIO with that message.

The source's pages are dropped from the page cache once read (``POSIX_FADV_DONTNEED``):
the bytes now live in the memory tier (and the mount's own page cache), so keeping the
source's copy too would hold every cold byte three times. Measured with 13 GB of the
machine's 23 GiB held elsewhere, a cold 4 GiB read by 4 readers: 161–355 MB/s with the
daemon's CPU going to reclaim (10–22 CPU-s) when the source's pages stayed, 842–1,386
MB/s (2–4 CPU-s) when dropped; 1.7 GB/s with memory to spare. (The kernel drops whole
folios only: a range inside a large folio stays, which 4 MiB chunks rarely are.)

Blocking: ``load`` runs in a worker thread.
"""
from __future__ import annotations

import logging
import os

import xxhash

from .errors import ChunkUnavailable, SourceChanged, SourceError
from .manifest.index import ManifestIndex
from .manifest.model import Extent

log = logging.getLogger(__name__)


class Origin:
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

    def _read_extent(self, e: Extent, part: memoryview) -> str | None:
        """Fill ``part`` with extent ``e`` from its source file; why it failed, or None."""
        path = os.path.join(self.root, self.index.path(e.entry))
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as err:
            return f"cannot be opened ({err.strerror})"
        try:
            got = os.preadv(fd, [part], e.file_offset)
            os.posix_fadvise(fd, e.file_offset, e.length, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        if got != e.length:
            return f"is shorter than at import ({e.file_offset + got} bytes)"
        if xxhash.xxh3_128_digest(part) != e.digest:
            return f"bytes {e.file_offset}..{e.file_offset + e.length} differ from the snapshot"
        return None

    def _read_once(self, chunk: int) -> tuple[bytearray, list[tuple[int, bytes, str]]]:
        ix = self.index
        buf = bytearray(ix.chunk_len[chunk])
        view = memoryview(buf)
        bad: list[tuple[int, bytes, str]] = []
        for e in ix.chunk_extents(chunk):
            why = self._read_extent(e, view[e.chunk_offset:e.chunk_offset + e.length])
            if why:
                bad.append((e.entry, os.path.join(self.root, ix.path(e.entry)), why))
        return buf, bad

    def _check_root(self, what: str) -> None:
        if not os.path.isdir(self.root):
            raise ChunkUnavailable(f"{what} of {self.dataset}: no replica had it and the "
                                   f"source {os.fsdecode(self.root)} is missing")

    def _changed(self, path: bytes, why: str, entries: frozenset[int], partial: bytes | None) -> SourceChanged:
        return SourceChanged(
            f"source file {os.fsdecode(path)} {why}: it changed after dataset "
            f"{self.dataset} was imported; re-import the dataset (kspeedfs import)",
            entries, partial)

    def load_extent(self, e: Extent) -> memoryview:
        """Verified bytes of one extent alone (a small file when the dataset is larger than
        the cache tiers: reading its whole chunk would read ~chunk/size times the bytes)."""
        self._check_root(f"file {os.fsdecode(self.index.path(e.entry))}")
        buf = bytearray(e.length)
        why = self._read_extent(e, memoryview(buf))
        if why:
            log.warning("extent of %s failed the checksum, retrying: %s",
                        os.fsdecode(self.index.path(e.entry)), why)
            why = self._read_extent(e, memoryview(buf))
        if why:
            raise self._changed(os.path.join(self.root, self.index.path(e.entry)), why,
                                frozenset((e.entry,)), None)
        return memoryview(buf).toreadonly()

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
        return memoryview(buf).toreadonly(), mismatches
