"""``kspeedfs import``: scan a source tree, lay it out in chunks, checksum, publish.

A source is an :class:`ImportSource`: a directory (:class:`FileSource`, here) or a
bucket prefix (``kspeedfs/objstore/source.py``). It scans itself into the entry arrays
(:class:`_Tree`) and reads byte ranges of its files; the layout, chunking, packing and
hashing below are the same for both.

Memory. Every array here, per entry, file, chunk or extent, is a ``spill.Column``: a
temporary file (``tempfile``'s directory) with a small tail in memory, so the importer's
peak memory does not grow with the tree (10^8 entries are ~7.5 GB of arrays: the page
cache holds them, and writes them back when it needs room). What does grow is
per-directory: the scan's queue of directories to list. No path is kept per entry; a
file's path is its parent's (a bounded cache of directory paths) plus its name.

Four phases, each a pass over the arrays front to back:

1. **scan** (:func:`scan`): a directory is walked breadth-first (one thread,
   ``os.scandir`` with bytes names, lstat only); a bucket is listed in parallel and its
   keys become paths. Children of a directory get consecutive entry numbers in name
   order (model.py explains why). Sockets, FIFOs and device nodes are skipped with a
   warning; hard links are imported as independent files.
2. **layout** (:func:`plan`): every regular file gets an offset in the chunked address
   space (``model.Layout.place``); extents and chunk boundaries follow from it.
3. **hash** (:func:`_hash`, N threads): each task reads one chunk's worth of files into
   one buffer (``preadv``, or ranged GETs) and computes the extent, chunk and block
   digests. xxhash releases the GIL on large buffers and file reads do too, so the
   threads overlap source I/O (NFS/Lustre latency) with hashing on every core. A file
   whose size changed since the scan fails the import with its name. Chunks are handed
   out and their digests land in chunk order, so every digest array is appended.
4. **encode** (:func:`encode`): the manifest's inflated bytes as pieces streamed from
   the spill files, published as a new version (``store.publish_stream``); an existing
   version is never touched.
"""
from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import stat
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import xxhash

from .. import tuning
from ..errors import SourceChanged, SourceError
from .model import (
    BLOCK_DIGEST_SIZE,
    CHUNK_ARRAYS,
    DIGEST_SIZE,
    ENTRY_ARRAYS,
    FORMAT_OBJECTS,
    FORMAT_VERSION,
    HEADER,
    MAGIC,
    NAME_MAX,
    Layout,
    align8,
    blocks_per_chunk,
)
from .spill import Column, Identities
from .store.base import DatasetInfo, MetadataStore, check_name

log = logging.getLogger(__name__)


@dataclass
class ImportProgress:
    """Snapshot handed to the progress callback (the CLI draws it)."""

    phase: str            # "scan", "hash", "publish", "done"
    files_done: int
    files_total: int
    bytes_done: int
    bytes_total: int
    elapsed: float


ProgressFn = Callable[[ImportProgress], None]


