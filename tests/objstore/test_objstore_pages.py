"""Manifest pages in a ``gs://`` or ``az://`` bucket (objstore/pages.py) on the emulators:
published under the page directory's names, not written again, a node's copy filled
from the bucket (cluster/page_copy.py), and a sweep that deletes only unreferenced
page objects; the same client and settings as the object-store sources."""
from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

from kspeedfs.cluster.node_stats import NodeCounters
from kspeedfs.cluster.page_copy import PageCopy
from kspeedfs.cluster.placement import Member
from kspeedfs.config import SourceConfig, StoreConfig
from kspeedfs.manifest.pages import Root, page_name, read_all, read_table, write_pages
from kspeedfs.manifest.store import open_store
from kspeedfs.manifest.store.base import DatasetInfo, MetadataStore
from kspeedfs.objstore.pages import BucketPages
from tests.objstore.conftest import Store

PS = 64 << 10


def _info(name: str) -> DatasetInfo:
    return DatasetInfo(name=name, version=0, files=1, entries=1, bytes=1, chunks=1,
                       chunk_size=1, imported_at=0.0, source="test")


def _publish(meta: MetadataStore, store: Store, name: str, raw: bytes, tmp: Path) -> DatasetInfo:
    if store.scheme != "gs":
        return meta.publish_stream(_info(name), [raw], len(raw))
    # fake-gcs-server takes no XML-API PUT (fsouza/fake-gcs-server#331), which is
    # obstore's put: here the pages are written as files and uploaded as gsutil would
    d = tmp / f"pages-{name}"
    root, _ = write_pages([raw], str(d))
    for f in d.rglob("*"):
        if f.is_file():
            store.put(f"pages/{f.relative_to(d)}", f.read_bytes())
    return meta.publish(replace(_info(name), inflated_size=len(raw)), root)


async def test_pages_in_the_bucket_fill_a_copy_and_only_unreferenced_ones_are_swept(
        store: Store, tmp_path: Path) -> None:
    cfg = StoreConfig(backend="embedded", path=str(tmp_path / "meta"), pages=store.url("pages"),
                      paged_above=4096)
    meta = open_store(cfg, None, SourceConfig())
    pages = meta.pages
    assert isinstance(pages, BucketPages)
    keep_raw, drop_raw = random.Random(1).randbytes(3 * PS + 7), random.Random(2).randbytes(2 * PS)
    kept = _publish(meta, store, "keep", keep_raw, tmp_path)
    _publish(meta, store, "drop", drop_raw, tmp_path)
    root = Root.parse(meta.manifest("keep", kept.version))
    assert write_pages([keep_raw], pages)[1] == 0                # all there already
    names = {n for n, _, _ in pages.listing()}
    assert len(names) == 5 + 3 and all(n.startswith("pages/") for n in names)
    assert pages.key(root.tables[0]) == "pages/" + page_name(root.tables[0])

    membership = SimpleNamespace(members=[Member("me")], nodes={})
    pc = PageCopy(str(tmp_path / "copy"), pages, "me", meta,  # type: ignore[arg-type]
                  membership, None, NodeCounters(), 4)  # type: ignore[arg-type]
    await pc.fill("keep", kept.version)
    copy = str(tmp_path / "copy")
    assert read_all(root, read_table(root, [copy]), [copy]) == keep_raw
    assert pc.counters.pages_from_store == 5

    store.put("pages/notes.txt", b"not a page")
    meta.remove("drop")
    assert meta.sweep_pages(grace=0) == 3
    left = {n for n, _, _ in pages.listing()}
    assert len(left) == 5 and left <= names
    assert read_all(root, read_table(root, [pages]), [pages]) == keep_raw
