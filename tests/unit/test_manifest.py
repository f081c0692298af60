"""Manifest: layout/packing arithmetic, import → blob → index round trip, versions."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kspeedfs.errors import ManifestCorrupt, SourceError
from kspeedfs.manifest.importer import import_tree
from kspeedfs.manifest.index import ManifestIndex
from kspeedfs.manifest.model import Layout
from kspeedfs.manifest.store.embedded import EmbeddedStore
from tests.fixtures.mounts import CHUNK, files_below, make_tree

C = 64 << 10


@given(st.lists(st.integers(0, 3 * C), max_size=60))
def test_layout_small_files_never_straddle(sizes: list[int]) -> None:
    lay = Layout(C)
    prev_end = 0
    for size in sizes:
        off = lay.place(size)
        assert off >= prev_end
        if 0 < size < C:
            assert off // C == (off + size - 1) // C          # inside one chunk
        if size >= C:
            assert off % C == 0                              # big files start on a boundary
        prev_end = off + size


def test_small_files_are_packed() -> None:
    lay = Layout(4 << 20)
    for _ in range(1_000):
        lay.place(110_000)
    assert lay.chunks == 27   # 38 files per 4 MiB chunk, not 1000 chunks


def _imported(tmp_path: Path, src: Path, chunk: int = CHUNK) -> tuple[ManifestIndex, EmbeddedStore]:
    store = EmbeddedStore(tmp_path / "store")
    info = import_tree(src, "ds", store, chunk, threads=3)
    return ManifestIndex.from_blob(store.manifest("ds", info.version)), store


def test_round_trip_tree(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", small_files=300)
    ix, store = _imported(tmp_path, src)
    bsrc = os.fsencode(src)
    seen = 0
    for entry in ix.walk():
        rel = ix.path(entry)
        st_ = os.lstat(os.path.join(bsrc, rel))
        assert ix.mode[entry] == st_.st_mode and ix.mtime_ns[entry] == st_.st_mtime_ns, rel
        if stat.S_ISLNK(st_.st_mode):
            assert ix.readlink(entry) == os.readlink(os.path.join(bsrc, rel))
        elif stat.S_ISREG(st_.st_mode):
            data = Path(os.fsdecode(os.path.join(bsrc, rel))).read_bytes()
            assert ix.size[entry] == len(data)
            got = b"".join(data[e.file_offset:e.file_offset + e.length] for e in ix.file_extents(entry))
            assert got == data
            for e in ix.file_extents(entry):
                assert e.digest == xxhash.xxh3_128_digest(data[e.file_offset:e.file_offset + e.length])
            seen += 1
        parent = ix.parent[entry]
        assert ix.lookup(parent, ix.name(entry)) == entry      # binary search finds it
    assert seen == len(files_below(src))
    assert ix.lookup(0, b"no-such") is None
    info = store.dataset("ds")
    assert info.files == seen and info.chunks == ix.chunks
    # small files packed: 300 files of <= 12 KB cost a handful of chunks
    smalls = {e.chunk for entry in ix.walk() if ix.path(entry).startswith(b"small/")
              for e in ix.file_extents(entry)}
    assert len(smalls) < 20


def test_chunk_extents_cover_each_chunk(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", small_files=100)
    ix, _ = _imported(tmp_path, src)
    for k in range(ix.chunks):
        covered = sum(e.length for e in ix.chunk_extents(k))
        assert 0 < covered <= ix.chunk_len[k] <= ix.chunk_size


def test_reimport_is_a_new_version_and_old_stays(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(b"1")
    store = EmbeddedStore(tmp_path / "store")
    v1 = import_tree(src, "ds", store, CHUNK)
    (src / "a").write_bytes(b"22")
    v2 = import_tree(src, "ds", store, CHUNK)
    assert (v1.version, v2.version) == (1, 2)
    old = ManifestIndex.from_blob(store.manifest("ds", 1))
    new = ManifestIndex.from_blob(store.manifest("ds", 2))
    assert old.size[old.lookup(0, b"a")] == 1 and new.size[new.lookup(0, b"a")] == 2
    assert store.dataset("ds").version == 2


def test_import_errors(tmp_path: Path) -> None:
    store = EmbeddedStore(tmp_path / "store")
    with pytest.raises(SourceError):
        import_tree(tmp_path / "missing", "ds", store, CHUNK)
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(SourceError, match="not a directory"):
        import_tree(tmp_path / "file", "ds", store, CHUNK)


def test_special_files_are_skipped(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    os.mkfifo(src / "fifo")
    (src / "real").write_bytes(b"r")
    ix, _ = _imported(tmp_path, src)
    assert ix.lookup(0, b"fifo") is None and ix.lookup(0, b"real") is not None


def test_format_1_manifests_still_load_without_blocks(tmp_path: Path) -> None:
    """A manifest published before block digests (format 1: no block array, block_size
    0 in the header) loads, and says it has no blocks."""
    import zlib

    from kspeedfs.manifest.model import BLOCK_DIGEST_SIZE, HEADER, align8, blocks_per_chunk

    src = make_tree(tmp_path / "src", small_files=20)
    ix, store = _imported(tmp_path, src)
    assert ix.block_size == 128 << 10
    raw = zlib.decompress(store.manifest("ds", 1))
    fields = list(HEADER.unpack_from(raw, 0))
    fields[1], fields[-1] = 1, 0
    blocks = align8(blocks_per_chunk(ix.chunk_size, ix.block_size) * BLOCK_DIGEST_SIZE * ix.chunks)
    old = ManifestIndex(HEADER.pack(*fields) + raw[HEADER.size:len(raw) - blocks])
    assert old.block_size == 0 and old.chunks == ix.chunks
    assert old.chunk_digest(ix.chunks - 1) == ix.chunk_digest(ix.chunks - 1)


def test_corrupt_blob_is_refused() -> None:
    with pytest.raises(ManifestCorrupt):
        ManifestIndex.from_blob(b"definitely not zlib")
    import zlib

    with pytest.raises(ManifestCorrupt):
        ManifestIndex.from_blob(zlib.compress(b"KSPM" + b"\0" * 10))


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(0, 5 * 4096), min_size=1, max_size=25))
def test_read_ranges_property(tmp_path_factory: pytest.TempPathFactory, sizes: list[int]) -> None:
    """chunk_range() + file offsets reproduce any file slice (chunk of 16 KiB here)."""
    base = tmp_path_factory.mktemp("prop")
    src = base / "src"
    src.mkdir()
    blobs = []
    for i, n in enumerate(sizes):
        data = os.urandom(n)
        (src / f"f{i:03d}").write_bytes(data)
        blobs.append(data)
    store = EmbeddedStore(base / "store")
    info = import_tree(src, "p", store, 64 << 10)
    ix = ManifestIndex.from_blob(store.manifest("p", info.version))
    space = bytearray(ix.chunks * ix.chunk_size)
    for i, data in enumerate(blobs):
        entry = ix.lookup(0, f"f{i:03d}".encode())
        space[ix.data[entry]:ix.data[entry] + len(data)] = data
        for off in (0, len(data) // 3, max(len(data) - 1, 0)):
            rng = ix.chunk_range(entry, off, 4096)
            if off < len(data):
                assert rng and rng[0] * ix.chunk_size <= ix.data[entry] + off
            else:
                assert not rng
    for k in range(ix.chunks):
        chunk = bytes(space[k * ix.chunk_size:k * ix.chunk_size + ix.chunk_len[k]])
        assert xxhash.xxh3_128_digest(chunk) == ix.chunk_digest(k)
