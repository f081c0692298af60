"""② Manifest load: a version's store blob → the :class:`ManifestIndex` a mount reads.

A whole manifest (a zlib blob) is inflated into memory. A paged one (the blob is its
root, ``pages.py``) is mapped: the table pages are read and verified, then
``pager.PageMap`` fills each data page on first touch and evicts past ``cache_bytes``,
so a mount holds what it touches, not the dataset. Where the page map cannot be made
(no userfaultfd for this user, or the native module missing) every page is read up
front, with a warning: the mount works, with a whole manifest's memory.

Pages come from the directories :func:`page_dirs` lists, in order: the host's node's
copy (``cluster.page_copy``, ``cluster/page_copy.py``) when it exists, then
``store.pages`` when it is a directory. A bucket ``store.pages`` (``objstore/pages.py``)
is never read here: the page map reads files only (its handler must never need Python),
so a mount reads such pages through its host's node, as without ``store.pages``, and
fails at once with one line when the host has no node's copy (reading every page up
front instead would hold the whole manifest: 10 GB at 10^8 files). A page none of them
holds is asked of the node (its ask socket, ``ask.py``): the table pages
here, the data pages by the page map in C.
With no node to ask and no ``store.pages``, a version the node has not copied yet is
waited for (``PAGE_COPY_WAIT``): the node writes a version's table pages last, so once
they are there every page is.
"""
from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Sequence

from ..config import Config
from ..errors import ManifestCorrupt
from ..tuning import ASK_MS, PAGE_COPY_WAIT
from .ask import ask_page, ask_path
from .index import ManifestIndex
from .pages import PageDirectory, Root, is_root, read_all, read_table, table_pages
from .store import page_dir
from .store.base import DatasetInfo, MetadataStore

log = logging.getLogger(__name__)


def host_copy(cfg: Config) -> str:
    """Where the host's node keeps its page copy, "" when no node can (a single-machine
    store has no nodes)."""
    return cfg.cluster.page_copy if cfg.store.backend == "etcd" else ""


def page_dirs(cfg: Config) -> list[str]:
    """Where a process on this host reads manifest pages, in order: the host's node's
    copy (when the directory exists), then ``store.pages``."""
    dirs = []
    copy = host_copy(cfg)
    if copy and os.path.isdir(copy):
        dirs.append(copy)
    shared = page_dir(cfg.store)
    if shared:
        dirs.append(shared)
    return dirs


def ask_socket(cfg: Config) -> str | None:
    """The host's node's ask socket (``ask.py``) when it listens here: a page no
    directory holds is asked of the node by the page map."""
    copy = host_copy(cfg)
    path = ask_path(copy) if copy else ""
    if len(os.fsencode(path)) >= 108:        # sun_path: the node could not bind it either
        return None
    try:
        return path if path and stat.S_ISSOCK(os.stat(path).st_mode) else None
    except OSError:
        return None


def _table(root: Root, info: DatasetInfo, dirs: Sequence[str], wait: float,
           ask: str | None = None) -> bytes:
    """:func:`read_table`, the table pages asked of the host's node (``ask``) if they are
    missing, else waited for up to ``wait`` seconds."""
    deadline, said = time.monotonic() + wait, False
    while True:
        try:
            return read_table(root, dirs)
        except ManifestCorrupt as e:
            if ask:
                for digest, n in table_pages(root):
                    ask_page(ask, digest, n, ASK_MS / 1000)
                ask = None                   # once: then as without a node to ask
                continue
            if time.monotonic() >= deadline:
                if not wait:
                    raise
                raise ManifestCorrupt(f"manifest of {info.name} v{info.version}: its pages are "
                                      f"not in {', '.join(dirs)} after {wait:.0f}s ({e}); "
                                      f"without store.pages a mount needs its host's node "
                                      f"(running? kspeedfs preload {info.name})") from None
            if not said:
                said = True
                log.info("%s v%d: waiting up to %.0fs for this host's node to copy the "
                         "manifest's pages into %s", info.name, info.version, wait, dirs[0])
        time.sleep(0.5)


