"""``kspeedfs status``: the cluster at a glance: the live nodes, preloads, progress and
mounts from etcd, each node's statistics from its ``stats`` RPC, asked at once
(``node_stats.gather``; a node that does not answer in 3 s shows none). On a single
machine (the embedded store), this machine's live mounts of the store
(``fuse/registry.py``) with their tier use, each asked over its control socket."""
from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING, Any

from ..errors import KspeedfsError
from .options import cli_logging, cluster_store, load_config
from .terminal import Table, print_table

if TYPE_CHECKING:
    from ..config import Config
    from ..manifest.store.etcd import EtcdStore


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from ..cluster import lifecycle, node_stats
    from ..cluster.membership import NodeRecord
    from ..cluster.membership import list_json as _prefix

    cli_logging(args)
    cfg = load_config(args)
    if cfg.store.backend != "etcd":
        return _single_machine(cfg, args.json)
    store = cluster_store(cfg, "status")
    # only nodes whose record is signed with the cluster secret (others: one warning each)
    records = NodeRecord.list_verified(store)
    nodes = {n: asdict(r) for n, r in records.items()}
    stats = node_stats.gather(cfg.cluster.secret(), list(records.values()))
    preload = {name: asdict(req) for name, req in lifecycle.preloads(store).items()}
    progress = _prefix(store, "progress/")
    held = {tag: [asdict(r) for r in recs] for tag, recs in lifecycle.mounts(store).items()}
    datasets = _datasets(store, cfg.cluster.replicas, nodes, preload, progress, held)
    if args.json:
        print(json.dumps({"nodes": nodes, "stats": stats, "preload": preload, "progress": progress,
                          "mounts": held, "datasets": datasets}, indent=2))
        return 0
    now = time.time()
    print(f"{len(nodes)} live node(s)")
    for name, rec in sorted(nodes.items()):
        for line in node_lines(name, rec, lifecycle.node_stats(stats.get(name)), now):
            print(line)
    table = Table(["DATASET", "PRIO", "CACHED", "MEMORY", "SSD", "R", "HIT", "MOUNTS"],
                  right=(1, 2, 3, 4, 5, 6), title="datasets held by the cluster:")
    for d in datasets:
        table.add(d["tag"], d["priority"], f"{d['cached_pct']:.1f}%",
                  f"{d['memory_bytes'] / 2**30:.2f} GiB", f"{d['disk_bytes'] / 2**30:.2f} GiB",
                  f"{d['r_achieved']:.2f}/{d['r']}",
                  "-" if d["hit_ratio"] is None else f"{100 * d['hit_ratio']:.1f}%",
                  ", ".join(d["mounts"]) or "-")
    print_table(table)
    return 0


def local_mounts(cfg: Config) -> list[dict[str, Any]]:
    """This machine's live mounts of the configured store (``fuse/registry.py``), each
    with its tier use and hit ratio since it began, asked over its control socket
    (``unreachable``: why it did not answer; its numbers are then None)."""
    from dataclasses import asdict

    from ..errors import MountError
    from ..fuse import registry
    from ..manifest.store import identity
    from .stats import hit_ratio

    out = []
    for m in registry.live(identity(cfg.store)):
        try:
            stats, why = registry.ask(m.mountpoint, {"stats": True}).get("stats"), None
        except MountError as e:
            stats, why = None, str(e)
        s = stats if isinstance(stats, dict) else {}
        use = {k: s.get(k) for k in ("memory_bytes", "disk_bytes", "reads", "read_bytes")}
        out.append({**asdict(m), "tag": m.tag, **use,
                    "hit_ratio": hit_ratio(s) if s else None, "unreachable": why})
    return out


def _single_machine(cfg: Config, as_json: bool) -> int:
    """``status`` without a cluster: the live mounts of this store, one row each."""
    from .stats import size_word

    mounts = local_mounts(cfg)
    if as_json:
        print(json.dumps({"store": cfg.store.path, "mounts": mounts}, indent=2))
        return 0
    print(f"single machine (embedded store {cfg.store.path}; a cluster's status needs "
          f"--etcd): {len(mounts)} live mount(s)")
    table = Table(["MOUNTPOINT", "DATASET", "ENGINE", "MEMORY", "DISK", "HIT", "READ", "UP"],
                  right=(3, 4, 5, 6, 7))
    now = time.time()
    def size(m: dict[str, Any], key: str) -> str:
        return "-" if m[key] is None else size_word(m[key])

    for m in mounts:
        table.add(m["mountpoint"], m["tag"], m["engine"], size(m, "memory_bytes"),
                  size(m, "disk_bytes"),
                  "-" if m["hit_ratio"] is None else f"{100 * m['hit_ratio']:.1f}%",
                  size(m, "read_bytes"), f"{now - m['since']:.0f}s")
    if mounts:
        print_table(table)
    for m in mounts:
        if m["unreachable"]:
            print(f"  {m['mountpoint']}: no counters: {m['unreachable']}")
    return 0


