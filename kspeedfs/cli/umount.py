"""``kspeedfs umount MOUNTPOINT``: unmount (the daemon then exits by itself)."""
from __future__ import annotations

import argparse

from .. import mountpoint
from ..errors import MountError
from .options import cli_logging


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("mountpoint")
    p.add_argument("-z", "--lazy", action="store_true", help="detach now, clean up when no longer busy")


def run(args: argparse.Namespace) -> int:
    cli_logging(args)
    if not mountpoint.is_mounted(args.mountpoint):
        raise MountError(f"{args.mountpoint} is not mounted")
    mountpoint.unmount(args.mountpoint, args.lazy)
    return 0
