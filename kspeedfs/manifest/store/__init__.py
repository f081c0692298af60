"""Metadata store backends behind one interface; see ``base.py``."""
from __future__ import annotations

from ...config import StoreConfig
from .base import DatasetInfo, MetadataStore, check_name

__all__ = ["DatasetInfo", "MetadataStore", "check_name", "open_store"]


def open_store(cfg: StoreConfig) -> MetadataStore:
    """The configured backend. etcd is imported only when selected."""
    if cfg.backend == "etcd":
        from .etcd import EtcdStore

        return EtcdStore(cfg)
    from .embedded import EmbeddedStore

    return EmbeddedStore(cfg.path)
