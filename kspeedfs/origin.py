"""⑤′ The origin: the source directory the dataset was imported from, last resort.

A chunk is assembled from the files it packs (one ``preadv`` per extent into one
buffer) and checked extent by extent, so a mismatch names the file. A mismatching
read is retried once (a torn read from NFS, a flaky disk); if the source still does
not match, the file changed after import and only a re-import can fix it:
:class:`SourceChanged`, which the reader turns into EIO with that message.

Blocking: ``load`` runs in a worker thread.
"""
from __future__ import annotations

import logging
import os

import xxhash

from .errors import ChunkUnavailable, SourceChanged, SourceError
from .manifest.index import ManifestIndex

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

    def _read_once(self, chunk: int) -> tuple[bytearray, list[tuple[int, bytes, str]]]:
        ix = self.index
        buf = bytearray(ix.chunk_len[chunk])
        view = memoryview(buf)
        bad: list[tuple[int, bytes, str]] = []
        for e in ix.chunk_extents(chunk):
            path = os.path.join(self.root, ix.path(e.entry))
            part = view[e.chunk_offset:e.chunk_offset + e.length]
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError as err:
                bad.append((e.entry, path, f"cannot be opened ({err.strerror})"))
                continue
            try:
                got = os.preadv(fd, [part], e.file_offset)
            finally:
                os.close(fd)
            if got != e.length:
                bad.append((e.entry, path, f"is shorter than at import ({e.file_offset + got} bytes)"))
            elif xxhash.xxh3_128_digest(part) != e.digest:
                bad.append((e.entry, path, f"bytes {e.file_offset}..{e.file_offset + e.length} differ from the snapshot"))
        return buf, bad

    def load(self, chunk: int) -> tuple[memoryview, int]:
        """Verified bytes of ``chunk`` and the number of mismatching extents seen (retried)."""
        if not os.path.isdir(self.root):
            raise ChunkUnavailable(f"chunk {chunk} of {self.dataset}: no replica had it and the "
                                   f"source {os.fsdecode(self.root)} is missing")
        buf, bad = self._read_once(chunk)
        mismatches = len(bad)
        if bad:
            log.warning("chunk %d of %s: %d source extent(s) failed the checksum, retrying: %s",
                        chunk, self.dataset, len(bad), os.fsdecode(bad[0][1]))
            buf, bad = self._read_once(chunk)
            mismatches += len(bad)
        if bad:
            _, path, why = bad[0]
            raise SourceChanged(
                f"source file {os.fsdecode(path)} {why}: it changed after dataset "
                f"{self.dataset} was imported; re-import the dataset (kspeedfs import)",
                frozenset(entry for entry, _, _ in bad), bytes(buf),
            )
        # a read-only view, not bytes(buf): no 4 MiB copy under the GIL per chunk (14 % of
        # the daemon's samples in a cold random-read profile); nothing else holds ``buf``
        return memoryview(buf).toreadonly(), mismatches
