"""``python -m bench.arena_buckets``: it fills real arenas and counts what they refuse."""
from __future__ import annotations

import random

from bench.arena_buckets import fill


def test_a_full_arena_of_random_keys_refuses_none_and_one_bucket_would_have() -> None:
    rnd = random.Random(3)
    results = [fill(128, 1.0, rnd) for _ in range(20)]
    assert all(keys == 128 and refused == 0 and 0 <= second < keys
               for keys, refused, second, _ in results)
    assert sum(one for *_, one in results) > 0
