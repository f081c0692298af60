"""The origin of a bucket-prefix dataset (``kspeedfs/objstore/origin.py``) without a mount:
versioned buckets pin each object's version, so an overwrite after import changes
nothing a reader sees; in an unversioned bucket it is ``SourceChanged`` for that object."""
from __future__ import annotations

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
from tests.fixtures.s3 import S3Server

CHUNK = 256 << 10


def _import_and_open(b: str, tmp_path: Path) -> tuple[ManifestIndex, Any]:
    cfg = config.load(environ={})
    store = EmbeddedStore(tmp_path / "store")
    info = import_tree(ObjectSource(connect(f"s3://{b}/v", cfg.source), 8), "ds", store, CHUNK)
    ix = ManifestIndex.from_blob(store.manifest("ds", info.version), info.inflated_size)
    return ix, open_origin(info.source, ix, "ds", config=cfg.source)


def _entry(ix: ManifestIndex, path: bytes) -> int:
    return next(e for e in ix.walk() if ix.path(e) == path)


def test_versioned_bucket_reads_the_imported_version(aws_env: S3Server, bucket: tuple[Any, str],
                                                     tmp_path: Path) -> None:
    c, b = bucket
    c.put_bucket_versioning(Bucket=b, VersioningConfiguration={"Status": "Enabled"})
    for i in range(8):
        c.put_object(Bucket=b, Key=f"v/f{i}", Body=bytes([i]) * 5000)
    c.put_object(Bucket=b, Key="v/deleted", Body=b"gone before import")
    c.delete_object(Bucket=b, Key="v/deleted")          # its latest is a delete marker
    ix, origin = _import_and_open(b, tmp_path)
    assert {ix.path(e) for e in ix.walk()} == {f"f{i}".encode() for i in range(8)}
    e3 = _entry(ix, b"f3")
    etag, version = ix.object_identity(e3)
    assert version and version == c.head_object(Bucket=b, Key="v/f3")["VersionId"]
    c.put_object(Bucket=b, Key="v/f3", Body=b"new bytes" * 100)      # a new version
    for k in range(ix.chunks):
        data, mismatches = origin.load(k)
        assert xxhash.xxh3_128_digest(data) == ix.chunk_digest(k) and mismatches == 0


def test_unversioned_overwrite_is_source_changed(aws_env: S3Server, bucket: tuple[Any, str],
                                                 tmp_path: Path) -> None:
    c, b = bucket
    for i in range(8):
        c.put_object(Bucket=b, Key=f"v/f{i}", Body=bytes([i]) * 5000)
    ix, origin = _import_and_open(b, tmp_path)
    assert ix.object_identity(_entry(ix, b"f3"))[1] == ""
    c.put_object(Bucket=b, Key="v/f3", Body=bytes([3]) * 5000)
    origin.load(0)         # rewritten with the same bytes: the same ETag (their MD5), no change
    c.put_object(Bucket=b, Key="v/f3", Body=b"x" * 5000)
    with pytest.raises(SourceChanged) as err:
        origin.load(0)
    assert err.value.entries == {_entry(ix, b"f3")} and f"s3://{b}/v/f3" in str(err.value)
    e5 = _entry(ix, b"f5")
    ext = next(ix.file_extents(e5))
    assert bytes(origin.load_extent(ext)) == bytes([5]) * 5000
