"""``kspeedfs import``: scan a source tree, lay it out in chunks, checksum, publish.

A source is an :class:`ImportSource`: a directory (:class:`FileSource`, here) or a
bucket prefix (``kspeedfs/objstore/source.py``). It scans itself into the entry arrays and
reads byte ranges of its files; the layout, chunking, packing and hashing below are the
same for both.

Three phases, each over flat arrays so a 10^7-file tree fits comfortably:

1. **scan**: a directory is walked breadth-first (one thread, ``os.scandir`` with bytes
   names, lstat only); a bucket is listed in parallel and its keys become paths.
   Children of a directory get consecutive entry numbers in name order (model.py
   explains why). Sockets, FIFOs and device nodes are skipped with a
   warning; hard links are imported as independent files.
2. **layout**: every regular file gets an offset in the chunked address space
   (``model.Layout.place``); extents and chunk boundaries follow from it.
3. **hash** (N threads): each task reads one chunk's worth of files into one buffer
   (``preadv``, or ranged GETs) and computes the extent, chunk and block digests.
   xxhash releases the GIL on large buffers and file reads do too, so the threads
   overlap source I/O (NFS/Lustre latency) with hashing on every core. A file whose
   size changed since the scan fails the import with its name.

The result is one manifest blob published as a new version (``store.publish``);
an existing version is never touched.
"""
from __future__ import annotations

import json
import logging
import os
import stat
import time
import zlib
from array import array
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import xxhash

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
    """Entry arrays under construction (see model.ENTRY_ARRAYS)."""

    # one array per ENTRY_ARRAYS name, made in __init__
    parent: array[int]
    mode: array[int]
    uid: array[int]
    gid: array[int]
    size: array[int]
    mtime_ns: array[int]
    name_off: array[int]
    name_len: array[int]
    data: array[int]
    ext: array[int]

    def __init__(self) -> None:
        for name, code, _ in ENTRY_ARRAYS:
            setattr(self, name, array(code))
        self.names = bytearray()
        self.paths: list[bytes] = []      # relative path of every entry (import only)
        #: an object-store source's per-entry ``etag NUL version_id`` (model.py, "Objects")
        self.objects: list[bytes] | None = None

    def add(self, parent: int, name: bytes, st: os.stat_result, path: bytes) -> int:
        return self.add_entry(parent, name, st.st_mode, st.st_uid, st.st_gid,
                              st.st_size if not stat.S_ISDIR(st.st_mode) else 0,
                              st.st_mtime_ns, path)

    def add_entry(self, parent: int, name: bytes, mode: int, uid: int, gid: int, size: int,
                  mtime_ns: int, path: bytes) -> int:
        idx = len(self.mode)
        self.parent.append(parent)
        self.mode.append(mode)
        self.uid.append(uid)
        self.gid.append(gid)
        self.size.append(size)
        self.mtime_ns.append(mtime_ns)
        self.name_off.append(len(self.names))
        self.name_len.append(len(name))
        self.names += name
        self.data.append(0)
        self.ext.append(0)
        self.paths.append(path)
        return idx


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
        path = os.path.join(self.root, tree.paths[entry])
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


def scan(source: bytes, progress: ScanProgress | None = None) -> _Tree:
    """Breadth-first walk of ``source``; children of each directory contiguous and sorted."""
    try:
        root_st = os.stat(source)
    except OSError as e:
        raise SourceError(f"source {os.fsdecode(source)}: {e.strerror}") from e
    if not stat.S_ISDIR(root_st.st_mode):
        raise SourceError(f"source {os.fsdecode(source)} is not a directory")
    tree = _Tree()
    tree.add(0, b"", root_st, b"")
    queue: deque[int] = deque([0])
    nbytes = 0
    while queue:
        d = queue.popleft()
        rel = tree.paths[d]
        full = os.path.join(source, rel) if rel else source
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
        tree.data[d] = len(tree.mode)
        tree.size[d] = len(kept)
        for name, st in kept:
            child_rel = os.path.join(rel, name) if rel else name
            idx = tree.add(d, name, st, child_rel)
            if stat.S_ISDIR(st.st_mode):
                queue.append(idx)
            elif stat.S_ISLNK(st.st_mode):
                target = os.readlink(os.path.join(source, child_rel))
                tree.data[idx] = len(tree.names)
                tree.size[idx] = len(target)
                tree.names += target
            else:
                nbytes += st.st_size
        if progress:
            progress(len(tree.mode), nbytes)
    return tree