class _Tree:
    """The entry arrays under construction (model.ENTRY_ARRAYS, ``names``), spilled.

    Contract: the source appends entries breadth-first with :meth:`add_entry` (one
    thread) and may patch any entry's fields (``tree.data[d] = ...``); reads of any
    entry (``tree.size[e]``, :meth:`path`) are safe from any thread once the scan is
    over (:meth:`flush`). Each array is a ``spill.Column``: memory held is the tails of
    ``block`` entries plus ``tuning.IMPORT_PATHS`` directory paths, whatever the tree's
    size. Close it (or use it as a context manager) to drop the spill files.
    """

    # one column per ENTRY_ARRAYS name, made in __init__
    parent: Column
    mode: Column
    uid: Column
    gid: Column
    size: Column
    mtime_ns: Column
    name_off: Column
    name_len: Column
    data: Column
    ext: Column

    def __init__(self, spill_dir: str | None = None, block: int | None = None) -> None:
        self.spill_dir = spill_dir
        self.block = block or tuning.IMPORT_SPILL_ENTRIES
        self._columns: list[Column] = []
        for name, code, _ in ENTRY_ARRAYS:
            setattr(self, name, self.column(code))
        self.names = self.column("B")
        self._entry_columns = tuple(getattr(self, name) for name, _, _ in ENTRY_ARRAYS)
        self._tails = tuple(c.tail for c in self._entry_columns)
        #: an object-store source's per-entry ``etag NUL version_id`` (model.py, "Objects")
        self.objects: Identities | None = None
        # directory paths: a file's path is its parent's plus its name
        self._dir_path = functools.lru_cache(maxsize=tuning.IMPORT_PATHS)(self.path)

    def column(self, code: str) -> Column:
        """A new spilled array, closed with the tree."""
        col = Column(code, self.spill_dir, self.block)
        self._columns.append(col)
        return col

    def track_objects(self) -> Identities:
        """Start the per-entry object identities (an object-store source)."""
        self.objects = Identities(self.column, self.block)
        return self.objects

    def __len__(self) -> int:
        return len(self.mode)

    def add(self, parent: int, name: bytes, st: os.stat_result) -> int:
        return self.add_entry(parent, name, st.st_mode, st.st_uid, st.st_gid,
                              st.st_size if not stat.S_ISDIR(st.st_mode) else 0,
                              st.st_mtime_ns)

    def add_entry(self, parent: int, name: bytes, mode: int, uid: int, gid: int, size: int,
                  mtime_ns: int) -> int:
        t = self._tails
        idx = self.mode.base + len(t[1])
        names = self.names
        t[0].append(parent)
        t[1].append(mode)
        t[2].append(uid)
        t[3].append(gid)
        t[4].append(size)
        t[5].append(mtime_ns)
        t[6].append(names.base + len(names.tail))
        t[7].append(len(name))
        names.tail.frombytes(name)
        t[8].append(0)
        t[9].append(0)
        if len(t[1]) >= self.block:
            self.flush()
        return idx

    def add_target(self, entry: int, target: bytes) -> None:
        """Record symlink ``entry``'s target (model.py: data = its offset in names)."""
        self.data[entry] = len(self.names)
        self.size[entry] = len(target)
        self.names.extend_bytes(target)

    def flush(self) -> None:
        """Write every tail out."""
        for col in self._entry_columns:
            col.flush()
        self.names.flush()

    def name(self, entry: int) -> bytes:
        off = self.name_off[entry]
        return self.names.read(off, off + self.name_len[entry]).tobytes()

    def path(self, entry: int) -> bytes:
        """``entry``'s path below the source's root (b"" for the root), from its parents'
        names: the importer keeps no path per entry."""
        if entry == 0:
            return b""
        parent = self.parent[entry]
        base = self._dir_path(parent) if parent else b""
        return base + b"/" + self.name(entry) if base else self.name(entry)

    def close(self) -> None:
        for col in self._columns:
            col.close()

    def __enter__(self) -> _Tree:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


ScanProgress = Callable[[int, int], None]     # (entries so far, bytes so far)


class ImportSource(Protocol):
    """What the importer needs from a source: its tree, then byte ranges of its files."""

    #: what the dataset records as its source (``DatasetInfo.source``): a path or a URL
    url: str
    #: readers worth running at once (0: the importer's default, 2 x CPUs)
    threads: int

    def scan(self, progress: ScanProgress | None) -> _Tree:
        """Entry arrays of the whole tree, children of each directory contiguous and
        sorted by name; ``SourceError`` if it cannot be listed."""

    def read_into(self, tree: _Tree, entry: int, offset: int, out: memoryview) -> None:
        """Fill ``out`` from file ``entry`` at ``offset``; ``SourceChanged`` naming the
        file if it is gone or no longer what the scan saw."""

    def record(self) -> dict[str, str] | None:
        """The manifest's source record (format 3), None for a directory."""


class FileSource:
    """A directory tree (NFS, Lustre, a local disk): today's and the default source."""

    threads = 0

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.root = os.fsencode(os.path.abspath(path))
        self.url = os.fsdecode(self.root)

    def scan(self, progress: ScanProgress | None) -> _Tree:
        return scan(self.root, progress)

    def read_into(self, tree: _Tree, entry: int, offset: int, out: memoryview) -> None:
        path = os.path.join(self.root, tree.path(entry))
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:
            raise SourceChanged(f"{os.fsdecode(path)} vanished during import: {e.strerror}") from e
        try:
            got = os.preadv(fd, [out], offset)
            if got != len(out) or os.fstat(fd).st_size != tree.size[entry]:
                raise SourceChanged(f"{os.fsdecode(path)} changed size during import")
        finally:
            os.close(fd)

    def record(self) -> None:
        return None


