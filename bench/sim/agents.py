"""One simulator process: many node and mount agents in one trio run (``bench.sim``).

    python -m bench.sim.agents '<config JSON>'     commands on stdin, events on stdout

Each agent runs kspeedfs's own control-plane code against the real etcd cluster; only
the data plane is a stand-in (no endpoint, no arena: its statistics are a
``NodeStatistics`` with zeros and ``links`` made-up peers):

    node agent   Registration (lease, keep-alive every ttl/3), its signed NodeRecord,
                 stats/<node> every 2 s on the lease (what nodes did before the stats
                 RPC replaced it: ``stats on|off`` measures its share)
    mount agent  daemon._hold (mounts/<ds>@<v>/<host>:<pid> on its own lease, read
                 counters every 5 s)
    view         a Membership (the nodes/ watch: list, watch, resync every 10 s) whose
                 store counts listings and watch wake-ups; ``views`` of them, a sample

Agents share an EtcdStore per ``per_store`` agents (a real node has its own: see the
report's caveats). Trio's default thread limiter (40) would let only 40 views run their
watch thread: it is raised here, as it need not be in a node (two views).

Commands (one per line): ``views``, ``stats on|off``, ``kill <node>`` (its lease is no
longer refreshed: cancelled without a revoke, like a SIGKILL), ``join <node>``,
``expect gone|join <node>``, ``counts``, ``quit``. Events are JSON lines.
"""
from __future__ import annotations

import json
import logging
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import trio

from kspeedfs.cluster.arena import ArenaStatistics
from kspeedfs.cluster.fetch import PeerStatistics
from kspeedfs.cluster.lifecycle import MountRecord
from kspeedfs.cluster.membership import Membership, NodeRecord, Registration
from kspeedfs.cluster.node_stats import EndpointStatistics, LinkStatistics, NodeCounters, NodeStatistics
from kspeedfs.config import StoreConfig
from kspeedfs.errors import StoreError
from kspeedfs.manifest.store.etcd import EtcdStore

log = logging.getLogger(__name__)


def emit(**ev: Any) -> None:
    sys.stdout.write(json.dumps(ev) + "\n")
    sys.stdout.flush()


@dataclass
class ViewCounts:
    """What one view's store saw: listings (raced: one range per endpoint; now one),
    batches of watch events, watches ended at the resync deadline."""

    lists: int = 0
    events: int = 0
    timeouts: int = 0
    errors: int = 0


class CountingStore:
    """A view's store: the shared one, with its listings and watch wake-ups counted."""

    def __init__(self, store: EtcdStore, counts: ViewCounts) -> None:
        self._store = store
        self.counts = counts

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def race(self, op: Any, budget: float | None = None) -> Any:
        self.counts.lists += 1                 # PrefixView._list (raced before) ...
        return self._store.race(op, budget)

    def call(self, op: Any, budget: float | None = None) -> Any:
        self.counts.lists += 1                 # ... or sent to one endpoint: its only call
        return self._store.call(op, budget)

    def watch_prefix(self, prefix: str, start_revision: int, timeout: float,
                     on_batch: Any = None) -> Any:
        def counted(batch: Any) -> None:
            self.counts.events += 1
            on_batch(batch)
        try:
            relist = self._store.watch_prefix(prefix, start_revision, timeout, counted)
        except Exception:
            self.counts.errors += 1
            raise
        if relist is None:
            self.counts.timeouts += 1            # the stream's deadline: a resync
        return relist


def _zero(name: str, peers: list[str]) -> Any:
    """A PeerStatistics field: the per-peer maps filled for ``peers``, the rest zero."""
    if name == "per_peer_bytes":
        return {p: 1 << 30 for p in peers}
    if name == "vqps":
        return {p: "UP" for p in peers}
    if name == "peer_latency":
        return {}
    if name == "peer_latency_buckets_ms":
        return (1.0, 2.0, 5.0, 10.0, 50.0, 100.0)
    return 0


def stand_in_statistics(name: str, links: int) -> NodeStatistics:
    """A node's statistics as ``stats/<node>`` carries them, for a node with ``links``
    open vQPs (mounts reading from it, peers it copies from): zeros, real shape."""
    peers = [f"mount:host{i:04d}:{4000 + i}" for i in range(links)]
    return NodeStatistics(
        node=name, time=time.time(),
        arena=ArenaStatistics(slots=65536, used_slots=60000, used_bytes=60000 << 22,
                              capacity=65536 << 22, evictions=0, puts=60000),
        counters=NodeCounters(),
        reads=PeerStatistics(**{f.name: _zero(f.name, peers) for f in fields(PeerStatistics)}),
        endpoint=EndpointStatistics(["10.0.0.1", "10.1.0.1"], {
            p: LinkStatistics("UP", 0, {"10.0.0.1->10.0.1.1": "UP", "10.1.0.1->10.1.1.1": "UP"})
            for p in peers}),
        progress={"imagenet@1": {"owned": 2048, "cached": 2048, "from_peer": 0, "from_source": 2048}},
        disk={"capacity": 0, "used": 0})