@dataclass
class _Plan:
    layout: Layout
    block_size: int
    files: array[int]       # entry index of every non-empty regular file, in layout order
    chunk_len: array[int]
    chunk_first_file: array[int]
    extents: int


def plan(tree: _Tree, chunk_size: int, block_size: int) -> _Plan:
    """Assign layout offsets, extent indexes and chunk boundaries."""
    layout = Layout(chunk_size)
    files = array("I")
    chunk_len = array("I")
    chunk_first_file = array("I")
    ext = 0
    for idx in range(len(tree.mode)):
        if not stat.S_ISREG(tree.mode[idx]):
            continue
        size = tree.size[idx]
        off = layout.place(size)
        tree.data[idx] = off
        tree.ext[idx] = ext
        span = layout.chunk_span(off, size)
        if not span:
            continue
        ext += len(span)
        for k in span:
            while len(chunk_len) <= k:       # chunks skipped by alignment stay empty
                chunk_len.append(0)
                chunk_first_file.append(len(files))
            end = min(off + size, (k + 1) * chunk_size) - k * chunk_size
            if chunk_len[k] == 0:
                chunk_first_file[k] = len(files)
            chunk_len[k] = max(chunk_len[k], end)
        files.append(idx)
    return _Plan(layout, block_size, files, chunk_len, chunk_first_file, ext)


