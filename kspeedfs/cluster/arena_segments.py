"""The arena's memory as segments: one file (or memfd) each, mapped as one range.

A node hands a local process the segments of a dataset it may read (``grant.py``), so
each segment needs an fd of its own; peers READ the arena as one registered region,
addressed slot × slot_size, so the segments must also be one contiguous mapping::

    reserve  mmap(NULL, total, RW, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE)  (an mmap.mmap)
    segment  mmap(base + offset_i, length_i, RW, MAP_SHARED|MAP_FIXED, fd_i, 0)   (libc)

Python's ``mmap`` has no ``MAP_FIXED``, so the segments go over the reservation through
libc (``ctypes``); the reservation's ``mmap.mmap`` object stays the owner of the whole
range: its buffer is what the vMR registers, and closing it unmaps every segment.

A read-only fd of segment i (:meth:`SegmentMemory.readonly`) is a new open of the same
file through ``/proc/self/fd`` with ``O_RDONLY``: the receiver can map it ``PROT_READ``
only (a ``MAP_SHARED`` ``PROT_WRITE`` mapping of it fails with EACCES), cannot
``ftruncate`` it, and cannot reopen it writable, because a segment is mode 0600 and
owned by the node's user (a memfd is made so with ``fchmod``: it is created 0777).
"""
from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os

from .arena import Geometry

log = logging.getLogger(__name__)

_MAP_FIXED = 0x10              # (Linux; Python's mmap module has neither constant)
_MAP_NORESERVE = 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]


def _address(buf: mmap.mmap) -> int:
    """The first byte's address of ``buf`` (the buffer export is released at once, so
    ``buf`` can still be closed)."""
    view = (ctypes.c_char * 1).from_buffer(buf)
    try:
        return ctypes.addressof(view)
    finally:
        del view


def map_contiguous(fds: list[int], lengths: list[int]) -> mmap.mmap:
    """The files ``fds`` (each at least its ``lengths`` entry long, page multiples)
    mapped shared, one after the other, in one range; ``OSError`` if a mapping fails
    (then nothing stays mapped)."""
    total = sum(lengths)
    buf = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
    try:
        base, offset = _address(buf), 0
        for i, (fd, length) in enumerate(zip(fds, lengths, strict=True)):
            got = _libc.mmap(base + offset, length, mmap.PROT_READ | mmap.PROT_WRITE,
                             mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
            if got == _MAP_FAILED or got != base + offset:
                e = ctypes.get_errno() or errno.EINVAL
                raise OSError(e, f"mapping arena segment {i} over the reserved range: "
                              f"{os.strerror(e)}")
            offset += length
    except BaseException:
        buf.close()
        raise
    from rdma.buffer import advise_huge

    advise_huge(buf)
    return buf


def segment_lengths(arena_bytes: int, segment_bytes: int) -> list[int]:
    """The segments' lengths: ``segment_bytes`` each (0: one segment), the last shorter."""
    step = segment_bytes or arena_bytes
    return [min(step, arena_bytes - off) for off in range(0, arena_bytes, step)]


def memfd_segments(lengths: list[int], name: str) -> list[int]:
    """One memfd per segment, sized, mode 0600 (module docstring)."""
    fds: list[int] = []
    try:
        for i, length in enumerate(lengths):
            fd = os.memfd_create(f"kspeedfs-{name}.arena.{i}", os.MFD_CLOEXEC)
            fds.append(fd)
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, length)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


class SegmentMemory:
    """The arena's segments: their fds (owned: :meth:`close` closes them) and the one
    mapping of them all (owned by whoever closes it: the vMR registers it).

    Attributes:
        fds: segment i's fd (read-write).
        lengths: segment i's length in bytes.
        memory: the contiguous mapping, ``sum(lengths)`` long.
    """

    def __init__(self, fds: list[int], lengths: list[int]) -> None:
        self.fds = fds
        self.lengths = lengths
        self.memory = map_contiguous(fds, lengths)

    @classmethod
    def anonymous(cls, geometry: Geometry, name: str) -> SegmentMemory:
        """``geometry``'s segments in memfds: lost at exit, as anonymous memory is."""
        lengths = [geometry.segment_span(i)[1] for i in range(geometry.nsegments)]
        fds = memfd_segments(lengths, name)
        try:
            return cls(fds, lengths)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    def readonly(self, i: int) -> int:
        """A new read-only fd of segment ``i`` (close-on-exec); the caller owns it."""
        if not 0 <= i < len(self.fds):
            raise IndexError(f"no arena segment {i}")
        return os.open(f"/proc/self/fd/{self.fds[i]}", os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        """Close the segments' fds (the mapping keeps the memory until it is closed)."""
        for fd in self.fds:
            os.close(fd)
        self.fds = []
