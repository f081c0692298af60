"""The manifest: an immutable snapshot of a source tree laid out in chunks.

Why this shape
--------------
A mount must answer lookup/getattr/readdir/read for 10^6-10^7 files from memory,
without a store round trip and without a Python object per file (a dict per entry
costs ~500 B; 10^7 files would be 5 GB). So the manifest is a handful of flat,
little-endian arrays, one slot per entry, and the serialised blob *is* the in-memory
form: loading is a zlib inflate plus zero-copy ``memoryview.cast`` (see index.py).

Entries
    Numbered 0..E-1 in breadth-first order, root = 0, so the children of every
    directory are one contiguous, name-sorted run: ``lookup`` is a binary search,
    ``readdir`` streams a range by offset, and the FUSE inode is ``entry + 1``.
    Per entry: parent, mode, uid, gid, size, mtime_ns, name (offset/length into one
    names blob; names are bytes, any valid file name works), ``data`` and ``ext``:

    =========  ================================  ================================
    kind       data                              ext / size
    =========  ================================  ================================
    directory  index of the first child          size = number of children
    file       offset in the dataset layout      ext = index of its first extent
    symlink    offset of the target in names     size = target length
    =========  ================================  ================================

Layout and chunks
    All file bytes form one linear address space cut into fixed-size chunks
    (default 4 MiB). Files are placed in entry order (so one directory's files are
    neighbours). A file smaller than a chunk never straddles a chunk boundary (it
    moves to the next chunk instead), so a million 100 KB JPEGs become ~25k chunks
    and any small file is served by a single chunk; a file of a chunk or more starts
    on a boundary and spans ceil(size/chunk) chunks. Gaps are zeros. Chunk k is
    bytes [k*C, k*C + chunk_len[k]) of that space.

Extents and checksums
    An extent is the part of one file inside one chunk. Every extent carries the
    xxh3-128 of its bytes, and every chunk the xxh3-128 of its whole content.
    xxh3-128 rather than xxh3-64: the chunk digest is also the chunk's cache key
    (content-addressed, shared across versions and datasets in the cache tiers and,
    later, across nodes), and 64 bits give a birthday collision at ~4*10^9 keys,
    which a large fleet's cache can approach; 128 bits cost the same on x86-64
    (both ~8 GB/s per core here) and 8 more bytes per extent.
    Extents verify bytes read from the *source* (and name the file that changed);
    chunk digests verify bytes from a cache tier or a peer in one pass.

Blocks (format 2)
    Every chunk is also cut into fixed blocks (``block_size``, default 128 KiB, the
    kernel's largest FUSE read; the last block of a chunk may be shorter), each with an
    xxh3-64 of its bytes, stored at a fixed stride of ceil(chunk_size/block_size) per
    chunk. They exist for random reads: without them a 4 KiB read that misses has to
    load and verify its whole 4 MiB chunk; with them it loads one block from the source
    or a peer and checks just that (docs/benchmarks.md, "Random reads with block
    digests").
    64 bits rather than 128: a block digest only proves integrity (the chunk digest stays
    the cache key), an undetected corruption needs a 2^-64 accident, and the array costs
    8 bytes per block (64 MB per TB of data at 128 KiB, held by every mount).
    Format 1 manifests (no blocks) still load; their random reads load whole chunks.

Objects (format 3)
    A dataset imported from an object store (``s3://``, ``gs://``, ``az://``) is format 2
    plus one section after the block digests: the source record, a JSON object (``url``,
    ``endpoint``, and ``region`` for S3, ``account`` for Azure, ``emulator`` for a GCS
    emulator; never a credential), then per entry the object's identity at import,
    ``etag`` NUL ``version_id`` (S3's VersionId, empty when the bucket is not versioned;
    GCS's generation; Azure's version id, empty when the account keeps none; nothing
    for directories), as ``entries + 1`` offsets into one bytes blob. Size and
    last-modified are the entry's ``size`` and ``mtime_ns``. The origin pins every
    ranged GET to the recorded ETag (and version), so an object overwritten after import
    is a ``SourceChanged``, never a wrong byte. Directory imports stay format 2, so a
    mount from before format 3 still reads them.
"""
from __future__ import annotations

