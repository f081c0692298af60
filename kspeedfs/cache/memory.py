"""The memory tier: verified, immutable chunks (and blocks, and small files' extents),
bounded in bytes. Used only from the trio thread (but for ``resident``): no lock.

Two parts, because training reads a dataset in epochs:

* **resident** (``capacity - transient``): filled while there is room, then kept until
  the mount ends. A mount serves one dataset version, and an epoch reads every item
  once, in shuffled or in the same order. When the dataset does not fit, any fixed
  subset of it is hit at the rate capacity/dataset, the best a cache can do for reads
  that are equally likely everywhere; LRU instead evicts each item shortly before the
  next epoch wants it (the CoorDL "MinIO" cache argument, Mohan et al., VLDB 2021;
  simulated and measured: docs/design.md, "The memory tier's resident part").
* **transient** (``transient_fraction`` of the capacity, at least ``transient_min``):
  an LRU for everything the resident part has no room for, so a reader still finds the
  chunk it is reading, or that was prefetched for it, a moment later. Concurrent
  sequential readers each need their current chunk and their prefetch window here
  (~20 MiB each at the defaults), so a small tier is all transient: a plain LRU.

When the dataset fits, everything is resident and nothing is ever evicted, as before.

Mirror (the native engine, ``fuse/native.py``): with ``mirror_to(m)`` every buffer put
here is also ``m.put`` and every one that leaves is ``m.discard``-ed, so the engine's C
threads answer reads from exactly what this tier holds. They cannot reorder the LRU,
so eviction asks ``m.touched(key)`` first and gives a buffer served since it was last
asked a second chance (CLOCK); the order is still an LRU for reads answered here. A
buffer no read has reached yet (a prefetched chunk) is spared too while it is young
(``_unread``), or the chunks being read, sent to the young end, push it out first.
``served(key)`` (whether any read was answered from it since its put) tells the
prefetcher that a reader has reached a chunk that only C threads served.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import threading
import weakref
from collections import OrderedDict
from typing import Any, Protocol

from ..tuning import ALIGN_MIN, POPULATE_MIN, SPARE_BYTES, TRANSIENT_FRACTION, TRANSIENT_MIN

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)


def page_aligned(n: int) -> memoryview:
    """A zeroed, writable buffer of ``n`` bytes for this tier, starting on a page boundary
    when ``n >= ALIGN_MIN`` (a view into a bytearray one page larger).

    Why: the kernel copies a READ reply into the page cache a page at a time, pinning the
    source page of every piece (``fuse_copy_fill``); a source that starts mid-page is
    two pieces, two pins and two short copies per page. A bytearray's bytes start 16 or
    32 bytes into a page, so aligned buffers cost the mount less CPU per GB read
    (docs/design.md, "The memory tier's page alignment"). A file at least a chunk long
    starts a chunk (``Layout.place``), so its pages are the buffer's pages; packed small
    files start anywhere in theirs."""
    if n < ALIGN_MIN:
        return memoryview(bytearray(n))
    if n >= POPULATE_MIN and (mapped := _populated(n)) is not None:
        return mapped
    raw = bytearray(n + PAGE - 1)
    pad = -ctypes.addressof(ctypes.c_char.from_buffer(raw)) % PAGE
    return memoryview(raw)[pad:pad + n]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _populated(n: int) -> memoryview | None:
    """``n`` zeroed bytes of their own anonymous mapping (page-aligned), faulted in without
    the GIL: a spare mapping of that size zeroed by a ctypes ``memset``, else a new one
    ``MAP_POPULATE``'d inside a ctypes call. When its last view goes the mapping becomes a
    spare, up to ``SPARE_BYTES`` of them, else it is unmapped. None when the kernel refuses
    a mapping (the process's map count, ``vm.max_map_count``, spent): the caller takes a
    bytearray. Why (docs/design.md, "Chunk buffers faulted in without the GIL"):
    ``bytearray(n)`` zeroes fresh pages holding the GIL, ~3 ms a 4 MiB chunk here, so the
    source's GETs of a sequential reader's chunks started one after another; a spare
    skips the faults too."""
    global _spare_bytes
    with _spare_lock:
        free = _spare.get(n)
        addr = free.pop() if free else None
        if addr is not None:
            _spare_bytes -= n
    if addr is not None:
        ctypes.memset(addr, 0, n)
    else:
        addr = _libc.mmap(None, n, mmap.PROT_READ | mmap.PROT_WRITE,
                          mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_POPULATE, -1, 0)
        if addr is None or addr == _MAP_FAILED:
            return None
    pages = (ctypes.c_ubyte * n).from_address(addr)
    weakref.finalize(pages, _release, addr, n)
    return memoryview(pages).cast("B")


_spare: dict[int, list[int]] = {}        # mapping size -> addresses no view holds
_spare_bytes = 0
_spare_lock = threading.Lock()           # the last view may go in any thread


def _release(addr: int, n: int) -> None:
    """The last view of mapping ``addr`` went: keep it as a spare, or unmap it."""
    global _spare_bytes
    with _spare_lock:
        if _spare_bytes + n <= SPARE_BYTES:
            _spare.setdefault(n, []).append(addr)
            _spare_bytes += n
            return
    _libc.munmap(addr, n)


class Mirror(Protocol):
    """What holds a copy of the tier's index (``fuse.native.TierMirror``)."""

    def put(self, key: bytes, data: Any) -> None: ...
    def discard(self, key: bytes) -> None: ...
    def touched(self, key: bytes) -> bool: ...
    def served(self, key: bytes) -> bool: ...


class MemoryCache:
    """Verified buffers by key (chunk, block or extent digest), bounded in bytes: a
    resident part kept for the mount's life and a transient LRU (module docstring).
    ``get`` returns the stored object itself (immutable bytes; never copied). Trio thread
    only. A ``Mirror`` set with ``mirror_to`` sees every put and every removal."""

    def __init__(self, capacity: int, transient_fraction: float = TRANSIENT_FRACTION,
                 transient_min: int = TRANSIENT_MIN) -> None:
        self.capacity = capacity
        self.transient_capacity = min(capacity, max(int(capacity * transient_fraction),
                                                    transient_min))
        self.resident_capacity = capacity - self.transient_capacity
        self._resident: dict[bytes, bytes | memoryview] = {}
        self._resident_used = 0
        self._transient: OrderedDict[bytes, bytes | memoryview] = OrderedDict()
        self._transient_used = 0
        self._put_at: dict[bytes, int] = {}     # transient key -> _put_bytes after its put
        self._put_bytes = 0                     # bytes ever put into the transient part
        self._mirror: Mirror | None = None

    def mirror_to(self, mirror: Mirror | None) -> None:
        """Mirror every buffer held now and later into ``mirror`` (None: stop)."""
        self._mirror = mirror
        if mirror is not None:
            for part in (self._resident, self._transient):
                for key, data in part.items():
                    mirror.put(key, data)

    @property
    def used(self) -> int:
        return self._resident_used + self._transient_used

    @property
    def resident_used(self) -> int:
        return self._resident_used

    @property
    def resident_room(self) -> int:
        """Bytes the resident part can still take (then kept)."""
        return self.resident_capacity - self._resident_used

    def __len__(self) -> int:
        return len(self._resident) + len(self._transient)

    def __contains__(self, key: bytes) -> bool:
        return key in self._resident or key in self._transient

    def served(self, key: bytes) -> bool:
        """Whether the mirror (C threads) answered a read from ``key``'s buffer since it
        was put; False without a mirror (every read then comes through ``get``), and for a
        key not held (the mirror holds exactly what this tier holds)."""
        return self._mirror is not None and self._mirror.served(key)

    def resident(self, key: bytes) -> bytes | memoryview | None:
        """``key``'s buffer if the resident part holds it; safe from any thread (the
        library's callers): that part is never reordered, and an entry enters or leaves
        it whole, in one dict operation under the GIL."""
        return self._resident.get(key)

    def get(self, key: bytes) -> bytes | memoryview | None:
        data = self._resident.get(key)
        if data is not None:
            return data
        data = self._transient.get(key)
        if data is not None:
            self._transient.move_to_end(key)
        return data

    def put(self, key: bytes, data: bytes | memoryview) -> None:
        self.discard(key)
        n = len(data)
        if self._resident_used + n <= self.resident_capacity:
            self._resident[key] = data
            self._resident_used += n
        elif n > self.transient_capacity:
            return
        else:
            self._transient[key] = data
            self._transient_used += n
            self._put_bytes += n
            self._put_at[key] = self._put_bytes
        if self._mirror is not None:
            self._mirror.put(key, data)
        self._evict()

    def _evict(self) -> None:
        """Trim the transient LRU to its capacity. With a mirror, a buffer goes to the
        young end instead when a C thread served it since it was last looked at (its
        second chance), or when no read has reached it yet and it is young (``_unread``).
        Two rounds at most: the first clears every second chance; if the second finds
        only young unread buffers, the oldest goes."""
        spares = 2 * len(self._transient)
        while self._transient_used > self.transient_capacity:
            key, evicted = self._transient.popitem(last=False)
            if (self._mirror is not None and spares > 0
                    and (self._mirror.touched(key) or self._unread(key))):
                self._transient[key] = evicted
                spares -= 1
                continue
            self._gone(key, evicted)

    def _unread(self, key: bytes) -> bool:
        """Whether ``key`` is a buffer no read has reached yet (a prefetched chunk) and
        less than the transient's capacity was put after it. C's reads do not reorder
        the LRU, so a chunk being read, spared for that, went to the young end past the
        chunks prefetched after it, and the next eviction took those, unread, to be
        fetched again when their READs reached Python (docs/design.md, "The native chunk
        fetch": prefetched chunks evicted unread). Old and unread (its reader stopped
        early) it is evicted as before."""
        assert self._mirror is not None
        age = self._put_bytes - self._put_at.get(key, 0)
        return age < self.transient_capacity and not self._mirror.served(key)

    def discard(self, key: bytes) -> None:
        old = self._resident.pop(key, None)
        if old is not None:
            self._resident_used -= len(old)
            if self._mirror is not None:
                self._mirror.discard(key)
        elif (old := self._transient.pop(key, None)) is not None:
            self._gone(key, old)

    def _gone(self, key: bytes, data: bytes | memoryview) -> None:
        """``key``'s buffer ``data``, taken out of the transient LRU, is gone: its bytes,
        its put age and the mirror's entry with it (eviction and ``discard`` alike)."""
        self._transient_used -= len(data)
        self._put_at.pop(key, None)
        if self._mirror is not None:
            self._mirror.discard(key)
