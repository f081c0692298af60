"""Options shared by every command, defined once, and their mapping onto config keys;
the argparse ``type=`` checks of command arguments (names, versions, durations), so a bad
value is a one-line usage error before anything runs."""
from __future__ import annotations

import argparse
import math
import re
from typing import TYPE_CHECKING, Any

from .. import config as config_mod
from ..config import Config

if TYPE_CHECKING:
    from ..manifest.store.etcd import EtcdStore


def add_common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("common options")
    g.add_argument("--config", metavar="PATH",
                   help=f"config file (default $KSPEEDFS_CONFIG or {config_mod.DEFAULT_CONFIG_PATH})")
    g.add_argument("--store", metavar="DIR", help="embedded metadata store directory (store.path)")
    g.add_argument("--etcd", metavar="URL", action="append",
                   help="use the etcd metadata store at URL (repeatable; sets store.backend=etcd)")
    g.add_argument("--set", metavar="SECTION.KEY=VALUE", action="append", default=[],
                   help="override any config key, e.g. --set cache.memory=8GiB")
    g.add_argument("--log-level", metavar="LEVEL", help="DEBUG, INFO, WARNING, ERROR (log.level)")
    g.add_argument("-v", "--verbose", action="store_true", help="same as --log-level DEBUG")


def dataset_name(text: str) -> str:
    """argparse type: a valid dataset name (``manifest/store/base.py`` check_name)."""
    from ..errors import ConfigError
    from ..manifest.store.base import check_name

    try:
        return check_name(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def dataset_version(text: str) -> tuple[str, int | None]:
    """argparse type: ``DATASET[@VERSION]`` (no version: None)."""
    name, sep, v = text.partition("@")
    if not sep:
        return dataset_name(name), None
    if not v.isdigit() or int(v) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the version after @ must be a positive integer")
    return dataset_name(name), int(v)


def node_name(text: str) -> str:
    """argparse type: a node name (a host name: etcd keys and a log file name)."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", text):
        raise argparse.ArgumentTypeError(f"invalid node name {text!r}: use 1-64 characters from "
                                         "A-Z a-z 0-9 . _ -, starting with a letter or digit")
    return text


def priority(text: str) -> int:
    """argparse type: a preload priority, -1000..1000 (``cluster/lifecycle.py``)."""
    try:
        n = int(text)
    except ValueError:
        n = 1 << 20
    if not -1000 <= n <= 1000:
        raise argparse.ArgumentTypeError(f"invalid priority {text!r}: an integer in -1000..1000")
    return n


def version(text: str) -> int:
    """argparse type: a dataset version, 1.."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n < 1 << 63:
        raise argparse.ArgumentTypeError(f"invalid version {text!r}: a number >= 1")
    return n


def seconds(text: str) -> float:
    """argparse type: a finite, non-negative duration in seconds."""
    try:
        s = float(text)
    except ValueError:
        s = -1.0
    if not (s >= 0 and math.isfinite(s)):
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}: seconds, finite and >= 0")
    return s


def load_config(args: argparse.Namespace, **overrides: Any) -> Config:
    from ..errors import ConfigError

    if args.config == "":
        raise ConfigError("--config: an empty path")
    o: dict[str, Any] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected SECTION.KEY=VALUE")
        o[key.strip()] = value.strip()
    if args.store:
        o["store.path"] = args.store
    if args.etcd:
        o["store.backend"] = "etcd"
        o["store.etcd"] = args.etcd
    if args.verbose:
        o["log.level"] = "DEBUG"
    elif args.log_level is not None:
        o["log.level"] = args.log_level
    o.update({k: v for k, v in overrides.items() if v is not None})   # unset flags keep --set
    return config_mod.load(args.config, o)


def cli_logging(args: argparse.Namespace) -> None:
    from .. import log

    level = "DEBUG" if args.verbose else (args.log_level or "WARNING").upper()
    # a bad --log-level is reported by load_config (log.level), not by logging's ValueError
    log.setup(level if level in ("DEBUG", "INFO", "WARNING", "ERROR") else "WARNING")


def cluster_store(cfg: Config, command: str) -> EtcdStore:
    """The etcd store the cluster commands (preload, status) work on; a clear error
    when the configuration points at the embedded store instead."""
    from ..errors import KspeedfsError
    from ..manifest.store.etcd import EtcdStore

    if cfg.store.backend != "etcd":
        raise KspeedfsError(f"{command} needs the cluster's etcd store (--etcd URL)")
    return EtcdStore(cfg.store, cfg.cluster.secret())   # records are signed: the secret verifies them
