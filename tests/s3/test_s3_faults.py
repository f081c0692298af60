"""What moto does not do, injected by a proxy in front of it (tests/fixtures/s3.py,
``FaultProxy``): error bursts, bodies cut by resets, slow first bytes, the endpoint down.
Import and the origin get through the transient ones with verified bytes, give up on a
dead endpoint within a bounded time, as EIO (``ChunkUnavailable``), and on a stalled one
within ``source.read_deadline``, as ETIMEDOUT (``SourceTimeout``)."""
from __future__ import annotations

import errno
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash

from kspeedfs import config
from kspeedfs.errors import ChunkUnavailable, SourceTimeout
from kspeedfs.manifest.importer import import_tree
from kspeedfs.manifest.index import ManifestIndex
from kspeedfs.manifest.store.embedded import EmbeddedStore
from kspeedfs.objstore import connect
from kspeedfs.objstore.source import ObjectSource
from kspeedfs.origin import Origin, open_origin
from tests.fixtures.s3 import FaultProxy, S3Server

CHUNK = 256 << 10


@pytest.fixture
def proxy(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    with FaultProxy(s3_server) as p:
        for k, v in p.env().items():
            monkeypatch.setenv(k, v)
        yield p


def _dataset(c: Any, b: str) -> None:
    for i in range(40):
        c.put_object(Bucket=b, Key=f"d/small{i:02d}", Body=bytes([i]) * (1000 + 97 * i))
    c.put_object(Bucket=b, Key="d/large", Body=bytes(range(256)) * (4 * CHUNK // 256 + 5))


def _import(b: str, tmp_path: Path, **source: Any) -> tuple[ManifestIndex, Origin]:
    cfg = config.load(environ={}, overrides={f"source.{k}": v for k, v in source.items()})
    store = EmbeddedStore(tmp_path / "store")
    info = import_tree(ObjectSource(connect(f"s3://{b}/d", cfg.source), 4), "ds", store, CHUNK)
    ix = ManifestIndex.from_blob(store.manifest("ds", info.version), info.inflated_size)
    return ix, open_origin(info.source, ix, "ds", config=cfg.source)


def _read_all(ix: ManifestIndex, origin: Origin) -> None:
    for k in range(ix.chunks):
        data, _ = origin.load(k)
        assert xxhash.xxh3_128_digest(data) == ix.chunk_digest(k), k


def test_error_bursts_are_retried(proxy: FaultProxy, bucket: tuple[Any, str], tmp_path: Path) -> None:
    c, b = bucket
    _dataset(c, b)
    proxy.fail(8, 503, "SlowDown", every=2)
    proxy.fail(3, 500, "InternalError", every=3)
    proxy.fail(3, 429, "TooManyRequests", every=2)
    ix, origin = _import(b, tmp_path)
    proxy.fail(6, 503, "SlowDown", every=2)
    _read_all(ix, origin)
    assert proxy.counts["fail"] == 20


def test_bodies_cut_by_resets_are_read_again(proxy: FaultProxy, bucket: tuple[Any, str],
                                            tmp_path: Path) -> None:
    c, b = bucket
    _dataset(c, b)
    proxy.reset(4, every=3)
    ix, origin = _import(b, tmp_path)
    proxy.reset(4, every=2)
    _read_all(ix, origin)
    assert proxy.counts["reset"] == 8


def test_slow_first_byte_is_retried_after_the_timeout(proxy: FaultProxy, bucket: tuple[Any, str],
                                                     tmp_path: Path) -> None:
    c, b = bucket
    _dataset(c, b)
    ix, origin = _import(b, tmp_path, timeout=1.0)
    proxy.delay(1, 4.0)
    t0 = time.monotonic()
    _read_all(ix, origin)
    assert proxy.counts["delay"] == 1 and time.monotonic() - t0 < 3.5


def test_dead_endpoint_is_eio_within_the_deadline_then_reads_again(
        proxy: FaultProxy, bucket: tuple[Any, str], tmp_path: Path) -> None:
    c, b = bucket
    _dataset(c, b)
    ix, origin = _import(b, tmp_path, timeout=0.5, retries=3)
    proxy.delay(1000, 5.0)                  # every GET stalls past the timeout
    t0 = time.monotonic()
    with pytest.raises(ChunkUnavailable):
        origin.load(0)
    assert time.monotonic() - t0 < 8        # 3 attempts x 0.5 s + backoff
    proxy.clear()
    proxy.stop()                            # down: connections refused
    t0 = time.monotonic()
    with pytest.raises(ChunkUnavailable) as err:
        origin.load(1)
    assert time.monotonic() - t0 < 8 and "s3://" in str(err.value)
    proxy.start()                           # back on the same port
    _read_all(ix, origin)


def test_a_stalled_source_is_etimedout_within_read_deadline(
        proxy: FaultProxy, bucket: tuple[Any, str], tmp_path: Path) -> None:
    """Each attempt may wait 10 s and there are 5: only ``source.read_deadline`` bounds a
    read of a source that stopped answering, chunk, extent or block alike."""
    c, b = bucket
    _dataset(c, b)
    ix, origin = _import(b, tmp_path, timeout=10.0, retries=5, read_deadline=1.0)
    proxy.delay(1000, 6.0)                  # every GET's answer, 6 s late
    extent = next(iter(ix.chunk_extents(0)))
    for read in (lambda: origin.load(0), lambda: origin.load_extent(extent),
                 lambda: origin.load_block(1, 0)):
        t0 = time.monotonic()
        with pytest.raises(SourceTimeout) as err:
            read()
        took = time.monotonic() - t0
        assert 1.0 <= took < 1.5, took
        assert err.value.errno == errno.ETIMEDOUT
        assert f"s3://{b}/d/" in str(err.value) and "source.read_deadline (1 s)" in str(err.value)
    proxy.clear()
    origin.read_deadline = 30.0             # 1 s is tight for a chunk's 40 GETs on a busy machine
    _read_all(ix, origin)                   # answered again: the next reads get their bytes
