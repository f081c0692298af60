"""Memory for MRs: private anonymous pages, transparent huge pages when large.

Why not ``mmap.mmap(-1, n)``: that is a *shared* anonymous mapping, i.e. shmem, which
transparent huge pages skip unless ``shmem_enabled`` says otherwise (it says "never"
here). An MR is walked by the kernel's socket copies (the soft provider) or pinned by
the HCA (verbs); with 4 KiB pages a 4 MiB READ touches 1,024 TLB entries, with a huge
page two. The soft engine's receive copy cost ~20 % less per GB with huge pages.
"""
from __future__ import annotations

import mmap
import os

#: buffers of at least this size ask for transparent huge pages (best effort)
HUGE = 2 << 20


def anonymous(length: int) -> mmap.mmap:
    """``length`` zeroed bytes of private anonymous memory, huge pages advised if large
    (before first touch, so the faults can be served by huge pages)."""
    buf = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if length >= HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:          # THP disabled or unsupported: plain pages
            pass
    return buf


def shared_file(path: str, length: int) -> tuple[mmap.mmap, bool]:
    """``length`` bytes of a file (``MAP_SHARED``, so what is written outlives this
    process: a node's arena in /dev/shm survives its restart), and whether its content
    was kept (the file existed with this length; else it is made and zeroed). Huge pages
    are asked for, but shmem gets them only where ``shmem_enabled`` allows."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        kept = os.fstat(fd).st_size == length
        if not kept:
            os.ftruncate(fd, 0)
            os.ftruncate(fd, length)
        buf = mmap.mmap(fd, length, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    if length >= HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return buf, kept
