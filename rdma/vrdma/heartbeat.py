"""Per-path heartbeats: the interval/miss arithmetic, and why the defaults are what they are.

What a heartbeat is here
------------------------
An 8-byte RDMA READ, on the path's own QP, of the peer's *heartbeat word*: the first 8
bytes of a small control MR the peer's endpoint registers on every one of its NICs and
advertises in the handshake.  The word holds the peer's *incarnation* (a random 64-bit
number drawn at endpoint start), so a probe also proves we are still talking to the same
process.  READ rather than SEND/RECV because:

* it exercises exactly what the data path uses (the QP, the remote NIC, an rkey, the
  one-sided responder) -- a SEND/RECV ping could succeed on a path where READs fail;
* the responder spends no CPU and needs no receive buffers to be replenished, so there is
  no RNR failure mode and nothing on the peer to fall behind under load (an overloaded
  peer process must not look like a dead NIC);
* it is idempotent, like the data READs, so a probe lost with its path needs no cleanup.

The cost of that choice: a peer process that is alive but hung (SIGSTOP) still answers on
hardware (the NIC serves READs), so heartbeats detect *path* death, not a wedged server.
(On the soft provider the engine lives in the peer process; a SIGSTOP does stop it.)

Any successful completion on the path counts as a heartbeat ("traffic is a heartbeat"):
a 1 MiB READ queued in front of the probe must not make a busy, healthy path look silent.
And a path whose data READs completed within the last half interval is not probed at
all: while it carries traffic, the traffic is its heartbeat. (Probing busy paths anyway
cost a mount daemon reading from 3 peers 600 probes/s and ~8 % of its main thread.) When
the traffic stops, for whatever reason, probing resumes at the next tick, so the bounds
below hold as if every tick had probed.

The arithmetic
--------------
Let ``I`` = ``interval`` and ``M`` = ``miss_threshold``.  Probes are posted every ``I``
(at most one in flight per path), and the monitor ticks every ``I``.  A path is

* SUSPECT when nothing has completed on it for ``suspect_after·I``: no *new* READs go
  there (in-flight ones keep their chance), so load moves away before the verdict;
* DOWN when nothing has completed for ``M·I``.

Both verdicts also need the probe that should have broken the silence to be overdue
itself (out for ``(k-1)·I``): if our own event loop stalled and posted no probe, the path
is not blamed for it.  While a path is healthy something completes at least every ``I``
(+ RTT), so the last success before a failure is at most ``I + rtt`` old when the failure
happens; DOWN is declared at the first tick after ``M·I`` of silence.  Hence::

    detection  ∈  [ (M-1)·I ,  (M+1)·I + rtt + tick jitter ]

(``tests/rdma/test_vrdma_path.py`` checks this against a simulated schedule for many
``I``, ``M``, RTT and failure times.)  Two exceptions, both to keep a starved host from
killing healthy paths: a path whose CQ still holds unconsumed WCs is not silent, and the
*last* live path is held SUSPECT instead of DOWN -- the peer-dead clock starts from its
silence instead, so PeerUnreachable keeps the bound below (:mod:`.path`).

Defaults: ``I = 10 ms``, ``M = 5``, ``suspect_after = 2``  →  detection 40–60 ms, and the
in-flight READs of the dead path are re-posted on a healthy one right after (the QP is
moved to ERR, its WRs flush, each flush re-posts), so the caller-visible stall is about
``(M+1)·I`` ≈ 60 ms + one READ -- inside the ~100 ms the issue asks for, with ~40 ms of
headroom for scheduling jitter of a Python event loop.  Measured on the netns testbed
(soft provider, 8 READs of 4–64 KiB in flight): NIC down → path DOWN in 58–82 ms, the
slowest READ caught by the failure completes after 57–127 ms, no READ fails.  Why not
smaller: a trio loop busy with checksum work can be late by a few ms; ``M·I`` = 50 ms
is ~10× that, so a healthy path is not declared dead by a late tick (a false DOWN costs
a rebuild, not data, but it costs it on every path at once).  Cost: 100 probes/s per
path of 8 bytes -- negligible for a handful of peers; for hundreds of peers raise ``I``
(detection scales linearly).

Idle virtual QPs probe slowly.  A vQP with no data READ for ``idle_after`` (and none in
flight or waiting) ticks and probes every ``idle_interval`` (default 100 ms) instead of
every ``I``.  Measured before this: three idle nodes of the netns test-bed, each holding
vQPs to the other two, spent 8–11 % of a core apiece on probes and monitor ticks, a
third of a 2-vCPU machine doing nothing.  Detection on an idle vQP is the same verdict
(silence *and* an overdue probe), reached at the first idle tick after the probe is
overdue: ≤ ``2·idle_interval``.  Nobody waits on it: the first READ after an idle spell
wakes the monitor at once, which probes every path then and ticks every ``I`` from
there on, so a path that died while idle is DOWN within ``(M-1)·I`` + a tick of that
READ being posted, and the READ is re-posted as usual (its stall is bounded as above).

Quiet virtual QPs probe more slowly still.  "Idle" counts only the READs Python posts
through the vQP: a mount whose peer READs are the native fetch's (posted from C,
``VQP.native_target``; completions told by ``VQP.native_done``) is idle in that sense
while busy, and its monitor's idle ticks are what find a NIC that dies under C's
READs, so they stay at ``idle_interval``.  Once no READ of either kind has been posted
or completed for ``idle_after``, the vQP is quiet: it ticks and probes every
``quiet_interval`` (default 1 s), and the next READ of either kind posted from Python
wakes it (C starts READs only on routes Python gave after posting one itself).
Measured: a mount idle beside 3 nodes (2 rails, 6 paths) spends 0.003 CPU-s
a second of its Python thread, against 0.017 at 100 ms (~0.2–0.26 ms a probe); beside
64 nodes that is ~0.06 of a core against ~0.36.

The transport timeout of the QPs (``qp_timeout_ms`` × (``retry_cnt``+1), default 250 ms ×
4 on soft; verbs exponent 16 ≈ 268 ms × 4) is only the backstop: heartbeats (or a reset TCP
connection on soft, or an error WC) decide first.  It is deliberately loose (~1 s): the
transport timer cannot be held like the last path's heartbeat verdict, and on a starved
host (load ~20 on 2 CPUs in our tests) a 300 ms timer killed healthy last paths.

This module is pure: no I/O, no clock of its own (``now`` is passed in), so tests drive it.
"""
from __future__ import annotations