def record(name: str, i: int) -> NodeRecord:
    return NodeRecord(node=name, host=name, nics=[f"10.0.{i // 250}.{i % 250 + 1}",
                                                   f"10.1.{i // 250}.{i % 250 + 1}"],
                      port=7470, rpc_port=7471, capacity=256 << 30, nslots=65536,
                      slot_size=4 << 20, nbuckets=16384)


class LogCounter(logging.Handler):
    """Counts the membership module's warnings: a lost lease is the simulator (or etcd)
    falling behind."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lost = 0
        self.unreachable = 0
        self.failed_puts = 0            # first puts of a node that failed (retried)

    def emit(self, rec: logging.LogRecord) -> None:
        msg = rec.getMessage()
        if "expired; registering again" in msg:
            self.lost += 1
        elif "cannot refresh" in msg or "etcd unreachable" in msg:
            self.unreachable += 1


@dataclass
class Sim:
    cfg: dict[str, Any]
    stores: list[EtcdStore] = field(default_factory=list)
    scopes: dict[str, trio.CancelScope] = field(default_factory=dict)     # agent → its tasks
    stats_scopes: dict[str, trio.CancelScope] = field(default_factory=dict)
    regs: dict[str, Registration] = field(default_factory=dict)
    views: dict[str, tuple[Membership, ViewCounts]] = field(default_factory=dict)
    expect: dict[tuple[str, str], set[str]] = field(default_factory=dict)  # → views not yet
    stats_puts: int = 0
    hold_puts: int = 0
    lag_max: float = 0.0
    logs: LogCounter = field(default_factory=LogCounter)

    def store_for(self, k: int) -> EtcdStore:
        per_store: int = self.cfg["per_store"]
        return self.stores[(k // per_store) % len(self.stores)]

    # -- agents ---------------------------------------------------------------------------

    async def node(self, name: str, k: int, nursery: trio.Nursery, store: EtcdStore | None = None,
                   task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        store = store or self.store_for(k)
        reg = Registration(store, self.cfg["ttl"])
        self.regs[name] = reg
        rec = record(name, k)
        for attempt in range(3):       # a saturated etcd (or simulator) can fail the first
            try:
                await trio.to_thread.run_sync(reg.put, NodeRecord.key(store, name),
                                              rec.signed(store))
                break
            except StoreError as e:
                self.logs.failed_puts += 1
                if attempt == 2:
                    raise
                log.error("%s: registering: %s; again", name, e)
        task_status.started()
        with trio.CancelScope() as scope:
            self.scopes[name] = scope
            async with trio.open_nursery() as n:
                n.start_soon(reg.run)
                if self.cfg["stats"]:
                    n.start_soon(self.stats, name, store, reg)
                await trio.sleep_forever()

    async def stats(self, name: str, store: EtcdStore, reg: Registration) -> None:
        def statistics() -> NodeStatistics:
            self.stats_puts += 1
            return stand_in_statistics(name, self.cfg["links"])
        key = f"{store.prefix}stats/{name}"
        with trio.CancelScope() as scope:
            self.stats_scopes[name] = scope
            await trio.sleep(random.uniform(0, 2.0))
            while True:     # what nodes before the stats RPC did, for its share of the load
                try:
                    await trio.to_thread.run_sync(reg.put, key,
                                                  json.dumps(asdict(statistics())).encode())
                except StoreError:
                    pass
                await trio.sleep(self.cfg["stats_interval"])

    async def mount(self, name: str, k: int, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        from kspeedfs.daemon import _hold

        store = self.store_for(k)
        rec = MountRecord("imagenet", 1, name, "/mnt/imagenet", 1000 + k)
        counters = {c: 0 for c in ("reads", "read_bytes", "memory_hits", "disk_hits",
                                   "peer_hits", "source_loads", "source_extents", "source_blocks")}

        def reads() -> dict[str, int]:
            self.hold_puts += 1
            counters["reads"] += 1000
            return dict(counters)
        task_status.started()
        with trio.CancelScope() as scope:
            self.scopes[name] = scope
            await _hold(store, rec, self.cfg["ttl"], reads, lambda: False,
                        period=self.cfg["hold_period"])

    async def view(self, name: str, k: int, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        store = self.store_for(k)
        counts = ViewCounts()
        m = Membership(store, leave_grace=self.cfg["leave_grace"])
        m.view.store = CountingStore(store, counts)      # type: ignore[assignment]
        self.views[name] = (m, counts)
        async with trio.open_nursery() as n:
            await n.start(m.run)
            task_status.started()
            while True:
                changed = m.view.changed
                self.check(name, m)
                await changed.wait()

    def check(self, view: str, m: Membership) -> None:
        for (what, node), waiting in list(self.expect.items()):
            if view in waiting and (node in m.view.values) == (what == "join"):
                waiting.discard(view)
                emit(ev="seen", what=what, node=node, view=view, t=time.time())

    async def lag(self) -> None:
        while True:
            t = trio.current_time()
            await trio.sleep(0.1)
            self.lag_max = max(self.lag_max, trio.current_time() - t - 0.1)

    # -- the process ----------------------------------------------------------------------

    def new_store(self, endpoints: list[str]) -> EtcdStore:
        return EtcdStore(StoreConfig(backend="etcd", etcd=endpoints, etcd_prefix=self.cfg["prefix"]),
                         bytes.fromhex(self.cfg["secret"]))

    async def main(self) -> None:
        cfg = self.cfg
        trio.to_thread.current_default_thread_limiter().total_tokens = 100_000
        member_log = logging.getLogger("kspeedfs.cluster.membership")
        member_log.setLevel(logging.WARNING)        # the root logger's ERROR would drop them
        member_log.addHandler(self.logs)
        eps = cfg["endpoints"]
        nstores = max(1, -(-(len(cfg["nodes"]) + len(cfg["mounts"])) // cfg["per_store"]))
        for s in range(nstores):
            mine = eps if cfg["spread"] == "all" else [eps[(cfg["worker"] + s) % len(eps)]]
            self.stores.append(self.new_store(mine))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.lag)
            t0 = time.monotonic()
            agents = [("node", n) for n in cfg["nodes"]] + [("mount", m) for m in cfg["mounts"]]
            ramp = cfg["ramp"]
            async with trio.open_nursery() as starting:
                for k, (kind, name) in enumerate(agents):
                    starting.start_soon(self._start, nursery, kind, name, k,
                                        ramp * k / max(1, len(agents)))
            emit(ev="ready", agents=len(agents), seconds=time.monotonic() - t0)
            await self.commands(nursery)
            nursery.cancel_scope.cancel()

    async def _start(self, nursery: trio.Nursery, kind: str, name: str, k: int, at: float) -> None:
        await trio.sleep(at)
        if kind == "node":
            await nursery.start(self.node, name, k, nursery)
        else:
            await nursery.start(self.mount, name, k)

    async def commands(self, nursery: trio.Nursery) -> None:
        stdin = trio.lowlevel.FdStream(os.dup(0))
        buf = b""
        while True:
            data = await stdin.receive_some()
            if not data:
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if await self.command(line.decode().split(), nursery) == "quit":
                    return

    async def command(self, words: list[str], nursery: trio.Nursery) -> str | None:
        cmd = words[0]
        if cmd == "views":
            t0 = time.monotonic()
            async with trio.open_nursery() as starting:
                for k, name in enumerate(self.cfg["views"]):
                    starting.start_soon(nursery.start, self.view, name, k)
            emit(ev="listed", views=len(self.views), seconds=time.monotonic() - t0)
        elif cmd == "stats":
            on = words[1] == "on"
            for name in self.cfg["nodes"]:
                if name in self.stats_scopes:
                    self.stats_scopes.pop(name).cancel()
                if on and name in self.regs and name in self.scopes:
                    nursery.start_soon(self.stats, name, self.regs[name].store, self.regs[name])
            emit(ev="stats", on=on)
        elif cmd == "kill":
            self.scopes.pop(words[1]).cancel()      # no revoke: the lease runs out
            if words[1] in self.stats_scopes:
                self.stats_scopes.pop(words[1]).cancel()
            emit(ev="killed", node=words[1], t=time.time())
        elif cmd == "join":
            # a store of its own, as a joining node has: a shared one's race threads are
            # busy with its other agents' keep-alives
            store = self.new_store(self.cfg["endpoints"])
            t = time.time()
            try:
                await nursery.start(self.node, words[1], len(self.cfg["nodes"]) + 7, nursery, store)
            except StoreError as e:
                emit(ev="joined", node=words[1], t=t, error=str(e))
            else:
                emit(ev="joined", node=words[1], t=t, put=time.time() - t)
        elif cmd == "expect":
            # a leave is expected of the views that hold the node now (a view that lost
            # it earlier, to a lapsed lease or a failed watch, is counted as stale)
            waiting = {v for v, (m, _) in self.views.items()
                       if words[1] == "join" or words[2] in m.view.values}
            self.expect[(words[1], words[2])] = waiting
            emit(ev="expecting", views=len(waiting), stale=len(self.views) - len(waiting))
        elif cmd == "counts":
            emit(ev="counts", views={n: c.__dict__ for n, (_, c) in self.views.items()},
                 stats_puts=self.stats_puts, hold_puts=self.hold_puts, lag_max=self.lag_max,
                 leases_lost=self.logs.lost, unreachable=self.logs.unreachable,
                 failed_puts=self.logs.failed_puts,
                 members={n: len(m.view.values) for n, (m, _) in self.views.items()})
            self.lag_max = 0.0
        elif cmd == "quit":
            return "quit"
        return None


def main() -> None:
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    trio.run(Sim(json.loads(sys.argv[1])).main)
    os._exit(0)       # gRPC threads of abandoned watches need not be joined


if __name__ == "__main__":
    main()
