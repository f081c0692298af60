"""Manifest pages in a bucket (``store.pages = s3://BUCKET/PREFIX``, objstore/pages.py)
against a real S3 server (moto): a paged version published by the embedded and the etcd
store goes to the bucket under the page directory's names, a node's copy is filled from
it (cluster/page_copy.py), a page altered in the bucket is refused, the sweep deletes only
unreferenced page objects, and a mount with no node's copy fails in one line."""
from __future__ import annotations

import hashlib
import random
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kspeedfs import config
from kspeedfs.cluster.node_stats import NodeCounters
from kspeedfs.cluster.page_copy import PageCopy
from kspeedfs.cluster.placement import Member
from kspeedfs.config import SourceConfig, StoreConfig
from kspeedfs.errors import KspeedfsError, ManifestCorrupt
from kspeedfs.manifest.load import load_index, open_on_host
from kspeedfs.manifest.pages import HASH_SIZE, Root, page_name, read_all, read_table, write_pages
from kspeedfs.manifest.store import open_store
from kspeedfs.manifest.store.base import DatasetInfo, MetadataStore
from kspeedfs.objstore.pages import BucketPages
from tests.fixtures.etcd import EtcdServer
from tests.fixtures.s3 import S3Server

SECRET = b"bucket-pages-test-cluster-secret"
PS = 64 << 10


def _raw(n: int, seed: int = 1) -> bytes:
    return random.Random(seed).randbytes(n)               # every page distinct


def _info(name: str = "ds") -> DatasetInfo:
    return DatasetInfo(name=name, version=0, files=1, entries=1, bytes=1, chunks=1,
                       chunk_size=1, imported_at=0.0, source="test")


def _keys(c: Any, bucket: str, prefix: str = "") -> dict[str, bytes]:
    out = {}
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", ()):
            out[o["Key"]] = c.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
    return out


@pytest.fixture(params=["embedded", "etcd"])
def store_cfg(request: pytest.FixtureRequest, aws_env: S3Server, bucket: tuple[Any, str],
              tmp_path: Path) -> StoreConfig:
    """``store.pages`` in the test's bucket, for an embedded or an etcd store."""
    _, b = bucket
    common: dict[str, Any] = {"pages": f"s3://{b}/pages", "paged_above": 4096}
    if request.param == "embedded":
        return StoreConfig(backend="embedded", path=str(tmp_path / "store"), **common)
    server: EtcdServer = request.getfixturevalue("etcd_server")
    return StoreConfig(backend="etcd", etcd=[server.endpoint],
                       etcd_prefix=f"/kst-{uuid.uuid4().hex[:12]}/", **common)


@pytest.fixture
def store(store_cfg: StoreConfig) -> Iterator[MetadataStore]:
    with open_store(store_cfg, SECRET if store_cfg.backend == "etcd" else None,
                    SourceConfig()) as s:
        yield s


def _copy(tmp_path: Path, store: MetadataStore) -> PageCopy:
    """A node's copy with no peers: every page from store.pages (the bucket)."""
    membership = SimpleNamespace(members=[Member("me")], nodes={})
    return PageCopy(str(tmp_path / "copy"), store.pages, "me", store,  # type: ignore[arg-type]
                    membership, None, NodeCounters(), 4)  # type: ignore[arg-type]


def _publish(store: MetadataStore, raw: bytes, name: str = "ds") -> tuple[DatasetInfo, Root]:
    info = store.publish_stream(_info(name), [raw[:5000], raw[5000:]], len(raw))
    return info, Root.parse(store.manifest(name, info.version))


async def test_a_paged_version_goes_to_the_bucket_and_a_nodes_copy_fills_from_it(
        store: MetadataStore, bucket: tuple[Any, str], tmp_path: Path) -> None:
    c, b = bucket
    raw = _raw(5 * PS + 123)
    info, root = _publish(store, raw)
    keys = _keys(c, b)
    assert len(keys) == root.pages + len(root.tables) == 7
    for key, data in keys.items():                      # the page directory's names
        h = hashlib.sha256(zlib.decompress(data)).hexdigest()
        assert key == f"pages/{h[:2]}/{h}"
    assert not (tmp_path / "store" / "pages").exists()  # nothing beside the bucket

    pc = _copy(tmp_path, store)
    await pc.fill("ds", info.version)
    assert pc.counters.pages_from_store == 7
    copy = str(tmp_path / "copy")
    assert read_all(root, read_table(root, [copy]), [copy]) == raw
    assert sorted(p.name for p in (tmp_path / "copy").rglob("*") if p.is_file()) == \
        sorted(k.rsplit("/", 1)[1] for k in keys)


async def test_a_nodes_page_rpc_answers_from_its_copy_never_from_the_bucket(
        store: MetadataStore, tmp_path: Path) -> None:
    info, root = _publish(store, _raw(2 * PS, seed=7))
    pc = _copy(tmp_path, store)
    assert await pc.answer(root.tables[0].hex()) == {"absent": True}
    await pc.fill("ds", info.version)
    assert "page" in await pc.answer(root.tables[0].hex())


def test_pages_the_bucket_has_are_not_written_again(store: MetadataStore,
                                                     bucket: tuple[Any, str]) -> None:
    raw = _raw(3 * PS, seed=2)
    sink = store.pages
    assert isinstance(sink, BucketPages)
    _, first = write_pages([raw], sink, workers=4)
    _, again = write_pages([raw], sink, workers=4)
    _, grown = write_pages([raw + b"x"], sink, workers=4)   # one new data page and its table
    assert first > 0 and again == 0 and 0 < grown < first


