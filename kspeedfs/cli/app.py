"""``kspeedfs`` command line: parse, load config, dispatch; the one place errors
become exit codes.

Each command lives in its own module, imported only when that command runs, so
``kspeedfs --help`` imports neither pyfuse3 nor etcd. User errors
(:class:`KspeedfsError`) print one line and exit 1; anything else is a bug and
prints a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Sequence

from ..errors import KspeedfsError

# command → (module, summary)
COMMANDS = {
    "import": ("import_", "scan a directory into a new dataset version (chunks + checksums)"),
    "mount": ("mount", "mount a dataset read-only (daemonizes; --foreground to stay attached)"),
    "umount": ("umount", "unmount a kspeedfs mount"),
    "ls": ("ls", "list datasets"),
    "config": ("config", "print the effective configuration as TOML"),
    "node": ("node", "run this machine's cluster node (memory arena, vRDMA endpoint)"),
    "preload": ("preload", "load a dataset into the cluster's pooled cache (--check: verify)"),
    "status": ("status", "nodes, NICs and paths, cache use, datasets cached, hit ratios"),
}

log = logging.getLogger("kspeedfs")


def build_parser() -> argparse.ArgumentParser:
    from . import options

    p = argparse.ArgumentParser(prog="kspeedfs", description="Distributed cache filesystem for training data.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, summary) in COMMANDS.items():
        sp = sub.add_parser(name, help=summary, description=summary)
        options.add_common(sp)
        importlib.import_module(f"{__package__}.{module}").add_arguments(sp)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module = importlib.import_module(f"{__package__}.{COMMANDS[args.command][0]}")
    try:
        return int(module.run(args) or 0)
    except KspeedfsError as e:
        log.debug("exception information:", exc_info=True)
        print(f"kspeedfs {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"kspeedfs {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
