"""``kspeedfs preload DATASET``: ask the cluster to hold a dataset version; show progress.

The request is one etcd key (``preload/<dataset>``); every node loads its own share in
parallel (``cluster/reconcile.py``) and reports to ``progress/``. This command
only watches: interrupting it does not stop the preload, and running it again resumes
the view (nodes skip what they already hold). ``--check`` asks every node which
chunks it holds and prints cached % per node and the replica health of every chunk;
it exits 1 unless every chunk has R verified copies.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any

from .options import cli_logging, cluster_store, dataset_name, load_config, priority, seconds, version
from .terminal import Table, is_terminal, print_table, progress_bar

if TYPE_CHECKING:
    from ..cluster.membership import NodeRecord
    from ..config import Config
    from ..manifest.store.base import DatasetInfo
    from ..manifest.store.etcd import EtcdStore


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dataset", type=dataset_name)
    p.add_argument("--version", dest="dataset_version", type=version, help="default: the current one")
    p.add_argument("--check", action="store_true", help="verify: cached %% per node, replica health")
    p.add_argument("--no-wait", action="store_true", help="request and return")
    p.add_argument("--timeout", type=seconds, default=0,
                   help="give up waiting after this many seconds (0: wait)")
    p.add_argument("--priority", type=priority, default=0,
                   help="eviction priority, -1000..1000 (higher stays when memory is short; "
                        "default 0)")
    p.add_argument("--evict", action="store_true",
                   help="if it does not fit, unload the lower-priority datasets the plan names")
    p.add_argument("--force", action="store_true",
                   help="request it even if it does not fit (the arenas evict by priority)")
    p.add_argument("--json", action="store_true",
                   help="one JSON document on stdout (progress and messages on stderr)")


def _progress(store: EtcdStore, tag: str) -> tuple[dict[str, NodeRecord], dict[str, Any]]:
    from ..cluster.membership import NodeRecord, list_json

    return NodeRecord.list_verified(store), list_json(store, f"progress/{tag}/")


def run(args: argparse.Namespace) -> int:

    cli_logging(args)
    cfg = load_config(args)
    store = cluster_store(cfg, "preload")
    info = store.dataset(args.dataset, args.dataset_version)
    tag = f"{info.name}@{info.version}"
    if args.check:
        return _check(cfg, store, info, as_json=args.json)
    from ..cluster import lifecycle

    plan, unloaded = lifecycle.request_planned(
        store, info.name, info.version, info.chunks, cfg.cluster.replicas, args.priority,
        evict=args.evict, force=args.force)
    for gone in unloaded:
        print(f"unloaded {gone} (lower priority) to make room", file=sys.stderr)
    if not plan.fits and not unloaded:
        print(f"warning (--force): {plan.describe()}", file=sys.stderr)
    print(f"preload of {tag} requested: {info.chunks:,} chunks, {info.bytes / 1e9:.2f} GB, "
          f"R={cfg.cluster.replicas}, priority {args.priority}; {plan.describe()}",
          file=sys.stderr if args.json else sys.stdout)
    if args.no_wait:
        if args.json:
            print(json.dumps({"requested": tag, "priority": args.priority, "fits": plan.fits,
                              "in_memory": plan.in_memory, "need_bytes": plan.need * plan.slot_size,
                              "unloaded": unloaded}))
        return 0
    return _wait(store, tag, args.timeout, as_json=args.json)


def _wait(store: EtcdStore, tag: str, timeout: float, as_json: bool = False) -> int:
    """Watch the nodes' ``progress/<tag>/`` records until every live node holds its share
    (0) or ``timeout`` s pass (1; the preload goes on). A progress bar on stderr (plain
    lines when it is not a terminal; none with ``as_json``, which prints one JSON
    document on stdout at the end instead of the closing sentence)."""
    from ..cluster.lifecycle import count

    t0 = time.monotonic()
    first_cached = None
    tty = is_terminal(sys.stderr)
    with progress_bar(every=10.0) as bar:
        while True:
            nodes, prog = _progress(store, tag)
            owned = sum(count(p, "owned") for n, p in prog.items() if n in nodes)
            cached = sum(count(p, "cached") for n, p in prog.items() if n in nodes)
            refused = sum(count(p, "refused") for n, p in prog.items() if n in nodes)
            done = bool(nodes) and set(nodes) <= set(prog) and cached + refused >= owned
            el = time.monotonic() - t0
            if first_cached is None:
                first_cached = cached
            rate = (cached - first_cached) / el if el > 0 else 0
            eta = f"{(owned - cached) / rate:,.0f}s" if rate > 0 else "-"
            detail = (f"{cached:,}/{owned:,} chunk replicas on {len(prog)}/{len(nodes)} nodes, "
                      f"{rate:,.1f} chunks/s, ETA {eta}" if nodes else
                      "no live nodes (start `kspeedfs node` on the training nodes)")
            if not as_json:
                bar.update(tag, cached, owned or None, detail)
            if done or (timeout and el > timeout):
                break
            time.sleep(0.5 if tty else 2.0)
    if as_json:
        print(json.dumps({"dataset": tag, "complete": done, "seconds": round(el, 3),
                          "owned": owned, "cached": cached, "refused": refused,
                          "nodes": len(nodes), "reporting": len(prog)}, indent=2))
    elif done:
        print(f"preload of {tag} complete in {el:.1f}s" + (
            f"; {refused:,} chunk replicas not held (room for them would evict an equal or "
            "higher priority, or full index buckets: other replicas or the source serve "
            "them; node logs)"
            if refused else ""))
    else:
        print(f"preload of {tag}: still running after {el:.0f}s (it continues on the nodes)")
    return 0 if done else 1


def _check(cfg: Config, store: EtcdStore, info: DatasetInfo, as_json: bool = False) -> int:
    """Ask every live node which chunks it holds: a table of cached % per node and the
    replica health of every chunk (``as_json``: the same as one JSON document). 0 when
    every chunk has R verified copies, else 1."""
    import trio

    from rdma.errors import RdmaError

    from ..cluster.membership import NodeRecord
    from ..cluster.placement import owners
    from ..cluster.rpc import RpcClient, RpcUnavailable
    from ..manifest.load import load_index

    ix = load_index(store, info, cfg.store.page_cache)
    records = list(NodeRecord.list_verified(store).values())
    secret = cfg.cluster.secret()
    have: dict[str, set[int] | None] = {}
    trouble: dict[str, str] = {}         # node → why it has no answer

    async def ask(rec: NodeRecord) -> None:
        c = RpcClient(secret, "preload-check", rec.nics, rec.rpc_port, timeout=10)
        try:
            r = await c.request({"op": "have", "dataset": info.name, "version": info.version})
            have[rec.node] = {int(k) for k in r["chunks"]}
        except (RpcUnavailable, RdmaError, OSError) as e:   # wrong secret, refused, down
            trouble[rec.node] = f"unreachable ({e})"
            have[rec.node] = None
        except (KeyError, TypeError, ValueError) as e:
            trouble[rec.node] = f"malformed reply ({type(e).__name__}: {e})"
            have[rec.node] = None
        finally:
            await c.aclose()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for rec in records:
                nursery.start_soon(ask, rec)

    trio.run(main)
    members = [r.member() for r in records]
    R = cfg.cluster.replicas
    own: dict[str, list[int]] = {r.node: [] for r in records}
    copies = [0] * (R + 1)
    for k in range(ix.chunks):
        who = owners(ix.chunk_digest(k), members, R)
        for w in who:
            own[w].append(k)
        held = sum(1 for w in who if k in (have.get(w) or ()))
        copies[min(held, R)] += 1
    ok = copies[R] == ix.chunks
    rows = []
    for r in records:
        h = have.get(r.node)
        mine = own[r.node]
        cached = sum(1 for k in mine if h and k in h) if h is not None else None
        rows.append((r.node, len(mine), cached,
                     100 * (cached or 0) / len(mine) if mine else 100.0, trouble.get(r.node, "")))
    if as_json:
        print(json.dumps({
            "dataset": f"{info.name}@{info.version}", "chunks": ix.chunks, "replicas": R, "ok": ok,
            "nodes": [{"node": n, "owns": o, "cached": c, "percent": round(p, 1), "error": t or None}
                      for n, o, c, p, t in rows],
            "copies": {str(i): c for i, c in enumerate(copies)}}, indent=2))
        return 0 if ok else 1
    print(f"{info.name}@{info.version}: {ix.chunks:,} chunks, R={R}, {len(records)} live nodes")
    table = Table(["NODE", "OWNS", "CACHED", "%", ""], right=(1, 2, 3))
    for n, o, c, p, t in rows:
        table.add(n, f"{o:,}", "-" if c is None else f"{c:,}", f"{p:.1f}%", t)
    print_table(table)
    print("replica health: " + ", ".join(f"{c:,} chunks with {i} cop{'y' if i == 1 else 'ies'}"
                                         for i, c in enumerate(copies) if c))
    print("OK: every chunk has R verified copies" if ok else "INCOMPLETE")
    return 0 if ok else 1
