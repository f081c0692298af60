"""The paths of one virtual QP, and the peer-level verdict drawn from them.

Each path has its own state machine (:mod:`.path`).  Seen from the peer, the vQP is in
one of these states (``VQP.statistics().state``)::

              a path leaves UP (SUSPECT, DOWN, REBUILDING)
  +-----------+  ------------------------------------------->  +----------+
  | reachable |                                                | degraded |
  +-----------+  <-------------------------------------------  +----------+
   every path ever UP is UP     every ever-UP path UP again         |
        |                                                            |
        |              no path UP or SUSPECT                         |
        +------------------------------+-----------------------------+
                                       v
                               +-------------+   a path UP again (rebuild,
                               | unreachable |   then its first heartbeat)
                               +-------------+  ---------------------------> reachable
                                                                             or degraded
      any --aclose()--> closed

The peer-dead clock (:attr:`PathSet.all_dead_since`) is stricter than "no path alive":
it starts the moment no path is alive *and talking*, i.e. also when the last path is held
SUSPECT (:mod:`.path`) but silent past the DOWN threshold with no WC waiting on its CQ.
Once that clock is ``unreachable_grace`` old, READs that wait and new READs fail with
:class:`~rdma.errors.PeerUnreachable` (:mod:`.dispatch`), and the held last path is
given up (:mod:`.monitor`).

Every path transition goes through :meth:`PathSet.note`, which is the one place that logs
it, moves the peer-dead clock, hands waiting READs to a path that came UP
(:attr:`PathSet.on_up`), wakes :meth:`VQP.wait_connected` and calls the user's
``on_transition``.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio

from ..errors import PathBroken, PeerUnreachable, WCError
from .heartbeat import HeartbeatConfig
from .path import Path, PathState, Transition

#: the vQP's log lines keep the logger name they always had (operators filter on it)
log = logging.getLogger("rdma.vrdma.vqp")


class PathSet:
    """The paths to one peer and what their states add up to.

    Synchronous, no tasks of its own: the CQ consumers, the monitor and the rebuild tasks
    report events here.

    Attributes:
        peer: the peer's node name (logs, errors).
        paths: one :class:`Path` per (local NIC, remote NIC) pair, ``paths[i].id == i``.
        all_dead_since: when the peer-dead clock started (see the module docstring), or
            ``None`` while some path is alive and talking.  Starts "now": no path is UP
            before the first build.
        last_broken: the :class:`PathBroken` of the latest path to go DOWN, the
            ``__cause__`` of the PeerUnreachable errors raised after it.
        on_up: called (no arguments) when a path comes UP, after the reachability update.
        on_transition: the user's callback, called last for every transition.
    """

    def __init__(self, peer: str, pairs: list[tuple[str, str]], cfg: HeartbeatConfig,
                 clock: Callable[[], float], now: float,
                 on_transition: Callable[[Transition], None] | None = None) -> None:
        self.peer = peer
        self.cfg = cfg
        self.clock = clock
        self.paths = [Path(i, l_, r, cfg, now) for i, (l_, r) in enumerate(pairs)]
        self.all_dead_since: float | None = now
        self.last_broken: BaseException | None = None
        self.on_up: Callable[[], None] | None = None
        self.on_transition = on_transition
        self._changed = trio.Event()

    # ------------------------------------------------------------------ queries
    def dead_for_grace(self, now: float) -> bool:
        """Has the peer been dead (no path alive and talking) for ``unreachable_grace``?"""
        return (self.all_dead_since is not None
                and now - self.all_dead_since >= self.cfg.unreachable_grace)

    def unreachable(self, now: float) -> PeerUnreachable:
        """The error for a READ given up on now, naming every path's state."""
        dead = 0.0 if self.all_dead_since is None else now - self.all_dead_since
        reasons = "; ".join(f"{p.name}: {p.m.state.value} ({p.m.reason})" for p in self.paths)
        e = PeerUnreachable(f"peer {self.peer} unreachable: every path dead for "
                            f"{dead * 1e3:.0f} ms ({reasons})", self.peer)
        e.__cause__ = self.last_broken
        return e

    def next_change(self) -> trio.Event:
        """An event set by the next transition (a fresh one per call)."""
        self._changed = trio.Event()
        return self._changed

    def state(self) -> str:
        """``"reachable"``, ``"degraded"`` or ``"unreachable"`` (module diagram)."""
        if all(p.m.state is PathState.UP for p in self.paths if p.m.ever_up) and \
                any(p.m.state is PathState.UP for p in self.paths):
            return "reachable"
        if any(p.m.alive for p in self.paths):
            return "degraded"
        return "unreachable"

    # ------------------------------------------------------------------ events
    def fail(self, path: Path, reason: str, cause: BaseException | None) -> None:
        """Something other than a WC broke ``path`` (post refused, wrong incarnation,
        silence): DOWN, and its QP to ERR so what is left on it flushes."""
        t = path.m.fail(reason, self.clock())
        if t is not None:
            self._broken(path, reason, cause)
            self.note(t)

    def wc_failed(self, path: Path, wc: Any, now: float) -> None:
        """An error WC on ``path``: its QP is in ERR, whatever the status."""
        t = path.m.wc_error(wc.status, now)
        if t is not None:
            err = WCError(wc)
            self._broken(path, t.reason, err)
            self.note(t)

    def _broken(self, path: Path, reason: str, cause: BaseException | None) -> None:
        """The path just went DOWN: flush what is left on it (each flush re-posts)."""
        e = PathBroken(f"path {path.name} to {self.peer}: {reason}")
        e.__cause__ = cause
        self.last_broken = e
        log.info("vqp %s: path %s DOWN: %s", self.peer, path.name, reason)
        path.set_error_state()

    def note(self, t: Transition | None) -> None:
        """Record a path transition (``None``: nothing happened); see the module doc."""
        if t is None:
            return
        log.debug("vqp %s path %d: %s -> %s (%s)", self.peer, t.path_id, t.old.value,
                  t.new.value, t.reason)
        self.update_reachability(t.at)
        if t.new is PathState.UP:
            # a recovery is news for an operator; a brief SUSPECT under load is not
            level = logging.DEBUG if t.old is PathState.SUSPECT else logging.INFO
            log.log(level, "vqp %s: path %s UP (%s)", self.peer, self.paths[t.path_id].name,
                    t.reason)
            if self.on_up is not None:
                self.on_up()
        self._changed.set()
        if self.on_transition is not None:
            self.on_transition(t)

    def update_reachability(self, now: float) -> None:
        """The peer counts as dead from the moment no path is alive *and talking*: every
        path DOWN/REBUILDING, or the last one held SUSPECT but silent past the DOWN
        threshold.  That moment starts the ``unreachable_grace`` clock."""
        if any(p.m.alive and (not p.m.silent_dead(now) or p.wcs_pending())
               for p in self.paths):
            self.all_dead_since = None
        elif self.all_dead_since is None:
            self.all_dead_since = now
