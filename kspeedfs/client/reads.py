"""③–⑥ for the Python library: a file's bytes by entry, for any caller thread.

    read / readinto / read_batch      resident in the memory tier? sliced right here
                                      (``_resident``); a small file in the host's
                                      grant? copied right here (``_hosted``); a small
                                      file whose chunk has a route to a peer? READ
                                      right here, in C (``_peered``); else one
                                      ``ReadLoop.call`` (a batch: one for all), the
                                      Reader's loads overlapping in the loop
    aread / aread_batch               the same for asyncio or trio callers, with
                                      ``ReadLoop.acall``: no thread waits
    read_all                          always the loop (the rest of a file: its chunks
                                      load concurrently, its stream prefetches)

A small file (one extent in one chunk, at most an eighth of a chunk:
``SMALL_FILE_DIVISOR``) whose slot in the host node's grant is known
(``cluster/granted.py``) is copied and verified in the caller's thread as well
(``_hosted``): a hand-over to the trio thread cost 75–140 µs here, the copy and xxh3 of a
110 KB extent 5–30 µs. It is not put into the memory tier (the node's memory is the
cache); the first read of a file whose slot is not known yet goes to the loop, whose
``locate`` answers the next chunks' slots too.

Without a grant, such a small file is READ from a peer by the caller's thread through C
(``_peered``, ``cluster/peer_wait.py``) once the loop has read a file of its chunk and
given C that chunk's route; any failure there (no route, a late or failed READ, a
mismatch) sends the read to the loop, whose path fails over and hedges
(docs/design.md, "The library's native fetch").

Resident hits skip the trio thread: bytes the memory tier's resident part holds (kept
until close, never reordered) are sliced in the caller's thread, as the native engine's
C threads answer a mount's memory hits; one hop to the trio thread costs tens of
microseconds, a 4 KiB copy well under one. They are counted for ``statistics()`` the
same way (``ReadLoop.count``). A view of a tier's buffer is safe to hold anywhere:
buffers are immutable, and a landing slot is reused only once nothing refers to it
(``cluster/landing.py``).
"""
from __future__ import annotations

from typing import Any

import trio

from ..cache.prefetch import Stream
from ..manifest.index import ManifestIndex
from ..tuning import READ_MANY_CONCURRENCY, SMALL_FILE_DIVISOR
from .errors import PathLike
from .loop import ReadLoop

__all__ = ["FileReads"]

#: (entry, offset, size) of one file read; None: nothing to read there
Job = tuple[int, int, int] | None
#: a batch's bytes and errors (None: that job succeeded), in its jobs' order
Batch = tuple[list[Any], list[Exception | None]]


