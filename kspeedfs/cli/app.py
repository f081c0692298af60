"""``kspeedfs`` command line: parse, load config, dispatch; the one place errors
become exit codes.

Each command lives in its own module, imported only when that command runs, so
``kspeedfs --help`` imports neither pyfuse3 nor etcd. :func:`main` is the one
exception → exit status wrapper: user errors (either exception tree, i.e. any
:class:`~rdma.errors.ErrnoError`, and ``OSError``; also inside a trio
``ExceptionGroup``) print one line and exit 1; a usage error prints one line and exits
2; anything else is a bug and prints one line ("internal error") and exits 70. The
traceback goes to the debug log only (``--verbose``); nothing prints a Python traceback
by default.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

from ..errors import ErrnoError

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
    "stats": ("stats", "a live view of a mount (or --cluster): throughput per tier, ops/s, hits"),
    "unload": ("unload", "take a dataset out of the pooled cache (its versions stay in the store)"),
    "rm": ("rm", "remove a dataset version (or all versions) from the store and the cache"),
    "gc": ("gc", "remove old dataset versions by the keep rule (store.keep_versions)"),
    "migrate": ("migrate", "publish a whole manifest again as pages (store.pages)"),
    "secret": ("secret", "cluster secret: generate writes a new random one (mode 0600)"),
    "arena": ("arena", "this host's node arena files (RAM they hold); drop NODE removes one"),
    "csi": ("csi", "run the Kubernetes CSI node plugin (stages and publishes kspeedfs volumes)"),
}
EX_SOFTWARE = 70     # sysexits.h: an internal error (a bug)

log = logging.getLogger("kspeedfs")


class Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (its default prints the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {_one_line(message)} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from . import options

    p = Parser(prog="kspeedfs", description="Distributed cache filesystem for training data.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    for name, (module, summary) in COMMANDS.items():
        sp = sub.add_parser(name, help=summary, description=summary)
        options.add_common(sp)
        importlib.import_module(f"{__package__}.{module}").add_arguments(sp)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        module = importlib.import_module(f"{__package__}.{COMMANDS[args.command][0]}")
        return int(module.run(args) or 0)
    except SystemExit:
        raise
    except BaseException as e:
        if getattr(args, "verbose", False) or str(getattr(args, "log_level", "")).upper() == "DEBUG":
            if not logging.getLogger().handlers:
                logging.basicConfig()
            log.debug("exception information:", exc_info=e)
        message, status = describe(e)
        print(f"kspeedfs {args.command}: {message}", file=sys.stderr)
        return status


def describe(e: BaseException) -> tuple[str, int]:
    """One line and an exit status for whatever ended a command."""
    leaves = list(_leaves(e))
    if any(isinstance(x, KeyboardInterrupt) for x in leaves):
        return "interrupted", 130
    user = [x for x in leaves if isinstance(x, (ErrnoError, OSError))]
    if user and len(user) == len(leaves):
        more = f" (and {len(user) - 1} more)" if len(user) > 1 else ""
        return f"error: {_one_line(_text(user[0]))}{more}", 1
    bug = next((x for x in leaves if x not in user), e)
    return (f"internal error: {_one_line(_text(bug))}; "
            "run with --verbose for the traceback", EX_SOFTWARE)


def _leaves(e: BaseException) -> list[BaseException]:
    if isinstance(e, BaseExceptionGroup):
        return [leaf for sub in e.exceptions for leaf in _leaves(sub)]
    return [e]


def _text(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    if isinstance(e, (ErrnoError, OSError)) and str(e):
        return str(e)
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


if __name__ == "__main__":
    sys.exit(main())
