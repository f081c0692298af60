"""``kspeedfs config``: print the effective configuration (defaults < file < env < flags)."""
from __future__ import annotations

import argparse

from .options import cli_logging, load_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    cli_logging(args)
    print(load_config(args).to_toml(), end="")
    return 0
