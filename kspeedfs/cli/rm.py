"""``kspeedfs rm DATASET[@VERSION]``: remove a dataset version (or every version) from
the store and the pooled cache.

Refused, naming the mounts, while a live mount holds a version it removes unless
``--force`` (``cluster/lifecycle.py`` ``pinned_versions``: the mounts this machine
serves, ``fuse/registry.py``, with either store, and every host's ``mounts/`` records
with etcd): a mount keeps its manifest in memory and keeps reading, but could not be
mounted again. A preloaded version removed is unloaded first, so the nodes drop its
chunks.
"""
from __future__ import annotations

import argparse
import json

from .options import cli_logging, dataset_version, load_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", type=dataset_version, metavar="DATASET[@VERSION]")
    p.add_argument("--force", action="store_true", help="remove even what a live mount holds")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    from ..cluster import lifecycle
    from ..errors import DatasetInUse, DatasetNotFound
    from ..manifest.store import open_configured

    cli_logging(args)
    cfg = load_config(args)
    name, version = args.target
    with open_configured(cfg) as store:
        versions = store.versions(name)
        if version is not None and version not in versions:
            raise DatasetNotFound(f"dataset {name!r} has no version {version}")
        doomed = versions if version is None else [version]
        pinned = lifecycle.pinned_versions(store, name)
        mounted = {v: why for v, why in pinned.items() if v in doomed and why != "preloaded"}
        if mounted and not args.force:
            raise DatasetInUse("; ".join(f"{name}@{v} is {why}" for v, why in sorted(mounted.items()))
                               + " (unmount it first, or --force)")
        unloaded = None
        if hasattr(store, "call"):
            req = lifecycle.preloads(store).get(name)
            if req is not None and req.version in doomed:
                unloaded = lifecycle.unload(store, name)
        store.remove(name, version)
    tags = [f"{name}@{v}" for v in doomed]
    if args.json:
        print(json.dumps({"removed": tags, "unloaded": f"{name}@{unloaded.version}" if unloaded else None,
                          "mounted": {f"{name}@{v}": why for v, why in mounted.items()}}))
        return 0
    print(f"removed {', '.join(tags)}" + (f" (unloaded {name}@{unloaded.version} from the cache)"
                                          if unloaded else "")
          + (f"; still mounted: {'; '.join(mounted.values())}" if mounted else ""))
    return 0
