"""The fsspec filesystem (kspeedfs/filesystem.py) through fsspec itself: found by its
entry point, URLs with and without a version, listings, cat/cat_file/cat_ranges against
the source bytes, pyarrow reading a Parquet file and tarfile reading a shard, from a real
embedded store."""
from __future__ import annotations

import importlib.metadata
import io
import os
import random
import tarfile
from pathlib import Path

import pytest

from kspeedfs.manifest.importer import import_tree
from kspeedfs.manifest.store.embedded import EmbeddedStore

fsspec = pytest.importorskip("fsspec")

CHUNK = 256 << 10


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("fsspec")
    src = base / "src"
    (src / "train").mkdir(parents=True)
    rnd = random.Random(3)
    for i in range(40):
        (src / "train" / f"{i:03d}.jpg").write_bytes(rnd.randbytes(rnd.randint(1, 30_000)))
    (src / "big.bin").write_bytes(rnd.randbytes(5 * CHUNK + 77))
    with tarfile.open(src / "shard-000.tar", "w") as tar:
        for i in range(10):
            data = rnd.randbytes(500 + i)
            info = tarfile.TarInfo(f"{i:06d}.cls")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({"id": list(range(5000)), "name": [f"item-{i}" for i in range(5000)]})
        pq.write_table(table, src / "table.parquet", row_group_size=1000)
    except ImportError:
        pass
    (base / "kspeedfs.toml").touch()
    store = EmbeddedStore(base / "store")
    import_tree(src, "ds", store, CHUNK)
    (src / "v2-only.txt").write_bytes(b"2")            # v2 differs from v1
    import_tree(src, "ds", store, CHUNK)
    return src, base


@pytest.fixture
def fs(store, monkeypatch):
    _, base = store
    monkeypatch.setenv("KSPEEDFS_CONFIG", str(base / "kspeedfs.toml"))
    f = fsspec.filesystem("kspeedfs", config={"store.path": str(base / "store")},
                          skip_instance_cache=True)
    yield f
    f.close()


def test_the_entry_point_registers_the_protocol() -> None:
    eps = importlib.metadata.entry_points(group="fsspec.specs")
    assert [ep.value for ep in eps if ep.name == "kspeedfs"] == \
        ["kspeedfs.filesystem:KspeedfsFileSystem"]
    from kspeedfs.filesystem import KspeedfsFileSystem

    assert fsspec.get_filesystem_class("kspeedfs") is KspeedfsFileSystem


def test_listing_and_info(store, fs) -> None:
    src, _ = store
    assert fs.ls("", detail=False) == ["ds"]
    names = fs.ls("kspeedfs://ds/train", detail=False)
    assert names == sorted(f"ds/train/{n}" for n in os.listdir(src / "train"))
    info = fs.info("kspeedfs://ds/big.bin")
    assert info["type"] == "file" and info["size"] == (src / "big.bin").stat().st_size
    assert fs.isdir("ds/train") and fs.exists("ds/v2-only.txt")
    assert not fs.exists("ds@1/v2-only.txt") and fs.exists("ds@1/train/000.jpg")
    assert fs.cat_file("ds@2/v2-only.txt") == b"2"
    with pytest.raises(FileNotFoundError):
        fs.info("ds/nope")
    with pytest.raises(FileNotFoundError):
        fs.cat_file("nosuchdataset/x")
    assert len(fs.find("ds/train")) == 40


def test_cat_cat_file_and_cat_ranges_match_the_source(store, fs) -> None:
    src, _ = store
    big = (src / "big.bin").read_bytes()
    assert fs.cat_file("kspeedfs://ds/big.bin") == big
    assert fs.cat_file("ds/big.bin", CHUNK - 10, CHUNK + 10) == big[CHUNK - 10:CHUNK + 10]
    assert fs.cat_file("ds/big.bin", -100) == big[-100:]
    assert fs.cat_file("ds/big.bin", 10, -10) == big[10:-10]
    got = fs.cat("ds/train/*.jpg")
    assert len(got) == 40
    for path, data in got.items():
        assert data == (src / path.removeprefix("ds/")).read_bytes(), path
    paths = [f"ds/train/{i:03d}.jpg" for i in range(1, 30)] + ["ds/big.bin", "ds/missing"]
    starts = [i * 7 for i in range(len(paths))]
    ends = [s + 1000 for s in starts]
    out = fs.cat_ranges(paths, starts, ends)
    for p, s, e, data in zip(paths[:-1], starts, ends, out, strict=False):
        assert data == (src / p.removeprefix("ds/")).read_bytes()[s:e], p
    assert isinstance(out[-1], FileNotFoundError)
    with pytest.raises(FileNotFoundError):
        fs.cat_ranges(paths, starts, ends, on_error="raise")
    assert fs.cat(["ds/train/001.jpg", "ds/nope"], on_error="omit").keys() == {"ds/train/001.jpg"}


def test_open_with_fsspec_and_tarfile(store, fs) -> None:
    src, base = store
    with fsspec.open("kspeedfs://ds@1/train/000.jpg", config={"store.path": str(base / "store")}) as f:
        assert f.read() == (src / "train" / "000.jpg").read_bytes()
    with fs.open("ds/shard-000.tar") as f, tarfile.open(fileobj=f) as tar:
        names = tar.getnames()
        assert names == [f"{i:06d}.cls" for i in range(10)]
        assert [len(tar.extractfile(n).read()) for n in names] == [500 + i for i in range(10)]
    with pytest.raises(OSError):
        fs.open("ds/big.bin", "wb")


def test_pyarrow_reads_a_parquet_file(store, fs) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    table = pq.read_table("ds/table.parquet", filesystem=fs)
    assert table.num_rows == 5000
    assert table.column("name")[4321].as_py() == "item-4321"
    with fs.open("ds/table.parquet") as f:
        pf = pq.ParquetFile(f)
        assert pf.metadata.num_row_groups == 5
        assert pf.read_row_group(3).column("id")[0].as_py() == 3000
