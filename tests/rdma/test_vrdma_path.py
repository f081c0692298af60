"""vRDMA pure logic: heartbeat arithmetic, the path state machine, path choice.

No I/O and no provider: the state machines are driven directly (Hypothesis for the path
machine, against a tiny model of what the diagram in rdma/vrdma/path.py promises).
"""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rdma.enums import IBV_WC_RETRY_EXC_ERR, IBV_WC_WR_FLUSH_ERR
from rdma.vrdma.heartbeat import HeartbeatConfig, Liveness
from rdma.vrdma.path import Path, PathMachine, PathState, choose_path

CFG = HeartbeatConfig()


def test_default_detection_is_under_100ms() -> None:
    lo, hi = CFG.detection_bounds()
    assert (lo, hi) == pytest.approx((0.040, 0.060))
    assert CFG.unreachable_bound() < 0.5
    assert hi < 0.1


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        HeartbeatConfig(interval=0)
    with pytest.raises(ValueError):
        HeartbeatConfig(suspect_after=6, miss_threshold=5)


def test_liveness_needs_an_overdue_probe_to_blame_the_path() -> None:
    live = Liveness(CFG, now=0.0)
    # the loop stalled for 100 ms and posted no probe: not the path's fault
    assert live.verdict(0.100) == "ok"
    live.probe_posted(0.100)
    assert live.verdict(0.105) == "ok"
    assert live.verdict(0.115) == "suspect"
    assert live.verdict(0.140) == "down"
    live.ok(0.141)
    live.probe_done()
    assert live.verdict(0.142) == "ok"


def _up(m: PathMachine, now: float) -> None:
    m.rebuild_started(now)
    m.rebuild_connected(now)
    m.ok(now)
    assert m.state is PathState.UP


def simulate_failure(cfg: HeartbeatConfig, fail_at: float, rtt: float,
                     gap: float | None = None) -> tuple[float, int]:
    """Drive a path with the monitor's schedule (a tick every interval, a probe when the
    path wants one) until it dies at ``fail_at``; with ``gap``, data READs complete
    every ``gap`` until then. Returns the time DOWN is declared and the probes posted
    more than an interval before the failure."""
    m = PathMachine(0, cfg, 0.0)
    _up(m, 0.0)
    now, probe_done_at, probes_before_failure = 0.0, None, 0
    data_t = gap
    while True:
        now += cfg.interval
        while data_t is not None and data_t <= now and data_t < fail_at:   # traffic since
            m.live.data_ok(data_t)                                         # the last tick
            m.ok(data_t)
            data_t += gap
        if probe_done_at is not None and probe_done_at <= now:
            m.ok(probe_done_at)
            m.live.probe_done()
            probe_done_at = None
        t = m.tick(now)
        if t is not None and t.new is PathState.DOWN:
            return now, probes_before_failure
        if m.live.want_probe(now):
            probes_before_failure += now < fail_at - cfg.interval
            m.live.probe_posted(now)
            probe_done_at = now + rtt if now + rtt < fail_at else None


@given(fail_at=st.floats(0.05, 2.0), rtt=st.floats(0.0001, 0.004),
       interval=st.sampled_from([0.005, 0.010, 0.020]), misses=st.integers(2, 8))
def test_detection_within_computed_bounds(fail_at: float, rtt: float, interval: float,
                                          misses: int) -> None:
    cfg = HeartbeatConfig(interval=interval, miss_threshold=misses, suspect_after=1)
    declared, _ = simulate_failure(cfg, fail_at, rtt)
    lo, hi = cfg.detection_bounds(rtt)
    assert lo - 1e-9 <= declared - fail_at <= hi + interval + 1e-9


@given(fail_at=st.floats(0.05, 2.0), rtt=st.floats(0.0001, 0.004),
       interval=st.sampled_from([0.005, 0.010, 0.020]), misses=st.integers(2, 8),
       gap=st.floats(0.0002, 0.002))
def test_a_busy_path_is_not_probed_and_detection_keeps_its_bounds(
        fail_at: float, rtt: float, interval: float, misses: int, gap: float) -> None:
    """Data READs complete every ``gap`` (< interval/2) until the path dies: no probe
    goes out while they do, and DOWN still comes within the computed bounds."""
    cfg = HeartbeatConfig(interval=interval, miss_threshold=misses, suspect_after=1)
    declared, probes_before_failure = simulate_failure(cfg, fail_at, rtt, gap)
    assert probes_before_failure == 0
    lo, hi = cfg.detection_bounds(rtt)
    assert lo - 1e-9 <= declared - fail_at <= hi + interval + 1e-9


def test_error_wc_is_immediate_and_rebuild_rejoins_on_heartbeat() -> None:
    m = PathMachine(0, CFG, 0.0)
    _up(m, 0.0)
    t = m.wc_error(IBV_WC_RETRY_EXC_ERR, 1.0)
    assert t is not None and t.new is PathState.DOWN and "RETRY_EXC" in t.reason
    assert m.wc_error(IBV_WC_WR_FLUSH_ERR, 1.0) is None       # flushes after: nothing new
    assert not m.postable and m.next_attempt == 1.0
    m.rebuild_started(1.0)
    assert m.state is PathState.REBUILDING and not m.postable
    m.rebuild_connected(1.2)
    assert m.state is PathState.REBUILDING                    # not until READs flow
    t = m.ok(1.25)
    assert t is not None and t.new is PathState.UP
    assert m.last_rebuild_seconds == pytest.approx(0.25)


