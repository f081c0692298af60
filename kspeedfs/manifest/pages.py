"""Paged manifests: the raw manifest cut into content-addressed pages under a small root.

A manifest of 10^7-10^8 entries is 1-10 GB inflated; no store should carry it whole and
no mount should hold it whole. So past ``store.paged_above`` bytes the importer's output
(the same raw bytes ``index.ManifestIndex`` reads, model.py's layout) is cut into fixed
pages, and what the store keeps as the version's blob is the *root*:

```
store blob (signed record: size, xxh3, SHA-256)   page directory (<dir>/<hh>/<sha256 hex>)
┌────────────────────────────────────┐
│ root: KSPR, page size, raw size,   │──► table page 0 ──► data page 0 ... 2047
│ pages, SHA-256 of each table page  │──► table page 1 ──► data page 2048 ...
└────────────────────────────────────┘    (a table page: the SHA-256 of each data page)
```

* A page is ``page_size`` bytes of the raw manifest (the last one shorter), stored
  zlib'd in a file named by the SHA-256 of its inflated bytes; a table page holds
  ``page_size / 32`` data-page hashes. A page number is an offset divided by the page
  size, never a search.
* Trust flows from the store's record: the root blob is verified against the record's
  SHA-256 (signed in etcd), each table page against the root, each data page against
  its table. A page directory (a shared filesystem, a node's copy) can withhold a page
  but never change one.
* Writing (:class:`PageWriter`) takes the importer's stream in pieces: memory is one page.
  Pages are immutable and shared between versions that have them in common.
* Reading: :func:`read_table` loads the data pages' hashes (32 bytes per 64 KiB: 5 MB at
  10^8 entries); the mount then maps the raw bytes with ``pager.PageMap``, which fills
  a page on first touch (``native/manifest_pager.c``), or, where userfaultfd is not
  available, :func:`read_all` loads every page up front.

docs/design.md, "Paged manifests", has the figures.
"""
from __future__ import annotations

import hashlib
import os
import secrets
import struct
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import ManifestCorrupt

ROOT_MAGIC = b"KSPR"
ROOT_FORMAT = 1
PAGE_SIZE = 64 << 10
HASH_SIZE = 32
# magic, format, page size, raw size, data pages, table pages
ROOT_HEADER = struct.Struct("<4sIIQQI")
MIN_PAGE, MAX_PAGE = 4096, 1 << 20


def is_root(blob: bytes | memoryview) -> bool:
    """A paged manifest's root, not a whole (zlib) one: zlib streams start 0x78."""
    return bytes(blob[:4]) == ROOT_MAGIC


