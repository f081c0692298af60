"""The origin of a gs:// or az:// dataset (``kspeedfs/objstore/origin.py``) without a mount:
an overwrite after import is ``SourceChanged`` for that object only; a GCS bucket that
keeps noncurrent generations still reads as imported; error bursts and bodies cut short
(a fault proxy in front of the emulator) cost retries, never a wrong byte."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash

from kspeedfs import config
from kspeedfs.errors import SourceChanged
from kspeedfs.manifest.importer import import_tree
from kspeedfs.manifest.index import ManifestIndex
from kspeedfs.manifest.store.embedded import EmbeddedStore
from kspeedfs.objstore import connect
from kspeedfs.objstore.source import ObjectSource
from kspeedfs.origin import open_origin
from tests.fixtures.gcs import FakeGcsServer
from tests.fixtures.s3 import FaultProxy
from tests.objstore.conftest import Store

CHUNK = 256 << 10


def _import_and_open(url: str, tmp_path: Path) -> tuple[ManifestIndex, Any]:
    cfg = config.load(environ={})
    store = EmbeddedStore(tmp_path / "store")
    info = import_tree(ObjectSource(connect(url, cfg.source), 8), "ds", store, CHUNK)
    ix = ManifestIndex.from_blob(store.manifest("ds", info.version), info.inflated_size)
    return ix, open_origin(info.source, ix, "ds", config=cfg.source)


def _entry(ix: ManifestIndex, path: bytes) -> int:
    return next(e for e in ix.walk() if ix.path(e) == path)


def _all_verified(ix: ManifestIndex, origin: Any) -> None:
    for k in range(ix.chunks):
        data, mismatches = origin.load(k)
        assert xxhash.xxh3_128_digest(data) == ix.chunk_digest(k) and mismatches == 0


def test_overwrite_is_source_changed(store: Store, tmp_path: Path) -> None:
    store.put_many({f"v/f{i}": bytes([i]) * 5000 for i in range(8)})
    ix, origin = _import_and_open(store.url("v"), tmp_path)
    _all_verified(ix, origin)
    store.put("v/f3", b"x" * 5000)
    with pytest.raises(SourceChanged) as err:
        origin.load(0)
    assert err.value.entries == {_entry(ix, b"f3")} and store.url("v/f3") in str(err.value)
    ext = next(ix.file_extents(_entry(ix, b"f5")))
    assert bytes(origin.load_extent(ext)) == bytes([5]) * 5000


def test_gcs_versioned_bucket_reads_the_imported_generation(gcs_server: FakeGcsServer,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Path) -> None:
    for k, v in gcs_server.env().items():
        monkeypatch.setenv(k, v)
    gcs_server.create_bucket("kst-versioned", versioning=True)
    for i in range(8):
        gcs_server.put("kst-versioned", f"v/f{i}", bytes([i]) * 5000)
    ix, origin = _import_and_open("gs://kst-versioned/v", tmp_path)
    e3 = _entry(ix, b"f3")
    assert ix.object_identity(e3)[1] == gcs_server.metadata("kst-versioned", "v/f3")["generation"]
    gcs_server.put("kst-versioned", "v/f3", b"new bytes" * 100)      # a new generation
    _all_verified(ix, origin)


@pytest.fixture
def proxy(store: Store, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    with FaultProxy(store.server) as p:
        for k, v in store.env(p.endpoint).items():
            monkeypatch.setenv(k, v)
        yield p


def test_faults_cost_retries_not_bytes(store: Store, proxy: FaultProxy, tmp_path: Path) -> None:
    """503 bursts on listing and reads, and bodies cut by a reset: the import and every
    chunk load get through, every byte verified."""
    store.put_many({f"d/small{i:02d}": bytes([i]) * (1000 + 97 * i) for i in range(40)})
    store.put("d/large", bytes(range(256)) * (4 * CHUNK // 256 + 5))
    proxy.fail(4, 503, "SlowDown", every=2)
    ix, origin = _import_and_open(store.url("d"), tmp_path)
    proxy.fail(6, 503, "ServerBusy", every=3)
    proxy.reset(3, every=4)
    _all_verified(ix, origin)
    assert proxy.counts["fail"] == 10 and proxy.counts["reset"] == 3, proxy.counts
