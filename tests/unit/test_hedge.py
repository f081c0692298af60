"""The hedging rule (kspeedfs/cluster/hedge.py) as plain synchronous code: the threshold
(p99 × factor of a peer's recent READs of that size class, floor, cap, fallbacks), the
byte budget, suspicion (tried last, back after an in-time READ or the suspect time)
and the latency summary. The race itself runs in tests/cluster/test_cluster_tail.py."""
from __future__ import annotations

import pytest

from kspeedfs.cluster import hedge
from kspeedfs.cluster.hedge import BUCKETS_MS, Hedger, size_class
from kspeedfs.config import ClusterConfig
from kspeedfs.errors import ConfigError
from kspeedfs.tuning import HEDGE_MIN_SAMPLES, HEDGE_WINDOW

MS = 1e-3


def test_size_classes_are_powers_of_four_from_4k() -> None:
    assert [size_class(n) for n in (1, 256, 4096)] == [0, 0, 0]
    assert [size_class(n) for n in (4097, 16 << 10, 64 << 10, 128 << 10, 256 << 10)] == [1, 1, 2, 3, 3]
    assert [size_class(n) for n in (1 << 20, 4 << 20, (4 << 20) + 1, 1 << 30)] == [4, 5, 6, 6]


def test_threshold_is_p99_times_factor_clamped() -> None:
    h = Hedger(factor=2.0, floor=2 * MS, cap=100 * MS)
    assert h.threshold("a", 4096) == pytest.approx(100 * MS)       # no history: the cap
    for i in range(96):                                            # (recomputed every 16)
        h.done("a", 4096, (1 + i / 100) * MS)                      # 1.00 .. 1.95 ms
    assert h.threshold("a", 4096) == pytest.approx(2 * 1.95 * MS)  # p99 1.95 ms × 2
    assert h.threshold("a", 1 << 20) == pytest.approx(100 * MS)    # another size class
    assert h.threshold("b", 4096) == pytest.approx(2 * 1.95 * MS)  # b: the class over all peers
    for _ in range(HEDGE_WINDOW):
        h.done("c", 4096, 0.1 * MS)
    assert h.threshold("c", 4096) == pytest.approx(2 * MS)         # the floor
    for _ in range(HEDGE_WINDOW):
        h.done("d", 1 << 20, 80 * MS)
    assert h.threshold("d", 1 << 20) == pytest.approx(100 * MS)    # the cap


def test_a_late_read_is_no_sample_so_a_hang_does_not_raise_the_threshold() -> None:
    h = Hedger(factor=2.0, floor=2 * MS, cap=100 * MS)
    for _ in range(HEDGE_MIN_SAMPLES * 2):
        h.done("a", 4096, 1 * MS)
    t = h.threshold("a", 4096)
    for _ in range(50):
        h.done("a", 4096, 0.5, sample=False)                       # READs that lost a hedge
    assert h.threshold("a", 4096) == t
    s = h.latency("a", 0.0)
    assert s.reads == HEDGE_MIN_SAMPLES * 2 + 50 and s.longest_ms == 500.0
    assert s.counts[BUCKETS_MS.index(1.0)] == HEDGE_MIN_SAMPLES * 2 and s.counts[-2] == 50
    assert sum(s.counts) == s.reads


def test_budget_is_a_token_bucket_of_read_bytes() -> None:
    h = Hedger(budget=0.05, burst=1 << 20)
    assert h.may_hedge(1 << 20)                       # the burst
    assert not h.may_hedge(1)
    assert (h.hedges, h.refused, h.hedge_bytes) == (1, 1, 1 << 20)
    h.done("a", 10 << 20, 1 * MS)                     # 10 MiB READ: 512 KiB of credit
    assert h.may_hedge(512 << 10) and not h.may_hedge(1)
    for _ in range(100):
        h.done("a", 10 << 20, 1 * MS)
    assert h.credit == 1 << 20                        # never more than the burst
    # over any long run, hedged bytes <= budget × READ bytes + burst
    assert h.hedge_bytes <= 0.05 * h.read_bytes + h.burst


def test_repeated_overruns_make_a_peer_suspect_until_it_answers_in_time() -> None:
    h = Hedger(suspect_time=1.0)
    for _ in range(HEDGE_MIN_SAMPLES):
        h.done("b", 4096, 1 * MS)
    order = ["a", "b", "c"]
    h.overran("b", now=10.0)
    assert h.order(order, 10.0) == order              # once is chance
    h.overran("b", now=10.1)
    assert h.order(order, 10.2) == ["a", "c", "b"]    # twice: tried last
    assert h.latency("b", 10.2).suspected
    assert h.order(order, 11.2) == order              # the suspect time is over: in place
    h.overran("b", now=11.3)                          # one more overrun: suspect again
    assert h.order(order, 11.4) == ["a", "c", "b"]
    h.done("b", 4096, 1 * MS)                         # it answers in time: back at once
    assert h.order(order, 11.5) == order
    h.overran("b", now=11.6)                          # and the count started again
    assert h.order(order, 11.7) == order


def test_a_late_answer_does_not_clear_suspicion() -> None:
    h = Hedger()
    h.overran("a", 0.0)
    h.overran("a", 0.0)
    h.done("a", 4096, 0.4, sample=False)
    h.done("a", 4096, 0.4)                            # above the cap: not in time
    assert h.suspected("a", 0.5)


def test_config_keys() -> None:
    c = ClusterConfig()
    c.validate()
    hg = hedge.from_config(c)
    assert hg is not None and (hg.factor, hg.floor, hg.cap, hg.budget) == (2.0, 0.002, 0.1, 0.05)
    c.hedge = False
    assert hedge.from_config(c) is None
    for key, value in (("hedge_cap", 0.5), ("hedge_floor", 0.2), ("hedge_budget", 1.5),
                       ("hedge_factor", 0.5)):
        bad = ClusterConfig(**{key: value})
        with pytest.raises(ConfigError, match=f"cluster.hedge_{key.split('_')[1]}|cluster.hedge_cap"):
            bad.validate()
