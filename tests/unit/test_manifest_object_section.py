"""The object section of a format 3 manifest (an object-store dataset; manifest/model.py,
"Objects"), fuzzed as it arrives from the store: the source record's JSON and each file's
(ETag, version id) are read back by ``ManifestIndex`` (``source_record``,
``object_identity``) and must either parse or raise ``ManifestCorrupt``, never another
exception and never a record that is not an object of strings with a ``url``.

The manifest is built by the real importer from ``objstore/source.py``'s ``build_tree`` over a
listing made up here (no object store: the bytes are generated), so the section's layout
is the one an S3 import writes."""
from __future__ import annotations

import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kspeedfs.config import StoreConfig
from kspeedfs.errors import ManifestCorrupt
from kspeedfs.manifest.importer import _Tree, import_tree
from kspeedfs.manifest.index import ManifestIndex
from kspeedfs.manifest.model import is_file
from kspeedfs.manifest.store import open_store
from kspeedfs.objstore.bucket import ObjectInfo
from kspeedfs.objstore.source import build_tree
from kspeedfs.objstore.url import ObjectUrl

FUZZ = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
URL = ObjectUrl.parse("s3://bucket/train")


class ListedSource:
    """An object-store source whose listing and bytes are made up (``ImportSource``)."""

    url = str(URL)
    threads = 1

    def __init__(self, objects: list[ObjectInfo]) -> None:
        self.objects = objects

    def scan(self, progress: object) -> _Tree:
        return build_tree(URL, self.objects, 1_700_000_000 * 10**9)

    def read_into(self, tree: _Tree, entry: int, offset: int, out: memoryview) -> None:
        out[:] = bytes((entry + offset + i) % 251 for i in range(len(out)))

    def record(self) -> dict[str, str]:
        return {"url": self.url, "endpoint": "http://127.0.0.1:9", "region": "us-east-1"}


OBJECTS = [ObjectInfo(f"train/{d}/{i}.jpg", 1000 + 37 * i, f'"etag-{d}-{i}"', 10**18 + i,
                      f"v{i}" if i % 3 else "")
           for d in ("a", "b/c") for i in range(12)]


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, int]:
    """An object-store dataset's inflated manifest and where its object section starts."""
    store = open_store(StoreConfig(backend="embedded",
                                   path=str(tmp_path_factory.mktemp("objects") / "store")))
    info = import_tree(ListedSource(OBJECTS), "objs", store, 16 << 10)
    raw = zlib.decompress(store.manifest("objs", info.version))
    start = raw.rindex(b'{"endpoint"') - 8          # the record's length comes first
    ix = ManifestIndex(raw)
    assert ix.source_record is not None and ix.source_record["url"] == str(URL)
    return raw, start


def test_import_records_each_objects_etag_and_version(manifest: tuple[bytes, int]) -> None:
    ix = ManifestIndex(manifest[0])
    seen = {ix.path(e).decode(): ix.object_identity(e) for e in range(ix.entries) if is_file(ix.mode[e])}
    assert seen == {o.key.removeprefix("train/"): (o.etag, o.version_id) for o in OBJECTS}


def _read_back(raw: bytes) -> None:
    """Parse ``raw`` and read every record of its object section."""
    try:
        ix = ManifestIndex(raw)
        for e in range(ix.entries):
            if is_file(ix.mode[e]):
                etag, version = ix.object_identity(e)
                assert isinstance(etag, str) and isinstance(version, str)
    except ManifestCorrupt:
        return
    record = ix.source_record
    assert record is None or (isinstance(record.get("url"), str)
                              and all(isinstance(v, str) for v in record.values()))


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 1 << 30), st.integers(0, 255)), min_size=1, max_size=8))
def test_fuzz_object_section_bytes(manifest: tuple[bytes, int],
                                   edits: list[tuple[int, int]]) -> None:
    """Byte edits inside the object section: the record, its length, the offsets and the
    identities."""
    raw, start = manifest
    data = bytearray(raw)
    for pos, byte in edits:
        data[start + pos % (len(data) - start)] = byte
    _read_back(bytes(data))


@FUZZ
@given(st.integers(0, 1 << 30))
def test_fuzz_object_section_truncated(manifest: tuple[bytes, int], cut: int) -> None:
    raw, start = manifest
    _read_back(raw[:start + cut % (len(raw) - start)])


@FUZZ
@given(st.binary(max_size=300))
def test_fuzz_source_record_any_bytes(manifest: tuple[bytes, int], record: bytes) -> None:
    """The source record replaced by any bytes (its length field set to match), the rest
    of the section shifted as a longer or shorter record would shift it."""
    raw, start = manifest
    old = int.from_bytes(raw[start:start + 8], "little")
    pad = -(8 + old) % 8
    rest = raw[start + 8 + old + pad:]
    body = len(record).to_bytes(8, "little") + record
    _read_back(raw[:start] + body + b"\0" * (-len(body) % 8) + rest)
