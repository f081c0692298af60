"""``kspeedfs migrate DATASET[@VERSION]``: publish a whole manifest again as pages.

A version imported before paged manifests (or under a store without a page directory)
is kept whole in the store, and every mount loads it whole. ``migrate`` reads it,
writes its pages where the store keeps them (``store.pages``, a directory or a bucket
prefix; the embedded store's ``<path>/pages``) and publishes the same content as the
dataset's next version, its root in the store (``manifest/pages.py``). Mounts of the old
version keep working; a mount of the new one holds only what it touches. Versions are
immutable, so the old one stays until ``kspeedfs rm``/``gc`` removes it.
"""
from __future__ import annotations

import argparse
import json

from .options import cli_logging, dataset_version, load_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", type=dataset_version, metavar="DATASET[@VERSION]",
                   help="default version: the current one")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    from ..errors import ConfigError
    from ..manifest.index import inflate
    from ..manifest.pages import is_root
    from ..manifest.store import open_configured

    cli_logging(args)
    cfg = load_config(args)
    name, version = args.target
    with open_configured(cfg) as store:
        if store.page_sink() is None:
            raise ConfigError("store.pages: this store has nowhere to put pages (set store.pages "
                              "to a bucket prefix s3://BUCKET/PREFIX the nodes read, or a "
                              "shared directory)")
        info, blob = store.fetch(name, version)
        if is_root(blob):
            raise ConfigError(f"{name}@{info.version} is paged already")
        raw = inflate(blob, info.inflated_size)
        del blob
        store.paged_above = 0
        new = store.publish_stream(info, [raw], len(raw))
    if args.json:
        print(json.dumps({"from": f"{name}@{info.version}", "to": f"{name}@{new.version}",
                          "root_bytes": new.manifest_size, "manifest_bytes": new.inflated_size}))
    else:
        print(f"migrated {name}@{info.version} to {name}@{new.version}: pages of "
              f"{new.inflated_size} bytes, a {new.manifest_size}-byte root in the store")
    return 0
