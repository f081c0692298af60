"""The importer's arrays in temporary files: what lets a 10^8-entry import run in bounded memory.

Every per-entry, per-file, per-chunk and per-extent array the importer builds
(``importer.py``: the entry arrays and names of ``_Tree``, the plan's ``files`` and chunk
arrays, the digests, an object store's identities) is a :class:`Column`: an unlinked
temporary file plus a small in-memory tail. Appends go to the tail, which is written out
whole when it fills; items already on file are read and patched with ``pread`` and
``pwrite``. The bytes then live in the kernel's page cache, which can write them back and
drop them, not in the process (docs/design.md, "The importer's peak memory").

:class:`Identities` is the variable-length column of an object-store source (``etag NUL
version`` per entry, model.py "Objects"), where a value may still change while its
entry is being read (a version learned at the first GET), until :meth:`Identities.settle`.
"""
from __future__ import annotations

import os
import struct
import tempfile
import threading
from array import array
from collections.abc import Callable, Iterator

from .. import tuning


def _pread_all(fd: int, n: int, offset: int) -> bytes:
    got = os.pread(fd, n, offset)
    if len(got) == n:
        return got
    parts = [got]
    done = len(got)
    while done < n:
        more = os.pread(fd, n - done, offset + done)
        if not more:
            raise OSError(f"spill file ends at {offset + done}, {n - done} bytes short")
        parts.append(more)
        done += len(more)
    return b"".join(parts)


