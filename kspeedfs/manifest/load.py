"""② Manifest load: a version's store blob → the :class:`ManifestIndex` a mount reads.

A whole manifest (a zlib blob) is inflated into memory. A paged one (the blob is its
root, ``pages.py``) is mapped: the table pages are read and verified, then
``pager.PageMap`` fills each data page on first touch and evicts past ``cache_bytes``,
so a mount holds what it touches, not the dataset. Where the page map cannot be made
(no userfaultfd for this user, or the native module missing) every page is read up
front, with a warning: the mount works, with a whole manifest's memory.
"""
from __future__ import annotations

import logging

from ..errors import ManifestCorrupt
from .index import ManifestIndex
from .pages import Root, is_root, read_all, read_table
from .store.base import DatasetInfo, MetadataStore

log = logging.getLogger(__name__)


def open_index(blob: bytes, info: DatasetInfo, page_dir: str | None,
               cache_bytes: int) -> ManifestIndex:
    """The index of ``info``'s version from its (verified) store blob; a paged one's pages
    come from ``page_dir`` (``ManifestCorrupt`` when there is none, or the root or a table
    page is bad or missing)."""
    if not is_root(blob):
        return ManifestIndex.from_blob(blob, info.inflated_size)
    root = Root.parse(blob)
    if info.inflated_size and root.raw_size != info.inflated_size:
        raise ManifestCorrupt(f"manifest of {info.name} v{info.version}: its root maps "
                              f"{root.raw_size} bytes, the record declares {info.inflated_size}")
    if page_dir is None:
        raise ManifestCorrupt(f"manifest of {info.name} v{info.version} is paged, and no page "
                              "directory is configured (store.pages)")
    page_dirs = [page_dir]
    hashes = read_table(root, page_dirs)
    try:
        from .pager import PageMap

        pages = PageMap(root.raw_size, root.page_size, hashes, page_dirs, cache_bytes)
    except (ImportError, OSError) as e:
        log.warning("%s v%d: manifest pages cannot be mapped (%s); reading all %d of them",
                    info.name, info.version, e, root.pages)
        return ManifestIndex(read_all(root, hashes, page_dirs))
    log.info("%s v%d: manifest of %d bytes mapped as %d pages, %d bytes resident at most",
             info.name, info.version, root.raw_size, root.pages, cache_bytes)
    return ManifestIndex(pages.view(), pages=pages)


def load_index(store: MetadataStore, info: DatasetInfo,
               cache_bytes: int = 1 << 30) -> ManifestIndex:
    """:func:`open_index` of a version fetched from ``store`` (its own page directory)."""
    blob = store.manifest(info.name, info.version)
    return open_index(blob, info, store.page_dir, cache_bytes)