def _listed(full: bytes) -> list[tuple[bytes, os.stat_result]]:
    """The entries of directory ``full`` the manifest keeps, sorted by name."""
    try:
        with os.scandir(full) as it:
            children = sorted(((e.name, e.stat(follow_symlinks=False)) for e in it),
                              key=lambda x: x[0])
    except OSError as e:
        raise SourceError(f"cannot list {os.fsdecode(full)}: {e.strerror}") from e
    kept = []
    for name, st in children:
        if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            log.warning("skipping %s: not a file, directory or symlink",
                        os.fsdecode(os.path.join(full, name)))
            continue
        if len(name) > NAME_MAX:
            raise SourceError(f"name longer than {NAME_MAX} bytes in {os.fsdecode(full)}")
        kept.append((name, st))
    return kept


def scan(source: bytes, progress: ScanProgress | None = None) -> _Tree:
    """Breadth-first walk of ``source``; children of each directory contiguous and sorted."""
    try:
        root_st = os.stat(source)
    except OSError as e:
        raise SourceError(f"source {os.fsdecode(source)}: {e.strerror}") from e
    if not stat.S_ISDIR(root_st.st_mode):
        raise SourceError(f"source {os.fsdecode(source)} is not a directory")
    tree = _Tree()
    try:
        _walk(tree, source, root_st, progress)
    except BaseException:
        tree.close()
        raise
    return tree


def _walk(tree: _Tree, source: bytes, root_st: os.stat_result,
          progress: ScanProgress | None) -> None:
    tree.add(0, b"", root_st)
    # (entry, full path) of the directories still to list: per-directory state only
    queue: deque[tuple[int, bytes]] = deque([(0, source)])
    nbytes = 0
    while queue:
        d, full = queue.popleft()
        kept = _listed(full)
        tree.data[d] = len(tree)
        tree.size[d] = len(kept)
        for name, st in kept:
            idx = tree.add(d, name, st)
            if stat.S_ISDIR(st.st_mode):
                queue.append((idx, os.path.join(full, name)))
            elif stat.S_ISLNK(st.st_mode):
                tree.add_target(idx, os.readlink(os.path.join(full, name)))
            else:
                nbytes += st.st_size
        if progress:
            progress(len(tree), nbytes)
    tree.flush()


@dataclass
class _Plan:
    layout: Layout
    block_size: int
    files: Column           # entry index of every non-empty regular file, in layout order
    chunk_len: Column
    chunk_first_file: Column
    extents: int
    regular: int            # regular files, empty ones included
    bytes: int              # their bytes


def plan(tree: _Tree, chunk_size: int, block_size: int) -> _Plan:
    """Assign layout offsets (``data``) and extent indexes (``ext``) of every file, and
    the chunk arrays; one pass over the entries, a block at a time."""
    tree.flush()
    layout = Layout(chunk_size)
    p = _Plan(layout, block_size, tree.column("I"), tree.column("I"), tree.column("I"), 0, 0, 0)
    files, c = p.files, chunk_size
    last, cur_len, cur_first = -1, 0, 0      # the last chunk so far, not yet appended
    for start, modes, sizes, data, exts in _layout_blocks(tree):
        for j, m in enumerate(modes):
            if m & _S_IFMT != _S_IFREG:
                continue
            size = sizes[j]
            off = data[j] = layout.place(size)
            exts[j] = p.extents
            p.regular += 1
            if not size:
                continue
            p.bytes += size
            k0, k1 = off // c, (off + size - 1) // c
            p.extents += k1 - k0 + 1
            nf = len(files)
            for k in range(k0, k1 + 1):
                if k > last:
                    if last >= 0:
                        p.chunk_len.append(cur_len)
                        p.chunk_first_file.append(cur_first)
                    for _ in range(last + 1, k):     # chunks skipped by alignment stay empty
                        p.chunk_len.append(0)
                        p.chunk_first_file.append(nf)
                    last, cur_len, cur_first = k, 0, nf
                if cur_len == 0:
                    cur_first = nf
                cur_len = max(cur_len, min(off + size, (k + 1) * c) - k * c)
            files.append(start + j)
        tree.data.write(start, data)
        tree.ext.write(start, exts)
    if last >= 0:
        p.chunk_len.append(cur_len)
        p.chunk_first_file.append(cur_first)
    for col in (files, p.chunk_len, p.chunk_first_file):
        col.flush()
    return p


_S_IFMT, _S_IFREG = 0o170000, stat.S_IFREG
_Block = tuple[int, "array[int]", "array[int]", "array[int]", "array[int]"]


def _layout_blocks(tree: _Tree) -> Iterator[_Block]:
    """(first entry, modes, sizes, data, exts) of consecutive blocks of entries."""
    for start, modes in tree.mode.blocks(tree.block):
        stop = start + len(modes)
        yield (start, modes, tree.size.read(start, stop), tree.data.read(start, stop),
               tree.ext.read(start, stop))


