"""Options shared by every command, defined once, and their mapping onto config keys."""
from __future__ import annotations

import argparse
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


def load_config(args: argparse.Namespace, **overrides: Any) -> Config:
    o: dict[str, Any] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            from ..errors import ConfigError

            raise ConfigError(f"--set {item!r}: expected SECTION.KEY=VALUE")
        o[key.strip()] = value.strip()
    if args.store:
        o["store.path"] = args.store
    if args.etcd:
        o["store.backend"] = "etcd"
        o["store.etcd"] = args.etcd
    if args.verbose:
        o["log.level"] = "DEBUG"
    elif args.log_level:
        o["log.level"] = args.log_level
    o.update({k: v for k, v in overrides.items() if v is not None})   # unset flags keep --set
    return config_mod.load(args.config, o)


def cli_logging(args: argparse.Namespace) -> None:
    from .. import log

    log.setup("DEBUG" if args.verbose else (args.log_level or "WARNING"))


def cluster_store(cfg: Config, command: str) -> "EtcdStore":
    """The etcd store the cluster commands (preload, status) work on; a clear error
    when the configuration points at the embedded store instead."""
    from ..errors import KspeedfsError
    from ..manifest.store.etcd import EtcdStore

    if cfg.store.backend != "etcd":
        raise KspeedfsError(f"{command} needs the cluster's etcd store (--etcd URL)")
    return EtcdStore(cfg.store)