async def test_a_page_altered_in_the_bucket_is_refused_never_used(
        store: MetadataStore, bucket: tuple[Any, str], tmp_path: Path) -> None:
    c, b = bucket
    raw = _raw(3 * PS, seed=3)
    info, root = _publish(store, raw)
    hashes = read_table(root, [store.pages])       # type: ignore[list-item]
    victim = hashes[HASH_SIZE:2 * HASH_SIZE]
    forged = raw[PS:2 * PS - 1] + b"!"                 # same length, other bytes
    c.put_object(Bucket=b, Key=f"pages/{page_name(victim)}", Body=zlib.compress(forged))

    pc = _copy(tmp_path, store)
    with pytest.raises(KspeedfsError, match="SHA-256 differs"):
        await pc.fill("ds", info.version)
    assert not (tmp_path / "copy" / page_name(victim)).exists()
    for table in root.tables:                          # a refused version's tables: never
        assert not (tmp_path / "copy" / page_name(table)).exists()
    with pytest.raises(ManifestCorrupt, match="corrupt in s3://"):
        read_all(root, hashes, [store.pages])          # type: ignore[list-item]


def test_the_sweep_removes_only_unreferenced_page_objects(store: MetadataStore,
                                                          bucket: tuple[Any, str]) -> None:
    c, b = bucket
    keep_raw, drop_raw = _raw(3 * PS, seed=4), _raw(2 * PS, seed=5)
    _, keep_root = _publish(store, keep_raw, "keep")
    kept = set(_keys(c, b, "pages/"))
    _publish(store, drop_raw, "drop")
    others = {"pages/readme.txt": b"not a page", "pages/ab/" + "cd" * 32: b"wrong directory",
              f"pages/{'AB' * 32}"[:-64] + "ab/" + "AB" * 32: b"upper case",
              "elsewhere/" + page_name(hashlib.sha256(b"x").digest()): b"outside the prefix"}
    for key, body in others.items():
        c.put_object(Bucket=b, Key=key, Body=body)
    assert store.sweep_pages(grace=3600) == 0          # all younger than the grace
    store.remove("drop")                               # its sweep keeps the young pages
    assert store.sweep_pages(grace=0) == 2 + 1         # drop's data pages and its table
    left = set(_keys(c, b))
    assert left == kept | set(others)
    assert read_all(keep_root, read_table(keep_root, [store.pages]),  # type: ignore[list-item]
                    [store.pages]) == keep_raw         # type: ignore[list-item]


def test_a_mount_with_bucket_pages_and_no_node_here_fails_in_one_line(
        store: MetadataStore, store_cfg: StoreConfig, tmp_path: Path) -> None:
    info, _ = _publish(store, _raw(2 * PS, seed=6))
    cfg = config.load(environ={}, overrides={"store.pages": store_cfg.pages,
                                             "store.backend": "etcd",
                                             "cluster.page_copy": str(tmp_path / "none")})
    with pytest.raises(ManifestCorrupt) as e:
        open_on_host(cfg, store.manifest("ds", info.version), info)
    assert "s3://" in str(e.value) and "kspeedfs node" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_plain_http_endpoint_is_used_only_as_the_endpoint_says(
        aws_env: S3Server, bucket: tuple[Any, str]) -> None:
    c, b = bucket
    https = aws_env.endpoint.replace("http://", "https://")
    pages = BucketPages(f"s3://{b}/pages", SourceConfig(endpoint=https, retries=1, timeout=2))
    with pytest.raises(KspeedfsError) as e:                # TLS to a plain-http server
        pages.put(hashlib.sha256(b"p").digest(), zlib.compress(b"p"))
    assert "\n" not in str(e.value) and "SSL" in str(e.value)
    assert not _keys(c, b)


def test_migrate_writes_a_whole_versions_pages_to_the_bucket_and_a_tool_reads_them(
        aws_env: S3Server, bucket: tuple[Any, str], tmp_path: Path) -> None:
    from kspeedfs.manifest.index import inflate
    from tests.fixtures.mounts import kspeedfs

    c, b = bucket
    src = tmp_path / "src"
    for i in range(300):
        (src / f"d{i % 3}").mkdir(parents=True, exist_ok=True)
        (src / f"d{i % 3}" / f"file-{i:05d}-{'x' * 40}").write_bytes(b"%d" % i)
    opts = ["--set", f"store.path={tmp_path / 'store'}", "--set", f"store.pages=s3://{b}/pages",
            "--set", f"log.dir={tmp_path / 'log'}"]
    kspeedfs(["import", str(src), "--name", "ds", "-q", *opts])   # under 1 MiB: whole
    assert not _keys(c, b)
    out = kspeedfs(["migrate", "ds", *opts]).stdout
    assert out.startswith("migrated ds@1 to ds@2"), out
    with open_store(StoreConfig(path=str(tmp_path / "store"), pages=f"s3://{b}/pages"),
                    None, SourceConfig()) as s:
        whole = s.manifest("ds", 1)
        root = Root.parse(s.manifest("ds", 2))
        assert len(_keys(c, b, "pages/")) == root.pages + len(root.tables)
        assert read_all(root, read_table(root, [s.pages]),       # type: ignore[list-item]
                        [s.pages]) == inflate(whole, s.dataset("ds", 1).inflated_size)  # type: ignore[list-item]
        # a tool's load_index (preload --check) reads the bucket's pages through Python
        ix, v1 = load_index(s, s.dataset("ds", 2)), load_index(s, s.dataset("ds", 1))
        assert ix.entries == v1.entries == 304
        assert sorted(ix.path(e) for e in ix.walk()) == sorted(v1.path(e) for e in v1.walk())