def chunk_extents(tree: _Tree, p: _Plan, k: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(entry, file_offset, chunk_offset, length, extent_index) of every extent in chunk k."""
    c = p.layout.chunk_size
    base = k * c
    i = p.chunk_first_file[k]
    while i < len(p.files):
        idx = p.files[i]
        off, size = tree.data[idx], tree.size[idx]
        if off >= base + c:
            break
        start = max(off, base)
        end = min(off + size, base + c)
        if end > start:
            yield idx, start - off, start - base, end - start, tree.ext[idx] + (start // c - off // c)
        i += 1


def _hash_chunk(source: ImportSource, tree: _Tree, p: _Plan,
                k: int) -> tuple[int, bytes, list[tuple[int, bytes]], bytes, int]:
    """(k, chunk digest, [(extent index, digest)], block digests, files starting here)."""
    buf = bytearray(p.chunk_len[k])
    view = memoryview(buf)
    digests = []
    nfiles = 0
    for idx, foff, coff, length, ext in chunk_extents(tree, p, k):
        source.read_into(tree, idx, foff, view[coff:coff + length])
        digests.append((ext, xxhash.xxh3_128_digest(view[coff:coff + length])))
        if foff == 0:
            nfiles += 1
    B = p.block_size
    blocks = b"".join(xxhash.xxh3_64_digest(view[o:o + B]) for o in range(0, len(buf), B))
    return k, xxhash.xxh3_128_digest(buf), digests, blocks, nfiles


def encode(tree: _Tree, p: _Plan, ext_digests: bytearray, chunk_digests: bytearray,
           block_digests: bytearray, level: int = 1,
           record: dict[str, str] | None = None) -> tuple[bytes, int]:
    """Serialise to the blob format read by ``index.ManifestIndex.from_blob``; returns
    the blob and its inflated size (which the dataset info declares: a loader's cap).
    With a source ``record`` (an object store) it is format 3: the object section follows."""
    parts: list[bytes] = []

    def put(b: bytes | bytearray) -> None:
        parts.append(bytes(b))
        pad = align8(len(b)) - len(b)
        if pad:
            parts.append(b"\0" * pad)

    fmt = FORMAT_VERSION if record is None else FORMAT_OBJECTS
    header = HEADER.pack(MAGIC, fmt, p.layout.chunk_size, len(tree.mode), len(p.files),
                         len(p.chunk_len), p.extents, len(tree.names), 0, p.block_size)
    put(header)
    for name, _, _ in ENTRY_ARRAYS:
        put(getattr(tree, name).tobytes())
    put(tree.names)
    put(p.files.tobytes())
    put(p.chunk_len.tobytes())
    put(p.chunk_first_file.tobytes())
    put(ext_digests)
    put(chunk_digests)
    put(block_digests)
    if record is not None:
        put(_object_section(tree, record))
    assert [n for n, _, _ in CHUNK_ARRAYS] == ["chunk_len", "chunk_first_file"]
    return zlib.compress(b"".join(parts), level), sum(len(b) for b in parts)


def _object_section(tree: _Tree, record: dict[str, str]) -> bytes:
    """The format 3 section (model.py, "Objects")."""
    objects = tree.objects or []
    raw = json.dumps(record, sort_keys=True).encode()
    offsets = array("Q", [0])
    for i in range(len(tree.mode)):
        offsets.append(offsets[-1] + (len(objects[i]) if i < len(objects) else 0))
    out = bytearray(len(raw).to_bytes(8, "little") + raw)
    out += b"\0" * (align8(len(out)) - len(out))
    return bytes(out + offsets.tobytes() + b"".join(objects))


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

    tree = src.scan(lambda n, b: report("scan", n, 0, b, 0))
    p = plan(tree, chunk_size, min(block_size, chunk_size))
    nfiles = sum(1 for m in tree.mode if stat.S_ISREG(m))
    total_bytes = sum(tree.size[i] for i in p.files)
    log.info("scanned %s: %d entries, %d files, %d bytes, %d chunks", src.url,
             len(tree.mode), nfiles, total_bytes, len(p.chunk_len))

    ext_digests = bytearray(DIGEST_SIZE * p.extents)
    chunk_digests = bytearray(DIGEST_SIZE * len(p.chunk_len))
    stride = blocks_per_chunk(chunk_size, p.block_size) * BLOCK_DIGEST_SIZE
    block_digests = bytearray(stride * len(p.chunk_len))
    threads = threads or src.threads or 2 * (os.cpu_count() or 1)
    done_files = nfiles - len(p.files)   # empty files need no reading
    done_bytes = 0
    with ThreadPoolExecutor(threads, thread_name_prefix="kspeedfs-hash") as pool:
        window = threads * 2
        pending: deque[Future[tuple[int, bytes, list[tuple[int, bytes]], bytes, int]]] = deque()
        chunks = iter(range(len(p.chunk_len)))
        for k in chunks:
            pending.append(pool.submit(_hash_chunk, src, tree, p, k))
            if len(pending) >= window:
                break
        while pending:
            k, cd, eds, bds, nf = pending.popleft().result()
            chunk_digests[k * DIGEST_SIZE:(k + 1) * DIGEST_SIZE] = cd
            block_digests[k * stride:k * stride + len(bds)] = bds
            for e, d in eds:
                ext_digests[e * DIGEST_SIZE:(e + 1) * DIGEST_SIZE] = d
            done_files += nf
            done_bytes += p.chunk_len[k]
            report("hash", done_files, nfiles, done_bytes, p.layout.cursor)
            nxt = next(chunks, None)
            if nxt is not None:
                pending.append(pool.submit(_hash_chunk, src, tree, p, nxt))

    report("publish", nfiles, nfiles, total_bytes, total_bytes)
    blob, inflated_size = encode(tree, p, ext_digests, chunk_digests, block_digests,
                                 record=src.record())
    info = DatasetInfo(
        name=name, version=0, files=nfiles, entries=len(tree.mode), bytes=total_bytes,
        chunks=len(p.chunk_len), chunk_size=chunk_size, imported_at=0.0,
        source=src.url, inflated_size=inflated_size,
    )
    sealed = store.publish(info, blob)
    report("done", nfiles, nfiles, total_bytes, total_bytes)
    log.info("published %s v%d (%d-byte manifest)", name, sealed.version, len(blob))
    return sealed