def page_count(size: int, page_size: int) -> int:
    """Pages of ``size`` bytes: the last may be short."""
    return -(-size // page_size)


def page_path(directory: str, digest: bytes) -> str:
    h = digest.hex()
    return os.path.join(directory, h[:2], h)


@dataclass(frozen=True)
class Root:
    """A parsed root: the geometry and the table pages' hashes."""

    page_size: int
    raw_size: int
    pages: int
    tables: tuple[bytes, ...]

    @property
    def per_table(self) -> int:
        return self.page_size // HASH_SIZE

    def page_len(self, page: int) -> int:
        return min(self.page_size, self.raw_size - page * self.page_size)

    def encode(self) -> bytes:
        return ROOT_HEADER.pack(ROOT_MAGIC, ROOT_FORMAT, self.page_size, self.raw_size,
                                self.pages, len(self.tables)) + b"".join(self.tables)

    @classmethod
    def parse(cls, blob: bytes | memoryview) -> Root:
        """Untrusted bytes → a root whose counts agree with each other, or
        ``ManifestCorrupt``."""
        blob = bytes(blob)
        try:
            magic, fmt, page_size, raw_size, pages, ntables = ROOT_HEADER.unpack_from(blob)
        except struct.error:
            raise ManifestCorrupt("manifest root truncated") from None
        if magic != ROOT_MAGIC or fmt != ROOT_FORMAT:
            raise ManifestCorrupt(f"not a manifest root (magic {magic!r}, format {fmt})")
        if not MIN_PAGE <= page_size <= MAX_PAGE or page_size & (page_size - 1):
            raise ManifestCorrupt(f"manifest root: page size {page_size} is not a power of 2 "
                                  f"in {MIN_PAGE}..{MAX_PAGE}")
        if raw_size < 1 or pages != page_count(raw_size, page_size):
            raise ManifestCorrupt(f"manifest root: {pages} pages for {raw_size} bytes")
        if ntables != page_count(pages * HASH_SIZE, page_size):
            raise ManifestCorrupt(f"manifest root: {ntables} table pages for {pages} pages")
        if len(blob) != ROOT_HEADER.size + HASH_SIZE * ntables:
            raise ManifestCorrupt(f"manifest root is {len(blob)} bytes, expected "
                                  f"{ROOT_HEADER.size + HASH_SIZE * ntables}")
        at = ROOT_HEADER.size
        tables = tuple(blob[at + i * HASH_SIZE:at + (i + 1) * HASH_SIZE] for i in range(ntables))
        return cls(page_size, raw_size, pages, tables)


class PageWriter:
    """Cuts a stream of raw manifest bytes into pages in ``directory``; :meth:`finish`
    writes the table pages and returns the root blob. Memory: one page."""

    def __init__(self, directory: str, page_size: int = PAGE_SIZE, level: int = 1) -> None:
        self.directory, self.page_size, self.level = directory, page_size, level
        self._buf = bytearray()
        self._hashes = bytearray()
        self.raw_size = 0
        self.stored = 0      # bytes written to the directory (pages it already had: 0)

    def feed(self, piece: bytes | bytearray | memoryview) -> None:
        view = memoryview(piece).cast("B")
        self.raw_size += len(view)
        while len(view):
            take = min(len(view), self.page_size - len(self._buf))
            self._buf += view[:take]
            view = view[take:]
            if len(self._buf) == self.page_size:
                self._flush()

    def finish(self) -> bytes:
        if self._buf or not self.raw_size:
            self._flush()
        pages = len(self._hashes) // HASH_SIZE
        hashes = bytes(self._hashes)
        tables = []
        for at in range(0, len(hashes), self.page_size):
            tables.append(self._store(hashes[at:at + self.page_size]))
        root = Root(self.page_size, self.raw_size, pages, tuple(tables))
        return root.encode()

    def _flush(self) -> None:
        self._hashes += self._store(bytes(self._buf))
        self._buf.clear()

    def _store(self, page: bytes) -> bytes:
        digest = hashlib.sha256(page).digest()
        try:
            os.utime(page_path(self.directory, digest))  # shared: fresh again for sweep's grace
        except FileNotFoundError:
            data = zlib.compress(page, self.level)
            put_page(self.directory, digest, data)
            self.stored += len(data)
        return digest


def put_page(directory: str, digest: bytes, data: bytes) -> None:
    """Write one page file (``data``: its zlib stream, already verified by the caller)
    under its content address, by write-then-rename: readers see a whole page or none."""
    path = page_path(directory, digest)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # a name of its own per write: a node's fill and a mount's ask may write one page at
    # once from two threads, and a shared name would let one rename the other's half
    tmp = f"{path}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def inflate_page(data: bytes, digest: bytes, length: int) -> bytes:
    """A page file's bytes (untrusted: any directory, any peer) → the page, inflated and
    verified; ``ValueError`` saying why not (not zlib, not ``length`` bytes, trailing
    bytes, another SHA-256). Inflates at most ``length + 1`` bytes: no bomb."""
    z = zlib.decompressobj()
    try:
        page = z.decompress(data, length + 1)
    except zlib.error as e:
        raise ValueError(f"not a zlib stream ({e})") from None
    if len(page) != length or not z.eof or z.unused_data or z.unconsumed_tail:
        raise ValueError(f"not one zlib stream of {length} bytes")
    if hashlib.sha256(page).digest() != digest:
        raise ValueError("its SHA-256 differs")
    return page


def write_pages(pieces: Iterable[bytes | bytearray | memoryview], directory: str,
                page_size: int = PAGE_SIZE) -> tuple[bytes, int]:
    """Write the pages of a raw manifest; returns (root blob, bytes newly stored)."""
    w = PageWriter(directory, page_size)
    for piece in pieces:
        w.feed(piece)
    return w.finish(), w.stored


def read_page(dirs: Sequence[str], digest: bytes, length: int) -> bytes:
    """One page, inflated and verified, from the first directory that has it whole;
    ``ManifestCorrupt`` naming it when none does."""
    why = "in no page directory"
    for d in dirs:
        try:
            with open(page_path(d, digest), "rb") as f:
                return inflate_page(f.read(), digest, length)
        except FileNotFoundError:
            continue
        except OSError as e:
            why = f"unreadable in {d}: {e}"
        except ValueError as e:
            why = f"corrupt in {d}: {e}"
    raise ManifestCorrupt(f"manifest page {digest.hex()} is {why}")


def table_pages(root: Root) -> list[tuple[bytes, int]]:
    """(hash, length) of each table page of ``root``: all full but the last."""
    total = root.pages * HASH_SIZE
    return [(digest, min(root.page_size, total - i * root.page_size))
            for i, digest in enumerate(root.tables)]


def read_table(root: Root, dirs: Sequence[str]) -> bytes:
    """The SHA-256 of every data page, in order (from the verified table pages)."""
    return b"".join(read_page(dirs, digest, n) for digest, n in table_pages(root))


def read_all(root: Root, hashes: bytes, dirs: Sequence[str]) -> bytes:
    """Every page, verified: the raw manifest whole (where pages cannot be mapped)."""
    return b"".join(read_page(dirs, hashes[i * HASH_SIZE:(i + 1) * HASH_SIZE], root.page_len(i))
                    for i in range(root.pages))


def referenced(root: Root, dirs: Sequence[str]) -> set[bytes]:
    """Every page a root needs, tables included (for sweeping unreferenced pages)."""
    hashes = read_table(root, dirs)
    return set(root.tables) | {hashes[i:i + HASH_SIZE] for i in range(0, len(hashes), HASH_SIZE)}


def sweep(directory: str, keep: set[bytes], grace: float) -> int:
    """Delete the pages in ``directory`` that no kept root needs and that nothing wrote or
    reused for ``grace`` seconds (an import in progress writes and touches its pages
    before its root is published), and writers' temporary files as old (a writer that
    crashed between its write and its rename); returns how many went."""
    gone, now = 0, time.time()
    for sub in os.scandir(directory) if os.path.isdir(directory) else ():
        if not sub.is_dir(follow_symlinks=False) or len(sub.name) != 2:
            continue
        for f in os.scandir(sub.path):
            try:
                digest: bytes | None = bytes.fromhex(f.name)
            except ValueError:
                digest = None
                if not f.name.endswith(".tmp"):
                    continue                # not ours
            if digest in keep or now - f.stat(follow_symlinks=False).st_mtime < grace:
                continue
            os.unlink(f.path)
            gone += 1
    return gone
