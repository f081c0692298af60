"""``kspeedfs status``: the cluster at a glance, from etcd only (nodes publish every 2 s)."""
from __future__ import annotations

import argparse
import json
import time

from .options import cli_logging, cluster_store, load_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from ..cluster.membership import NodeRecord, list_json as _prefix

    cli_logging(args)
    cfg = load_config(args)
    store = cluster_store(cfg, "status")
    # only nodes whose record is signed with the cluster secret (others: one warning each)
    nodes = {n: asdict(r) for n, r in NodeRecord.list_verified(store).items()}
    stats = _prefix(store, "stats/")
    preload, progress = _prefix(store, "preload/"), _prefix(store, "progress/")
    if args.json:
        print(json.dumps({"nodes": nodes, "stats": stats, "preload": preload, "progress": progress},
                         indent=2))
        return 0
    now = time.time()
    print(f"{len(nodes)} live node(s)")
    for name, rec in sorted(nodes.items()):
        s = stats.get(name, {})
        a = s.get("arena", {})
        c = s.get("counters", {})
        print(f"  {name}: NICs {', '.join(rec['nics'])}; cache {a.get('used_bytes', 0) / 2**30:.2f}/"
              f"{rec['capacity'] / 2**30:.2f} GiB ({a.get('used_slots', 0)} chunks); "
              f"up {now - rec['started']:.0f}s")
        print(f"    loads: {c.get('source_loads', 0)} from source, {c.get('peer_loads', 0)} from "
              f"peers, {c.get('demand_loads', 0)} on demand, {c.get('rereplicated', 0)} re-replicated")
        reads = s.get("reads", {})
        if reads.get("peer_latency"):
            print(f"    peer READs: {_latency(reads)}")
        for peer, p in sorted(s.get("endpoint", {}).get("peers", {}).items()):
            paths = ", ".join(f"{k} {v}" for k, v in p["paths"].items())
            print(f"    to {peer}: {p['state']} ({paths}); reads failed over {p['reads_failed_over']}")
    print("datasets held by the cluster:")
    for name, req in sorted(preload.items()):
        tag = f"{name}@{req['version']}"
        mine = {k.split("/", 1)[1]: v for k, v in progress.items() if k.startswith(tag + "/")}
        owned = sum(v["owned"] for n, v in mine.items() if n in nodes)
        cached = sum(v["cached"] for n, v in mine.items() if n in nodes)
        print(f"  {tag}: {100 * cached / owned if owned else 0:.1f}% of {owned:,} chunk replicas cached")
    return 0


def _p99(counts: list[int], buckets: list[float]) -> str:
    """The bucket bound under which 99 % of a peer's READs fell ("> last" past it)."""
    total, seen = sum(counts), 0
    for i, n in enumerate(counts):
        seen += n
        if seen >= 0.99 * total:
            return f"{buckets[i]:g} ms" if i < len(buckets) else f"> {buckets[-1]:g} ms"
    return "-"


def _latency(reads: dict) -> str:
    """One line of a node's READs from its peers: hedges (issue 19) and p99 per peer."""
    per = ", ".join(
        f"{peer} p99 ≤ {_p99(p['counts'], reads['peer_latency_buckets_ms'])}"
        + (" (suspected)" if p.get("suspected") else "")
        for peer, p in sorted(reads["peer_latency"].items()) if p.get("reads"))
    return (f"hedged {reads.get('peer_hedges', 0)} (won {reads.get('peer_hedges_won', 0)}), "
            f"longest wait {reads.get('peer_longest_wait_ms', 0)} ms; {per or 'none yet'}")
