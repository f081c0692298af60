"""③ Which group owns each arena segment, and which of its slots are free.

The bookkeeping behind the arena's group-strict placement (``arena.py``, "Segments and
groups"): a segment holding keys is owned by one group (a granted dataset, or None), an
empty one by nobody, and a segment handed to a reader is pinned to its group even when
empty. :class:`SegmentOwners` keeps those facts and the free slots; which key goes where,
and what is evicted for it, stays the arena's.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .arena import Geometry

Group = str | None      # the dataset a key is stored for; None: no grant applies


class SegmentOwners:
    """Per segment: its owner, its free slots (a stack, lowest slot on top), how many are
    used, whether it is pinned. ``take``/``release`` keep the invariant that a segment
    with used slots, or a pinned one, has an owner, and any other is empty and unowned.
    Single-threaded, as the arena."""

    def __init__(self, g: Geometry, used: set[int]) -> None:
        """Every slot free but ``used``; segments holding any are owned by None."""
        per, n = g.per_segment, g.nsegments
        self.per = per
        self.count = n
        self._free = [[s for s in range(min(g.nslots, (i + 1) * per) - 1, i * per - 1, -1)
                       if s not in used] for i in range(n)]
        self._used = [0] * n
        for s in used:
            self._used[s // per] += 1
        self._owner: list[Group] = [None] * n
        self._owned: dict[Group, set[int]] = {None: {i for i in range(n) if self._used[i]}}
        self._open: dict[Group, set[int]] = {None: {i for i in self._owned[None] if self._free[i]}}
        self._empty = {i for i in range(n) if not self._used[i]}
        self._pinned: set[int] = set()

    def segment(self, slot: int) -> int:
        return slot // self.per

    def slot_owner(self, slot: int) -> Group:
        return self._owner[self.segment(slot)]

    def segments(self, group: Group) -> list[int]:
        """The segments ``group`` owns now, ascending."""
        return sorted(self._owned.get(group, ()))

    def has_free(self, g: Group) -> bool:
        """Whether a slot is free for group ``g``: in its segments or an empty one."""
        return bool(self._open.get(g) or self._empty)

    def has_slot(self, g: Group, freeing: Iterable[int]) -> bool:
        """Whether a slot is free for group ``g`` once the keys in slots ``freeing`` go."""
        if self.has_free(g):
            return True
        segs = Counter(self.segment(slot) for slot in freeing)
        return any(self._owner[s] == g or (self._used[s] == n and s not in self._pinned)
                   for s, n in segs.items())

    def keys_by_segment(self, held: Iterable[tuple[bytes, int]],
                        keep: Callable[[int], bool]) -> dict[int, list[bytes]]:
        """The keys of ``held`` ((key, slot) pairs) by segment, of the segments ``keep``."""
        out: dict[int, list[bytes]] = {}
        for key, slot in held:
            seg = self.segment(slot)
            if keep(seg):
                out.setdefault(seg, []).append(key)
        return out

    def whole_segment(self, held: Iterable[tuple[bytes, int]], g: Group,
                      rank: Callable[[bytes], int], may_go: Callable[[int], bool]
                      ) -> tuple[int, list[bytes]] | None:
        """(highest rank, keys) of the segment of another group, not pinned, whose keys
        of ``held`` ((key, slot) pairs) may all go (``may_go`` of each one's rank): the
        lowest highest rank, then the fewest chunks; None when there is none."""
        best: tuple[int, int, list[bytes]] | None = None
        others = self.keys_by_segment(held, lambda s: self._owner[s] != g and s not in self._pinned)
        for keys in others.values():
            ranks = [rank(k) for k in keys]
            if all(may_go(r) for r in ranks):
                top = max(ranks)
                if best is None or (top, len(keys)) < best[:2]:
                    best = (top, len(keys), keys)
        return (best[0], best[2]) if best is not None else None

    def alone(self, g: Group) -> bool:
        """Whether ``g`` owns every segment that is not empty."""
        return len(self._owned.get(g, ())) == self.count - len(self._empty)

    def take(self, g: Group) -> int:
        """A free slot of ``g``'s segments, else of an empty one (then ``g``'s)."""
        mine = self._open.get(g)
        seg = next(iter(mine)) if mine else min(self._empty)
        if not self._used[seg]:
            self._empty.discard(seg)
            self._owner[seg] = g
            self._owned.setdefault(g, set()).add(seg)
        slot = self._free[seg].pop()
        self._used[seg] += 1
        if self._free[seg]:
            self._open.setdefault(g, set()).add(seg)
        else:
            self._open.get(g, set()).discard(seg)
        return slot

    def release(self, slot: int) -> None:
        """Slot ``slot`` is free again; its segment, once empty and unpinned, is nobody's."""
        seg = self.segment(slot)
        g = self._owner[seg]
        self._free[seg].append(slot)
        self._used[seg] -= 1
        if self._used[seg] or seg in self._pinned:
            self._open.setdefault(g, set()).add(seg)
            return
        self._open[g].discard(seg)
        self._owned[g].discard(seg)
        self._owner[seg] = None
        self._empty.add(seg)

    def _give(self, seg: int, g: Group) -> None:
        """Segment ``seg``, owned by None and holding keys, is ``g``'s from now on."""
        self._owner[seg] = g
        self._owned[None].discard(seg)
        self._owned.setdefault(g, set()).add(seg)
        if seg in self._open.get(None, ()):
            self._open[None].discard(seg)
            self._open.setdefault(g, set()).add(seg)

    def regroup(self, held: Iterable[tuple[bytes, int]], group: Callable[[bytes], Group]) -> int:
        """Give each segment of None whose every key of ``held`` ((key, slot) pairs)
        ``group`` now puts in one group G to G; returns how many. Adopted chunks sit in
        None's segments (``Arena.adopt``: the groups were unknown then), where no reader
        is granted them; once the node knows its groups (its first reconcile pass) a
        segment that holds one dataset's chunks only is that dataset's again, and the
        invariant holds: G's segments hold only G's keys."""
        moved = 0
        for seg, keys in self.keys_by_segment(held, lambda seg: self._owner[seg] is None).items():
            groups = {group(k) for k in keys}
            if len(groups) == 1 and (g := groups.pop()) is not None:
                self._give(seg, g)
                moved += 1
        return moved

    def pin(self, seg: int) -> None:
        """Segment ``seg`` (owned by a group, not None) stays that group's for good."""
        if self._owner[seg] is None:
            raise ValueError(f"arena segment {seg} is not owned by a granted group")
        self._pinned.add(seg)
