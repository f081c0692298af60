"""The memory tier: a byte-bounded LRU of verified, immutable chunks.

LRU rather than something cleverer because the workload (epochs over a dataset,
shuffled within an epoch) has no reuse skew for frequency to exploit, and when the
dataset does not fit, no policy beats the others by much; LRU is O(1) with an
OrderedDict and easy to reason about. Used only from the trio thread: no lock.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

log = logging.getLogger(__name__)


class MemoryCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._chunks: OrderedDict[bytes, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._chunks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._chunks

    def get(self, key: bytes) -> bytes | None:
        data = self._chunks.get(key)
        if data is not None:
            self._chunks.move_to_end(key)
        return data

    def put(self, key: bytes, data: bytes) -> None:
        if len(data) > self.capacity:
            return
        old = self._chunks.pop(key, None)
        if old is not None:
            self.used -= len(old)
        self._chunks[key] = data
        self.used += len(data)
        while self.used > self.capacity:
            _, evicted = self._chunks.popitem(last=False)
            self.used -= len(evicted)

    def discard(self, key: bytes) -> None:
        old = self._chunks.pop(key, None)
        if old is not None:
            self.used -= len(old)
