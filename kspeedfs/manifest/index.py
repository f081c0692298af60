"""② Manifest lookup: the in-memory index a mount answers every request from.

Loaded once per mount from the store blob (``from_blob``): inflate, then every
array is a zero-copy ``memoryview.cast`` over the inflated bytes, so load time is
the inflate plus a header parse and memory is the raw arrays (~70 bytes per small
file plus its name; see docs/design.md for measured RSS per 10^6 files). Nothing here
does I/O, and nothing here changes after load: the index is safe to share between
trio tasks and worker threads without locks.

Entry numbers are 0-based (root = 0); the FUSE layer adds 1 for inode numbers.

Inflating untrusted input. ``from_blob(blob, inflated_size)`` inflates with a
``zlib.decompressobj`` and ``max_length``: never more than the size the (signed)
dataset info record declares, plus one byte to notice a longer stream, so a 1.5 MiB
blob that would inflate to 1 GiB costs at most the declared size and fails cleanly as
``ManifestCorrupt``. A stream that ends early, has trailing data, or inflates to a
different size than declared is corrupt as well. ``inflated_size = 0`` means "not
declared" (records older than the field): inflated without a cap, as before; every
import now declares it, and in etcd the declaration is signed. The parser
behind it (``ManifestIndex.__init__``) raises ``ManifestCorrupt`` for any malformed
content (tests/unit/test_signature.py fuzzes both).
"""
from __future__ import annotations

import json
import os
import sys
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..errors import ManifestCorrupt
from .model import (
    BLOCK_DIGEST_SIZE,
    CHUNK_ARRAYS,
    DIGEST_SIZE,
    ENTRY_ARRAYS,
    FORMATS,
    HEADER,
    MAGIC,
    Extent,
    align8,
    blocks_per_chunk,
    check_header,
    is_dir,
    is_file,
    is_symlink,
)

if TYPE_CHECKING:
    from .pager import PageMap


