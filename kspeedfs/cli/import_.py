"""``kspeedfs import SOURCE --name NAME``: a new dataset version, with a progress line."""
from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, TextIO

from .options import cli_logging, dataset_name, load_config


if TYPE_CHECKING:
    from ..manifest.importer import ImportProgress


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="directory to import (NFS, Lustre, a local disk, ...)")
    p.add_argument("--name", required=True, type=dataset_name, help="dataset name")
    p.add_argument("--chunk-size", metavar="SIZE", help="chunk size, e.g. 4MiB (import.chunk_size)")
    p.add_argument("--block-size", metavar="SIZE",
                   help="random-read block size, e.g. 128KiB (import.block_size)")
    p.add_argument("--threads", type=int, help="reader/hasher threads (import.threads)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")


class ProgressLine:
    """Redraws one terminal line at most 10 times a second: files/s, MB/s, ETA."""

    def __init__(self, stream: TextIO = sys.stderr) -> None:
        self.stream = stream
        self.last = 0.0
        self.phase = ""
        self.tty = stream.isatty()

    def __call__(self, p: ImportProgress) -> None:
        now = time.monotonic()
        if p.phase == self.phase and now - self.last < (0.1 if self.tty else 5.0):
            return
        self.last = now
        self.phase = p.phase
        el = max(p.elapsed, 1e-6)
        if p.phase == "scan":
            line = f"scanning: {p.files_done:,} entries, {p.bytes_done / 1e6:,.0f} MB"
        elif p.phase == "publish":
            line = f"publishing the manifest of {p.files_total:,} files"
        else:
            rate = p.bytes_done / el
            eta = (p.bytes_total - p.bytes_done) / rate if rate else 0
            pct = 100 * p.bytes_done / p.bytes_total if p.bytes_total else 100
            line = (f"{p.phase}: {pct:5.1f}%  {p.files_done:,}/{p.files_total:,} files  "
                    f"{p.files_done / el:,.0f} files/s  {rate / 1e6:,.1f} MB/s  ETA {eta:,.0f}s")
        if self.tty:
            self.stream.write("\r\033[K" + line + ("\n" if p.phase == "done" else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def run(args: argparse.Namespace) -> int:
    from ..manifest.importer import import_tree
    from ..manifest.store import open_configured

    cli_logging(args)
    cfg = load_config(args, **{"import.chunk_size": args.chunk_size,
                                 "import.block_size": args.block_size,
                                 "import.threads": args.threads})
    t0 = time.monotonic()
    with open_configured(cfg) as store:
        info = import_tree(args.source, args.name, store, cfg.import_.chunk_size, cfg.import_.threads,
                           progress=None if args.quiet else ProgressLine(),
                           block_size=cfg.import_.block_size)
    dt = time.monotonic() - t0
    print(f"imported {info.name} v{info.version}: {info.files:,} files, {info.bytes / 1e6:,.1f} MB, "
          f"{info.chunks:,} chunks of {info.chunk_size >> 20} MiB in {dt:.1f}s "
          f"({info.bytes / 1e6 / max(dt, 1e-9):,.0f} MB/s); manifest {info.manifest_size:,} bytes")
    return 0
