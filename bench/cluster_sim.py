"""1,000 nodes, simulated: kspeedfs's control plane at scale against a real 3-member etcd.

    python -m bench.cluster_sim --nodes 100 300 1000 [--mounts-per-node 1] [--views 100]
                                [--workers 2] [--window 10] [--json FILE]

What runs (``bench/sim/``): a 3-member etcd on loopback (``tests/fixtures/etcd_cluster.py``,
data in /dev/shm); ``--workers`` agent processes (``bench/sim/agents.py``) holding N node
agents and N × mounts-per-node mount agents between them, each with the real membership
code: Registration (a lease, keep-alives every ttl/3), the signed
NodeRecord, ``stats/<node>`` every 2 s (what nodes published before the stats RPC) and
``daemon._hold`` (``mounts/`` every 5 s); and ``--views`` Membership views (the ``nodes/``
watch) spread over nodes and mounts: a *sample*, because every view checks
all N records on every change (see below), which on 2 cores is the
simulator's own limit long before etcd's. Their etcd load is counted per view and
scaled to N + M views in the arithmetic.

Per N, in order:

1. registration of every agent (ramped), then the views' first listing;
2. a steady window with stats on (``--window`` s), and one with stats off: etcd's own
   counters (``/metrics``: puts, proposals, ranges, keep-alive messages, bytes) and CPU
   (``/proc/PID/stat`` of the three members), the simulator's CPU, the machine's load;
   the difference of the two windows is the stats publication's load;
3. a plain listing loop over the N records (``bench/sim/baseline.py``): etcd CPU per
   listing of N records, the unit of the views' cost;
4. one node killed (its lease no longer refreshed, no revoke): the time until each view
   sees its record go, and per view the watch wake-ups and listings it cost;
5. one node joining: the same;
6. placement moves for that leave and join over ``--chunks`` synthetic chunks, with
   ``placement.owners`` (``bench/sim/moves.py``).

Once per run, first: a plain put loop (two processes, 16 threads each) for the etcd
write rate this machine sustains, the yardstick of the saturation arithmetic
(docs/design.md, "1,000 nodes, simulated").
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from bench.sim.moves import chunk_keys, moves
from kspeedfs.cluster.placement import Member
from tests.fixtures.etcd_cluster import EtcdCluster, proc_cpu_seconds

SECRET = b"cluster-sim-secret-0123456789abcdef"
PY = sys.executable
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# etcd counters read per window: (report name, metric prefix, label filter, how to merge
# the three members: "max" for what every member applies (the raft log), "sum" for what
# each member serves on its own)
COUNTERS = (
    ("puts", "etcd_mvcc_put_total", "", "max"),
    ("txns", "etcd_mvcc_txn_total", "", "max"),
    ("proposals", "etcd_server_proposals_committed_total", "", "max"),
    ("ranges", "etcd_mvcc_range_total", "", "sum"),
    ("keepalives", "grpc_server_msg_received_total", 'grpc_method="LeaseKeepAlive"', "sum"),
    ("keepalive_streams", "grpc_server_started_total", 'grpc_method="LeaseKeepAlive"', "sum"),
    ("watches", "grpc_server_started_total", 'grpc_method="Watch"', "sum"),
    ("sent_bytes", "etcd_network_client_grpc_sent_bytes_total", "", "sum"),
    ("recv_bytes", "etcd_network_client_grpc_received_bytes_total", "", "sum"),
    ("leases_revoked", "etcd_debugging_lease_revoked_total", "", "max"),
)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


class Workers:
    """The agent processes: JSON config on argv, commands on stdin, events on stdout."""

    def __init__(self, configs: Sequence[dict[str, Any]], log_dir: str) -> None:
        self.events: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
        self.backlog: list[dict[str, Any]] = []     # events read while waiting for others
        self.procs = []
        for i, cfg in enumerate(configs):
            with open(os.path.join(log_dir, f"agents-{i}.log"), "ab") as err:
                p = subprocess.Popen([PY, "-m", "bench.sim.agents", json.dumps(cfg)], cwd=REPO,
                                     env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=err, start_new_session=True)
            self.procs.append(p)
            threading.Thread(target=self._read, args=(i, p), daemon=True).start()

    def _read(self, i: int, p: subprocess.Popen[bytes]) -> None:
        assert p.stdout is not None
        for line in p.stdout:
            try:
                self.events.put((i, json.loads(line)))
            except ValueError:
                pass
        self.events.put((i, {"ev": "exit", "rc": p.wait()}))

    def send(self, line: str, only: int | None = None) -> None:
        for i, p in enumerate(self.procs):
            if only is None or i == only:
                assert p.stdin is not None
                p.stdin.write(line.encode() + b"\n")
                p.stdin.flush()

    def wait(self, ev: str, count: int, timeout: float) -> list[dict[str, Any]]:
        """The next ``count`` events named ``ev`` (others are kept for a later wait), or
        fewer at timeout."""
        got = [e for e in self.backlog if e["ev"] == ev][:count]
        self.backlog = [e for e in self.backlog if not any(e is g for g in got)]
        deadline = time.monotonic() + timeout
        while len(got) < count:
            try:
                i, e = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if e["ev"] == "exit":
                raise RuntimeError(f"agent process {i} exited ({e['rc']}); see its log")
            if e["ev"] == ev:
                got.append({**e, "worker": i})
            else:
                self.backlog.append({**e, "worker": i})
        return got

    def cpu(self) -> float:
        return sum(proc_cpu_seconds(p.pid) for p in self.procs)

    def close(self) -> None:
        for p in self.procs:
            try:
                self.send("quit", self.procs.index(p))
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait()
            for f in (p.stdin, p.stdout):
                if f is not None:
                    f.close()


def _machine_busy() -> tuple[float, float]:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


def snapshot(cluster: EtcdCluster, workers: Workers | None) -> dict[str, Any]:
    per = [cluster.metrics(i) for i in range(len(cluster.members))]
    out: dict[str, Any] = {"t": time.monotonic(), "etcd_cpu": [cluster.cpu_seconds(i) for i in
                                                                range(len(cluster.members))]}
    for name, prefix, label, _ in COUNTERS:
        out[name] = [sum(v for k, v in m.items() if k.startswith(prefix) and label in k) for m in per]
    out["leader"] = max(range(len(per)), key=lambda i: per[i].get("etcd_server_is_leader", 0))
    out["db_bytes"] = max(m.get("etcd_mvcc_db_total_size_in_bytes", 0) for m in per)
    out["sim_cpu"] = workers.cpu() if workers else 0.0
    out["busy"], out["jiffies"] = _machine_busy()
    with open("/proc/loadavg") as f:
        out["load1"] = float(f.read().split()[0])
    return out


def rates(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    dt = b["t"] - a["t"]
    r: dict[str, Any] = {"seconds": round(dt, 2)}
    for name, _, _, merge in COUNTERS:
        # per member first: a member applying the log late must not look like a burst
        d = [y - x for x, y in zip(a[name], b[name], strict=False)]
        r[name + "_s"] = (max(d) if merge == "max" else sum(d)) / dt
    cpu = [(y - x) / dt for x, y in zip(a["etcd_cpu"], b["etcd_cpu"], strict=False)]
    r["etcd_cpu"] = sum(cpu)                       # cores, the three members together
    r["etcd_cpu_leader"] = cpu[b["leader"]]
    r["sim_cpu"] = (b["sim_cpu"] - a["sim_cpu"]) / dt
    r["machine_busy"] = (b["busy"] - a["busy"]) / max(1, b["jiffies"] - a["jiffies"])
    r["load1"] = b["load1"]
    return r


def baseline(cluster: EtcdCluster, prefix: str, op: str, seconds: float, procs: int = 2,
             threads: int = 16, value_bytes: int = 256) -> dict[str, Any]:
    """Two client processes looping ``op`` (puts, lists) as fast as etcd answers."""
    cfg = {"endpoints": cluster.endpoints, "prefix": prefix, "op": op, "seconds": seconds,
           "threads": threads, "value_bytes": value_bytes}
    a = snapshot(cluster, None)
    ps = [subprocess.Popen([PY, "-m", "bench.sim.baseline", json.dumps(cfg)], cwd=REPO,
                           env=_env(), stdout=subprocess.PIPE) for _ in range(procs)]
    outs = [json.loads(p.communicate()[0]) for p in ps]
    b = snapshot(cluster, None)
    r = rates(a, b)
    ops = sum(o["ops"] for o in outs)
    r["ops_s"] = ops / max(o["seconds"] for o in outs)
    r["etcd_cpu_per_op"] = r["etcd_cpu"] * r["seconds"] / max(1, ops)
    return r


def simulate(cluster: EtcdCluster, n: int, args: argparse.Namespace, log_dir: str) -> dict[str, Any]:
    prefix = f"/sim-{n}-{uuid.uuid4().hex[:8]}/"
    nodes = [f"n{i:04d}" for i in range(n)]
    mounts = [f"m{i:04d}" for i in range(int(n * args.mounts_per_node))]
    victim, joiner = nodes[0], f"n{n:04d}"
    k = args.workers
    nviews = min(args.views, n - 1 + len(mounts))
    # views: half on nodes (not the victim), half on mounts, spread evenly
    vn = min(n - 1, nviews - min(len(mounts), nviews // 2))
    vm = nviews - vn
    node_views = nodes[1::max(1, (n - 1) // max(1, vn))][:vn]
    mount_views = mounts[::max(1, len(mounts) // max(1, vm))][:vm] if vm else []
    configs = []
    for w in range(k):
        mine_n = [x for j, x in enumerate(nodes) if j % k == w]
        mine_m = [x for j, x in enumerate(mounts) if j % k == w]
        views = ([x for x in node_views if x in set(mine_n)] +
                 [x for x in mount_views if x in set(mine_m)])
        configs.append({
            "worker": w, "endpoints": cluster.endpoints, "prefix": prefix,
            "secret": SECRET.hex(), "nodes": mine_n, "mounts": mine_m,
            "views": [f"view:{x}" for x in views], "ttl": args.ttl,
            "stats_interval": args.stats_interval,
            "hold_period": 5.0, "links": args.links, "per_store": args.per_store,
            "spread": args.spread, "leave_grace": 5.0, "stats": True,
            "ramp": max(3.0, (len(mine_n) + len(mine_m)) / args.ramp_rate)})
    out: dict[str, Any] = {"nodes": n, "mounts": len(mounts), "views": nviews, "workers": k,
                           "links": args.links, "spread": args.spread, "ttl": args.ttl,
                           "stats_interval": args.stats_interval}
    workers = Workers(configs, log_dir)
    try:
        t0 = time.monotonic()
        ready = workers.wait("ready", k, 120 + n / 5)
        if len(ready) < k:
            raise RuntimeError("agents did not register in time")
        out["register_s"] = time.monotonic() - t0
        workers.send("views")
        listed = workers.wait("listed", k, 120)
        out["views_listed_s"] = max(e["seconds"] for e in listed)
        time.sleep(args.settle)

        a = snapshot(cluster, workers)
        workers.send("counts")
        c0 = _counts(workers.wait("counts", k, 30))
        time.sleep(args.window)
        b = snapshot(cluster, workers)
        workers.send("counts")
        c1 = _counts(workers.wait("counts", k, 30))
        out["steady"] = rates(a, b)
        out["steady"].update(_steady_counts(c0, c1, b["t"] - a["t"]))

        workers.send("stats off")
        workers.wait("stats", k, 30)
        time.sleep(args.settle)
        a = snapshot(cluster, workers)
        time.sleep(args.window)
        b = snapshot(cluster, workers)
        workers.send("counts")
        c2 = _counts(workers.wait("counts", k, 30))
        out["no_stats"] = rates(a, b)
        out["no_stats"].update({"leases_lost": c2["leases_lost"] - c1["leases_lost"],
                                "lag_max": c2["lag_max"]})

        ll = out["list_loop"] = baseline(cluster, prefix, "lists", args.list_seconds, threads=8)
        # the agents keep running meanwhile: their etcd CPU (the stats-off window's) out
        ll["etcd_cpu_per_op_net"] = max(0.0, ll["etcd_cpu"] - out["no_stats"]["etcd_cpu"]) \
            * ll["seconds"] / max(1.0, ll["ops_s"] * ll["seconds"])
        workers.send("stats on")
        workers.wait("stats", k, 30)
        time.sleep(args.settle)

        for name, what, node, cmd in (("leave", "gone", victim, f"kill {victim}"),
                                      ("join", "join", joiner, f"join {joiner}")):
            try:
                out[name] = _change(workers, cluster, what, node, cmd, nviews, args)
            except RuntimeError as e:               # the simulator gave out: say so
                out[name] = {"error": str(e)}
            time.sleep(args.settle)
        workers.send("counts")
        out["final"] = _counts(workers.wait("counts", k, 30))
        out["final"].pop("views")
        out["db_bytes"] = snapshot(cluster, None)["db_bytes"]
    finally:
        workers.close()

    keys = chunk_keys(args.chunks, salt=n)
    weight = (256 << 30) / (1 << 30)
    before = [Member(x, weight) for x in nodes]
    t = time.process_time()
    for name, after in (("leave", before[1:]), ("join", before + [Member(joiner, weight)])):
        out.setdefault(name, {})
        m = moves(keys, before, after, args.replicas)
        exp, sd = m.expected(len(after) if name == "join" else n)
        out[name]["moves"] = {"chunks": m.chunks, "moved": m.moved, "moved_fraction": m.moved_fraction,
                              "expected": exp, "sd": sd, "touched_fraction": m.touched_fraction,
                              "foreign": m.foreign}
    out["placement_cpu_s"] = time.process_time() - t
    return out


def _counts(events: list[dict[str, Any]]) -> dict[str, Any]:
    views: dict[str, dict[str, int]] = {}
    for e in events:
        views.update(e["views"])
    return {"views": views, "stats_puts": sum(e["stats_puts"] for e in events),
            "hold_puts": sum(e["hold_puts"] for e in events),
            "leases_lost": sum(e["leases_lost"] for e in events),
            "unreachable": sum(e["unreachable"] for e in events),
            "failed_puts": sum(e.get("failed_puts", 0) for e in events),
            "lag_max": max(e["lag_max"] for e in events)}


def _delta(c0: dict[str, Any], c1: dict[str, Any], what: str) -> int:
    return sum(v[what] - c0["views"].get(name, {}).get(what, 0) for name, v in c1["views"].items())


def _steady_counts(c0: dict[str, Any], c1: dict[str, Any], dt: float) -> dict[str, Any]:
    nv = max(1, len(c1["views"]))
    return {"stats_puts_s": (c1["stats_puts"] - c0["stats_puts"]) / dt,
            "hold_puts_s": (c1["hold_puts"] - c0["hold_puts"]) / dt,
            "lists_per_view_s": _delta(c0, c1, "lists") / nv / dt,
            "view_errors_s": _delta(c0, c1, "errors") / dt,
            "leases_lost": c1["leases_lost"] - c0["leases_lost"], "lag_max": c1["lag_max"]}


def _change(workers: Workers, cluster: EtcdCluster, what: str, node: str, cmd: str,
            nviews: int, args: argparse.Namespace) -> dict[str, Any]:
    """One membership change: when each view saw it, and what it cost per view."""
    k = len(workers.procs)
    workers.send("counts")
    c0 = _counts(workers.wait("counts", k, 30))
    workers.send(f"expect {what} {node}")
    expecting = workers.wait("expecting", k, 30)
    nviews = sum(e["views"] for e in expecting)
    stale = sum(e["stale"] for e in expecting)
    a = snapshot(cluster, workers)
    workers.send(cmd, only=0)
    started = workers.wait("killed" if what == "gone" else "joined", 1, 60)
    if not started or "error" in started[0]:
        raise RuntimeError(f"{cmd}: {started[0].get('error') if started else 'no answer'}")
    start = started[0]
    seen = workers.wait("seen", nviews, args.ttl * 3 + 20)
    time.sleep(1.0)
    b = snapshot(cluster, workers)
    workers.send("counts")
    c1 = _counts(workers.wait("counts", k, 30))
    delays = sorted(e["t"] - start["t"] for e in seen)
    nv = max(1, len(c1["views"]))
    r = rates(a, b)
    return {"seen_by": len(seen), "of": nviews,
            "first_s": delays[0] if delays else None,
            "median_s": statistics.median(delays) if delays else None,
            "last_s": delays[-1] if delays else None,
            "events_per_view": _delta(c0, c1, "events") / nv,
            "lists_per_view": _delta(c0, c1, "lists") / nv,
            "ranges_per_list": (sum(b["ranges"]) - sum(a["ranges"])) / max(1, _delta(c0, c1, "lists")),
            "resync_timeouts_per_view": _delta(c0, c1, "timeouts") / nv,
            "stale_views": stale, "view_errors_per_view": _delta(c0, c1, "errors") / nv,
            "ranges": sum(b["ranges"]) - sum(a["ranges"]), "window_s": r["seconds"],
            "etcd_cpu_s": r["etcd_cpu"] * r["seconds"], "sim_cpu_s": r["sim_cpu"] * r["seconds"]}


def report(base: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    lines = [f"put loop (2 procs x 16 threads, 256 B): {base['ops_s']:.0f} puts/s, etcd "
             f"{base['etcd_cpu']:.2f} cores (3 members), {base['etcd_cpu_per_op'] * 1e6:.0f} "
             f"us etcd CPU/put, machine busy {base['machine_busy']:.0%}, load {base['load1']:.1f}"]
    for r in runs:
        s, q, lv, jn, ll = r["steady"], r["no_stats"], r["leave"], r["join"], r["list_loop"]
        agents = r["nodes"] + r["mounts"]
        lines += [
            f"\nN={r['nodes']} nodes, {r['mounts']} mounts, {r['views']} views, "
            f"{r['workers']} agent processes, stats links={r['links']}, endpoints={r['spread']}, "
            f"ttl {r['ttl']}s, stats every {r['stats_interval']:g}s",
            f"  register {r['register_s']:.1f}s, views listed in {r['views_listed_s']:.1f}s",
            f"  steady: puts {s['puts_s']:.0f}/s, txns {s['txns_s']:.0f}/s, proposals "
            f"{s['proposals_s']:.0f}/s, keep-alive msgs {s['keepalives_s']:.0f}/s (streams "
            f"{s['keepalive_streams_s']:.0f}/s), ranges "
            f"{s['ranges_s']:.0f}/s, etcd in {s['recv_bytes_s'] / 1e6:.2f} MB/s out "
            f"{s['sent_bytes_s'] / 1e6:.2f} MB/s",
            f"          etcd CPU {s['etcd_cpu']:.2f} cores (leader {s['etcd_cpu_leader']:.2f}), "
            f"simulator {s['sim_cpu']:.2f} cores = {s['sim_cpu'] / agents * 1e3:.2f} ms/s per "
            f"agent; machine busy {s['machine_busy']:.0%}, load {s['load1']:.1f}; leases lost "
            f"{s['leases_lost']}, worst trio lag {s['lag_max'] * 1e3:.0f} ms",
            f"          stats puts issued {s['stats_puts_s']:.0f}/s, mount holds "
            f"{s['hold_puts_s']:.0f}/s, view listings {s['lists_per_view_s']:.3f}/s per view, "
            f"failed watches {s['view_errors_s']:.1f}/s",
            f"  stats off: puts {q['puts_s']:.0f}/s, proposals {q['proposals_s']:.0f}/s, "
            f"etcd in {q['recv_bytes_s'] / 1e6:.2f} MB/s, etcd CPU {q['etcd_cpu']:.2f} cores, "
            f"simulator {q['sim_cpu']:.2f}; stats' share: {s['puts_s'] - q['puts_s']:.0f} puts/s, "
            f"{s['etcd_cpu'] - q['etcd_cpu']:.2f} cores",
            f"  list loop over {r['nodes']} records: {ll['ops_s']:.0f} lists/s, "
            f"{ll['etcd_cpu_per_op'] * 1e3:.2f} ms etcd CPU per list "
            f"({ll.get('etcd_cpu_per_op_net', 0) * 1e3:.2f} without the agents' share), "
            f"{ll['sent_bytes_s'] / max(1, ll['ops_s']) / 1e3:.0f} kB per list",
        ]
        for name, c in (("leave (lease lapses)", lv), ("join", jn)):
            m = c["moves"]
            if "error" in c:
                lines.append(f"  {name}: not measured: {c['error']}")
            else:
                lines.append(
                    f"  {name}: seen by {c['seen_by']}/{c['of']} views after "
                    f"{_s(c['first_s'])} / {_s(c['median_s'])} / {_s(c['last_s'])} "
                    f"(first/median/last), {c['stale_views']} views stale before; per view "
                    f"{c['events_per_view']:.2f} watch events, {c['view_errors_per_view']:.2f} "
                    f"failed watches, "
                    f"{c['lists_per_view']:.2f} listings, {c['resync_timeouts_per_view']:.2f} "
                    f"quiet resyncs (a listing each before the resync fix), "
                    f"{c['ranges_per_list']:.1f} "
                    f"ranges per listing; etcd CPU {c['etcd_cpu_s']:.2f}s, simulator "
                    f"{c['sim_cpu_s']:.1f}s in {c['window_s']:.1f}s")
            lines.append(
                f"      placement: {m['moved']} of {m['chunks'] * 2} replicas moved = "
                f"{m['moved_fraction']:.5f} (1/N = {m['expected']:.5f} +- {m['sd']:.5f}); "
                f"chunks touched {m['touched_fraction']:.4f}; moves not from the leaver/to the "
                f"joiner: {m['foreign']}")
    return "\n".join(lines)


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}s"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cluster_sim", description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[100, 300, 1000])
    p.add_argument("--mounts-per-node", type=float, default=1.0)
    p.add_argument("--views", type=int, default=100, help="Membership views (a sample)")
    p.add_argument("--workers", type=int, default=2, help="agent processes")
    p.add_argument("--per-store", type=int, default=50, help="agents sharing one EtcdStore")
    p.add_argument("--links", type=int, default=16, help="peers in each node's stats record")
    p.add_argument("--spread", choices=("all", "one"), default="all",
                   help="each store lists all 3 members (production) or one")
    p.add_argument("--ttl", type=int, default=5, help="cluster.lease_ttl")
    p.add_argument("--stats-interval", type=float, default=2.0,
                   help="the stats/<node> publication's interval (nodes before the stats RPC)")
    p.add_argument("--ramp-rate", type=float, default=150.0,
                   help="agents registered per second per agent process")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--window", type=float, default=10.0)
    p.add_argument("--settle", type=float, default=3.0)
    p.add_argument("--list-seconds", type=float, default=4.0)
    p.add_argument("--put-seconds", type=float, default=8.0)
    p.add_argument("--chunks", type=int, default=4000)
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--log-dir", help="the agent processes' logs (default: a new temp dir)")
    args = p.parse_args(argv)
    with EtcdCluster(3) as cluster:
        log_dir = args.log_dir or tempfile.mkdtemp(prefix="kspeedfs-sim-")
        print(f"etcd {', '.join(cluster.endpoints)}; agent logs in {log_dir}", flush=True)
        base = baseline(cluster, "/sim-baseline/", "puts", args.put_seconds)
        runs = []
        for n in args.nodes:
            try:
                runs.append(simulate(cluster, n, args, log_dir))
            except Exception as e:             # the simulator gave out: say so, go on
                print(f"\nN={n}: not measured: {e}", flush=True)
                continue
            print(report(base, runs[-1:]).split("\n", 1)[1], flush=True)
        text = report(base, runs)
    print("\n" + text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"baseline": base, "runs": runs, "args": vars(args)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