def test_last_path_is_held_not_failed_on_silence() -> None:
    m = PathMachine(0, CFG, 0.0)
    _up(m, 0.0)
    m.live.probe_posted(0.0)
    t = m.tick(0.2, hold=True)
    assert t is not None and t.new is PathState.SUSPECT and "held" in t.reason
    assert m.silent_dead(0.2) and m.alive
    assert m.tick(0.3, hold=True) is None
    t = m.ok(0.31)                                  # the stall ends: nothing was lost
    assert t is not None and t.new is PathState.UP and not m.silent_dead(0.31)
    m.live.probe_posted(0.31)
    assert m.tick(0.5, hold=False).new is PathState.DOWN   # another path is alive now
    assert m.wc_error(12, 0.5) is None


def test_failed_rebuilds_back_off_and_cap() -> None:
    m = PathMachine(0, CFG, 0.0)
    _up(m, 0.0)
    m.fail("x", 0.0)
    rng = random.Random(1)
    waits = []
    now = 0.0
    for _ in range(10):
        m.rebuild_started(now)
        m.rebuild_failed("refused", now, rng)
        waits.append(m.next_attempt - now)
        now = m.next_attempt
    assert waits[0] < 0.1
    assert all(w <= CFG.rebuild_backoff_max * 1.25 for w in waits)
    assert waits[-1] >= CFG.rebuild_backoff_max * 0.75


def test_never_up_paths_retry_slowly() -> None:
    m = PathMachine(0, CFG, 0.0)
    for i in range(12):
        m.rebuild_started(float(i))
        m.rebuild_failed("no route", float(i), random.Random(0))
    assert m.next_attempt - 11 > CFG.rebuild_backoff_max
    assert not m.ever_up and m.downs == 0


def _paths(states: list[PathState], loads: list[int]) -> list[Path]:
    out = []
    for i, (s, n) in enumerate(zip(states, loads, strict=True)):
        p = Path(i, f"10.0.{i}.1", f"10.0.{i}.2", CFG, 0.0)
        p.m.state = s
        p.data_inflight = n
        out.append(p)
    return out


def test_choose_path_least_loaded_round_robin_suspect_fallback() -> None:
    U, S, D = PathState.UP, PathState.SUSPECT, PathState.DOWN
    ps = _paths([U, U, D], [3, 1, 0])
    assert choose_path(ps, 0, 255).id == 1
    ps = _paths([U, U], [2, 2])
    assert {choose_path(ps, rr, 255).id for rr in range(2)} == {0, 1}
    ps = _paths([S, D, PathState.REBUILDING], [5, 0, 0])
    assert choose_path(ps, 0, 255).id == 0           # only a SUSPECT path left: use it
    ps = _paths([U, S], [7, 0])
    assert choose_path(ps, 0, 255).id == 0           # SUSPECT only when nothing is UP
    assert choose_path(ps, 0, 7).id == 1             # ... or UP ones are full
    assert choose_path(_paths([D, D], [0, 0]), 0, 255) is None


class PathModel(RuleBasedStateMachine):
    """Random event sequences on one PathMachine; invariants from the diagram."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.m = PathMachine(0, CFG, 0.0)
        self.closed = False

    def _t(self, t) -> None:  # noqa: ANN001
        if t is not None:
            assert t.old is not t.new
            assert t.new is not PathState.CLOSED or self.closed

    @rule(dt=st.floats(0.0, 0.1), hold=st.booleans())
    def tick(self, dt: float, hold: bool) -> None:
        self.now += dt
        before = self.m.state
        self._t(self.m.tick(self.now, hold=hold))
        if hold and before in (PathState.UP, PathState.SUSPECT):
            assert self.m.state is not PathState.DOWN      # a held last path stays

    @rule()
    def ok(self) -> None:
        before = self.m.state
        self._t(self.m.ok(self.now))
        if before in (PathState.SUSPECT, PathState.REBUILDING) and self.m.connected:
            assert self.m.state is PathState.UP

    @rule(status=st.sampled_from([IBV_WC_RETRY_EXC_ERR, IBV_WC_WR_FLUSH_ERR]))
    def wc_error(self, status: int) -> None:
        was_connected = self.m.connected
        self._t(self.m.wc_error(status, self.now))
        if was_connected and not self.closed:
            assert self.m.state is PathState.DOWN

    @rule()
    def probe(self) -> None:
        self.m.live.probe_posted(self.now)

    @rule()
    def rebuild_start(self) -> None:
        before = self.m.state
        self._t(self.m.rebuild_started(self.now))
        if before is PathState.DOWN:
            assert self.m.state is PathState.REBUILDING

    @rule(succeed=st.booleans())
    def rebuild_end(self, succeed: bool) -> None:
        if succeed:
            self._t(self.m.rebuild_connected(self.now))
        else:
            self._t(self.m.rebuild_failed("x", self.now))
            if not self.closed:
                assert self.m.state is not PathState.REBUILDING

    @precondition(lambda self: not self.closed)
    @rule()
    def close(self) -> None:
        self.closed = True
        self._t(self.m.close(self.now))

    @invariant()
    def consistent(self) -> None:
        m = self.m
        if self.closed:
            assert m.state is PathState.CLOSED and not m.connected
        if m.state in (PathState.UP, PathState.SUSPECT):
            assert m.connected and m.ever_up
        if m.state is PathState.DOWN:
            assert not m.connected
        assert m.postable == (m.state is PathState.UP)


TestPathModel = PathModel.TestCase
TestPathModel.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
