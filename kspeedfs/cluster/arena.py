"""③ A node's cache: a memory arena of chunk slots plus an index peers read one-sidedly.

Two vMRs, registered on every NIC of the node and exported to authenticated peers::

    "arena"  nslots × slot_size bytes        slot s holds one chunk at s·slot_size
    "index"  nbuckets × WAYS × 32 bytes      open hash table: key → (slot, length)

    index entry (32 B, little-endian):  key[16] = xxh3-128 of the chunk | slot u32 |
                                        length u32 | reserved u64
    the buckets of a key = its first and its second 8 bytes as integers, mod nbuckets:
                           the first while that holds fewer than SPILL entries, else the
                           one of the two holding fewer (``buckets_of``,
                           ``Arena._bucket_for``)

Why this shape — the reader needs no help from the owner's CPU on the hot path: it
READs the key's bucket (WAYS × 32 = 256 bytes), finds its key, READs the slot, and
checks the bytes against the key. Two one-sided READs, zero RPCs (a third, the second
bucket, for the few keys not in their first).

Why two buckets a key: with one, at a full arena (4 keys a bucket on average, Poisson)
~2 % of buckets were asked for more than WAYS keys and refused ~0.8 % of the chunks (a
copy fewer; none where every replica holds the same share, R nodes of R, and they all
refused the same chunks: read from the source on every pass). An arena like the
demo's (128 slots, 90 % full after its kill) refused a chunk in 31 % of random datasets.
With the second choice taken only past SPILL = 6 entries (``python -m
bench.arena_buckets``): no chunk refused at a full arena of 128, 4,096 or 65,536 slots,
and 3.0-4.7 % of keys in their second bucket, so a reader of an earlier version (which
READs only the first) misses only those, and an earlier node's files (every key in its
first) are read as they are.

Why eviction needs no locks or epochs with readers: the key *is* the checksum of the
content (content addressing). The owner evicts by clearing the index entry first and
only then reusing the slot; a reader that raced (read the entry before the clear and
the slot after the reuse, or caught a half-written slot) gets bytes whose xxh3-128 is
not the key it looked up — the verification every read does anyway — and retries the
index once, then treats the chunk as missing. So no read can return wrong bytes, and
no coordination is needed for one to be safe. Slots are written only by this process
(``put``), in the order data → index entry.

Restart (``adopt``): the arena and index may live in files that outlive the node
(``cluster.arena_dir``); a restarted node scans the index and keeps every entry whose
slot's bytes still hash to its key, clearing the others (a slot torn by the crash, or
changed while the node was down), so it serves again without reloading what it held.

Eviction order when the arena is full (``rank``, lower goes first): chunks outside this
node's share (placement moved them elsewhere, or no preloaded dataset has them: rank <
0, oldest first), then the chunks of the lowest-priority preloaded dataset
(``cluster/lifecycle.py``). A chunk is not stored at all when making room would evict
one of a higher rank, or, on a node without an SSD tier, of its own rank within the
share: a low-priority load never pushes out a high-priority dataset, and a share larger
than the arena (a preload forced past the capacity plan, a share grown by a lost peer)
keeps the chunks it got first instead of each load evicting an earlier one that the
next pass, or the next reader's miss, loads again. (With an SSD tier the evicted chunk
goes there: still held by the node, the arena its memory part, oldest first.) Finding a
victim is a scan, oldest first, that stops at the first chunk outside the share; when
every slot is in the share it reads every rank (one dict lookup each, ~5 ms per 10^5
slots; only when the share exceeds the arena).

Segments and groups (``docs/design.md``, "Zero-copy on the node's host"): the slots are
cut into segments of ``Geometry.segment_slots`` (the last may be shorter), each its own
file or memfd (``arena_segments.py``) so one segment can be handed, read-only, to a
local process granted one dataset. ``group(key)`` names the dataset a key is stored for
(None: no grant applies). A segment holding keys is *owned* by the group of the first
of them and only ever holds keys of that group; an empty segment is unowned. A key's
slot comes from its group's segments first, then from an empty one. When neither has
a free slot: the key's group's own lowest-ranked chunk goes (the rules above) — unless
it is in the share (rank >= 0) and a whole segment of another group holds only chunks
that may go and rank no higher: then that segment is emptied for the group (its
chunks evicted, spilled to the SSD tier if there is one). With no grants every key is
in group None, there is one group, and all of this is the rules above. Adopted chunks
(``adopt``) cannot be told apart by dataset yet: their segments are owned by None,
which is never granted, until ``regroup`` (after the node's first reconcile pass) gives
each segment holding one granted dataset's chunks only back to that dataset.

Who owns which segment, and its free slots, are kept by ``arena_owners.SegmentOwners``.
A segment handed to a local reader (``pin``) stays its group's until the node exits,
even when empty: the reader's mapping cannot be taken back, so a segment it maps must
never hold another group's chunks. Its chunks may still be evicted, for its own group's.
"""
from __future__ import annotations