@dataclass
class _ChunkTask:
    k: int
    length: int             # chunk_len[k]
    first_entry: int        # its first file (the tree's size when it has none)
    first_ext: int          # the extent index of its first extent
    extents: array[int]     # (entry, file offset, chunk offset, length) per extent, flat


def _chunk_tasks(tree: _Tree, p: _Plan) -> Iterator[_ChunkTask]:
    """Every chunk's extents in chunk order, from one pass over the entries (files are
    laid out in entry order, so chunks fill front to back)."""
    c, n = p.layout.chunk_size, len(tree)
    task = _ChunkTask(0, 0, n, 0, array("Q"))
    for start, modes, sizes, data, exts in _layout_blocks(tree):
        for j, m in enumerate(modes):
            size = sizes[j]
            if m & _S_IFMT != _S_IFREG or not size:
                continue
            off, entry = data[j], start + j
            k0 = off // c
            for k in range(k0, (off + size - 1) // c + 1):
                while k > task.k:
                    yield task
                    task = _ChunkTask(task.k + 1, 0, n, exts[j] + k - k0, array("Q"))
                lo, hi = max(off, k * c), min(off + size, (k + 1) * c)
                if not task.extents:
                    task.first_entry, task.first_ext = entry, exts[j] + k - k0
                task.extents.extend((entry, lo - off, lo - k * c, hi - lo))
                task.length = max(task.length, hi - k * c)
    chunks = len(p.chunk_len)
    while task.k < chunks:
        yield task
        task = _ChunkTask(task.k + 1, 0, n, p.extents, array("Q"))


@dataclass
class _Hashed:
    chunk: bytes            # xxh3-128 of the chunk
    extents: bytes          # xxh3-128 of each extent, from task.first_ext on
    blocks: bytes           # xxh3-64 of each block
    files: int              # files starting in this chunk


def _hash_chunk(source: ImportSource, tree: _Tree, task: _ChunkTask, block_size: int) -> _Hashed:
    buf = bytearray(task.length)
    view = memoryview(buf)
    digests = []
    nfiles = 0
    ex = task.extents
    for i in range(0, len(ex), 4):
        idx, foff, coff, length = ex[i], ex[i + 1], ex[i + 2], ex[i + 3]
        source.read_into(tree, idx, foff, view[coff:coff + length])
        digests.append(xxhash.xxh3_128_digest(view[coff:coff + length]))
        if foff == 0:
            nfiles += 1
    B = block_size
    blocks = b"".join(xxhash.xxh3_64_digest(view[o:o + B]) for o in range(0, len(buf), B))
    return _Hashed(xxhash.xxh3_128_digest(buf), b"".join(digests), blocks, nfiles)


@dataclass
class _Digests:
    extents: Column         # DIGEST_SIZE per extent
    chunks: Column          # DIGEST_SIZE per chunk
    blocks: Column          # blocks_per_chunk * BLOCK_DIGEST_SIZE per chunk


def encode(tree: _Tree, p: _Plan, digests: _Digests,
           record: dict[str, str] | None = None) -> tuple[Iterator[bytes], int]:
    """The blob format read by ``index.ManifestIndex``, inflated: (its bytes in pieces of
    at most ``tuning.IMPORT_PIECE``, streamed from the spill files; its size, which the
    dataset info declares: a loader's cap). With a source ``record`` (an object store)
    it is format 3: the object section follows."""
    fmt = FORMAT_VERSION if record is None else FORMAT_OBJECTS
    header = HEADER.pack(MAGIC, fmt, p.layout.chunk_size, len(tree), len(p.files),
                         len(p.chunk_len), p.extents, len(tree.names), 0, p.block_size)
    assert [n for n, _, _ in CHUNK_ARRAYS] == ["chunk_len", "chunk_first_file"]
    columns = [*(getattr(tree, name) for name, _, _ in ENTRY_ARRAYS), tree.names, p.files,
               p.chunk_len, p.chunk_first_file, digests.extents, digests.chunks, digests.blocks]
    piece = tuning.IMPORT_PIECE
    sections: list[tuple[int, Iterator[bytes]]] = [(len(header), iter([header]))]
    sections += [(col.nbytes, col.pieces(piece)) for col in columns]
    if record is not None:
        raw = json.dumps(record, sort_keys=True).encode()
        head = len(raw).to_bytes(8, "little") + raw
        head += bytes(align8(len(head)) - len(head))
        objects = tree.objects or tree.track_objects()
        size, rest = objects.section_pieces(len(tree), piece)
        sections.append((len(head) + size, itertools.chain([head], rest)))
    return _padded(sections), sum(align8(n) for n, _ in sections)


def _padded(sections: list[tuple[int, Iterator[bytes]]]) -> Iterator[bytes]:
    """Each section's pieces, then zeros up to a multiple of 8 bytes (model.py)."""
    for size, pieces in sections:
        got = 0
        for piece in pieces:
            got += len(piece)
            yield piece
        if got != size:
            raise AssertionError(f"manifest section of {got} bytes, {size} planned")
        if align8(size) != size:
            yield bytes(align8(size) - size)


def _hash(src: ImportSource, tree: _Tree, p: _Plan, threads: int,
          done: Callable[[int, int], None]) -> _Digests:
    """Read and checksum every chunk, ``threads`` at once; results land in chunk order,
    so every digest array is appended front to back. ``done(files, bytes)`` after each."""
    out = _Digests(tree.column("B"), tree.column("B"), tree.column("B"))
    stride = blocks_per_chunk(p.layout.chunk_size, p.block_size) * BLOCK_DIGEST_SIZE
    tasks = _chunk_tasks(tree, p)
    with ThreadPoolExecutor(threads, thread_name_prefix="kspeedfs-hash") as pool:
        pending: deque[tuple[_ChunkTask, Future[_Hashed]]] = deque(
            (t, pool.submit(_hash_chunk, src, tree, t, p.block_size))
            for t in itertools.islice(tasks, threads * 2))
        while pending:
            task, fut = pending.popleft()
            h = fut.result()
            if len(out.extents) != task.first_ext * DIGEST_SIZE and h.extents:
                raise AssertionError(f"chunk {task.k}'s extents start at {task.first_ext}, "
                                     f"not {len(out.extents) // DIGEST_SIZE}")
            out.chunks.extend_bytes(h.chunk)
            out.blocks.extend_bytes(h.blocks + bytes(stride - len(h.blocks)))
            out.extents.extend_bytes(h.extents)
            nxt = next(tasks, None)
            if nxt is not None:
                pending.append((nxt, pool.submit(_hash_chunk, src, tree, nxt, p.block_size)))
            if tree.objects is not None:      # entries below the pending chunks are read
                tree.objects.settle(min((t.first_entry for t, _ in pending), default=len(tree)))
            done(h.files, task.length)
    return out


def import_tree(
    source: str | os.PathLike[str] | ImportSource,
    name: str,
    store: MetadataStore,
    chunk_size: int,
    threads: int = 0,
    progress: ProgressFn | None = None,
    block_size: int = 128 << 10,
) -> DatasetInfo:
    """Import ``source`` (a directory, or any :class:`ImportSource`) as the next version of
    dataset ``name``; returns its info."""
    check_name(name)
    src: ImportSource = (FileSource(source) if isinstance(source, (str, bytes, os.PathLike))
                         else source)
    t0 = time.monotonic()

    def report(phase: str, fd: int, ft: int, bd: int, bt: int) -> None:
        if progress:
            progress(ImportProgress(phase, fd, ft, bd, bt, time.monotonic() - t0))

    with src.scan(lambda n, b: report("scan", n, 0, b, 0)) as tree:
        p = plan(tree, chunk_size, min(block_size, chunk_size))
        log.info("scanned %s: %d entries, %d files, %d bytes, %d chunks", src.url,
                 len(tree), p.regular, p.bytes, len(p.chunk_len))
        files_done = p.regular - len(p.files)   # empty files need no reading
        bytes_done = 0

        def hashed(files: int, nbytes: int) -> None:
            nonlocal files_done, bytes_done
            files_done += files
            bytes_done += nbytes
            report("hash", files_done, p.regular, bytes_done, p.layout.cursor)

        digests = _hash(src, tree, p, threads or src.threads or 2 * (os.cpu_count() or 1), hashed)
        report("publish", p.regular, p.regular, p.bytes, p.bytes)
        pieces, inflated_size = encode(tree, p, digests, record=src.record())
        info = DatasetInfo(
            name=name, version=0, files=p.regular, entries=len(tree), bytes=p.bytes,
            chunks=len(p.chunk_len), chunk_size=chunk_size, imported_at=0.0,
            source=src.url, inflated_size=inflated_size,
        )
        sealed = store.publish_stream(info, pieces, inflated_size)
    report("done", p.regular, p.regular, p.bytes, p.bytes)
    log.info("published %s v%d (%d-byte manifest)", name, sealed.version, sealed.manifest_size)
    return sealed
