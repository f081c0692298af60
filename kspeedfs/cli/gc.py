"""``kspeedfs gc [DATASET...]``: remove old dataset versions by the version rule.

Keeps the newest ``store.keep_versions`` (``--keep``) of each dataset and every
version a live mount holds (this machine's mounts with either store, every host's with
etcd) or a preload names (``cluster/lifecycle.py`` ``pinned_versions``); removes the
rest from the store. ``kspeedfs import`` runs the same rule for the dataset it imported.
"""
from __future__ import annotations

import argparse
import json

from .options import cli_logging, dataset_name, load_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("datasets", nargs="*", type=dataset_name, metavar="DATASET",
                   help="default: every dataset")
    p.add_argument("--keep", type=int, help="versions to keep (store.keep_versions)")
    p.add_argument("--dry-run", action="store_true", help="say what would go; remove nothing")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    from ..cluster import lifecycle
    from ..errors import ConfigError
    from ..manifest.store import open_configured

    cli_logging(args)
    cfg = load_config(args)
    keep = cfg.store.keep_versions if args.keep is None else args.keep
    if keep < 1:
        raise ConfigError(f"--keep {keep}: keep at least 1 version (0 would mean keep all)")
    removed: dict[str, list[int]] = {}
    with open_configured(cfg) as store:
        names = args.datasets or sorted(i.name for i in store.datasets())
        for name in names:
            removed[name] = lifecycle.collect(store, name, keep, args.dry_run)
    if args.json:
        print(json.dumps({"keep": keep, "dry_run": args.dry_run, "removed": removed}))
        return 0
    verb = "would remove" if args.dry_run else "removed"
    gone = [f"{n}@{v}" for n, vs in removed.items() for v in vs]
    print(f"{verb} {', '.join(gone)}" if gone else f"nothing to remove (keep {keep})")
    return 0
