"""Memory for MRs: private anonymous pages, transparent huge pages when large; and
copies out of them into fresh ``bytes`` (:func:`copy_out`).

Why not ``mmap.mmap(-1, n)``: that is a *shared* anonymous mapping, i.e. shmem, which
transparent huge pages skip unless ``shmem_enabled`` says otherwise (it says "never"
here). An MR is walked by the kernel's socket copies (the soft provider) or pinned by
the HCA (verbs); with 4 KiB pages a 4 MiB READ touches 1,024 TLB entries, with a huge
page two. The soft engine's receive copy cost ~20 % less per GB with huge pages.
"""
from __future__ import annotations

import ctypes
import mmap

#: buffers of at least this size ask for transparent huge pages (best effort)
HUGE = 2 << 20
#: copies out of at least this many bytes run without the GIL (:func:`copy_out`)
COPY_OUT_NOGIL = 64 << 10

_bytes_new = ctypes.pythonapi.PyBytes_FromStringAndSize
_bytes_new.restype = ctypes.py_object
_bytes_new.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
_bytes_at = ctypes.pythonapi.PyBytes_AsString
_bytes_at.restype = ctypes.c_void_p
_bytes_at.argtypes = (ctypes.py_object,)


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


def copy_out(buf: mmap.mmap, offset: int, length: int) -> bytes:
    """``buf[offset:offset + length]`` as new bytes; from ``COPY_OUT_NOGIL`` bytes on,
    copied by ``ctypes.memmove``, which runs without the GIL. A copy that a cache keeps
    lands in pages never touched before, and faulting them in holding the GIL stalled
    every other thread of the process (docs/design.md, "Copies out of a staging slot").
    The caller keeps ``offset + length`` inside ``buf``."""
    if length < COPY_OUT_NOGIL:
        return bytes(memoryview(buf)[offset:offset + length])
    try:
        src = ctypes.c_char.from_buffer(buf, offset)
    except TypeError:                         # a read-only mapping exports no address
        return bytes(memoryview(buf)[offset:offset + length])
    out: bytes = _bytes_new(None, length)     # not yet shared: ours to fill
    ctypes.memmove(_bytes_at(out), ctypes.addressof(src), length)
    del src                                   # the export of ``buf`` ends here
    return out
