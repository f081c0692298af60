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
  its table. A page directory (a shared filesystem, a bucket, a node's copy) can
  withhold a page but never change one.
* Writing (:class:`PageWriter`) takes the importer's stream in pieces: memory is one page
  (and those in flight to a bucket). Pages are immutable and shared between versions
  that have them in common. It writes into a :class:`PageStore`: a directory
  (:class:`PageDirectory`) or a bucket prefix (``objstore/pages.py``), the same names in
  both; :func:`read_page` and :func:`sweep` take either too.
* Reading: :func:`read_table` loads the data pages' hashes (32 bytes per 64 KiB: 5 MB at
  10^8 entries); the mount then maps the raw bytes with ``pager.PageMap``, which fills
  a page on first touch (``native/manifest_pager.c``), or, where userfaultfd is not
  available, :func:`read_all` loads every page up front.

docs/design.md, "Paged manifests", has the figures.
"""
from __future__ import annotations

import errno
import hashlib
import os
import secrets
import stat
import struct
import time
import zlib
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from ..errors import KspeedfsError, ManifestCorrupt

ROOT_MAGIC = b"KSPR"
ROOT_FORMAT = 1
PAGE_SIZE = 64 << 10
HASH_SIZE = 32
# magic, format, page size, raw size, data pages, table pages
ROOT_HEADER = struct.Struct("<4sIIQQI")
MIN_PAGE, MAX_PAGE = 4096, 1 << 20
#: a stored page's bytes at most: zlib's bound for a MAX_PAGE page is well under it
FILE_MAX = 2 * MAX_PAGE


def is_root(blob: bytes | memoryview) -> bool:
    """A paged manifest's root, not a whole (zlib) one: zlib streams start 0x78."""
    return bytes(blob[:4]) == ROOT_MAGIC


