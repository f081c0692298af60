"""Listing a bucket prefix in parallel: one flat listing, split into key ranges as it goes.

A flat listing of a prefix is one page of 1,000 keys after another, each waiting for the
last (its continuation token). Listing "directory" by "directory" (one request per
common prefix) overlaps them, but costs a request per directory: 50 keys a directory is
20 requests where one page would do (0.23x a plain loop on fake-gcs-server). Here the
key space is cut into ranges instead, each a flat listing from its first key
(``Bucket.list_keys``: S3's ``StartAfter``, obstore's ``offset``) to the next range's,
``workers`` of them at once:

* :class:`_Listing` starts one range over everything (the head). A listing the server
  answers at once (one page, or one response as fake-gcs-server gives) ends there: one
  request, as the plain loop.
* Once the head waits for its next page (``LIST_SPLIT_WAIT`` of its first page's time),
  the split points come from the common prefixes after the head's last key
  (``Bucket.list_level``, down to ``LIST_SPLIT_DEPTH`` levels while there are fewer than
  ``workers``), each weighed by the keys per prefix the head has seen, and grouped into
  ranges of whole pages (``LIST_RANGE_FILL``; S3's last page of a range asks for one key
  past its guessed count). The head keeps the first group.
* A range owns the keys ``lo <= key < hi`` and stops on the page that passes ``hi``; a
  store that ignores the offset costs pages, never a key twice.

A prefix whose keys are all in one "directory" never splits (nothing to split at), nor
does a store whose offset may skip keys (``Bucket.splits``: a versioned S3 bucket): the
plain loop's speed. Keys become paths in ``source.py``; this module only collects them,
with what the manifest records of each (``ObjectInfo``). Figures: docs/design.md
"Object-store sources".
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..tuning import LIST_PAGE, LIST_RANGE_FILL, LIST_SPLIT_DEPTH, LIST_SPLIT_WAIT, LIST_SPLIT_WAIT_MIN
from .bucket import Bucket, ObjectInfo

log = logging.getLogger(__name__)


@dataclass
class _Range:
    """Keys ``lo <= key < hi`` (``hi`` None: to the end); ``lo`` is "" or a common prefix."""

    lo: str
    hi: str | None = None
    expect: int = 0         # the keys it is guessed to hold (0: unknown)
    last: str = ""          # the last key it gave
    ended: bool = False


def list_objects(bucket: Bucket, workers: int,
                 progress: Callable[[int, int], None] | None = None) -> list[ObjectInfo]:
    """Every object below the bucket URL's prefix, in no particular order;
    ``progress(objects, bytes)`` after each page; ``SourceError`` (one line) if a
    listing request fails."""
    return _Listing(bucket, workers, progress).run()


class _Listing:
    """One listing: ranges run on a pool of ``workers`` threads, each keeping its own keys
    of every page it gets; the calling thread only waits, and splits the head once it
    waits on the server (module docstring). Not reusable.

    The calling thread wakes for the head's first page, a range's end, and the head's
    wait, never per page: a GIL hand-off a page is a cost a one-response listing of 10^4
    keys shows (docs/design.md "Object-store sources", "Listing")."""

    def __init__(self, bucket: Bucket, workers: int,
                 progress: Callable[[int, int], None] | None) -> None:
        self.bucket = bucket
        self.base = bucket.url.prefix
        self.workers = workers
        self.progress = progress
        self.found: list[ObjectInfo] = []
        self.nbytes = 0
        self._lock = threading.Lock()       # everything below, and each range's hi and last
        self._changed = threading.Condition(self._lock)
        self._running = 0
        self._error: Exception | None = None
        self._t0 = time.monotonic()
        self._first_page = 0.0              # s from the start to the head's first page
        self._head_page = 0.0               # monotonic time of the head's last page
        self._stop = threading.Event()
        self._asked = False                 # the split's prefixes were listed: never twice
        self._tried = 0.0                   # the head's page a split found nothing after

    def run(self) -> list[ObjectInfo]:
        head = _Range("")
        with ThreadPoolExecutor(self.workers, thread_name_prefix="kspeedfs-list") as pool:
            try:
                self._start(pool, head)
                self._watch(pool, head)
            finally:
                self._stop.set()
        if self._error is not None:
            raise self._error
        return self.found

    def _start(self, pool: ThreadPoolExecutor, r: _Range) -> None:
        with self._lock:
            self._running += 1
        pool.submit(self._list_range, r)

    def _watch(self, pool: ThreadPoolExecutor, head: _Range) -> None:
        """Until every range ended (or one failed); the split when the head has waited
        ``LIST_SPLIT_WAIT`` of its first page's time for its next (tried again after its
        next page when its keys so far gave nothing to split at)."""
        while True:
            with self._lock:
                if not self._running or self._error is not None:
                    return
                if self._asked or not self._first_page:
                    self._changed.wait()
                    continue
                wait = max(self._first_page * LIST_SPLIT_WAIT, LIST_SPLIT_WAIT_MIN)
                left = wait - (time.monotonic() - self._head_page)
                if left > 0 or self._tried == self._head_page:
                    self._changed.wait(left if left > 0 else wait)
                    continue
                self._tried = self._head_page
            self._split(pool, head)

    def _list_range(self, r: _Range) -> None:
        """A pool thread: ``r``'s pages, its own keys of each kept."""
        try:
            for page in self.bucket.list_keys(self.base, r.lo[:-1], r.expect):
                with self._lock:
                    passed = self._keep(r, page)
                if passed or self._stop.is_set():
                    break
        except Exception as e:      # noqa: BLE001 - raised in the calling thread
            with self._lock:
                self._error = self._error or e
        finally:
            with self._lock:
                r.ended = True
                self._running -= 1
                self._changed.notify()

    def _keep(self, r: _Range, page: list[ObjectInfo]) -> bool:
        """(Under the lock) ``r``'s keys of ``page``; whether the page passed ``r``'s end."""
        hi = r.hi
        mine = [o for o in page if o.key >= r.lo and (hi is None or o.key < hi)]
        self.found.extend(mine)
        self.nbytes += sum(o.size for o in mine)
        if page:
            r.last = page[-1].key
        if not r.lo:                        # the head
            self._head_page = time.monotonic()
            if not self._first_page:
                self._first_page = self._head_page - self._t0
                self._changed.notify()
        if self.progress:
            self.progress(len(self.found), self.nbytes)
        return bool(page) and hi is not None and page[-1].key >= hi

    # -- the split ----------------------------------------------------------------------

    def _split(self, pool: ThreadPoolExecutor, head: _Range) -> None:
        """Cut what lies after the head's last key into ranges and start them (the head
        keeps the first), unless there is nothing to split at."""
        with self._lock:
            last = head.last
        if not self.bucket.splits():
            self._asked = True
            return
        points = self._points(last)
        with self._lock:
            points = [(p, n) for p, n in points if p > head.last]    # past its pages meanwhile
            runs = _group(points, self.workers)
            if not runs or head.ended:
                return
            head.hi = runs[0][0]
        log.debug("%s: listing split after %s into %d more ranges", self.bucket.url,
                  head.last, len(runs))
        for (lo, expect), hi in zip(runs, [*(lo for lo, _ in runs[1:]), None], strict=True):
            self._start(pool, _Range(lo, hi, expect))

    def _points(self, last: str) -> list[tuple[str, float]]:
        """Common prefixes after ``last``, each with the keys it is guessed to hold: the
        level's keys per directory among those the head has listed."""
        points: list[tuple[str, float]] = []
        level = self.base
        for _ in range(LIST_SPLIT_DEPTH):
            rel = last[len(level):]
            if "/" not in rel or len(points) >= self.workers:
                break               # ``last`` is this level's object: nothing below to split
            here = level + rel.split("/", 1)[0] + "/"       # the directory it is in
            self._asked = True
            _, prefixes = self.bucket.list_level(level)
            with self._lock:
                weight = self._keys_per_dir(level)
            points = [(p, weight) for p in sorted(prefixes) if p > here] + points
            level = here
        return points

    def _keys_per_dir(self, level: str) -> float:
        """Keys per directory of ``level`` among those listed so far below it."""
        dirs = set()
        n = 0
        for o in self.found:
            rel = o.key[len(level):] if o.key.startswith(level) else ""
            if "/" in rel:
                dirs.add(rel.split("/", 1)[0])
                n += 1
        return n / max(1, len(dirs))


def _group(points: list[tuple[str, float]], workers: int) -> list[tuple[str, int]]:
    """The ranges after the head's, each as (its first prefix, the keys guessed in it):
    ``points`` (sorted, with guessed keys) in runs of whole pages, at least ``workers``
    runs while they make a page each; the head's run (one page in flight) is one page.
    None when all fit in that one."""
    total = sum(n for _, n in points)
    pages = max(1, int(total // (workers * LIST_PAGE)))
    starts: list[str] = []
    counts = [0.0]                  # the head's run first
    target = LIST_RANGE_FILL * LIST_PAGE
    for p, n in points:
        if counts[-1] + n > target and counts[-1]:
            starts.append(p)
            counts.append(0.0)
            target = LIST_RANGE_FILL * LIST_PAGE * pages
        counts[-1] += n
    return [(p, round(n)) for p, n in zip(starts, counts[1:], strict=True)]