import logging
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from ..tuning import SPILL
from .arena_owners import Group, SegmentOwners

log = logging.getLogger(__name__)

WAYS = 8
ENTRY = struct.Struct("<16sIIQ")
BUCKET_BYTES = WAYS * ENTRY.size


class Buffer(Protocol):
    """What the arena needs of a registered buffer (a vRDMA ``VMR`` or a bytearray view)."""

    length: int

    def write(self, data: bytes | bytearray | memoryview, offset: int = 0) -> None: ...

    def read(self, length: int, offset: int = 0) -> bytes: ...


def buckets_of(key: bytes, nbuckets: int) -> tuple[int, ...]:
    """The buckets a key may be in, first bucket first (one when both are the same;
    none in an index of no buckets, which a node record may say)."""
    if nbuckets < 1:
        return ()
    b1 = int.from_bytes(key[:8], "little") % nbuckets
    b2 = int.from_bytes(key[8:16], "little") % nbuckets
    return (b1,) if b1 == b2 else (b1, b2)


def find_in_bucket(bucket: bytes | memoryview, key: bytes) -> tuple[int, int] | None:
    """(slot, length) of ``key`` in one bucket's bytes as READ from a peer, or None."""
    for i in range(WAYS):
        k, slot, length, _ = ENTRY.unpack_from(bucket, i * ENTRY.size)
        if k == key and length:
            return slot, length
    return None


