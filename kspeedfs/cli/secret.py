"""``kspeedfs secret generate [PATH]``: write a new cluster secret (default: cluster.secret_file).

The file holds 32 bytes from ``secrets.token_bytes`` as 64 hex digits and a newline:
text survives editors, ``scp`` and the ``.strip()`` that :meth:`ClusterConfig.secret`
applies, and its 256 bits pass that method's rules. The file is created mode 0600
and appears whole or not at all: the bytes go to a temporary file in the same
directory (``O_EXCL``, 0600, fsync), which is then linked to PATH (refusing an
existing file) or, with ``--force``, renamed over it.
"""
from __future__ import annotations

import argparse
import os
import secrets

from ..config import ClusterConfig
from ..errors import ConfigError
from .options import cli_logging, load_config

SECRET_BYTES = 32


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    g = sub.add_parser("generate", help="write 32 random bytes (hex) to PATH, mode 0600",
                       description="write a new random cluster secret, mode 0600")
    g.add_argument("path", nargs="?", help="where (default: cluster.secret_file)")
    g.add_argument("--force", action="store_true", help="replace an existing file")


def generate(path: str, force: bool = False) -> None:
    """Write a fresh secret to ``path`` atomically, mode 0600 (see the module docstring)."""
    directory = os.path.dirname(os.path.abspath(path))
    if not force and os.path.lexists(path):
        raise ConfigError(f"{path} exists; a new secret locks out every process still using "
                          "the old one (--force to replace it)")
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise ConfigError(f"{path}: cannot create a file in {directory} ({e.strerror})") from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(SECRET_BYTES) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if force:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)             # atomic, and never over an existing file
            except FileExistsError:
                raise ConfigError(f"{path} exists (--force to replace it)") from None
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    ClusterConfig(secret_file=path).secret()    # the file passes the rules it is read by


def run(args: argparse.Namespace) -> int:
    cli_logging(args)
    path = load_config(args).cluster.secret_file if args.path is None else args.path
    if not path:
        raise ConfigError("secret generate: no path (give one, or set cluster.secret_file)")
    generate(path, args.force)
    print(f"wrote a new cluster secret to {path} ({SECRET_BYTES} random bytes as hex, mode 0600); "
          "copy it to every node and client of the cluster")
    return 0
