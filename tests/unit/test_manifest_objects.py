"""Manifest format 3 (an object-store source, manifest/model.py "Objects"): the object
section round-trips, formats 1 and 2 still load beside it, and a damaged section is
``ManifestCorrupt``, never an exception of another kind."""
from __future__ import annotations

import stat
import zlib
from array import array

import pytest

from kspeedfs.errors import ManifestCorrupt
from kspeedfs.manifest.importer import _Digests, _Tree, encode, plan
from kspeedfs.manifest.index import ManifestIndex
from kspeedfs.manifest.model import BLOCK_DIGEST_SIZE, DIGEST_SIZE, blocks_per_chunk
from kspeedfs.manifest.spill import Column

C, B = 64 << 10, 4096


def _tree(objects: bool) -> _Tree:
    t = _Tree()
    t.add_entry(0, b"", stat.S_IFDIR | 0o755, 0, 0, 0, 1)
    t.data[0], t.size[0] = 1, 2
    t.add_entry(0, b"a.jpg", stat.S_IFREG | 0o644, 0, 0, 100, 2)
    t.add_entry(0, b"b.bin", stat.S_IFREG | 0o644, 0, 0, 3 * C, 3)
    if objects:
        ids = t.track_objects()
        for value in (b"", b'"etag-a"\0', b'"etag-b"\0v42'):
            ids.append(value)
    return t


def _zeros(t: _Tree, n: int) -> Column:
    col = t.column("B")
    col.extend_bytes(bytes(n))
    return col


def _blob(objects: bool) -> bytes:
    with _tree(objects) as t:
        p = plan(t, C, B)
        n = len(p.chunk_len)
        digests = _Digests(_zeros(t, DIGEST_SIZE * p.extents), _zeros(t, DIGEST_SIZE * n),
                           _zeros(t, blocks_per_chunk(C, B) * BLOCK_DIGEST_SIZE * n))
        pieces, size = encode(t, p, digests, record={"url": "s3://b/p/",
                                                     "endpoint": "http://127.0.0.1:9"} if objects else None)
        raw = b"".join(pieces)
    assert len(raw) == size
    return zlib.compress(raw)


def test_object_section_round_trips() -> None:
    ix = ManifestIndex.from_blob(_blob(True))
    assert ix.source_record == {"url": "s3://b/p/", "endpoint": "http://127.0.0.1:9"}
    assert ix.object_identity(1) == ('"etag-a"', "")
    assert ix.object_identity(2) == ('"etag-b"', "v42")
    assert ix.size[2] == 3 * C and len(list(ix.file_extents(2))) == 3


def test_directory_imports_stay_format_2() -> None:
    raw = zlib.decompress(_blob(False))
    assert int.from_bytes(raw[4:8], "little") == 2
    ix = ManifestIndex(raw)
    assert ix.source_record is None
    with pytest.raises(ManifestCorrupt):
        ix.object_identity(1)


@pytest.mark.parametrize("damage", ["record", "offsets", "truncated"])
def test_damaged_object_section_is_corrupt(damage: str) -> None:
    raw = bytearray(zlib.decompress(_blob(True)))
    section = raw.index(b'{"endpoint"')
    if damage == "record":
        raw[section:section + 2] = b"[1"          # not an object
    elif damage == "offsets":
        at = raw.index(array("Q", [0, 0, 9, 21]).tobytes())
        raw[at + 8:at + 16] = (1 << 40).to_bytes(8, "little")    # past the blob
    else:
        del raw[-10:]
    with pytest.raises(ManifestCorrupt):
        ix = ManifestIndex(bytes(raw))
        for e in range(ix.entries):
            if ix.is_file(e):
                ix.object_identity(e)
