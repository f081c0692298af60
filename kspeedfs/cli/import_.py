"""``kspeedfs import SOURCE --name NAME``: a new dataset version, with a progress bar
(``cli/terminal.py``: one line every few seconds when stderr is not a terminal).

SOURCE is a directory (or ``file://PATH``) or a bucket prefix, ``s3://BUCKET/PREFIX``,
``gs://BUCKET/PREFIX`` or ``az://CONTAINER/PREFIX`` (``kspeedfs/objstore/``: where the
bucket is and the credentials from ``[source]`` and each platform's own settings)."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..config import format_size
from ..errors import ConfigError
from .options import cli_logging, dataset_name, load_config
from .terminal import ProgressBar, progress_bar

if TYPE_CHECKING:
    from ..config import Config
    from ..manifest.importer import ImportProgress, ImportSource


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="directory to import (NFS, Lustre, a local disk, ...; "
                   "file://PATH), or a bucket prefix: s3://BUCKET/PREFIX, gs://BUCKET/PREFIX, "
                   "az://CONTAINER/PREFIX (the account from AZURE_STORAGE_ACCOUNT or "
                   "the connection string)")
    p.add_argument("--name", required=True, type=dataset_name, help="dataset name")
    p.add_argument("--chunk-size", metavar="SIZE", help="chunk size, e.g. 4MiB (import.chunk_size)")
    p.add_argument("--block-size", metavar="SIZE",
                   help="random-read block size, e.g. 128KiB (import.block_size)")
    p.add_argument("--threads", type=int, help="reader/hasher threads (import.threads)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.add_argument("--json", action="store_true",
                   help="no progress; the new version's summary as one JSON document")


def _progress(bar: ProgressBar) -> Callable[[ImportProgress], None]:
    """The importer's callback: its phases on ``bar`` (files/s, MB/s and ETA while hashing)."""

    def show(p: ImportProgress) -> None:
        el = max(p.elapsed, 1e-6)
        if p.phase == "scan":
            bar.update("scanning", p.files_done, None,
                       f"{p.files_done:,} entries, {p.bytes_done / 1e6:,.0f} MB  "
                       f"{p.files_done / el:,.0f}/s")
        elif p.phase == "publish":
            bar.update("publishing", p.bytes_total, p.bytes_total,
                       f"the manifest of {p.files_total:,} files")
        elif p.phase != "done":
            rate = p.bytes_done / el
            eta = f"{(p.bytes_total - p.bytes_done) / rate:,.0f}s" if rate else "-"
            bar.update(p.phase, p.bytes_done, p.bytes_total,
                       f"{p.files_done:,}/{p.files_total:,} files  {p.files_done / el:,.0f} files/s  "
                       f"{rate / 1e6:,.1f} MB/s  ETA {eta}")

    return show


def open_source(source: str, cfg: Config) -> str | ImportSource:
    """A directory path as it is; a bucket URL as an
    :class:`~kspeedfs.objstore.source.ObjectSource`."""
    from ..objstore import connect, is_object_url

    if source.startswith("file://"):
        return source[len("file://"):]
    if is_object_url(source):
        from ..objstore.source import ObjectSource

        return ObjectSource(connect(source, cfg.source),
                            cfg.import_.threads or cfg.source.max_inflight)
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", source) and not os.path.exists(source):
        raise ConfigError(f"{source}: unknown source scheme (a directory, file://, s3://, "
                          "gs:// or az://)")
    return source


def run(args: argparse.Namespace) -> int:
    from ..cluster import lifecycle
    from ..manifest.importer import import_tree
    from ..manifest.store import open_configured

    cli_logging(args)
    cfg = load_config(args, **{"import.chunk_size": args.chunk_size,
                                 "import.block_size": args.block_size,
                                 "import.threads": args.threads})
    t0 = time.monotonic()
    quiet = args.quiet or args.json
    source = open_source(args.source, cfg)
    with open_configured(cfg) as store, progress_bar() as bar:
        info = import_tree(source, args.name, store, cfg.import_.chunk_size, cfg.import_.threads,
                           progress=None if quiet else _progress(bar),
                           block_size=cfg.import_.block_size)
        dt = time.monotonic() - t0
        # the version rule (cluster/lifecycle.py): older versions beyond store.keep_versions
        # go, unless mounted or preloaded
        gone = lifecycle.collect(store, info.name, cfg.store.keep_versions)
    if args.json:
        print(json.dumps({**info.to_json(), "seconds": round(dt, 3),
                          "removed_versions": gone}, indent=2))
        return 0
    if gone:
        print(f"gc: removed {', '.join(f'{info.name}@{v}' for v in gone)} "
              f"(store.keep_versions={cfg.store.keep_versions})", file=sys.stderr)
    print(f"imported {info.name} v{info.version}: {info.files:,} files, {info.bytes / 1e6:,.1f} MB, "
          f"{info.chunks:,} chunks of {format_size(info.chunk_size)} in {_took(dt)} "
          f"({info.bytes / 1e6 / max(dt, 1e-9):,.0f} MB/s); manifest {info.manifest_size:,} bytes")
    return 0


def _took(seconds: float) -> str:
    """A duration as the summary line says it: tenths of a second, milliseconds below one
    tenth (a small tree imports in ~50 ms, which "0.0s" would hide)."""
    return f"{seconds:.1f}s" if seconds >= 0.1 else f"{seconds * 1e3:.0f} ms"
