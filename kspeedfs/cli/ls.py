"""``kspeedfs ls``: datasets with files, bytes, chunks, import time and source."""
from __future__ import annotations

import argparse
import json
import time

from ..config import format_size
from .options import cli_logging, load_config
from .terminal import Table, print_table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--versions", action="store_true", help="list every version, not only the current one")


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def run(args: argparse.Namespace) -> int:
    from ..manifest.store import open_configured

    cli_logging(args)
    cfg = load_config(args)
    with open_configured(cfg) as store:
        infos = store.datasets()
        if args.versions:
            infos = [store.dataset(i.name, v) for i in infos for v in store.versions(i.name)]
    if args.json:
        print(json.dumps([i.to_json() for i in infos], indent=2))
        return 0
    table = Table(["NAME", "VERSION", "FILES", "BYTES", "CHUNKS", "CHUNK", "IMPORTED", "SOURCE"],
                  right=(1, 2, 3, 4, 5))
    for i in infos:
        table.add(i.name, i.version, f"{i.files:,}", _human(i.bytes), f"{i.chunks:,}",
                  format_size(i.chunk_size),
                  time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i.imported_at)), i.source)
    print_table(table)
    return 0
