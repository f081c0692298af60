"""The tier chain (cache/tiers.py) the mount's reader and a cluster node share: order,
single-flight, the error contract, and the two modes (mount, node)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from kspeedfs.cache.disk import DiskCache
from kspeedfs.cache.memory import MemoryCache
from kspeedfs.cache.singleflight import SingleFlight
from kspeedfs.cache.tiers import Loaded, TierChain
from kspeedfs.errors import ChunkUnavailable
from kspeedfs.manifest.importer import import_tree
from kspeedfs.manifest.index import ManifestIndex
from kspeedfs.manifest.store.embedded import EmbeddedStore
from kspeedfs.origin import Origin

C = 64 << 10


class FakePeers:
    """Records how it was asked; has the chunks in ``held``."""

    def __init__(self, held: dict[bytes, bytes] | None = None) -> None:
        self.held = held or {}
        self.calls: list[dict[str, object]] = []

    async def read_chunk(self, dataset: str, version: int, chunk: int, key: bytes, length: int,
                         *, ask_owner: bool = True, exclude: str | None = None,
                         part: tuple[int, int, bytes] | None = None) -> bytes | None:
        self.calls.append({"dataset": (dataset, version), "ask_owner": ask_owner, "exclude": exclude})
        return self.held.get(key)


@pytest.fixture
def dataset(tmp_path: Path):
    src = tmp_path / "src"
    src.mkdir()
    big = os.urandom(4 * C)
    (src / "big").write_bytes(big)
    store = EmbeddedStore(tmp_path / "store")
    info = import_tree(src, "ds", store, C)
    ix = ManifestIndex.from_blob(store.manifest("ds", info.version))
    return src, ix, big


def _chain(ix, src, nursery, **kw) -> TierChain:
    return TierChain(index=ix, origin=Origin(src, ix, "ds"), memory=kw.pop("memory", MemoryCache(8 << 20)),
                     flights=SingleFlight(nursery), limiter=trio.CapacityLimiter(2), **kw)


async def test_a_node_chain_fills_from_the_source_once_then_says_cache(dataset, tmp_path) -> None:
    src, ix, big = dataset
    landed: list[tuple[int, str]] = []
    peers = FakePeers()
    disk = DiskCache(tmp_path / "disk", 1 << 20)
    async with trio.open_nursery() as n:
        chain = _chain(ix, src, n, disk=disk, peers=peers, dataset=("ds", 1), node="n1",
                       landed=lambda k, key, loaded: landed.append((k, loaded.tier)))
        assert await chain.fill(0) == "source"
        assert await chain.fill(0) == "cache"
    assert landed == [(0, "source")]
    assert peers.calls == [{"dataset": ("ds", 1), "ask_owner": False, "exclude": "n1"}]
    assert disk.used == 0                            # a node's SSD tier takes evictions only


async def test_a_mount_chain_asks_owners_and_writes_the_disk_tier(dataset, tmp_path) -> None:
    src, ix, big = dataset
    peers = FakePeers()
    disk = DiskCache(tmp_path / "disk", 1 << 20)
    async with trio.open_nursery() as n:
        chain = _chain(ix, src, n, disk=disk, peers=peers)
        assert bytes(await chain.chunk(1)) == big[C:2 * C]
    assert peers.calls[0]["ask_owner"] is True and peers.calls[0]["exclude"] is None
    assert ix.chunk_digest(1) in disk
    assert chain.counters.source_loads == 1


async def test_order_disk_then_peers_and_a_corrupt_disk_copy_is_skipped(dataset, tmp_path) -> None:
    src, ix, big = dataset
    k0, k1 = ix.chunk_digest(0), ix.chunk_digest(1)
    disk = DiskCache(tmp_path / "disk", 1 << 20)
    disk.put(k0, big[:C])
    disk.put(k1, b"x" * C)                           # corrupt
    peers = FakePeers({k0: b"never asked", k1: big[C:2 * C]})
    got: list[Loaded] = []
    async with trio.open_nursery() as n:
        chain = _chain(ix, src, n, disk=disk, peers=peers,
                       landed=lambda k, key, loaded: got.append(loaded))
        assert bytes(await chain.chunk(0)) == big[:C]
        assert bytes(await chain.chunk(1)) == big[C:2 * C]
    assert [g.tier for g in got] == ["disk", "peer"]
    assert k1 not in disk and chain.counters.corrupt_discarded == 1


async def test_a_source_that_cannot_be_read_is_chunk_unavailable(dataset, monkeypatch) -> None:
    src, ix, _ = dataset

    def fail(self, chunk):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Origin, "load", fail)
    async with trio.open_nursery() as n:
        for node in (None, "n1"):
            chain = _chain(ix, src, n, node=node)
            with pytest.raises(ChunkUnavailable, match="chunk 2 of ds: source read failed"):
                await chain.chunk(2)


async def test_concurrent_requests_share_one_load(dataset) -> None:
    src, ix, big = dataset
    async with trio.open_nursery() as n:
        chain = _chain(ix, src, n)
        for _ in range(5):
            n.start_soon(chain.chunk, 3)
    assert chain.counters.source_loads == 1
    assert chain.counters.waited_in_flight + chain.counters.memory_hits == 4