import stat
import struct
from dataclasses import dataclass

MAGIC = b"KSPM"
FORMAT_VERSION = 2
FORMAT_OBJECTS = 3       # format 2 + the object section (an object-store source)
FORMATS = (1, 2, 3)      # formats a mount can read (1: no block digests)
DIGEST_SIZE = 16
BLOCK_DIGEST_SIZE = 8    # xxh3-64 per block
NAME_MAX = 255

# Per-entry arrays: (attribute, array typecode, bytes per item). Order is the blob order.
ENTRY_ARRAYS: tuple[tuple[str, str, int], ...] = (
    ("parent", "I", 4),
    ("mode", "I", 4),
    ("uid", "I", 4),
    ("gid", "I", 4),
    ("size", "Q", 8),
    ("mtime_ns", "q", 8),
    ("name_off", "Q", 8),
    ("name_len", "H", 2),
    ("data", "Q", 8),
    ("ext", "I", 4),
)
# Per-chunk arrays.
CHUNK_ARRAYS: tuple[tuple[str, str, int], ...] = (
    ("chunk_len", "I", 4),
    ("chunk_first_file", "I", 4),   # index into ``files`` of the first file in the chunk
)
# header: magic, format, chunk_size, entries, files, chunks, extents, names_len, version,
# block_size (0 in format 1)
HEADER = struct.Struct("<4sIQQQQQQQQ")


def is_dir(mode: int) -> bool:
    return stat.S_ISDIR(mode)


def is_file(mode: int) -> bool:
    return stat.S_ISREG(mode)


def is_symlink(mode: int) -> bool:
    return stat.S_ISLNK(mode)


def align8(n: int) -> int:
    return (n + 7) & ~7


@dataclass(frozen=True)
class Extent:
    """The part of one file inside one chunk."""

    entry: int          # file entry index
    chunk: int          # chunk index
    file_offset: int    # where the extent starts in the file
    chunk_offset: int   # where it starts in the chunk
    length: int
    digest: bytes       # xxh3-128 of the extent's bytes


MAX_CHUNK = 1 << 30


def check_header(fmt: int, chunk_size: int, block_size: int, entries: int) -> None:
    """Refuse a header whose geometry no importer writes (``ManifestCorrupt``), at load,
    before a mount serves it: chunk_size 0 used to mount and then fail every read."""
    from ..errors import ManifestCorrupt

    if not 4096 <= chunk_size <= MAX_CHUNK:
        raise ManifestCorrupt(f"manifest chunk_size {chunk_size} is not in 4KiB..1GiB")
    if fmt >= 2 and not 512 <= block_size <= chunk_size:
        raise ManifestCorrupt(f"manifest block_size {block_size} is not in 512..chunk_size")
    if entries < 1:
        raise ManifestCorrupt("manifest has no root directory (0 entries)")


def block_key(chunk_key: bytes, block: int) -> bytes:
    """Memory-tier key of a block: the chunk's key plus the block number (a chunk key is
    16 bytes, so the two never meet)."""
    return chunk_key + block.to_bytes(4, "little")


def blocks_per_chunk(chunk_size: int, block_size: int) -> int:
    """The stride of the block digest array (0 when there are no blocks)."""
    return -(-chunk_size // block_size) if block_size else 0


class Layout:
    """Chunk arithmetic over the linear dataset address space."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.cursor = 0

    def place(self, size: int) -> int:
        """Offset for the next file of ``size`` bytes (see the module docstring)."""
        c = self.chunk_size
        pos = self.cursor % c
        if size and pos and (size >= c or pos + size > c):
            self.cursor += c - pos
        offset = self.cursor
        self.cursor += size
        return offset

    def chunk_span(self, offset: int, size: int) -> range:
        """Chunks a file at ``offset`` of ``size`` bytes covers (empty for size 0)."""
        if size == 0:
            return range(0)
        return range(offset // self.chunk_size, (offset + size - 1) // self.chunk_size + 1)

    @property
    def chunks(self) -> int:
        return (self.cursor + self.chunk_size - 1) // self.chunk_size