from dataclasses import dataclass

#: bytes read by one probe (the peer's incarnation word)
HEARTBEAT_BYTES = 8


@dataclass(frozen=True)
class HeartbeatConfig:
    """Heartbeat and failure-handling knobs of one virtual QP (all times in seconds)."""

    interval: float = 0.010
    miss_threshold: int = 5
    suspect_after: int = 2
    #: a vQP with no data READ for ``idle_after`` s ticks and probes every ``idle_interval``
    idle_interval: float = 0.100
    idle_after: float = 1.0
    #: ... and every ``quiet_interval`` once no READ of the native fetch's has been posted
    #: or completed on it for ``idle_after`` either (``ReadDispatcher.idle_tick``)
    quiet_interval: float = 1.0
    #: all paths dead for this long → pending and new READs get PeerUnreachable
    unreachable_grace: float = 0.25
    #: a READ parked because no path is UP (paths flapping, rebuilding) fails with
    #: PeerUnreachable once it is this old.  A READ parked only because every UP path's
    #: queue is full is never failed for it: that is load, not unreachability.
    read_timeout: float = 5.0
    #: a READ re-posted this many times (its paths kept failing under it) gives up
    max_reposts: int = 16
    #: per-try transport timeout (soft provider extension) and retries: the backstop
    qp_timeout_ms: int = 250
    qp_timeout_exp: int = 16
    qp_retry_cnt: int = 3
    #: rebuild retry backoff: base doubling up to max (with ±25 % jitter).  One attempt is
    #: a TCP connect + handshake, cheap enough to try 4×/s; the cap bounds how long a
    #: repaired NIC waits for its path to be rebuilt (≤ max + one build, ~0.3 s)
    rebuild_backoff: float = 0.05
    rebuild_backoff_max: float = 0.25
    #: paths that never came up at all (e.g. cross-rail pairs) retry this slowly
    never_up_backoff_max: float = 2.0
    #: connect + handshake budget of one path (re)build
    connect_timeout: float = 1.0

    def __post_init__(self) -> None:
        if self.interval <= 0:
            raise ValueError(f"interval={self.interval}: must be > 0")
        if self.idle_interval < self.interval:
            raise ValueError(f"idle_interval={self.idle_interval}: must be >= interval "
                             f"({self.interval})")
        if self.quiet_interval < self.idle_interval:
            raise ValueError(f"quiet_interval={self.quiet_interval}: must be >= "
                             f"idle_interval ({self.idle_interval})")
        if not 1 <= self.suspect_after <= self.miss_threshold:
            raise ValueError(f"need 1 <= suspect_after ({self.suspect_after}) <= "
                             f"miss_threshold ({self.miss_threshold})")

    @property
    def suspect_silence(self) -> float:
        return self.suspect_after * self.interval

    @property
    def down_silence(self) -> float:
        return self.miss_threshold * self.interval

    def detection_bounds(self, rtt: float = 0.0) -> tuple[float, float]:
        """(earliest, latest) time from a path dying to it being declared DOWN."""
        return ((self.miss_threshold - 1) * self.interval,
                (self.miss_threshold + 1) * self.interval + rtt)

    def unreachable_bound(self, rtt: float = 0.0) -> float:
        """Worst case from the last path dying to a pending READ raising PeerUnreachable
        (plus event-loop jitter): detection, then the grace period, then one tick."""
        return self.detection_bounds(rtt)[1] + self.unreachable_grace + self.interval


