"""Push: verified chunks go into the kernel page cache before the reader asks for them.

Why: the kernel reads a FUSE file in READ requests of at most 128 KiB, and each one is
a trip through pyfuse3 and the trio loop — the biggest single cost of a sequential
read (docs/design.md, "The page-cache push"). A chunk the prefetcher has already loaded
and verified can instead be written straight into the file's page cache with
``FUSE_NOTIFY_STORE`` (``pyfuse3.notify_store``); when the reader gets there the pages
are up to date and the kernel sends no READ at all. Files are opened with
``keep_cache`` and the snapshot is immutable, so a pushed page stays right for the life
of the mount.

The rules, each for a reason:

- **Whole pages only.** The kernel marks a stored page up to date only if the store
  covers all of it (or ends at EOF); a chunk boundary inside a page leaves that page to
  a normal READ.
- **Never past EOF.** A store beyond the file size extends the file in the kernel.
- **From a worker thread, never the trio thread.** The store locks each page; a page
  that the kernel's readahead has locked for a READ stays locked until the daemon
  answers that READ, and the trio thread is the one that answers.
- **Best effort.** If the kernel has forgotten the inode (ENOENT) or the store fails
  otherwise, the reader simply takes the READ path; failures are counted, not raised.
"""
from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pyfuse3
import trio

from ..manifest.index import ManifestIndex

if TYPE_CHECKING:
    from ..reader import Data

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE


def page_span(index: ManifestIndex, entry: int, chunk: int) -> tuple[int, int]:
    """The file range ``[lo, hi)`` of ``entry`` that chunk ``chunk`` can fill with whole
    pages (``hi <= lo`` when there is none)."""
    base, size, c = index.data[entry], index.size[entry], index.chunk_size
    lo = max(0, chunk * c - base)
    hi = min(size, (chunk + 1) * c - base)
    lo = -(-lo // PAGE) * PAGE
    if hi != size:
        hi = hi // PAGE * PAGE
    return lo, hi


class PageCache:
    """Pushes chunks of open files into the kernel page cache (one instance per mount)."""

    def __init__(self, index: ManifestIndex, threads: int = 2,
                 store: Callable[[int, int, Any], object] = pyfuse3.notify_store) -> None:
        # store: pyfuse3.notify_store (typed for bytes, takes any buffer) or the native
        # engine's; given memoryviews of cached chunks
        self.index = index
        self.store = store          # the engine's FUSE_NOTIFY_STORE (pyfuse3's, or native's)
        self._limiter = trio.CapacityLimiter(threads)
        self._active = 0
        self._idle = threading.Condition()
        self._closed = False

    async def push(self, entry: int, chunk: int, data: Data) -> int | None:
        """Store the part of verified chunk ``chunk`` that belongs to file ``entry``; the
        bytes stored (0: no whole page to store), or None if the kernel refused."""
        lo, hi = page_span(self.index, entry, chunk)
        if hi <= lo or self._closed:
            return 0
        at = self.index.data[entry] + lo - chunk * self.index.chunk_size
        view = memoryview(data)[at:at + hi - lo]
        ok = await trio.to_thread.run_sync(self._store, entry + 1, lo, view,
                                           limiter=self._limiter, abandon_on_cancel=True)
        return hi - lo if ok else None

    def _store(self, inode: int, offset: int, view: memoryview) -> bool:
        with self._idle:
            if self._closed:
                return False
            self._active += 1
        try:
            self.store(inode, offset, view)
            return True
        except OSError as e:
            log.debug("notify_store(inode %d, %d+%d): %s", inode, offset, len(view), e)
            return False
        finally:
            with self._idle:
                self._active -= 1
                self._idle.notify_all()

    def close(self, timeout: float = 2.0) -> None:
        """No new stores; wait (bounded) for running ones, so none touches the FUSE
        session after ``pyfuse3.close`` destroys it."""
        with self._idle:
            self._closed = True
            if not self._idle.wait_for(lambda: self._active == 0, timeout):
                log.warning("%d page-cache store(s) still running at unmount", self._active)