def _pwrite_all(fd: int, data: bytes | bytearray | memoryview | array[int], offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class Column:
    """A typed array (``array`` typecode ``code``) in an unlinked temporary file.

    Contract: :meth:`append` and :meth:`extend_bytes` add at the end (one thread); the
    tail is written out when it holds ``flush_items`` items or on :meth:`flush`. Items
    already written out may be read (``col[i]``, :meth:`read`) and patched (``col[i] =
    v``, :meth:`write`) from any thread; ``col[i] = v`` on the tail is for the appending
    thread only. Reads of single items and of short ranges on file go through a cache
    of the last ``tuning.SPILL_CACHED`` blocks of ``SPILL_BLOCK`` bytes (the hashing
    threads read each file's size and name in entry order: one ``pread`` per block
    instead of one per item); any patch empties it. Memory held: the tail, at most
    ``flush_items`` items, and the cached blocks.
    """

    def __init__(self, code: str, spill_dir: str | None, flush_items: int) -> None:
        self.tail = array(code)
        self.itemsize = self.tail.itemsize
        self.flush_items = max(1, flush_items)
        self.base = 0                      # items on file
        self._item = struct.Struct("=" + code)
        self._file = tempfile.TemporaryFile(dir=spill_dir, prefix="kspeedfs-import-")
        self.fd = self._file.fileno()
        self._block_items = max(1, tuning.SPILL_BLOCK // self.itemsize)
        self._cached: dict[int, array[int]] = {}
        self._cache_lock = threading.Lock()

    def _block(self, b: int) -> array[int]:
        """Block ``b`` (``_block_items`` items from ``b * _block_items``), cached when it
        is whole on file (the last one may be shorter, and grow)."""
        with self._cache_lock:
            got = self._cached.get(b)
        if got is not None:
            return got
        start = b * self._block_items
        stop = min(start + self._block_items, self.base)
        got = array(self.tail.typecode)
        got.frombytes(_pread_all(self.fd, (stop - start) * self.itemsize, start * self.itemsize))
        if len(got) < self._block_items:
            return got
        with self._cache_lock:
            if len(self._cached) >= tuning.SPILL_CACHED:
                del self._cached[next(iter(self._cached))]
            self._cached[b] = got
        return got

    def _patched(self) -> None:
        with self._cache_lock:
            self._cached.clear()

    def __len__(self) -> int:
        return self.base + len(self.tail)

    @property
    def nbytes(self) -> int:
        return len(self) * self.itemsize

    def append(self, value: int) -> None:
        self.tail.append(value)
        if len(self.tail) >= self.flush_items:
            self.flush()

    def extend_bytes(self, data: bytes | bytearray | memoryview) -> None:
        """Append raw items (a byte column: digests, names)."""
        self.tail.frombytes(data)
        if len(self.tail) >= self.flush_items:
            self.flush()

    def flush(self) -> None:
        if self.tail:
            _pwrite_all(self.fd, self.tail, self.base * self.itemsize)
            self.base += len(self.tail)
            del self.tail[:]

    def __getitem__(self, i: int) -> int:
        if i >= self.base:
            return self.tail[i - self.base]
        if i < 0:
            raise IndexError(f"column index {i} < 0")
        b, at = divmod(i, self._block_items)
        return self._block(b)[at]

    def __setitem__(self, i: int, value: int) -> None:
        if i >= self.base:
            self.tail[i - self.base] = value
        elif i < 0:
            raise IndexError(f"column index {i} < 0")
        else:
            self._patched()
            _pwrite_all(self.fd, self._item.pack(value), i * self.itemsize)

    def read(self, start: int, stop: int) -> array[int]:
        """Items ``[start, stop)`` as an array."""
        b = start // self._block_items
        if stop <= self.base and stop - start <= self._block_items and (stop - 1) // self._block_items == b:
            at = b * self._block_items
            return self._block(b)[start - at:stop - at]
        out = array(self.tail.typecode)
        if start < self.base:
            end = min(stop, self.base)
            out.frombytes(_pread_all(self.fd, (end - start) * self.itemsize, start * self.itemsize))
        if stop > self.base:
            out.extend(self.tail[max(start - self.base, 0):stop - self.base])
        return out

    def write(self, start: int, items: array[int]) -> None:
        """Patch items ``[start, start + len(items))``, all on file already."""
        if start + len(items) > self.base:
            raise IndexError(f"column patch [{start}, {start + len(items)}) past the file "
                             f"({self.base} items)")
        self._patched()
        _pwrite_all(self.fd, items, start * self.itemsize)

    def blocks(self, items: int) -> Iterator[tuple[int, array[int]]]:
        """(first index, items) of consecutive blocks of ``items`` items, front to back."""
        n = len(self)
        for start in range(0, n, items):
            yield start, self.read(start, min(start + items, n))

    def pieces(self, piece_bytes: int) -> Iterator[bytes]:
        """The column's bytes, front to back, in pieces of at most ``piece_bytes``."""
        self.flush()
        total = self.base * self.itemsize
        for off in range(0, total, piece_bytes):
            yield _pread_all(self.fd, min(piece_bytes, total - off), off)

    def close(self) -> None:
        self._file.close()


ColumnFactory = Callable[[str], Column]


class Identities:
    """Per-entry ``etag NUL version`` of an object-store source (model.py, "Objects").

    Contract: values are appended in entry order during the scan (:meth:`append`); an
    entry's value may be replaced (``ids[e] = v``, any thread) until :meth:`settle` is
    called with a frontier above it, after which it is final and neither read nor
    replaced again by the importer. Memory held: the replaced values of unsettled
    entries (the entries being read) and the columns' tails.
    """

    def __init__(self, column: ColumnFactory, block: int) -> None:
        self._ends, self._blob = column("Q"), column("B")            # as listed
        self._final_ends, self._final_blob = column("Q"), column("B")
        self._block = max(1, block)
        self._learned: dict[int, bytes] = {}
        self._settled = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._ends)

    def append(self, value: bytes) -> None:
        self._blob.extend_bytes(value)
        self._ends.append(len(self._blob))

    @staticmethod
    def _value(ends: Column, blob: Column, i: int) -> bytes:
        lo = ends[i - 1] if i else 0
        return blob.read(lo, ends[i]).tobytes()

    def __getitem__(self, i: int) -> bytes:
        with self._lock:
            got = self._learned.get(i)
            settled = i < self._settled
        if got is not None:
            return got
        if settled:
            return self._value(self._final_ends, self._final_blob, i)
        return self._value(self._ends, self._blob, i)

    def __setitem__(self, i: int, value: bytes) -> None:
        with self._lock:
            if i < self._settled:
                raise ValueError(f"entry {i}'s object identity is already settled")
            self._learned[i] = bytes(value)

    def settle(self, frontier: int) -> None:
        """Entries below ``frontier`` are final: copy them to the section's columns (an
        entry past the listed ones has an empty value)."""
        with self._lock:
            for start in range(self._settled, frontier, self._block):
                self._settle_block(start, min(start + self._block, frontier))
            self._settled = max(self._settled, frontier)

    def _settle_block(self, start: int, stop: int) -> None:
        listed = min(stop, len(self._ends))
        out_ends, out_blob = self._final_ends, self._final_blob
        if start < listed:
            ends = self._ends.read(start, listed)
            lo = self._ends[start - 1] if start else 0
            blob = self._blob.read(lo, ends[-1]).tobytes()
            learned = [e for e in self._learned if start <= e < listed]
            if not learned:                        # as listed: one copy, ends shifted
                shift = len(out_blob) - lo
                out_blob.extend_bytes(blob)
                for end in ends:
                    out_ends.append(end + shift)
            else:
                prev = lo
                for e, end in zip(range(start, listed), ends, strict=True):
                    value = self._learned.pop(e, None)
                    out_blob.extend_bytes(blob[prev - lo:end - lo] if value is None else value)
                    out_ends.append(len(out_blob))
                    prev = end
        for _ in range(max(start, listed), stop):
            out_ends.append(len(out_blob))

    def section_pieces(self, entries: int, piece_bytes: int) -> tuple[int, Iterator[bytes]]:
        """(size, pieces) of the offsets (``entries + 1``) and the values of the format 3
        object section; settles every entry."""
        self.settle(entries)
        size = 8 * (entries + 1) + self._final_blob.nbytes

        def pieces() -> Iterator[bytes]:
            yield bytes(8)
            yield from self._final_ends.pieces(piece_bytes)
            yield from self._final_blob.pieces(piece_bytes)

        return size, pieces()