class ManifestIndex:
    """Read-only queries over one manifest version's raw bytes: a whole inflated blob, or
    the mapping of a paged one (``pages``, filled on touch: ``pages.py``), which nothing
    here reads whole, so a mount touches only the pages its requests need."""

    def __init__(self, raw: bytes | memoryview, pages: PageMap | None = None) -> None:
        self._raw = raw
        #: the page map behind ``raw`` (a paged manifest), None when ``raw`` is whole
        self.pages = pages
        try:
            (magic, fmt, self.chunk_size, self.entries, self.nfiles, self.chunks, self.extents,
             names_len, _, block_size) = HEADER.unpack_from(raw, 0)
        except Exception as e:
            raise ManifestCorrupt(f"manifest header unreadable: {e}") from e
        if magic != MAGIC or fmt not in FORMATS:
            raise ManifestCorrupt(f"not a kspeedfs manifest (magic {magic!r}, format {fmt})")
        check_header(fmt, self.chunk_size, block_size, self.entries)
        mv = memoryview(raw)
        pos = align8(HEADER.size)

        def take(nbytes: int, code: str | None) -> memoryview:
            nonlocal pos
            if pos + nbytes > len(raw):
                raise ManifestCorrupt("manifest truncated")
            view = mv[pos:pos + nbytes]
            pos += align8(nbytes)
            # typeshed types cast() for literal formats only; these come from ENTRY_ARRAYS
            return view.cast(code) if code else view  # type: ignore[call-overload]

        for name, code, width in ENTRY_ARRAYS:
            setattr(self, name, take(width * self.entries, code))
        self.names = take(names_len, None)
        self.files = take(4 * self.nfiles, "I")
        for name, code, width in CHUNK_ARRAYS:
            setattr(self, name, take(width * self.chunks, code))
        self.ext_digests = take(DIGEST_SIZE * self.extents, None)
        self.chunk_digests = take(DIGEST_SIZE * self.chunks, None)
        #: random-read unit (model.py, "Blocks"); 0: a format 1 manifest, chunks only
        self.block_size: int = block_size if fmt >= 2 else 0
        self._block_stride = blocks_per_chunk(self.chunk_size, self.block_size) * BLOCK_DIGEST_SIZE
        self.block_digests = take(self._block_stride * self.chunks, None)
        #: the object-store source of a format 3 manifest (model.py, "Objects"); None for
        #: a directory source
        self.source_record: dict[str, str] | None = None
        self._obj_off: memoryview | None = None
        self._obj_data = memoryview(b"")
        if fmt >= 3:
            record_len = take(8, "Q")[0]
            self.source_record = _source_record(bytes(take(record_len, None)))
            self._obj_off = take(8 * (self.entries + 1), "Q")
            if self._obj_off[0] != 0:
                raise ManifestCorrupt("manifest object offsets do not start at 0")
            self._obj_data = take(self._obj_off[self.entries], None)
        # typed aliases for the attributes set above (for readers and type checkers)
        self.parent: memoryview
        self.mode: memoryview
        self.uid: memoryview
        self.gid: memoryview
        self.size: memoryview
        self.mtime_ns: memoryview
        self.name_off: memoryview
        self.name_len: memoryview
        self.data: memoryview
        self.ext: memoryview
        self.chunk_len: memoryview
        self.chunk_first_file: memoryview

    @classmethod
    def from_blob(cls, blob: bytes, inflated_size: int = 0) -> ManifestIndex:
        """Inflate and index a store blob; at most ``inflated_size`` bytes are inflated
        when it is declared (> 0), and the result must be exactly that long."""
        return cls(inflate(blob, inflated_size))

    @property
    def nbytes(self) -> int:
        """Memory held by the index (the inflated arrays)."""
        return len(self._raw)

    # -- entries -----------------------------------------------------------------------

    def name(self, entry: int) -> bytes:
        off = self.name_off[entry]
        return bytes(self.names[off:off + self.name_len[entry]])

    def is_dir(self, entry: int) -> bool:
        return is_dir(self.mode[entry])

    def is_file(self, entry: int) -> bool:
        return is_file(self.mode[entry])

    def is_symlink(self, entry: int) -> bool:
        return is_symlink(self.mode[entry])

    def children(self, entry: int) -> range:
        """Child entry numbers of a directory, in name order."""
        first = self.data[entry]
        return range(first, first + self.size[entry])

    def lookup(self, parent: int, name: bytes) -> int | None:
        """Entry named ``name`` in directory ``parent``: binary search over its children."""
        if not self.is_dir(parent):
            return None
        lo, hi = self.data[parent], self.data[parent] + self.size[parent]
        while lo < hi:
            mid = (lo + hi) // 2
            n = self.name(mid)
            if n < name:
                lo = mid + 1
            elif n > name:
                hi = mid
            else:
                return mid
        return None

    def readlink(self, entry: int) -> bytes:
        off = self.data[entry]
        return bytes(self.names[off:off + self.size[entry]])

    def path(self, entry: int) -> bytes:
        """Path of an entry relative to the dataset root (for source reads and logs)."""
        parts = []
        while entry:
            parts.append(self.name(entry))
            entry = self.parent[entry]
        return b"/".join(reversed(parts))

    def nlink(self, entry: int) -> int:
        if not self.is_dir(entry):
            return 1
        return 2 + sum(1 for c in self.children(entry) if self.is_dir(c))

    def walk(self, entry: int = 0) -> Iterator[int]:
        """Every entry below ``entry`` (breadth-first)."""
        for c in self.children(entry):
            yield c
        for c in self.children(entry):
            if self.is_dir(c):
                yield from self.walk(c)

    # -- data --------------------------------------------------------------------------

    def chunk_range(self, entry: int, offset: int, length: int) -> range:
        """Chunks holding bytes [offset, offset+length) of file ``entry`` (clipped at EOF)."""
        size = self.size[entry]
        end = min(offset + length, size)
        if offset >= end:
            return range(0)
        base = self.data[entry]
        c = self.chunk_size
        return range((base + offset) // c, (base + end - 1) // c + 1)

    def file_extents(self, entry: int) -> Iterator[Extent]:
        """Every extent of one file, in file order."""
        off, size = self.data[entry], self.size[entry]
        c = self.chunk_size
        first_chunk = off // c
        for i, k in enumerate(self.chunk_range(entry, 0, size)):
            start = max(off, k * c)
            end = min(off + size, (k + 1) * c)
            e = self.ext[entry] + i
            yield Extent(entry, k, start - off, start - k * c, end - start,
                         bytes(self.ext_digests[e * DIGEST_SIZE:(e + 1) * DIGEST_SIZE]))
            assert k - first_chunk == i

    def chunk_extents(self, chunk: int) -> Iterator[Extent]:
        """Every extent inside one chunk, in chunk order."""
        c = self.chunk_size
        base = chunk * c
        i = self.chunk_first_file[chunk]
        while i < self.nfiles:
            entry = self.files[i]
            off, size = self.data[entry], self.size[entry]
            if off >= base + c:
                break
            start, end = max(off, base), min(off + size, base + c)
            if end > start:
                e = self.ext[entry] + (start // c - off // c)
                yield Extent(entry, chunk, start - off, start - base, end - start,
                             bytes(self.ext_digests[e * DIGEST_SIZE:(e + 1) * DIGEST_SIZE]))
            i += 1

    def chunk_digest(self, chunk: int) -> bytes:
        return bytes(self.chunk_digests[chunk * DIGEST_SIZE:(chunk + 1) * DIGEST_SIZE])

    def block_digest(self, chunk: int, block: int) -> bytes:
        """xxh3-64 of block ``block`` of ``chunk`` (bytes [block*B, (block+1)*B) ∩ the chunk)."""
        at = chunk * self._block_stride + block * BLOCK_DIGEST_SIZE
        return bytes(self.block_digests[at:at + BLOCK_DIGEST_SIZE])

    def block_count(self, chunk: int) -> int:
        """Blocks of ``chunk`` (its last may be short; 0 in a format 1 manifest)."""
        return -(-self.chunk_len[chunk] // self.block_size) if self.block_size else 0

    def block_len(self, chunk: int, block: int) -> int:
        B = self.block_size
        return min(B, self.chunk_len[chunk] - block * B)

    def object_identity(self, entry: int) -> tuple[str, str]:
        """(ETag, version id) of the object behind file ``entry`` at import (format 3;
        the version id is "" unless the bucket was versioned)."""
        if self._obj_off is None:
            raise ManifestCorrupt("manifest has no object section (not an object-store source)")
        lo, hi = self._obj_off[entry], self._obj_off[entry + 1]
        if not lo <= hi <= len(self._obj_data):
            raise ManifestCorrupt(f"manifest object record of entry {entry} is out of range")
        etag, _, version = bytes(self._obj_data[lo:hi]).partition(b"\0")
        try:
            return etag.decode(), version.decode()
        except UnicodeDecodeError:
            raise ManifestCorrupt(f"manifest object record of entry {entry} is not UTF-8") from None


def _source_record(raw: bytes) -> dict[str, str]:
    """The object section's JSON record: an object of strings with a ``url``."""
    try:
        record = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise ManifestCorrupt(f"manifest source record is not JSON: {e}") from None
    if (not isinstance(record, dict) or not isinstance(record.get("url"), str)
            or not all(isinstance(v, str) for v in record.values())):
        raise ManifestCorrupt("manifest source record is not an object of strings with a url")
    return record


def fsdecode(path: bytes) -> str:
    return os.fsdecode(path)


def inflate(blob: bytes, inflated_size: int = 0) -> bytes:
    """zlib-inflate ``blob``, refusing to produce more than ``inflated_size`` bytes
    (when > 0) or a different length; ``ManifestCorrupt`` on any failure."""
    d = zlib.decompressobj()
    try:
        if inflated_size > 0:
            raw = d.decompress(blob, min(inflated_size + 1, sys.maxsize))
            if len(raw) > inflated_size or d.unconsumed_tail:
                raise ManifestCorrupt(f"manifest inflates past its declared {inflated_size} bytes")
        else:
            raw = d.decompress(blob)
        raw += d.flush()
    except zlib.error as e:
        raise ManifestCorrupt(f"manifest does not inflate: {e}") from e
    except MemoryError:
        raise ManifestCorrupt("manifest too large to inflate") from None
    if not d.eof:
        raise ManifestCorrupt("manifest truncated (zlib stream does not end)")
    if d.unused_data:
        raise ManifestCorrupt("manifest has trailing data after its zlib stream")
    if inflated_size > 0 and len(raw) != inflated_size:
        raise ManifestCorrupt(f"manifest inflates to {len(raw)} bytes, declared {inflated_size}")
    return raw
