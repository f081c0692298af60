"""⑤ Where chunks sit in the nodes' arenas, per node incarnation: the slot hints and the
copies of whole arena indexes that :mod:`.fetch` addresses a chunk READ by, without the
bucket READ first (and the native fetch's routes, :mod:`.native.fetch`).

    get(node, started, key)          the slot remembered for ``key`` there, or None
    learn(node, started, key, slot)  remember one (verified, or found in an index copy:
                                     the chunk's checksum catches a wrong one on use)
    stale(node, started, key)        the slot held another chunk: forget the hint and the
                                     index copy it may have come from
    in_index(rec, key, length)       the slot by ``rec``'s index copy (learned as a hint)
    lacks(rec, key, now)             ``rec``'s index copy, younger than INDEX_TRUST s, does
                                     not list ``key``
    index_due(rec, room, now)        bytes of ``rec``'s whole index to READ now, or 0
    keep_index(rec, data, now)       what that READ brought

Keyed by the node's incarnation (``NodeRecord.started``), so a restarted node's arena is
never addressed through what its predecessor held. Trio thread only.
"""
from __future__ import annotations

from ..tuning import HINTS, INDEX_REFRESH, INDEX_TRUST
from .arena import BUCKET_BYTES, buckets_of, find_in_bucket
from .membership import NodeRecord


class SlotHints:
    """Slots of chunks in the nodes' arenas: at most ``limit`` hints (the oldest goes
    first) and one index copy per node incarnation (dropped with any stale hint from it)."""

    def __init__(self, limit: int = HINTS) -> None:
        self.limit = limit
        self._hints: dict[tuple[str, float, bytes], int] = {}   # (node, started, key) → slot
        self._indexes: dict[tuple[str, float], bytes] = {}     # (node, started) → its index
        self._index_read: dict[tuple[str, float], float] = {}  # ... → when last asked for
        self._index_at: dict[tuple[str, float], float] = {}    # ... → when it arrived

    def get(self, node: str, started: float, key: bytes) -> int | None:
        return self._hints.get((node, started, key))

    def learn(self, node: str, started: float, key: bytes, slot: int) -> None:
        if len(self._hints) >= self.limit:
            del self._hints[next(iter(self._hints))]
        self._hints[(node, started, key)] = slot

    def stale(self, node: str, started: float, key: bytes) -> None:
        self._hints.pop((node, started, key), None)
        self._indexes.pop((node, started), None)

    def in_index(self, rec: NodeRecord, key: bytes, length: int) -> int | None:
        """``key``'s slot by the copy of ``rec``'s index when one is held and lists it
        with ``length`` bytes (then also a hint), else None."""
        index = self._indexes.get((rec.node, rec.started))
        if index is None or rec.nbuckets < 1:
            return None
        found = _find(index, rec, key)
        if found is None or found[1] != length:
            return None
        self.learn(rec.node, rec.started, key, found[0])
        return found[0]

    def lacks(self, rec: NodeRecord, key: bytes, now: float) -> bool:
        """Whether a copy of ``rec``'s index younger than INDEX_TRUST s is held and
        ``key`` is not in it: the node did not hold the chunk then (a node may refuse to
        hold one: ``Arena.takes``)."""
        at = (rec.node, rec.started)
        index = self._indexes.get(at)
        if index is None or rec.nbuckets < 1 or now - self._index_at[at] >= INDEX_TRUST:
            return False
        return _find(index, rec, key) is None

    def index_due(self, rec: NodeRecord, room: int, now: float) -> int:
        """The size of ``rec``'s whole index when no copy younger than INDEX_TRUST s is
        held, it fits ``room`` bytes and none was asked for in the last INDEX_REFRESH s
        (the caller READs it now, and passes it to ``keep_index``); else 0."""
        at = (rec.node, rec.started)
        size = rec.nbuckets * BUCKET_BYTES
        if (at in self._indexes and now - self._index_at[at] < INDEX_TRUST) or \
                not 0 < size <= room or \
                now - self._index_read.get(at, -INDEX_REFRESH) < INDEX_REFRESH:
            return 0
        self._index_read[at] = now
        return size

    def keep_index(self, rec: NodeRecord, data: bytes, now: float) -> None:
        self._indexes[(rec.node, rec.started)] = data
        self._index_at[(rec.node, rec.started)] = now


def _find(index: bytes, rec: NodeRecord, key: bytes) -> tuple[int, int] | None:
    """(slot, length) of ``key`` in a copy of ``rec``'s whole index (in either of its
    buckets, ``arena.buckets_of``), or None."""
    for b in buckets_of(key, rec.nbuckets):
        found = find_in_bucket(index[b * BUCKET_BYTES:(b + 1) * BUCKET_BYTES], key)
        if found is not None:
            return found
    return None
