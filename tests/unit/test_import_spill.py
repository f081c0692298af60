"""The importer's spilled arrays (manifest/spill.py): however small the in-memory tails,
the pieces and the caches, an import publishes the same manifest, array
for array; and the importer's peak memory does not grow with the number of entries."""
from __future__ import annotations

import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from kspeedfs import tuning
from kspeedfs.manifest.importer import _Tree, import_tree
from kspeedfs.manifest.index import ManifestIndex
from kspeedfs.manifest.model import CHUNK_ARRAYS, ENTRY_ARRAYS
from kspeedfs.manifest.store.embedded import EmbeddedStore
from kspeedfs.objstore.bucket import ObjectInfo
from kspeedfs.objstore.source import build_tree
from kspeedfs.objstore.url import ObjectUrl
from tests.fixtures.mounts import make_tree

C = 64 << 10
URL = ObjectUrl.parse("s3://bucket/train")
OBJECTS = [ObjectInfo(f"train/{d}/{i}.bin", 5000 * i, f'"etag-{d}-{i}"', 10**18 + i, "")
           for d in ("a", "b/c", "b/d") for i in range(30)]


class LearningSource:
    """An object-store source whose first read of each object learns its version (as
    ``ObjectSource`` does for GCS and Azure): the identities change while being read."""

    url = str(URL)
    threads = 3

    def scan(self, progress: object) -> _Tree:
        return build_tree(URL, OBJECTS, 1_700_000_000 * 10**9)

    def read_into(self, tree: _Tree, entry: int, offset: int, out: memoryview) -> None:
        assert tree.objects is not None
        etag, _, version = tree.objects[entry].partition(b"\0")
        if not version:
            tree.objects[entry] = etag + b"\0v-" + tree.path(entry)
        out[:] = bytes((entry * 31 + offset + i) % 251 for i in range(len(out)))

    def record(self) -> dict[str, str]:
        return {"url": self.url, "endpoint": "http://127.0.0.1:9"}


def _manifest(tmp_path: Path, source: object, name: str) -> bytes:
    store = EmbeddedStore(tmp_path / f"store-{name}")
    info = import_tree(source, "ds", store, C, threads=3, block_size=4096)  # type: ignore[arg-type]
    raw = zlib.decompress(store.manifest("ds", info.version))
    assert len(raw) == info.inflated_size
    return raw


def _arrays(raw: bytes) -> dict[str, bytes]:
    ix = ManifestIndex(raw)
    names = [n for n, _, _ in ENTRY_ARRAYS] + [n for n, _, _ in CHUNK_ARRAYS] + [
        "names", "files", "ext_digests", "chunk_digests", "block_digests"]
    out = {n: bytes(getattr(ix, n)) for n in names}
    out["objects"] = repr([ix.object_identity(e) for e in range(ix.entries) if ix.is_file(e)]
                          if ix.source_record else None).encode()
    return out


def _tiny(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tails of 2 entries, 24-byte pieces, one directory path and two 16-byte blocks
    cached: everything spills, and reads cross blocks."""
    monkeypatch.setattr(tuning, "IMPORT_SPILL_ENTRIES", 2)
    monkeypatch.setattr(tuning, "SPILL_BLOCK", 16)
    monkeypatch.setattr(tuning, "SPILL_CACHED", 2)
    monkeypatch.setattr(tuning, "IMPORT_PIECE", 24)
    monkeypatch.setattr(tuning, "IMPORT_PATHS", 1)


def test_tiny_spills_publish_the_same_directory_manifest(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_tree(tmp_path / "src", chunk=C, small_files=200)
    default = _manifest(tmp_path, src, "default")
    _tiny(monkeypatch)
    tiny = _manifest(tmp_path, src, "tiny")
    want, got = _arrays(default), _arrays(tiny)
    for name in want:
        assert got[name] == want[name], name
    assert tiny == default
    assert ManifestIndex(tiny).entries > 200


def test_tiny_spills_keep_learned_object_versions(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    default = _manifest(tmp_path, LearningSource(), "default")
    _tiny(monkeypatch)
    tiny = _manifest(tmp_path, LearningSource(), "tiny")
    want, got = _arrays(default), _arrays(tiny)
    for name in want:
        assert got[name] == want[name], name
    ix = ManifestIndex(tiny)
    seen = {ix.path(e): ix.object_identity(e) for e in range(ix.entries) if ix.is_file(e)}
    # an empty object is never read, so it learns no version
    assert seen == {o.key.removeprefix("train/").encode():
                    (o.etag, "v-" + o.key.removeprefix("train/") if o.size else "") for o in OBJECTS}


def test_tree_paths_come_from_parents_and_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tuning, "IMPORT_PATHS", 1)
    with build_tree(URL, OBJECTS, 1) as tree:
        assert tree.objects is not None
        got = {tree.path(e): tree.objects[e] for e in range(len(tree)) if tree.size[e] and
               tree.mode[e] & 0o170000 == 0o100000}
    assert got == {o.key.removeprefix("train/").encode(): o.etag.encode() + b"\0" for o in OBJECTS
                   if o.size}


_PEAK = """
import sys
from kspeedfs import tuning
from kspeedfs.manifest.importer import import_tree
from kspeedfs.manifest.store.base import DatasetInfo, MetadataStore
from bench.manifest_scale import SyntheticSource

class Drain(MetadataStore):
    '''A store that reads the manifest's pieces and keeps none: the importer's memory only.'''
    def publish_stream(self, info, pieces, inflated_size):
        assert sum(len(p) for p in pieces) == inflated_size
        return info
    publish = datasets = dataset = versions = manifest = remove = None

tuning.IMPORT_PIECE = 1 << 20      # pieces as large at both sizes
import_tree(SyntheticSource(int(sys.argv[1])), "ds", Drain(), 4 << 20, threads=1)
with open("/proc/self/status") as f:
    print(next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:")))
"""


def _peak(files: int) -> int:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", _PEAK, str(files)], cwd=root, env=env,
                         check=True, capture_output=True, text=True)
    return int(out.stdout)


def test_import_peak_memory_does_not_grow_with_entries() -> None:
    """2*10^5 and 2*10^6 synthetic entries, one hashing thread (its chunks in flight are
    the fixed cost): the importer held ~368 B per entry in the heap before its arrays
    spilled (660 MB more here; ~100 MB with the entry arrays' tails never written out),
    ~2 B per entry now (3-4 MB, malloc's noise)."""
    small, large = _peak(200_000), _peak(2_000_000)
    assert large - small < 1_800_000 * 10, (small, large)
