"""Paged manifests: pages and root round trip, verification, the store's paged publish,
the loader (mapped or read whole), ``kspeedfs migrate``, and a fuzz of the root."""
from __future__ import annotations

import hashlib
import os
import random
import zlib
from pathlib import Path

import pytest

from kspeedfs.errors import ManifestCorrupt
from kspeedfs.manifest import pages
from kspeedfs.manifest.importer import import_tree
from kspeedfs.manifest.index import ManifestIndex, inflate
from kspeedfs.manifest.load import load_index
from kspeedfs.manifest.pages import Root, page_path, read_all, read_table, write_pages
from kspeedfs.manifest.store.embedded import EmbeddedStore
from tests.fixtures.mounts import CHUNK, make_tree

PS = 4096


def _raw(n: int, seed: int = 1) -> bytes:
    rng = random.Random(seed)
    return bytes(rng.getrandbits(8) if i % 7 else 0 for i in range(n))


@pytest.mark.parametrize("size", [1, PS - 1, PS, PS + 1, 130 * PS + 17])
def test_pages_round_trip_whatever_the_size(tmp_path: Path, size: int) -> None:
    raw = _raw(size)
    pieces = [raw[i:i + 1000] for i in range(0, size, 1000)]
    blob, stored = write_pages(pieces, str(tmp_path), PS)
    root = Root.parse(blob)
    assert (root.raw_size, root.pages) == (size, -(-size // PS))
    assert len(root.tables) == -(-root.pages * 32 // PS) and stored > 0
    hashes = read_table(root, [str(tmp_path)])
    assert hashes[:32] == hashlib.sha256(raw[:PS]).digest()
    assert read_all(root, hashes, [str(tmp_path)]) == raw


def test_pages_shared_between_versions_are_stored_once(tmp_path: Path) -> None:
    raw = _raw(20 * PS)
    _, first = write_pages([raw], str(tmp_path), PS)
    _, again = write_pages([raw[:19 * PS] + b"x" * PS], str(tmp_path), PS)
    assert 0 < again < first / 5      # one new data page and its table page


def _written(tmp_path: Path) -> tuple[bytes, Root, bytes, str]:
    raw = _raw(8 * PS + 5)
    blob, _ = write_pages([raw], str(tmp_path), PS)
    root = Root.parse(blob)
    return raw, root, read_table(root, [str(tmp_path)]), str(tmp_path)


def test_a_missing_page_is_refused_naming_it(tmp_path: Path) -> None:
    _, root, hashes, d = _written(tmp_path)
    os.unlink(page_path(d, hashes[64:96]))
    with pytest.raises(ManifestCorrupt, match=hashes[64:96].hex()):
        read_all(root, hashes, [d])


@pytest.mark.parametrize("damage", ["other page", "not zlib", "longer", "shorter"])
def test_a_changed_page_is_refused(tmp_path: Path, damage: str) -> None:
    raw, root, hashes, d = _written(tmp_path)
    path = page_path(d, hashes[32:64])
    body = {"other page": zlib.compress(raw[:PS]), "not zlib": b"garbage",
            "longer": zlib.compress(raw[PS:2 * PS] + b"!"),
            "shorter": zlib.compress(raw[PS:2 * PS - 1])}[damage]
    Path(path).write_bytes(body)
    with pytest.raises(ManifestCorrupt, match="corrupt|unreadable"):
        read_all(root, hashes, [d])


def test_a_second_directory_serves_what_the_first_lacks(tmp_path: Path) -> None:
    raw, root, hashes, d = _written(tmp_path / "a")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert read_all(root, hashes, [str(empty), d]) == raw


def test_root_fuzz_parses_or_is_refused(tmp_path: Path) -> None:
    _, root, _, _ = _written(tmp_path)
    good = root.encode()
    rng = random.Random(7)
    parsed = 0
    for _ in range(3000):
        b = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            kind = rng.random()
            if kind < 0.5 and b:
                b[rng.randrange(len(b))] = rng.getrandbits(8)
            elif kind < 0.75:
                del b[rng.randrange(len(b) + 1):]
            else:
                b += bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 40)))
        try:
            r = Root.parse(bytes(b))
        except ManifestCorrupt:
            continue
        parsed += 1
        assert r.pages == -(-r.raw_size // r.page_size) and len(r.tables) * 32 == len(b) - 32
    assert parsed < 3000


def _whole_and_paged(tmp_path: Path) -> tuple[EmbeddedStore, ManifestIndex, ManifestIndex, int]:
    src = make_tree(tmp_path / "src", small_files=400)
    store = EmbeddedStore(tmp_path / "store")
    whole = import_tree(src, "ds", store, CHUNK, threads=2)
    raw = inflate(store.manifest("ds", whole.version), whole.inflated_size)
    store.paged_above = 0
    paged = store.publish_stream(whole, [raw[i:i + 5000] for i in range(0, len(raw), 5000)],
                                 len(raw))
    assert pages.is_root(store.manifest("ds", paged.version))
    assert paged.manifest_size < 200 and paged.inflated_size == len(raw)
    return store, load_index(store, whole), load_index(store, paged), len(raw)


def test_a_paged_version_indexes_exactly_as_the_whole_one(tmp_path: Path) -> None:
    _, whole, paged, size = _whole_and_paged(tmp_path)
    assert paged.entries == whole.entries and paged.chunks == whole.chunks
    assert bytes(paged._raw) == bytes(whole._raw)
    for e in range(whole.entries):
        assert paged.path(e) == whole.path(e) and paged.size[e] == whole.size[e]
    assert paged.lookup(0, whole.name(1)) == 1
    assert [paged.chunk_digest(k) for k in range(paged.chunks)] == \
        [whole.chunk_digest(k) for k in range(whole.chunks)]


def test_a_paged_version_with_its_pages_gone_does_not_load(tmp_path: Path) -> None:
    store, _, _, _ = _whole_and_paged(tmp_path)
    for p in Path(store.page_dir or "").rglob("*"):
        if p.is_file():
            p.unlink()
    info = store.dataset("ds")
    with pytest.raises(ManifestCorrupt, match="page"):
        load_index(store, info)


def test_removing_a_paged_version_sweeps_only_pages_no_other_version_needs(
        tmp_path: Path) -> None:
    store, _, _, _ = _whole_and_paged(tmp_path)
    first = store.dataset("ds")
    again = store.publish_stream(first, [b"\1" * (3 * pages.PAGE_SIZE)], 3 * pages.PAGE_SIZE)
    page_dir = Path(store.page_dir or "")
    before = {p.name for p in page_dir.rglob("*") if p.is_file()}
    assert store.sweep_pages(grace=0) == 0            # every page is some version's
    store.remove("ds", again.version)
    assert store.sweep_pages(grace=0) >= 2            # its data and table pages: not shared
    after = {p.name for p in page_dir.rglob("*") if p.is_file()}
    assert after < before
    assert load_index(store, first).entries > 0       # the other version still loads
    crashed = next(page_dir.glob("??")) / ("ab" * 32 + ".4242.tmp")   # a writer died
    crashed.write_bytes(b"half a page")
    foreign = next(page_dir.glob("??")) / "README"
    foreign.write_bytes(b"not ours")
    assert store.sweep_pages(grace=3600) == 0 and crashed.exists()     # young: may be live
    store.remove("ds")
    assert store.sweep_pages(grace=0) > 0
    assert [p for p in page_dir.rglob("*") if p.is_file()] == [foreign]