class FileReads:
    """Verified bytes of files of one dataset version, by entry, from any thread of the
    process that opened it.

    Offsets and sizes are already checked by the caller (the ``Dataset`` API); a read
    past a file's end returns fewer bytes. Every read checks the handle first
    (``ReadLoop.check``: ValueError once closed, RuntimeError in a forked child); errors
    of a read are those of ``ReadLoop.call`` (mapped by ``client/errors.py``), except that
    ``read_batch`` returns each job's error unmapped for the caller to map with its path.
    A ``stream`` is one open file's sequential-read state (``cache/prefetch.py``): the
    caller's, never shared between threads.

    Attributes:
        index: the manifest.
        loop: the trio thread the Reader runs in.
    """

    def __init__(self, index: ManifestIndex, loop: ReadLoop) -> None:
        self.index = index
        self.loop = loop

    def read(self, entry: int, offset: int, size: int, path: PathLike) -> bytes:
        """Bytes [offset, offset + size) of file ``entry`` (``size`` > 0, inside the file)."""
        self.loop.check()
        data = self._here(entry, offset, size)
        if data is not None:
            return data
        return self.loop.call(self._read, entry, offset, size, path=path)

    def read_all(self, entry: int, offset: int, size: int, stream: Stream,
                 path: PathLike) -> bytes:
        """The same as one request in the loop, as ``stream``'s read (no resident path)."""
        return self.loop.call(self._read, entry, offset, size, stream, path=path)

    def readinto(self, entry: int, offset: int, buf: memoryview, stream: Stream,
                 path: PathLike) -> int:
        """Bytes of file ``entry`` from ``offset`` into all of ``buf`` (inside the file),
        as ``stream``'s read; returns how many."""
        self.loop.check()
        parts = self._resident(entry, offset, len(buf))
        if parts is None:
            data = self._hosted(entry, offset, len(buf))
            if data is None:
                return self.loop.call(self._readinto, entry, offset, buf, stream, path=path)
            parts = [memoryview(data)]
        s = stream                      # as Prefetcher.advise records a read
        s.run, s.next_offset = (s.run + 1 if offset == s.next_offset else 0), offset + len(buf)
        return _copy(parts, buf)

    async def aread(self, entry: int, offset: int, size: int, path: PathLike) -> bytes:
        """:meth:`read`, awaited from an asyncio or trio task (``ReadLoop.acall``)."""
        self.loop.check()
        data = self._here(entry, offset, size)
        if data is not None:
            return data
        return await self.loop.acall(self._read, entry, offset, size, path=path)

    def read_batch(self, todo: list[Job]) -> Batch:
        """Each job's bytes (``b""`` for None) and its error (None: it succeeded), in
        ``todo``'s order: resident ones here, the rest in one call to the loop, at most
        ``READ_MANY_CONCURRENCY`` files at once. ``todo`` is consumed."""
        here = self._batch_here(todo)
        rest = self.loop.call(self._read_batch, todo) if any(todo) else None
        return _merged(len(todo), here, rest)

    async def aread_batch(self, todo: list[Job]) -> Batch:
        """:meth:`read_batch`, awaited from an asyncio or trio task."""
        here = self._batch_here(todo)
        rest = await self.loop.acall(self._read_batch, todo) if any(todo) else None
        return _merged(len(todo), here, rest)

    def _batch_here(self, todo: list[Job]) -> dict[int, bytes]:
        """The jobs answered in this thread (resident, or from the host's grant), taken
        out of ``todo``."""
        self.loop.check()
        here: dict[int, bytes] = {}
        for i, job in enumerate(todo):
            if job is not None:
                entry, offset, size = job
                end = min(offset + size, self.index.size[entry])
                data = self._here(entry, offset, end - offset) if end > offset else b""
                if data is not None:
                    here[i] = data
                    todo[i] = None
        return here

    def _here(self, entry: int, offset: int, size: int) -> bytes | None:
        """Bytes [offset, offset + size) answered in this thread (``size`` > 0, inside
        the file): resident, or copied from the host's grant; None: ask the loop."""
        parts = self._resident(entry, offset, size)
        if parts is not None:
            return bytes(parts[0]) if len(parts) == 1 else b"".join(parts)
        data = self._hosted(entry, offset, size)
        return data if data is not None else self._peered(entry, offset, size)

    def _small(self, entry: int, size: int) -> tuple[int, Any] | None:
        """(chunk, extent) of small file ``entry`` (one extent in one chunk, at most an
        eighth of a chunk) for a read of ``size`` bytes, at least half of it; else None."""
        ix = self.index
        whole = ix.size[entry]
        if whole > ix.chunk_size // SMALL_FILE_DIVISOR or 2 * size < whole:
            return None
        chunks = ix.chunk_range(entry, 0, whole)
        if len(chunks) != 1:
            return None
        (ext,) = ix.file_extents(entry)
        return chunks[0], ext

    def _peered(self, entry: int, offset: int, size: int) -> bytes | None:
        """Bytes [offset, offset + size) of small file ``entry`` READ from a peer and
        verified in this thread, through C (``PeerWait.read``), when its chunk has a
        route there; else None (the loop reads it, and routes its chunk for the next
        files). Not put into the memory tier, as ``_hosted``'s copies are not."""
        pw = self.loop.peer_wait
        small = None if pw is None or self._granted() else self._small(entry, size)
        if small is None:
            return None
        assert pw is not None
        data = pw.read(*small)
        if data is None:
            return None
        self.loop.count(size, 0, peer_bytes=len(data))
        return data if not offset and size == len(data) else data[offset:offset + size]

    def _granted(self) -> bool:
        """Whether the node on this host grants its memory now: then a file not copied
        from it goes to the loop, which locates it there, not to the peers."""
        host = self.loop.host
        current = None if host is None else host.current
        return current is not None and not current.closed

    def _hosted(self, entry: int, offset: int, size: int) -> bytes | None:
        """Bytes [offset, offset + size) of small file ``entry`` (one extent in one
        chunk) copied out of the host node's grant and verified against the extent's
        digest, when its slot is known (``HostGrant.copy_nowait``); else None. Only
        for a read of at least half the file: smaller pieces would copy and hash the
        whole extent each time, where the loop keeps it in the memory tier."""
        host, ix = self.loop.host, self.index
        small = None if host is None else self._small(entry, size)
        if host is None or small is None:
            return None
        k, ext = small
        data = host.copy_nowait(ix.chunk_digest(k), ix.chunk_len[k],
                                (ext.chunk_offset, ext.length, ext.digest))
        if data is None:
            return None
        self.loop.count(size, 0, len(data))
        if offset or size < len(data):
            data = data[offset:offset + size]
        return bytes(data) if isinstance(data, memoryview) else data   # a part of 1 MiB+

    def _resident(self, entry: int, offset: int, size: int) -> list[memoryview] | None:
        """Bytes [offset, offset + size) of file ``entry`` (``size`` > 0, inside the file)
        as views of buffers the memory tier's resident part holds — the chunks, or the
        small file's extent (where ``Reader`` keeps it) — or None if any is not there."""
        ix, resident = self.index, self.loop.memory.resident
        chunks = ix.chunk_range(entry, offset, size)
        c, start = ix.chunk_size, ix.data[entry] + offset
        parts = []
        for k in chunks:
            data = resident(ix.chunk_digest(k))
            if data is None:
                break
            parts.append(memoryview(data)[max(start, k * c) - k * c:
                                          min(start + size, (k + 1) * c) - k * c])
        else:
            self.loop.count(size, len(chunks))
            return parts
        if len(chunks) == 1 and len(ix.chunk_range(entry, 0, ix.size[entry])) == 1:
            (ext,) = ix.file_extents(entry)
            data = resident(ext.digest)
            if data is not None:
                self.loop.count(size, 1)
                return [memoryview(data)[offset:offset + size]]
        return None

    # -- in the loop ---------------------------------------------------------------------------

    async def _read(self, entry: int, offset: int, size: int, stream: Stream | None = None) -> bytes:
        parts = await self.loop.reader.read_parts(entry, offset, size, stream)
        pw = self.loop.peer_wait
        if pw is not None and not self._granted() and (small := self._small(entry, size)):
            pw.route(small[0])      # the next files of that chunk: read in their threads
        return bytes(parts[0]) if len(parts) == 1 else b"".join(parts)

    async def _readinto(self, entry: int, offset: int, buf: memoryview, stream: Stream) -> int:
        return _copy(await self.loop.reader.read_parts(entry, offset, len(buf), stream), buf)

    async def _read_batch(self, todo: list[Job]) -> Batch:
        results: list[Any] = [b""] * len(todo)
        errors: list[Exception | None] = [None] * len(todo)
        limit = trio.CapacityLimiter(READ_MANY_CONCURRENCY)

        async def one(i: int, entry: int, offset: int, size: int) -> None:
            async with limit:
                try:
                    results[i] = await self._read(entry, offset, size)
                except Exception as e:      # mapped and raised by the caller
                    errors[i] = e

        async with trio.open_nursery() as n:
            for i, item in enumerate(todo):
                if item is not None:
                    n.start_soon(one, i, *item)
        return results, errors


def _merged(n: int, here: dict[int, bytes], rest: Batch | None) -> Batch:
    """A batch's answers: the loop's (``rest``; None when every job was answered here),
    with those answered here in their places."""
    empty: Batch = ([b""] * n, [None] * n)
    results, errors = rest if rest is not None else empty
    for i, data in here.items():
        results[i] = data
    return results, errors


def _copy(parts: list[Any], buf: memoryview) -> int:
    """``parts`` into ``buf`` one after another; returns the bytes copied."""
    n = 0
    for p in parts:
        buf[n:n + len(p)] = p
        n += len(p)
    return n
