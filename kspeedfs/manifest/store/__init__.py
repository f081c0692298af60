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

from ...config import Config, SourceConfig, StoreConfig  # noqa: E402
from ..pages import PageDirectory, PageStore  # noqa: E402
from .base import DatasetInfo, MetadataStore, check_name  # noqa: E402

__all__ = ["DatasetInfo", "MetadataStore", "check_name", "identity", "open_configured",
           "open_store", "page_dir", "page_store"]


def identity(cfg: StoreConfig) -> str:
    """The one name of the store ``cfg`` selects, the same in every process that opens
    it, found without opening it: what a local mount's record names (``fuse/registry.py``),
    so ``rm`` weighs only the mounts of its own store. Embedded: the directory's real
    path; etcd: the key prefix (each host may list the endpoints, one per rail, its own
    way)."""
    if cfg.backend == "etcd":
        return f"etcd:{cfg.etcd_prefix}"
    return f"embedded:{os.path.realpath(cfg.path)}"


def open_store(cfg: StoreConfig, secret: bytes | None = None,
               source: SourceConfig | None = None) -> MetadataStore:
    """The configured backend. etcd is imported only when selected; ``secret`` (the
    cluster secret) is what it signs and verifies records with: without it, an etcd
    store refuses to publish or read datasets (``ConfigError``). ``source``: the
    settings a bucket ``store.pages`` is reached with (default: the environment's)."""
    store: MetadataStore
    if cfg.backend == "etcd":
        from .etcd import EtcdStore

        store = EtcdStore(cfg, secret)
    else:
        from .embedded import EmbeddedStore

        store = EmbeddedStore(cfg.path)
    store.page_dir = page_dir(cfg)
    if cfg.pages_url():                   # a directory is page_dir's alone
        store.pages = page_store(cfg, source)
    store.paged_above = cfg.paged_above
    return store


def page_dir(cfg: StoreConfig) -> str | None:
    """The directory where the store ``cfg`` selects keeps manifest pages
    (``manifest/pages.py``): ``store.pages``, else the embedded store's ``<path>/pages``;
    None for etcd without one (manifests stay whole in etcd) and for a bucket
    ``store.pages`` (:func:`page_store`)."""
    if cfg.pages:
        return cfg.pages_dir() or None
    return os.path.join(cfg.path, "pages") if cfg.backend == "embedded" else None


def page_store(cfg: StoreConfig, source: SourceConfig | None = None) -> PageStore | None:
    """Where the store ``cfg`` selects writes, reads and sweeps manifest pages: a bucket
    ``store.pages`` (``objstore/pages.py``, reached with ``source``), else
    :func:`page_dir`'s directory; None for none."""
    url = cfg.pages_url()
    if url:
        from ...objstore.pages import BucketPages

        return BucketPages(url, source or SourceConfig())
    directory = page_dir(cfg)
    return PageDirectory(directory) if directory else None


def open_configured(cfg: Config) -> MetadataStore:
    """:func:`open_store` for a whole configuration: with ``cluster.secret()`` when the
    backend is etcd (a missing or short secret is a ``ConfigError`` naming the file)."""
    secret = cfg.cluster.secret() if cfg.store.backend == "etcd" else None
    return open_store(cfg.store, secret, cfg.source)
