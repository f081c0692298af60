"""``kspeedfs preload DATASET``: ask the cluster to hold a dataset version; show progress.

The request is one etcd key (``preload/<dataset>``); every node loads its own share in
parallel (``cluster/node.py`` reconcile) and reports to ``progress/``. This command
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

from .options import cli_logging, cluster_store, dataset_name, load_config, seconds, version


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dataset", type=dataset_name)
    p.add_argument("--version", dest="dataset_version", type=version, help="default: the current one")
    p.add_argument("--check", action="store_true", help="verify: cached %% per node, replica health")
    p.add_argument("--no-wait", action="store_true", help="request and return")
    p.add_argument("--timeout", type=seconds, default=0,
                   help="give up waiting after this many seconds (0: wait)")


def _progress(store, tag: str) -> tuple[dict, dict]:
    from ..cluster.membership import NodeRecord, list_json

    return NodeRecord.list_verified(store), list_json(store, f"progress/{tag}/")


def run(args: argparse.Namespace) -> int:

    cli_logging(args)
    cfg = load_config(args)
    store = cluster_store(cfg, "preload")
    info = store.dataset(args.dataset, args.dataset_version)
    tag = f"{info.name}@{info.version}"
    if args.check:
        return _check(cfg, store, info)
    store.call(lambda c: c.put(f"{store.prefix}preload/{info.name}",
                               json.dumps({"version": info.version, "requested": time.time()})))
    print(f"preload of {tag} requested: {info.chunks:,} chunks, {info.bytes / 1e9:.2f} GB, "
          f"R={cfg.cluster.replicas}")
    if args.no_wait:
        return 0
    t0 = time.monotonic()
    first_cached = None
    tty = sys.stderr.isatty()
    while True:
        nodes, prog = _progress(store, tag)
        owned = sum(p["owned"] for n, p in prog.items() if n in nodes)
        cached = sum(p["cached"] for n, p in prog.items() if n in nodes)
        done = bool(nodes) and set(nodes) <= set(prog) and cached >= owned
        el = time.monotonic() - t0
        if first_cached is None:
            first_cached = cached
        rate = (cached - first_cached) / el if el > 0 else 0
        eta = f"{(owned - cached) / rate:,.0f}s" if rate > 0 else "-"
        line = (f"{tag}: {cached:,}/{owned:,} chunk replicas cached "
                f"({100 * cached / owned if owned else 0:.1f}%) on {len(prog)}/{len(nodes)} nodes, "
                f"{rate:,.1f} chunks/s, ETA {eta}")
        if not nodes:
            line = f"{tag}: no live nodes (start `kspeedfs node` on the training nodes)"
        sys.stderr.write(("\r\033[K" if tty else "") + line + ("" if tty and not done else "\n"))
        sys.stderr.flush()
        if done:
            print(f"preload of {tag} complete in {el:.1f}s")
            return 0
        if args.timeout and el > args.timeout:
            print(f"preload of {tag}: still running after {el:.0f}s (it continues on the nodes)")
            return 1
        time.sleep(0.5 if tty else 2.0)


def _check(cfg, store, info) -> int:
    import trio
    from rdma.errors import RdmaError

    from ..cluster.membership import NodeRecord
    from ..cluster.placement import owners
    from ..cluster.rpc import RpcClient, RpcUnavailable
    from ..manifest.index import ManifestIndex

    ix = ManifestIndex.from_blob(store.manifest(info.name, info.version), info.inflated_size)
    records = list(NodeRecord.list_verified(store).values())
    secret = cfg.cluster.secret()
    have: dict[str, set[int] | None] = {}

    async def ask(rec: NodeRecord) -> None:
        c = RpcClient(secret, "preload-check", rec.nics, rec.rpc_port, timeout=10)
        try:
            r = await c.request({"op": "have", "dataset": info.name, "version": info.version})
            have[rec.node] = {int(k) for k in r["chunks"]}
        except (RpcUnavailable, RdmaError, OSError) as e:   # wrong secret, refused, down
            print(f"  {rec.node}: unreachable ({e})")
            have[rec.node] = None
        except (KeyError, TypeError, ValueError) as e:
            print(f"  {rec.node}: malformed reply ({type(e).__name__}: {e})")
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
        held = sum(1 for w in who if have.get(w) and k in have[w])
        copies[min(held, R)] += 1
    print(f"{info.name}@{info.version}: {ix.chunks:,} chunks, R={R}, {len(records)} live nodes")
    print(f"  {'NODE':<16} {'OWNS':>8} {'CACHED':>8} {'%':>6}")
    for r in records:
        h = have.get(r.node)
        mine = own[r.node]
        cached = sum(1 for k in mine if h and k in h)
        pct = 100 * cached / len(mine) if mine else 100.0
        print(f"  {r.node:<16} {len(mine):>8,} {cached if h is not None else '-':>8} {pct:>5.1f}%")
    print("  replica health: " + ", ".join(f"{c:,} chunks with {i} cop{'y' if i == 1 else 'ies'}"
                                            for i, c in enumerate(copies) if c))
    ok = copies[R] == ix.chunks
    print("  OK: every chunk has R verified copies" if ok else "  INCOMPLETE")
    return 0 if ok else 1
