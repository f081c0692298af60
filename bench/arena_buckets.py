"""How full index buckets refuse chunks: the node arena's placement, on random keys.

    python -m bench.arena_buckets [--seed 1]

Fills real ``Arena`` objects (``kspeedfs/cluster/arena.py``: two buckets a key, the
second only past ``SPILL`` entries in the first) with random 16-byte keys of one share
(rank 0, no SSD tier) up to a fill level, and prints, per arena size and fill: the
chunks refused (both of a key's buckets full), the arenas that refused any, and the
keys that sit in their second bucket (what a reader of an earlier version, which READs
only the first, misses). Beside them, from the same keys, what one bucket a key refused
(the keys past WAYS in their first bucket: the layout before 01a3286). No network, no
files: a few seconds.

Measured here (seed 1; docs/design.md, "Arena and index"):

    slots  fill  arenas  refused, two buckets  any  in second   refused, one bucket  any
      128  0.90    4000              0.0000 %  0.000      3.0 %              0.429 %  0.305
      128  1.00    4000              0.0000 %  0.000      4.3 %              0.740 %  0.487
     4096  1.00     200              0.0000 %  0.000      4.6 %              0.806 %  1.000
    65536  1.00      10              0.0000 %  0.000      4.7 %              0.872 %  1.000
"""
from __future__ import annotations

import argparse
import random
from collections import Counter

from kspeedfs.cluster.arena import BUCKET_BYTES, ENTRY, WAYS, Arena, Geometry, buckets_of


class _Plain:
    """A bytearray with the registered-buffer interface ``Arena`` writes through."""

    def __init__(self, n: int) -> None:
        self.length = n
        self.b = bytearray(n)

    def write(self, data: bytes | bytearray | memoryview, offset: int = 0) -> None:
        self.b[offset:offset + len(data)] = data

    def read(self, length: int, offset: int = 0) -> bytes:
        return bytes(self.b[offset:offset + length])


def fill(nslots: int, level: float, rnd: random.Random) -> tuple[int, int, int, int]:
    """One arena of ``nslots`` 16-byte slots given ``level × nslots`` random keys: (keys,
    refused, keys in their second bucket, refused with one bucket a key)."""
    g = Geometry.for_memory(nslots * 16, 16)
    index = _Plain(g.index_bytes)
    arena = Arena(g, _Plain(g.arena_bytes), index, rank=lambda k: 0)
    keys = [rnd.randbytes(16) for _ in range(int(nslots * level))]
    refused = sum(not arena.put(k, b"x") for k in keys)
    second = 0
    for b in range(g.nbuckets):
        bucket = index.read(BUCKET_BYTES, b * BUCKET_BYTES)
        for w in range(WAYS):
            key, _, length, _ = ENTRY.unpack_from(bucket, w * ENTRY.size)
            second += bool(length) and buckets_of(key, g.nbuckets)[0] != b
    first = Counter(buckets_of(k, g.nbuckets)[0] for k in keys)
    one_bucket = sum(max(0, n - WAYS) for n in first.values())
    return len(keys), refused, second, one_bucket


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rnd = random.Random(args.seed)
    print("slots  fill  arenas  refused, two buckets  any  in second   refused, one bucket  any")
    for nslots, level, arenas in ((128, 0.9, 4000), (128, 1.0, 4000), (4096, 1.0, 200),
                                  (65536, 1.0, 10)):
        keys = refused = second = one = any_two = any_one = 0
        for _ in range(arenas):
            k, r, s, o = fill(nslots, level, rnd)
            keys, refused, second, one = keys + k, refused + r, second + s, one + o
            any_two += r > 0
            any_one += o > 0
        print(f"{nslots:5d}  {level:.2f}  {arenas:6d}  {100 * refused / keys:18.4f} %  "
              f"{any_two / arenas:.3f}  {100 * second / keys:7.1f} %  "
              f"{100 * one / keys:17.3f} %  {any_one / arenas:.3f}")


if __name__ == "__main__":
    main()
