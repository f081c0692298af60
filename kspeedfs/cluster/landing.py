"""Landing: registered buffers a chunk READ lands in, which the memory tier then keeps.

Why: copying each 4 MiB chunk out of a shared landing buffer into fresh ``bytes`` took
38 % of the mount daemon's samples while it read from peers (the copy holds the GIL,
and a fresh 4 MiB allocation faults its pages in). Registering a new buffer for every
READ and keeping it moved the cost to page faults, zeroing and unmapping, and was no
faster (measured). So slots are reused, but only once nothing refers to the chunk
any more: :meth:`Landing.keep` hands the slot's bytes out as a read-only memoryview
over a ctypes array that owns the slot; when the last view of it is gone (the memory
tier's entry, a reply being written, a slice), a finalizer puts the slot back.

Slots are registered in segments, added on demand up to ``limit`` slots (the memory
tier's capacity in chunks plus the READs in flight), so a mount that reads little from
peers registers little. When every slot is held, :meth:`take` says so and the caller
lands the READ in its staging buffer and copies.
"""
from __future__ import annotations

import ctypes
import logging
import weakref
from dataclasses import dataclass

from rdma.vrdma import VMR, Endpoint

from ..tuning import SEGMENT

log = logging.getLogger(__name__)

#: a slot: the vMR it lives in and its offset there
Slot = tuple[VMR, int]


@dataclass(frozen=True)
class LandingStatistics:
    """Slots registered, free now, chunks kept by the memory tier (lifetime), and takes
    that found every slot held (the READ landed in staging and was copied)."""

    slots: int
    free: int
    kept: int
    exhausted: int


class Landing:
    """A pool of registered slots that whole chunk READs land in, for the memory tier to keep.

    ``take`` never waits: it returns a free slot, first registering another segment
    (``SEGMENT`` slots, or fewer up to ``limit``, through ``endpoint.alloc``: local access
    only) when none is free and fewer than ``limit`` are registered, or None when every slot
    is held. A taken slot is the caller's until it returns it with ``give`` (only once no
    posted READ can still write into it) or hands it to ``keep``: the read-only view
    ``keep`` returns owns the slot, which goes back to the pool when the last view derived
    from it is released.
    Owns the slot bookkeeping and counters; the segments' vMRs are the endpoint's (it
    closes them), and the pool never frees one.
    Threads: ``take``, ``give``, ``keep`` and ``statistics`` on the trio thread (``Peers``'
    parts); the finalizer of a kept view appends its slot to the free list from whichever
    thread drops the last view (one list append, atomic under the GIL)."""

    def __init__(self, endpoint: Endpoint, slot_size: int, limit: int) -> None:
        self.ep = endpoint
        self.slot_size = slot_size
        self.limit = max(1, limit)
        self.segments: list[VMR] = []
        self.slots = 0                  # registered (``spare`` reads it once a chunk)
        self._free: list[Slot] = []     # appended to by finalizers, from any thread (GIL)
        self.kept = 0                   # chunks handed out (lifetime)
        self.exhausted = 0              # take() found every slot held

    def take(self) -> Slot | None:
        """A free slot (registering another segment if allowed), or None."""
        if not self._free and self.slots < self.limit:
            n = min(SEGMENT, self.limit - self.slots)
            vmr = self.ep.alloc(n * self.slot_size, name=f"landing{len(self.segments)}")
            self.segments.append(vmr)
            self.slots += n
            self._free.extend((vmr, i * self.slot_size) for i in range(n))
        if not self._free:
            self.exhausted += 1
            return None
        return self._free.pop()

    @property
    def spare(self) -> int:
        """Slots ``take`` can still hand out: free, or not registered yet."""
        return len(self._free) + self.limit - self.slots

    def give(self, slot: Slot) -> None:
        """Back to the pool (the READ failed, or its bytes were not kept)."""
        self._free.append(slot)

    def keep(self, slot: Slot, length: int) -> memoryview:
        """The slot's verified bytes as a read-only view that owns the slot: it returns to
        the pool when the last view derived from this one is gone."""
        vmr, at = slot
        owner = (ctypes.c_char * length).from_buffer(vmr.memory, at)
        weakref.finalize(owner, self._free.append, slot)
        self.kept += 1
        return memoryview(owner).cast("B").toreadonly()

    def statistics(self) -> LandingStatistics:
        return LandingStatistics(slots=self.slots, free=len(self._free), kept=self.kept,
                                 exhausted=self.exhausted)