@dataclass(frozen=True)
class Geometry:
    """Published in the node's membership record so readers can address its arena."""

    nslots: int
    slot_size: int
    nbuckets: int
    segment_slots: int = 0       # slots a segment (0: the whole arena is one segment)

    @classmethod
    def for_memory(cls, memory: int, slot_size: int, segment_bytes: int = 0) -> Geometry:
        nslots = memory // slot_size
        # half the index ways in use on average at a full arena; with two buckets a key
        # (module docstring), none full
        nbuckets = max(1, (2 * nslots + WAYS - 1) // WAYS)
        return cls(nslots, slot_size, nbuckets, min(nslots, segment_bytes // slot_size))

    @property
    def per_segment(self) -> int:
        """Slots in a segment (the last may hold fewer)."""
        return self.segment_slots or max(self.nslots, 1)

    @property
    def segment_bytes(self) -> int:
        return self.per_segment * self.slot_size

    @property
    def nsegments(self) -> int:
        return -(-self.nslots // self.per_segment)

    def segment_span(self, i: int) -> tuple[int, int]:
        """(offset in the arena, length) of segment ``i``."""
        first = i * self.per_segment
        return first * self.slot_size, (min(self.nslots, first + self.per_segment) - first) * self.slot_size

    @property
    def arena_bytes(self) -> int:
        return self.nslots * self.slot_size

    @property
    def index_bytes(self) -> int:
        return self.nbuckets * BUCKET_BYTES


@dataclass(frozen=True)
class ArenaStatistics:
    slots: int
    used_slots: int
    used_bytes: int
    capacity: int
    evictions: int
    puts: int
    refused: int = 0                 # chunks not stored: room would evict a higher rank




class Arena:
    """The owner's side: ``put``/``get``/``evict``. Single-threaded (the node's trio loop).

    Contract (module docstring): a key is stored data first, index entry second, and
    cleared entry first, slot second; a segment owned by group G holds only keys put
    while ``group(key)`` was G (``segments``, ``locate``: what a grant may see); an
    empty segment is owned by nobody."""

    def __init__(self, geometry: Geometry, data: Buffer, index: Buffer,
                 rank: Callable[[bytes], int] = lambda key: 0,
                 on_evict: Callable[[bytes, bytes], None] | None = None,
                 group: Callable[[bytes], Group] = lambda key: None) -> None:
        self.g = geometry
        self.data = data
        self.index = index
        self.rank = rank                         # eviction class of a key: < 0 first
        self.on_evict = on_evict                 # (key, bytes) of an evicted chunk: SSD tier
        self.group = group                       # the dataset a key is stored for (grants)
        self.owners = SegmentOwners(geometry, set())
        # key → (slot, length, bucket, way), oldest first
        self._slots: OrderedDict[bytes, tuple[int, int, int, int]] = OrderedDict()
        self._ways: dict[int, list[bytes | None]] = {}     # bucket → keys by way
        self.evictions = 0
        self.refused = 0                         # puts not stored: see put()
        self.puts = 0
        self.used_bytes = 0

    # ------------------------------------------------------------------ segments
    def regroup(self) -> int:
        """Segments of adopted chunks given back to their dataset (``SegmentOwners.regroup``);
        how many."""
        return self.owners.regroup(self._held(), self.group)

    def segments(self, group: Group) -> list[int]:
        """The segments ``group`` owns now (those holding its keys), ascending."""
        return self.owners.segments(group)

    def pin(self, seg: int) -> None:
        """Segment ``seg`` (owned by a group, not None) is handed to a reader: it stays
        that group's from now on (module docstring)."""
        self.owners.pin(seg)

    def locate(self, key: bytes, group: Group) -> tuple[int, int] | None:
        """(slot, length) of ``key`` when it is held in a segment ``group`` owns; None
        otherwise, and always for group None (never granted)."""
        hit = self._slots.get(key)
        if hit is None or group is None or self.owners.slot_owner(hit[0]) != group:
            return None
        return hit[0], hit[1]

    def adopt(self, verify: Callable[[bytes, memoryview | bytes], bool]) -> tuple[int, int]:
        """Take over what a previous process left in ``data``/``index`` (files that
        outlived it): every entry in one of its key's buckets whose slot's bytes
        ``verify`` against its key is kept, every other entry cleared (a reader would
        not find it, and evicting it would clear another way). Returns (kept, dropped).
        Call on an empty arena."""
        assert not self._slots
        kept = dropped = 0
        used: set[int] = set()
        for b in range(self.g.nbuckets):
            bucket = self.index.read(BUCKET_BYTES, b * BUCKET_BYTES)
            for way in range(WAYS):
                key, slot, length, _ = ENTRY.unpack_from(bucket, way * ENTRY.size)
                if not length and key == bytes(16):
                    continue
                ok = (0 < length <= self.g.slot_size and slot < self.g.nslots and slot not in used
                      and key not in self._slots and b in buckets_of(key, self.g.nbuckets)
                      and verify(key, self.data.read(length, slot * self.g.slot_size)))
                if not ok:
                    self.index.write(bytes(ENTRY.size), (b * WAYS + way) * ENTRY.size)
                    dropped += 1
                    continue
                used.add(slot)
                self._ways.setdefault(b, [None] * WAYS)[way] = key
                self._slots[key] = (slot, length, b, way)
                self.used_bytes += length
                kept += 1
        self.owners = SegmentOwners(self.g, used)
        return kept, dropped

    def __contains__(self, key: bytes) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def keys(self) -> list[bytes]:
        return list(self._slots)

    def get(self, key: bytes) -> bytes | None:
        """The owner's own copy (for serving re-replication locally, tests, ``--check``)."""
        hit = self._slots.get(key)
        if hit is None:
            return None
        slot, length, _, _ = hit
        return self.data.read(length, slot * self.g.slot_size)

    def takes(self, key: bytes) -> bool:
        """Whether ``put`` would store ``key`` now (True when it is held already): a
        node asked to load a chunk it would refuse answers at once, without reading it."""
        return key in self._slots or self._room(key)[0]

    def _room(self, key: bytes) -> tuple[bool, list[bytes]]:
        """Whether ``key`` may be stored, and the chunks that must go first to make room
        (none: there is room). A victim frees what is short: its way (and slot) in a
        full bucket (both of the key's full: a way in either), or a slot of the key's
        group (module docstring: or a whole segment of another group). Refused when
        the victim outranks the key, or ranks the same within the share (rank >= 0) in
        full buckets, or, with no SSD tier (``on_evict``), in a full arena: chunks of
        one share that do not all fit evicted one another whenever a reader missed one
        and its owner loaded it (found in a full bucket, when a key had one: a peer's
        fetches of two such chunks failed every ~0.7 s, 19-25 in each 8 s pass of the
        suite's 4-reader case). With an SSD tier the arena is the memory part of the
        node's copy: the oldest of the rank goes to the SSD, still held here. Outside
        the share (rank < 0) the oldest goes."""
        g = self.group(key)
        victims: list[bytes] = []
        if self._bucket_for(key) is None:
            victim = self._victim([k for b in buckets_of(key, self.g.nbuckets)
                                   for k in self._ways[b] if k is not None])
            if not self._may_evict(self.rank(victim), self.rank(key), full=True):
                return False, []
            victims.append(victim)
        if self.owners.has_slot(g, [self._slots[k][0] for k in victims]):
            return True, victims
        more = self._slot_victims(key, g)
        if more is None:
            return False, []
        return True, list(dict.fromkeys(victims + more))

    def _may_evict(self, theirs: int, mine: int, full: bool) -> bool:
        """Whether a chunk of rank ``theirs`` may go for one of rank ``mine`` (``_room``)."""
        return not (theirs > mine or (theirs == mine >= 0 and (full or self.on_evict is None)))

    def _held(self) -> Iterator[tuple[bytes, int]]:
        """(key, slot) of every chunk held, oldest first."""
        return ((key, hit[0]) for key, hit in self._slots.items())

    def _slot_victims(self, key: bytes, g: Group) -> list[bytes] | None:
        """What to evict for a slot of group ``g``: its own lowest-ranked chunk, or a
        whole segment of another group (module docstring); None: refused."""
        owners = self.owners
        alone = owners.alone(g)
        mine = list(self._slots) if alone else [k for k, s in self._held() if owners.slot_owner(s) == g]
        rank = self.rank(key)
        victim = self._victim(mine) if mine else None
        theirs = self.rank(victim) if victim is not None else 0
        if victim is not None and theirs < 0:
            return [victim]
        whole = None if alone else owners.whole_segment(
            self._held(), g, self.rank, lambda r: self._may_evict(r, rank, full=False))
        if victim is not None and self._may_evict(theirs, rank, full=False) and (
                whole is None or theirs <= whole[0]):
            return [victim]
        return whole[1] if whole is not None else None

    def _bucket_for(self, key: bytes) -> int | None:
        """The bucket ``key`` goes to now: its first while that holds fewer than SPILL
        keys, else the one of its two holding fewer (the first on a tie); None when both
        are full."""
        best, load = -1, WAYS
        for i, b in enumerate(buckets_of(key, self.g.nbuckets)):
            ways = self._ways.get(b)
            n = WAYS - ways.count(None) if ways is not None else 0
            if i == 0 and n < SPILL:
                return b
            if n < load:
                best, load = b, n
        return best if load < WAYS else None

    def put(self, key: bytes, data: bytes | bytearray | memoryview) -> bool:
        """Store a *verified* chunk. Data first, index entry second (see the docstring).
        False when it was not stored (``_room``: a higher-ranked chunk, or full buckets,
        or on a node without an SSD tier a full arena, of its own rank would have gone
        for it)."""
        if key in self._slots:
            return True
        if len(data) > self.g.slot_size:
            raise ValueError(f"chunk of {len(data)} bytes does not fit a {self.g.slot_size}-byte slot")
        ok, victims = self._room(key)
        if not ok:
            self.refused += 1
            if self.on_evict is not None:         # as if stored and evicted: the SSD tier
                self.on_evict(key, bytes(data))
            return False
        for victim in victims:
            self._evict(victim)
        b = self._bucket_for(key)
        assert b is not None                     # (_room: a way was free, or the victim's)
        ways = self._ways.setdefault(b, [None] * WAYS)
        slot = self.owners.take(self.group(key))
        way = ways.index(None)
        self.data.write(data, slot * self.g.slot_size)
        self.index.write(ENTRY.pack(key, slot, len(data), 0), (b * WAYS + way) * ENTRY.size)
        ways[way] = key
        self._slots[key] = (slot, len(data), b, way)
        self.used_bytes += len(data)
        self.puts += 1
        return True

    def _victim(self, candidates: list[bytes]) -> bytes:
        """The lowest-ranked candidate, the oldest among equals; the first one outside
        the share (rank < 0) ends the scan."""
        best, best_rank = candidates[0], None
        for key in candidates:                   # oldest first (insertion order)
            r = self.rank(key)
            if r < 0:
                return key
            if best_rank is None or r < best_rank:
                best, best_rank = key, r
        return best

    def _evict(self, key: bytes, spill: bool = True) -> None:
        slot, length, b, way = self._slots[key]
        if spill and self.on_evict is not None:
            self.on_evict(key, self.data.read(length, slot * self.g.slot_size))
        del self._slots[key]
        self.index.write(bytes(ENTRY.size), (b * WAYS + way) * ENTRY.size)   # entry first ...
        self._ways[b][way] = None
        self.owners.release(slot)                                             # ... then the slot
        self.used_bytes -= length
        self.evictions += 1

    def evict(self, key: bytes) -> None:
        if key in self._slots:
            self._evict(key)

    def drop(self, key: bytes) -> int:
        """Forget ``key`` without spilling it (its dataset was unloaded); its length."""
        if key not in self._slots:
            return 0
        length = self._slots[key][1]
        self._evict(key, spill=False)
        return length

    def statistics(self) -> ArenaStatistics:
        return ArenaStatistics(self.g.nslots, len(self._slots), self.used_bytes,
                               self.g.arena_bytes, self.evictions, self.puts, self.refused)
