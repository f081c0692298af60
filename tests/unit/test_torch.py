"""kspeedfs.torch.MapDataset in a real torch DataLoader with two worker processes: every
item is the source's bytes, each worker reads through a handle of its own (opened after
the fork, even when the parent had opened one; spawned workers get the dataset pickled
without it), batches go through ``__getitems__``."""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from kspeedfs.manifest.importer import import_tree
from kspeedfs.manifest.store.embedded import EmbeddedStore

torch = pytest.importorskip("torch")

from kspeedfs.torch import MapDataset, packed  # noqa: E402  (imports torch: only once it is there)


def with_pid(path: str, data: bytes) -> tuple[int, str, bytes]:
    return os.getpid(), path, data


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    base = tmp_path_factory.mktemp("torch")
    rnd = random.Random(5)
    for i in range(64):
        p = base / "src" / f"d{i % 3}" / f"{i:04d}.jpg"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(rnd.randbytes(rnd.randint(100, 40_000)))
    (base / "kspeedfs.toml").touch()
    import_tree(base / "src", "imgs", EmbeddedStore(base / "store"), 256 << 10)
    return base, {"store.path": str(base / "store"), "cache.memory": "32MiB"}


@pytest.mark.parametrize("context, parent_opened", [("fork", False), ("fork", True),
                                                     ("spawn", True)])
def test_a_dataloader_with_two_workers_reads_every_item(source, monkeypatch, context,
                                                        parent_opened) -> None:
    base, config = source
    monkeypatch.setenv("KSPEEDFS_CONFIG", str(base / "kspeedfs.toml"))
    paths = sorted(str(p.relative_to(base / "src")) for p in (base / "src").rglob("*.jpg"))
    ds = MapDataset("imgs", paths, with_pid, config=config)
    if parent_opened:           # a handle workers inherit (fork) or get pickled (spawn): unused
        assert ds[0][2] == (base / "src" / paths[0]).read_bytes()
    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2, shuffle=True,
                                         collate_fn=list,
                                         multiprocessing_context=context)
    seen: dict[str, bytes] = {}
    pids = set()
    for batch in loader:
        assert len(batch) == 8
        for pid, path, data in batch:
            pids.add(pid)
            seen[path] = data
    assert len(seen) == len(paths)
    for p in paths:
        assert seen[p] == (base / "src" / p).read_bytes(), p
    assert len(pids) == 2 and os.getpid() not in pids
    assert (ds._ds is not None) == parent_opened        # the parent opened nothing itself
    ds.close()


def test_packed_batches_reach_the_main_process_in_shared_memory(source, monkeypatch) -> None:
    base, config = source
    monkeypatch.setenv("KSPEEDFS_CONFIG", str(base / "kspeedfs.toml"))
    paths = sorted(str(p.relative_to(base / "src")) for p in (base / "src").rglob("*.jpg"))
    ds = MapDataset("imgs", paths, config=config)
    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2, collate_fn=packed)
    got = []
    for data, offsets in loader:
        assert data.dtype == torch.uint8 and data.is_shared()
        assert offsets[0] == 0 and offsets[-1] == len(data)
        got += [bytes(data[lo:hi].tolist()) for lo, hi in zip(offsets, offsets[1:], strict=False)]
    assert got == [(base / "src" / p).read_bytes() for p in paths]


def test_packed_outside_a_worker_keeps_empty_samples() -> None:
    data, offsets = packed([b"ab", b"", bytearray(b"cde"), memoryview(b"")])
    assert offsets.tolist() == [0, 2, 2, 5, 5]
    assert bytes(data.tolist()) == b"abcde" and not data.is_shared()
