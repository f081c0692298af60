"""Placement: deterministic, distinct owners, balanced, weighted, minimal movement."""
from __future__ import annotations

import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from kspeedfs.cluster.placement import Member, load_per_node, owners, reader_order

KEYS = [struct.pack("<QQ", i, i * 7919) for i in range(6000)]


def test_owners_distinct_and_deterministic() -> None:
    ms = [Member(f"n{i}") for i in range(5)]
    for k in KEYS[:200]:
        o = owners(k, ms, 3)
        assert len(o) == len(set(o)) == 3
        assert o == owners(k, list(reversed(ms)), 3)      # order of members is irrelevant
    assert owners(KEYS[0], ms[:1], 2) == ["n0"]
    assert owners(KEYS[0], [], 2) == []


def test_balance_equal_nodes() -> None:
    ms = [Member(f"n{i}") for i in range(12)]
    load = load_per_node(KEYS, ms, 2)
    mean = len(KEYS) * 2 / 12
    assert max(load.values()) / mean < 1.12 and min(load.values()) / mean > 0.88


def test_weights_are_respected() -> None:
    ms = [Member("small", 1.0), Member("big", 3.0)] + [Member(f"n{i}", 2.0) for i in range(3)]
    load = load_per_node(KEYS, ms, 1)
    assert 2.6 < load["big"] / load["small"] < 3.4


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 12), r=st.integers(1, 3), leaver=st.integers(0, 11))
def test_a_leaving_node_moves_only_its_own_replicas(n: int, r: int, leaver: int) -> None:
    ms = [Member(f"n{i}") for i in range(n)]
    gone = ms[leaver % n].node
    rest = [m for m in ms if m.node != gone]
    for k in KEYS[:300]:
        before, after = owners(k, ms, r), owners(k, rest, r)
        if gone not in before:
            assert before == after
        else:
            assert set(before) - {gone} <= set(after)


def test_reader_tries_the_local_owner_first() -> None:
    ms = [Member(f"n{i}") for i in range(4)]
    for k in KEYS[:50]:
        o = owners(k, ms, 2)
        assert reader_order(k, ms, 2, o[1]) == [o[1], o[0]]
        assert reader_order(k, ms, 2, "elsewhere") == o