def node_lines(name: str, rec: dict[str, Any], s: dict[str, Any], now: float) -> list[str]:
    """What ``status`` prints of one live node: ``rec`` its (verified) node record, ``s``
    its stats record as ``lifecycle.node_stats`` gives it."""
    a, c, d = s["arena"], s["counters"], s["disk"]
    ssd = (f"; SSD {d.get('used', 0) / 2**30:.2f}/{d['capacity'] / 2**30:.2f} GiB"
           if d.get("capacity") else "")
    out = [f"  {name}: NICs {', '.join(rec['nics'])}; cache {a.get('used_bytes', 0) / 2**30:.2f}/"
           f"{rec['capacity'] / 2**30:.2f} GiB ({a.get('used_slots', 0)} chunks){ssd}; "
           f"up {now - rec['started']:.0f}s"]
    if s["files"]:
        out.append("    arena files: " + ", ".join(f"{path} ({ram / 2**30:.2f} GiB RAM)"
                                                  for path, ram in sorted(s["files"].items())))
    refused = a.get("refused", 0)
    out.append(f"    loads: {c.get('source_loads', 0)} from source, {c.get('peer_loads', 0)} from "
               f"peers, {c.get('demand_loads', 0)} on demand, {c.get('rereplicated', 0)} re-replicated"
               + (f"; {c['unloaded']} dropped by unloads" if c.get("unloaded") else "")
               + (f"; {refused} not stored (no room without evicting an equal or higher "
                  "priority)" if refused else ""))
    if s["reads"]["peer_latency"]:
        out.append(f"    peer READs: {_latency(s['reads'])}")
    for peer, p in sorted(s["endpoint"]["peers"].items()):
        paths = ", ".join(f"{k} {v}" for k, v in p["paths"].items())
        out.append(f"    to {peer}: {p['state']} ({paths}); reads failed over "
                   f"{p['reads_failed_over']}")
    return out


def _datasets(store: EtcdStore, replicas: int, nodes: dict[str, Any], preload: dict[str, Any],
              progress: dict[str, Any],
              held: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per preloaded dataset: chunk replicas cached (of those the live nodes own), bytes
    per tier (chunks in memory / on SSD × the mean chunk size), R achieved (replicas
    cached per chunk, on average), the hit ratio of its mounts (reads served by memory
    or a peer's arena, of chunk requests) and which mounts use it. ``preload``: the
    well-formed requests (``lifecycle.preloads``, as dicts); ``progress``: the nodes'
    records as etcd holds them (any JSON, read through ``count``)."""
    from ..cluster.lifecycle import count

    out = []
    for name, req in sorted(preload.items()):
        tag = f"{name}@{req['version']}"
        mine = {k.split("/", 1)[1]: v for k, v in progress.items() if k.startswith(tag + "/")}
        live = [v for n, v in mine.items() if n in nodes]
        owned = sum(count(v, "owned") for v in live)
        cached = sum(count(v, "cached") for v in live)
        try:
            info = store.dataset(name, req["version"])
            chunks, mean = info.chunks, info.bytes / max(info.chunks, 1)
        except KspeedfsError:
            chunks, mean = 0, 0.0
        reads = [r.get("reads", {}) for r in held.get(tag, [])]
        hits = sum(r.get("memory_hits", 0) + r.get("peer_hits", 0) for r in reads)
        total = hits + sum(r.get("disk_hits", 0) + r.get("source_loads", 0) + r.get("source_extents", 0)
                           for r in reads)
        out.append({
            "tag": tag, "priority": req.get("priority", 0), "release": req.get("release", "manual"),
            "owned": owned, "cached": cached, "cached_pct": 100 * cached / owned if owned else 0.0,
            "memory_bytes": int(sum(count(v, "in_memory") for v in live) * mean),
            "disk_bytes": int(sum(count(v, "on_disk") for v in live) * mean),
            "r": replicas, "r_achieved": cached / chunks if chunks else 0.0,
            "hit_ratio": hits / total if total else None,
            "mounts": [f"{r['host']}:{r['mountpoint']}" for r in held.get(tag, [])],
        })
    return out


def _p99(counts: list[int], buckets: list[float]) -> str:
    """The bucket bound under which 99 % of a peer's READs fell ("> last" past it)."""
    total, seen = sum(counts), 0
    for i, n in enumerate(counts):
        seen += n
        if seen >= 0.99 * total:
            if i < len(buckets):
                return f"{buckets[i]:g} ms"
            return f"> {buckets[-1]:g} ms" if buckets else "-"
    return "-"


def _latency(reads: dict[str, Any]) -> str:
    """One line of a node's READs from its peers: hedges and p99 per peer."""
    per = ", ".join(
        f"{peer} p99 ≤ {_p99(p['counts'], reads['peer_latency_buckets_ms'])}"
        + (" (suspected)" if p.get("suspected") else "")
        for peer, p in sorted(reads["peer_latency"].items()) if p.get("reads"))
    return (f"hedged {reads.get('peer_hedges', 0)} (won {reads.get('peer_hedges_won', 0)}), "
            f"longest wait {reads.get('peer_longest_wait_ms', 0)} ms; {per or 'none yet'}")