def page_count(size: int, page_size: int) -> int:
    """Pages of ``size`` bytes: the last may be short."""
    return -(-size // page_size)


def page_name(digest: bytes) -> str:
    """A page's name below its directory or bucket prefix: ``<hh>/<SHA-256 hex>``."""
    h = digest.hex()
    return f"{h[:2]}/{h}"


def parse_page_name(name: str) -> bytes | None:
    """A name :func:`page_name` gives → the hash; None for any other name."""
    hh, sep, h = name.partition("/")
    if not sep or len(h) != 2 * HASH_SIZE or hh != h[:2] or h.lower() != h:
        return None
    try:
        return bytes.fromhex(h)
    except ValueError:
        return None


def page_path(directory: str, digest: bytes) -> str:
    return os.path.join(directory, page_name(digest))


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


class PageStore(Protocol):
    """Where pages are kept, each under its content address ``<hh>/<SHA-256 hex>`` (one
    zlib stream): a directory (:class:`PageDirectory`) or a bucket prefix
    (``objstore/pages.py``). Every call blocks; errors are ``OSError`` or
    ``KspeedfsError`` (one line)."""

    where: str             # for messages: the directory, or the bucket URL

    def get(self, digest: bytes, limit: int) -> bytes | None:
        """The page's stored bytes (untrusted: verify them), None when it holds none of at
        most ``limit`` bytes."""

    def has(self, digest: bytes) -> bool:
        """Whether it holds the page, and then that the page counts as new for a sweep's
        grace (a writer reusing a page keeps it from being swept under it)."""

    def put(self, digest: bytes, data: bytes) -> None:
        """Store a page's zlib stream (verified by the caller), whole or not at all."""

    def listing(self) -> Iterator[tuple[str, bytes | None, float]]:
        """(name, the page's hash, when last written) of each page held, and of each
        writer's leftover (hash None) that :meth:`remove` may delete; nothing else."""

    def remove(self, name: str) -> None:
        """Delete an entry :meth:`listing` gave."""


class PageDirectory:
    """:class:`PageStore` in a directory (``store.pages``, a node's copy): write-then-rename,
    an existing page's mtime touched when a writer reuses it."""

    def __init__(self, directory: str) -> None:
        self.directory = self.where = directory

    def get(self, digest: bytes, limit: int) -> bytes | None:
        return read_file(page_path(self.directory, digest), limit)

    def has(self, digest: bytes) -> bool:
        try:
            os.utime(page_path(self.directory, digest))
            return True
        except FileNotFoundError:
            return False

    def put(self, digest: bytes, data: bytes) -> None:
        put_page(self.directory, digest, data)

    def listing(self) -> Iterator[tuple[str, bytes | None, float]]:
        for sub in os.scandir(self.directory) if os.path.isdir(self.directory) else ():
            if not sub.is_dir(follow_symlinks=False) or len(sub.name) != 2:
                continue
            for f in os.scandir(sub.path):
                try:
                    digest: bytes | None = bytes.fromhex(f.name)
                except ValueError:
                    digest = None
                    if not f.name.endswith(".tmp"):
                        continue                # not ours
                yield f.path, digest, f.stat(follow_symlinks=False).st_mtime

    def remove(self, name: str) -> None:
        os.unlink(name)


def page_store(where: str | PageStore) -> PageStore:
    """A directory's :class:`PageDirectory`, or ``where`` itself."""
    return PageDirectory(where) if isinstance(where, str) else where


def read_file(path: str, limit: int) -> bytes | None:
    """A page file's bytes, or None when missing, not a regular file or over ``limit``
    (``O_NONBLOCK``: a FIFO under a page's name cannot block the reader)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ELOOP, errno.ENXIO):
            return None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        return f.read(limit + 1)


class PageWriter:
    """Cuts a stream of raw manifest bytes into pages in ``sink`` (a directory or any
    :class:`PageStore`); :meth:`finish` writes the table pages and returns the root blob.
    Pages the sink has (:meth:`PageStore.has`) are not written again. Memory: one page,
    plus ``workers - 1`` being written (a bucket's PUTs overlap; a directory's need not)."""

    def __init__(self, sink: str | PageStore, page_size: int = PAGE_SIZE, level: int = 1,
                 workers: int = 1) -> None:
        self.sink, self.page_size, self.level = page_store(sink), page_size, level
        self._buf = bytearray()
        self._hashes = bytearray()
        self.raw_size = 0
        self.stored = 0      # bytes written to the sink (pages it already had: 0)
        self.workers = workers
        self._pool = ThreadPoolExecutor(workers - 1) if workers > 1 else None
        self._inflight: deque[Future[int]] = deque()

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
        try:
            if self._buf or not self.raw_size:
                self._flush()
            pages = len(self._hashes) // HASH_SIZE
            hashes = bytes(self._hashes)
            tables = []
            for at in range(0, len(hashes), self.page_size):
                tables.append(self._store(hashes[at:at + self.page_size]))
            self._drain(0)
        finally:
            self.close()
        root = Root(self.page_size, self.raw_size, pages, tuple(tables))
        return root.encode()

    def close(self) -> None:
        """Stop the writer's threads, dropping pages not yet written (a failed stream's
        pages are unreferenced: the sweep takes them). Idempotent; :meth:`finish` calls it."""
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)

    def _flush(self) -> None:
        self._hashes += self._store(bytes(self._buf))
        self._buf.clear()

    def _store(self, page: bytes) -> bytes:
        digest = hashlib.sha256(page).digest()
        if self._pool is None:
            self.stored += self._keep(digest, page)
        else:
            self._drain(self.workers - 2)
            self._inflight.append(self._pool.submit(self._keep, digest, page))
        return digest

    def _drain(self, left: int) -> None:
        """Wait for pages being written until at most ``left`` are (their errors raise)."""
        while len(self._inflight) > max(left, 0):
            self.stored += self._inflight.popleft().result()

    def _keep(self, digest: bytes, page: bytes) -> int:
        if self.sink.has(digest):                # shared: fresh again for sweep's grace
            return 0
        data = zlib.compress(page, self.level)
        self.sink.put(digest, data)
        return len(data)


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


def write_pages(pieces: Iterable[bytes | bytearray | memoryview], sink: str | PageStore,
                page_size: int = PAGE_SIZE, workers: int = 1) -> tuple[bytes, int]:
    """Write the pages of a raw manifest; returns (root blob, bytes newly stored)."""
    w = PageWriter(sink, page_size, workers=workers)
    try:
        for piece in pieces:
            w.feed(piece)
        return w.finish(), w.stored
    finally:
        w.close()


def read_page(dirs: Sequence[str | PageStore], digest: bytes, length: int) -> bytes:
    """One page, inflated and verified, from the first directory (or other
    :class:`PageStore`) that has it whole; ``ManifestCorrupt`` naming it when none does."""
    why = "in no page directory"
    for d in map(page_store, dirs):
        try:
            data = d.get(digest, FILE_MAX)
            if data is None:
                continue
            return inflate_page(data, digest, length)
        except (OSError, KspeedfsError) as e:
            why = f"unreadable in {d.where}: {e}"
        except ValueError as e:
            why = f"corrupt in {d.where}: {e}"
    raise ManifestCorrupt(f"manifest page {digest.hex()} is {why}")


def table_pages(root: Root) -> list[tuple[bytes, int]]:
    """(hash, length) of each table page of ``root``: all full but the last."""
    total = root.pages * HASH_SIZE
    return [(digest, min(root.page_size, total - i * root.page_size))
            for i, digest in enumerate(root.tables)]


def read_table(root: Root, dirs: Sequence[str | PageStore]) -> bytes:
    """The SHA-256 of every data page, in order (from the verified table pages)."""
    return b"".join(read_page(dirs, digest, n) for digest, n in table_pages(root))


def read_all(root: Root, hashes: bytes, dirs: Sequence[str | PageStore]) -> bytes:
    """Every page, verified: the raw manifest whole (where pages cannot be mapped)."""
    return b"".join(read_page(dirs, hashes[i * HASH_SIZE:(i + 1) * HASH_SIZE], root.page_len(i))
                    for i in range(root.pages))


def referenced(root: Root, dirs: Sequence[str | PageStore]) -> set[bytes]:
    """Every page a root needs, tables included (for sweeping unreferenced pages)."""
    hashes = read_table(root, dirs)
    return set(root.tables) | {hashes[i:i + HASH_SIZE] for i in range(0, len(hashes), HASH_SIZE)}


def sweep(pages: str | PageStore, keep: set[bytes], grace: float) -> int:
    """Delete the pages in ``pages`` (a directory or a bucket's) that no kept root needs
    and that nothing wrote or reused for ``grace`` seconds (an import in progress writes
    and touches its pages before its root is published), and writers' leftovers as old (a
    writer that crashed between its write and its rename); returns how many went."""
    gone, now, store = 0, time.time(), page_store(pages)
    for name, digest, mtime in store.listing():
        if digest in keep or now - mtime < grace:
            continue
        store.remove(name)
        gone += 1
    return gone
