"""``kspeedfs arena``: this host's node arena files; ``kspeedfs arena drop NODE`` removes one.

A node's arena and index outlive it in ``cluster.arena_dir`` (tmpfs: they hold RAM until
removed) so that a restart re-adopts them (``cluster/arena_files.py``). Retiring a node
from a host, an operator drops them here: refused while that node runs.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from .options import cli_logging, load_config, node_name
from .terminal import Table, print_table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", nargs="?", choices=["ls", "drop"], default="ls",
                   help="ls (default): list the files; drop: remove NODE's arena and index")
    p.add_argument("node", nargs="?", type=node_name, help="the node whose arena to drop")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    from ..cluster import arena_files
    from ..errors import ConfigError, DatasetNotFound

    cli_logging(args)
    cfg = load_config(args)
    directory = cfg.cluster.arena_dir
    if not directory:
        raise ConfigError("cluster.arena_dir is empty: nodes keep their arena in anonymous "
                          "memory, no file to list or drop")
    if args.action == "drop":
        if not args.node:
            raise ConfigError("kspeedfs arena drop needs the node's name")
        tag = arena_files.cluster_tag(cfg.cluster.secret(), cfg.store.etcd_prefix)
        gone = arena_files.drop(directory, tag, args.node)
        if not gone:
            raise DatasetNotFound(f"no arena of node {args.node} of this cluster in {directory}")
        freed = sum(f.ram_bytes for f in gone)
        if args.json:
            print(json.dumps({"dropped": [f.path for f in gone], "ram_bytes": freed}))
        else:
            print(f"dropped node {args.node}'s arena: {len(gone)} files, "
                  f"{freed / 2**30:.2f} GiB of RAM back")
        return 0
    try:
        ours = arena_files.cluster_tag(cfg.cluster.secret(), cfg.store.etcd_prefix)
    except ConfigError:
        ours = None                          # no secret here: every cluster shown as other
    files = arena_files.listing(directory)
    if args.json:
        print(json.dumps([{**asdict(f), "this_cluster": f.cluster == ours} for f in files],
                         indent=2))
        return 0
    table = Table(["FILE", "NODE", "CLUSTER", "RAM", "IN USE"], right=(3,))
    for f in files:
        table.add(f.path, f.node, "this" if f.cluster == ours else f.cluster,
                  f"{f.ram_bytes / 2**30:.2f} GiB", "yes" if f.in_use else "no")
    print_table(table)
    return 0
