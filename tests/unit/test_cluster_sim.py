"""The cluster simulator's placement-move arithmetic (``bench/sim/moves.py``).

``bench.cluster_sim`` reports, per N, the share of replicas a join or a leave moves and
holds it against 1/N; these tests check that count against ``placement.owners``
directly, on changes small enough to count by hand, and that it notices movement that
rendezvous hashing should never cause (``foreign``)."""
from __future__ import annotations

from bench.sim.moves import chunk_keys, moves
from kspeedfs.cluster.placement import Member, owners

KEYS = chunk_keys(2000)


def test_a_leave_moves_exactly_the_leavers_replicas() -> None:
    ms = [Member(f"n{i}") for i in range(20)]
    gone = ms[7].node
    held = sum(gone in owners(k, ms, 2) for k in KEYS)
    m = moves(KEYS, ms, [x for x in ms if x.node != gone], 2)
    assert m.moved == m.touched == held             # one new owner per chunk it held
    assert m.foreign == 0
    p, sd = m.expected(20)
    assert p == 1 / 20 and abs(m.moved_fraction - p) < 4 * sd


def test_a_join_moves_only_to_the_joiner() -> None:
    ms = [Member(f"n{i}") for i in range(20)]
    joiner = Member("n20")
    taken = sum(joiner.node in owners(k, ms + [joiner], 2) for k in KEYS)
    m = moves(KEYS, ms, ms + [joiner], 2)
    assert m.moved == taken and m.foreign == 0
    p, sd = m.expected(21)
    assert abs(m.moved_fraction - p) < 4 * sd


def test_weights_change_the_share_a_joiner_takes() -> None:
    ms = [Member(f"n{i}") for i in range(10)]
    m = moves(KEYS, ms, ms + [Member("big", 10.0)], 1)
    assert 0.4 < m.moved_fraction < 0.6                 # weight 10 of 20: half the chunks


def test_movement_among_bystanders_is_counted_as_foreign() -> None:
    a = [Member(f"n{i}") for i in range(4)]
    b = [Member(f"n{i}", 1.0 + i) for i in range(4)]   # same nodes, weights changed
    m = moves(KEYS, a, b, 1)
    assert m.moved > 0 and m.foreign == m.moved


def test_nothing_changes_nothing_moves() -> None:
    ms = [Member(f"n{i}") for i in range(5)]
    m = moves(KEYS[:200], ms, list(reversed(ms)), 2)
    assert (m.moved, m.touched, m.foreign) == (0, 0, 0)
