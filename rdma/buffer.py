"""Memory for MRs: private anonymous pages, transparent huge pages when large.

Why not ``mmap.mmap(-1, n)``: that is a *shared* anonymous mapping, i.e. shmem, which
transparent huge pages skip unless ``shmem_enabled`` says otherwise (it says "never"
here). An MR is walked by the kernel's socket copies (the soft provider) or pinned by
the HCA (verbs); with 4 KiB pages a 4 MiB READ touches 1,024 TLB entries, with a huge
page two. The soft engine's receive copy cost ~20 % less per GB with huge pages.
"""
from __future__ import annotations

import mmap

#: buffers of at least this size ask for transparent huge pages (best effort)
HUGE = 2 << 20


def anonymous(length: int) -> mmap.mmap:
    """``length`` zeroed bytes of private anonymous memory, huge pages advised if large
    (before first touch, so the faults can be served by huge pages)."""
    buf = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advise_huge(buf)
    return buf


def advise_huge(buf: mmap.mmap) -> None:
    """Ask for transparent huge pages for a large mapping (best effort: shmem gets them
    only where ``shmem_enabled`` allows)."""
    if len(buf) >= HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:          # THP disabled or unsupported: plain pages
            pass
