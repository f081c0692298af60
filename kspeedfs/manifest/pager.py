"""A paged manifest's raw blob at one fixed address range, filled page by page on first touch.

``PageMap`` wraps the native page map (``native/manifest_pager.h``; docs/design.md,
"Paged manifests", "The page map"): a region of the blob's size whose pages a userfaultfd
handler (C threads, never the GIL) loads from content-addressed page files when a reader
first touches them, verified by SHA-256. ``view()`` is an ordinary read-only memoryview
over it, so ``ManifestIndex`` and the C engine read it as they read a whole blob.

A page file is ``<dir>/<first two hex chars>/<SHA-256 of the inflated page, 64 lowercase
hex>``, holding one zlib stream (``zlib.compress``) of the page's bytes.

A page that no dir holds a valid copy of reads as zeros (so its reader is not stuck
forever) and sets ``failure`` for good; whoever reads through the map checks ``failure``
after reading and fails closed. At most ``max(1, cache_bytes // page_size)`` pages stay
filled: the oldest-filled is dropped, and faults again when touched.

Not for a forked child: there the mapping is gone (touching it is SIGSEGV) and every
method but ``close`` raises RuntimeError.
"""
from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Sequence
from typing import Any

from .pages import HASH_SIZE, page_count, page_path

__all__ = ["HASH_LEN", "MAX_THREADS", "PageMap", "page_count", "page_path"]

try:
    from . import _pager  # type: ignore[attr-defined]  # the C extension: no stubs
except ImportError as e:  # a checkout whose native code was not built
    _pager = None
    _IMPORT_ERROR = str(e)
else:
    _IMPORT_ERROR = ""

#: bytes of one page's hash (SHA-256)
HASH_LEN = HASH_SIZE
#: the most handler threads one map may have (native/manifest_pager.h MP_MAX_THREADS)
MAX_THREADS = 64


class PageMap:
    """The raw blob of ``size`` bytes, cut into ``page_size`` pages whose SHA-256s are
    ``hashes`` (32 bytes each, in page order), loaded on first touch from ``dirs`` (in
    order), at most ``cache_bytes`` of them kept, by ``threads`` handler threads. With
    ``ask`` (the host's node's ask socket, ``cluster/page_copy.py``), a page no dir
    holds is asked of the node, which writes it to ``dirs[0]`` (each step of the ask
    bounded by ``ask_ms``), then the dirs are tried again.

    ValueError for arguments out of range; OSError when userfaultfd cannot be used here
    (nor in user-mode-only form) or the native code is not built: the caller then loads
    the whole manifest instead.
    """

    def __init__(self, size: int, page_size: int, hashes: bytes, dirs: Sequence[str],
                 cache_bytes: int, threads: int = 2, ask: str | None = None,
                 ask_ms: int = 10_000) -> None:
        if size <= 0:
            raise ValueError(f"size must be > 0, not {size}")
        if page_size < mmap.PAGESIZE or page_size % mmap.PAGESIZE:
            raise ValueError(f"page_size {page_size}: not a multiple of {mmap.PAGESIZE}")
        want = HASH_LEN * page_count(size, page_size)
        if len(hashes) != want:
            raise ValueError(f"hashes: {len(hashes)} bytes, not {want} "
                             f"({HASH_LEN} per page of {page_size})")
        if isinstance(dirs, str | bytes) or not dirs:
            raise ValueError("dirs: a non-empty sequence of directories")
        if cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0, not {cache_bytes}")
        if not 1 <= threads <= MAX_THREADS:
            raise ValueError(f"threads {threads}: not in 1..{MAX_THREADS}")
        if _pager is None:
            raise OSError(errno.EOPNOTSUPP, f"the page map is not built ({_IMPORT_ERROR}); "
                          "run `python setup.py build_ext --inplace`")
        self.size = size
        self.page_size = page_size
        self._map: Any = _pager.PageMap(size, page_size, bytes(hashes),
                                        [os.fspath(d) for d in dirs], cache_bytes, threads,
                                        ask, ask_ms)

    def view(self) -> memoryview:
        """A read-only memoryview (format 'B', ``size`` bytes) over the region; close()
        refuses while one is alive (release it, or let it go)."""
        return memoryview(self._map)

    @property
    def failure(self) -> str | None:
        """The first page that could not be loaded, on one line (index and hash, and each
        dir's reason), or None; once set it stays."""
        f: str | None = self._map.failure
        return f

    @property
    def native(self) -> Any:
        """The C object: the FUSE engine takes it through the capsule
        ``kspeedfs.manifest._pager._C_API`` (manifest_pager.h, ``struct mp_capi``)."""
        return self._map

    @property
    def address(self) -> int:
        """The ``struct mp *`` (manifest_pager.h), for C that checks ``mp_failed``."""
        a: int = self._map.address
        return a

    def stats(self) -> dict[str, int]:
        """Counters: faults (fault messages), fills (pages loaded and verified), evictions,
        resident_pages, failures (pages that read as zeros), fill_ns (their wall time in
        total, fault message to copied), asks (pages asked of the node), user_mode_only
        (1: kernel-mode reads of a page not yet loaded get EFAULT); and the handlers' CPU
        time in a fill's parts: read_ns, inflate_ns, sha_ns, copy_ns."""
        st: dict[str, int] = self._map.stats()
        return st

    @property
    def closed(self) -> bool:
        c: bool = self._map.closed
        return c

    def close(self) -> None:
        """Stop the handler threads and unmap; idempotent. BufferError while a view is
        alive (as mmap's close)."""
        self._map.close()

    def __enter__(self) -> PageMap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
