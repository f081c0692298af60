"""``kspeedfs unload DATASET``: take a dataset out of the pooled cache.

Its preload request goes; every node drops the dataset's chunks from its arena and SSD
tier (``cluster/reconcile.py``), except chunks another preloaded dataset shares.
The versions stay in the store: ``kspeedfs preload`` brings it back. Mounts keep
working (their reads go to the source, or to a peer that still holds a chunk).
"""
from __future__ import annotations

import argparse
import json

from .options import cli_logging, cluster_store, dataset_name, load_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dataset", type=dataset_name)
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    from ..cluster import lifecycle
    from ..errors import DatasetNotFound

    cli_logging(args)
    cfg = load_config(args)
    store = cluster_store(cfg, "unload")
    try:
        removed = lifecycle.unload(store, args.dataset)
        held = lifecycle.mounts(store, args.dataset)
    finally:
        store.close()
    if removed is None:
        raise DatasetNotFound(f"{args.dataset} is not preloaded (nothing to unload)")
    tag = f"{args.dataset}@{removed.version}"
    users = [f"{r.host}:{r.mountpoint}" for r in held.get(tag, [])]
    if args.json:
        print(json.dumps({"unloaded": tag, "mounts": users}))
        return 0
    print(f"unloaded {tag}: the nodes drop its chunks"
          + (f"; still mounted at {', '.join(users)} (reads go to the source)" if users else ""))
    return 0