class Liveness:
    """Silence bookkeeping of one path: when did something last complete, is a probe out.

    ``ok(now)`` on every successful completion (probe or data); ``verdict(now)`` says how
    long the path has been silent in units the path state machine understands.
    """

    __slots__ = ("cfg", "last_ok", "last_data", "probe_since")

    def __init__(self, cfg: HeartbeatConfig, now: float) -> None:
        self.cfg = cfg
        self.last_ok = now
        self.last_data = float("-inf")
        self.probe_since: float | None = None

    def reset(self, now: float) -> None:
        self.last_ok = now
        self.last_data = float("-inf")
        self.probe_since = None

    def ok(self, now: float) -> None:
        if now > self.last_ok:
            self.last_ok = now

    def probe_posted(self, now: float) -> None:
        self.probe_since = now

    def probe_done(self) -> None:
        self.probe_since = None

    def data_ok(self, now: float) -> None:
        """A data READ completed: besides ``ok``, it stands in for the next probe."""
        self.ok(now)
        if now > self.last_data:
            self.last_data = now

    def want_probe(self, now: float) -> bool:
        """Post a probe when none is in flight (one is enough: RC retries it, and a lost
        one shows up as silence anyway) and no data READ completed in the last half
        interval: a busy path is proven alive by its traffic and is not probed."""
        return self.probe_since is None and now - self.last_data >= self.cfg.interval / 2

    def silence(self, now: float) -> float:
        return max(0.0, now - self.last_ok)

    def verdict(self, now: float) -> str:
        """``"ok"``, ``"suspect"`` or ``"down"``.

        Silence alone is not enough: the probe that should have broken it must itself be
        overdue (out for ``(k-1)·I``).  If the event loop stalled and no probe went out,
        the path is not blamed for our own lateness; a probe is posted instead."""
        s = self.silence(now)
        age = -1.0 if self.probe_since is None else now - self.probe_since
        iv = self.cfg.interval
        if s >= self.cfg.down_silence and age >= (self.cfg.miss_threshold - 1) * iv:
            return "down"
        if s >= self.cfg.suspect_silence and age >= (self.cfg.suspect_after - 1) * iv:
            return "suspect"
        return "ok"