def open_index(blob: bytes, info: DatasetInfo, page_dirs: str | Sequence[str] | None,
               cache_bytes: int, wait: float = 0.0, ask: str | None = None) -> ManifestIndex:
    """The index of ``info``'s version from its (verified) store blob; a paged one's pages
    come from ``page_dirs``, in order (one directory, or None for none, as before
    :func:`page_dirs`; ``ManifestCorrupt`` when there is none, or the root or a table
    page is bad or missing after ``wait`` seconds). ``ask``: the host's node's ask
    socket, for the data pages no directory holds (:func:`ask_socket`)."""
    if not is_root(blob):
        return ManifestIndex.from_blob(blob, info.inflated_size)
    root = _root(blob, info)
    page_dirs = [page_dirs] if isinstance(page_dirs, str) else list(page_dirs or ())
    if not page_dirs:
        raise ManifestCorrupt(f"manifest of {info.name} v{info.version} is paged, and no page "
                              "directory is here (store.pages, or cluster.page_copy: the "
                              "host's node's copy)")
    hashes = _table(root, info, page_dirs, wait, ask)
    try:
        from .pager import PageMap

        pages = PageMap(root.raw_size, root.page_size, hashes, page_dirs, cache_bytes,
                        ask=ask, ask_ms=ASK_MS)
    except (ImportError, OSError) as e:
        log.warning("%s v%d: manifest pages cannot be mapped (%s); reading all %d of them",
                    info.name, info.version, e, root.pages)
        return ManifestIndex(read_all(root, hashes, page_dirs))
    log.info("%s v%d: manifest of %d bytes mapped as %d pages, %d bytes resident at most",
             info.name, info.version, root.raw_size, root.pages, cache_bytes)
    return ManifestIndex(pages.view(), pages=pages)


def _root(blob: bytes, info: DatasetInfo) -> Root:
    """The parsed root of ``info``'s paged version, its size checked against the record."""
    root = Root.parse(blob)
    if info.inflated_size and root.raw_size != info.inflated_size:
        raise ManifestCorrupt(f"manifest of {info.name} v{info.version}: its root maps "
                              f"{root.raw_size} bytes, the record declares {info.inflated_size}")
    return root


def load_index(store: MetadataStore, info: DatasetInfo, cache_bytes: int = 1 << 30,
               dirs: Sequence[str] | None = None) -> ManifestIndex:
    """:func:`open_index` of a version fetched from ``store``; pages from ``dirs``
    (default: the store's own pages). For a tool, not a mount: pages the store keeps in a
    bucket are read whole, through Python (the page map reads files only), so the index
    holds the whole manifest."""
    blob = store.manifest(info.name, info.version)
    sink = store.page_sink()
    if dirs is None and is_root(blob) and sink is not None and not isinstance(sink, PageDirectory):
        root = _root(blob, info)
        log.info("%s v%d: reading all %d manifest pages from %s", info.name, info.version,
                 root.pages, sink.where)
        return ManifestIndex(read_all(root, read_table(root, [sink]), [sink]))
    if dirs is None:
        dirs = [store.page_dir] if store.page_dir else []
    return open_index(blob, info, dirs, cache_bytes)


def open_on_host(cfg: Config, blob: bytes, info: DatasetInfo) -> ManifestIndex:
    """:func:`open_index` as a mount or a library handle on this host opens a version:
    its pages from :func:`page_dirs`, waiting for the host's node's copy when that is
    the only directory (:func:`mount_wait`), asking the node for what it lacks
    (:func:`ask_socket`)."""
    dirs = page_dirs(cfg)
    url = cfg.store.pages_url()
    if url and not dirs and is_root(blob):
        raise ManifestCorrupt(f"manifest of {info.name} v{info.version} is paged in {url} "
                              f"(store.pages), which a mount reads through its host's node "
                              f"only, and no node keeps a page copy here ({cfg.cluster.page_copy}"
                              f"): start kspeedfs node on this host, or kspeedfs preload {info.name}")
    return open_index(blob, info, dirs, cfg.store.page_cache, mount_wait(cfg, dirs),
                      ask_socket(cfg))


def mount_wait(cfg: Config, dirs: Sequence[str]) -> float:
    """How long a mount waits for a paged version's pages: ``PAGE_COPY_WAIT`` when its
    only page directory is the host's node's copy, else not at all."""
    return PAGE_COPY_WAIT if dirs and not page_dir(cfg.store) else 0.0
