"""Prefetch: a sequential reader finds its next chunks already loading.

Per open file we remember where the last read ended. A read that starts there is
sequential; after ``trigger`` sequential reads the window opens: the next
``depth`` chunks past the one being read are started as background loads (through
the single-flight, so a prefetch and a demand read of one chunk are one load).
Random readers never trigger it, so they do not pay for bytes they will not read.
The kernel's own readahead (``read_ahead_kb``, set after mount) covers the gap within
a chunk; this covers the latency of fetching whole chunks from the next tier.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Stream:
    """Sequential-read state of one open file handle."""

    next_offset: int = 0
    run: int = 0              # consecutive sequential reads
    prefetched_to: int = -1   # highest chunk index already requested


class Prefetcher:
    def __init__(self, depth: int, trigger: int = 2) -> None:
        self.depth = depth
        self.trigger = trigger

    def advise(self, stream: Stream, offset: int, size: int, chunks: range, last_chunk: int) -> range:
        """Record a read; return the chunks to start loading ahead (maybe empty)."""
        stream.run = stream.run + 1 if offset == stream.next_offset else 0
        stream.next_offset = offset + size
        if self.depth == 0 or stream.run < self.trigger or not chunks:
            return range(0)
        start = max(chunks[-1] + 1, stream.prefetched_to + 1)
        stop = min(chunks[-1] + 1 + self.depth, last_chunk + 1)
        if start >= stop:
            return range(0)
        stream.prefetched_to = stop - 1
        return range(start, stop)
