"""Metadata store backends behind one interface; see ``base.py``.

Who needs the cluster secret: the etcd backend signs every dataset info record it
publishes and refuses every one it reads that is not signed with the cluster's key
(``signature.py``), so opening it takes the secret; the embedded backend is a local
directory guarded by file permissions and stays unsigned (no secret needed).
:func:`open_configured` reads the secret only when the configuration selects etcd.
"""
from __future__ import annotations

import os

# gRPC's fork handlers (pthread_atfork) abort a process that forks while gRPC threads
# run, and our processes do fork (test fixtures, daemons spawning helpers); no child of
# ours ever uses the parent's channels, so the handlers are only a hazard. Set here, in
# the package every etcd module is loaded through, because it must precede grpc's import.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from ...config import Config, StoreConfig  # noqa: E402
from .base import DatasetInfo, MetadataStore, check_name  # noqa: E402

__all__ = ["DatasetInfo", "MetadataStore", "check_name", "identity", "open_configured",
           "open_store", "page_dir"]


def identity(cfg: StoreConfig) -> str:
    """The one name of the store ``cfg`` selects, the same in every process that opens
    it, found without opening it: what a local mount's record names (``fuse/registry.py``),
    so ``rm`` weighs only the mounts of its own store. Embedded: the directory's real
    path; etcd: the key prefix (each host may list the endpoints, one per rail, its own
    way)."""
    if cfg.backend == "etcd":
        return f"etcd:{cfg.etcd_prefix}"
    return f"embedded:{os.path.realpath(cfg.path)}"


def open_store(cfg: StoreConfig, secret: bytes | None = None) -> MetadataStore:
    """The configured backend. etcd is imported only when selected; ``secret`` (the
    cluster secret) is what it signs and verifies records with: without it, an etcd
    store refuses to publish or read datasets (``ConfigError``)."""
    store: MetadataStore
    if cfg.backend == "etcd":
        from .etcd import EtcdStore

        store = EtcdStore(cfg, secret)
    else:
        from .embedded import EmbeddedStore

        store = EmbeddedStore(cfg.path)
    store.page_dir = page_dir(cfg)
    store.paged_above = cfg.paged_above
    return store


def page_dir(cfg: StoreConfig) -> str | None:
    """Where the store ``cfg`` selects keeps manifest pages (``manifest/pages.py``):
    ``store.pages``, else the embedded store's ``<path>/pages``; None for etcd without
    one (manifests stay whole in etcd)."""
    if cfg.pages:
        return cfg.pages
    return os.path.join(cfg.path, "pages") if cfg.backend == "embedded" else None


def open_configured(cfg: Config) -> MetadataStore:
    """:func:`open_store` for a whole configuration: with ``cluster.secret()`` when the
    backend is etcd (a missing or short secret is a ``ConfigError`` naming the file)."""
    secret = cfg.cluster.secret() if cfg.store.backend == "etcd" else None
    return open_store(cfg.store, secret)
