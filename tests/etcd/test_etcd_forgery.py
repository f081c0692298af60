"""An attacker with write access to etcd but without the cluster secret, on a real etcd.

The hostile-input attacks, each against the real store and membership code:
a forged next version of a dataset (the attacker's own source directory, a real
manifest of it with matching checksums, ``current`` pointed at it) without a
signature, with another cluster's signature, or as a copy of a genuine signed record
moved to another version; the genuine version's parts replaced; fake node records
(unsigned, signed with another secret, a real node's record copied to another key).
Each is refused: the forged version does not resolve (``RecordUnverified``), the genuine
one still does, and membership and ``NodeRecord.list_verified`` (``kspeedfs status``)
list only the genuine node.
"""
from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from kspeedfs.cluster.membership import Membership, NodeRecord
from kspeedfs.config import StoreConfig
from kspeedfs.errors import ManifestCorrupt, RecordUnverified
from kspeedfs.manifest.importer import import_tree
from kspeedfs.manifest.index import ManifestIndex
from kspeedfs.manifest.store import open_store
from kspeedfs.manifest.store.etcd import EtcdStore
from kspeedfs.manifest.store.etcd_parts import PART_SIZE
from kspeedfs.manifest.store.signature import RecordSigner
from tests.fixtures.etcd import EtcdServer

SECRET = b"forgery-test-cluster-secret-0001"
OTHER = b"forgery-test-other-secret-000002"


@pytest.fixture
def cfg(etcd_server: EtcdServer) -> StoreConfig:
    return StoreConfig(backend="etcd", etcd=[etcd_server.endpoint],
                       etcd_prefix=f"/ksf-{uuid.uuid4().hex[:12]}/", etcd_timeout=5.0)


@pytest.fixture
def store(cfg: StoreConfig) -> Iterator[EtcdStore]:
    with EtcdStore(cfg, SECRET) as s:
        yield s  # type: ignore[misc]


def _tree(root: Path, fill: bytes) -> Path:
    for i in range(5):
        (root / "d").mkdir(parents=True, exist_ok=True)
        (root / "d" / f"f{i}").write_bytes(fill * (1000 + i))
    return root


def forge_version(store: EtcdStore, attacker_root: Path, name: str, version: int,
                   sign_with: bytes | None) -> bytes:
    """What the attacker writes: a real manifest of its own tree (checksums match its
    bytes) as ``version``, with an info record signed by ``sign_with`` (None: unsigned),
    and ``current``/``last`` pointing at it. Returns the attacker's blob."""
    embedded = open_store(StoreConfig(backend="embedded", path=str(attacker_root / "store")))
    info = import_tree(attacker_root / "src", name, embedded, 64 << 10)
    blob = embedded.manifest(name, info.version)
    record = {**info.to_json(), "version": version, "parts": 1, "part_size": PART_SIZE}
    key = f"{store.prefix}datasets/{name}/v{version}/info"
    value = (RecordSigner(sign_with).seal_json(key, record) if sign_with
             else json.dumps(record).encode())
    store.call(lambda c: c.put(store.part_key(name, version, 0), blob))
    store.call(lambda c: c.put(key, value))
    store.call(lambda c: c.put(f"{store.prefix}datasets/{name}/current", str(version)))
    store.call(lambda c: c.put(f"{store.prefix}datasets/{name}/last", str(version)))
    return blob


@pytest.mark.parametrize("sign_with", [None, OTHER], ids=["unsigned", "other-secret"])
def test_forged_next_version_is_refused(store: EtcdStore, tmp_path: Path, sign_with: bytes | None,
                                        caplog: pytest.LogCaptureFixture) -> None:
    genuine = import_tree(_tree(tmp_path / "real", b"R"), "ds", store, 64 << 10)
    _tree(tmp_path / "evil" / "src", b"E")
    forge_version(store, tmp_path / "evil", "ds", genuine.version + 1, sign_with)

    with caplog.at_level(logging.WARNING):
        with pytest.raises(RecordUnverified, match=f"v{genuine.version + 1}/info"):
            store.dataset("ds")                        # current points at the forgery
        with pytest.raises(RecordUnverified):
            store.manifest("ds", genuine.version + 1)
        assert store.datasets() == []                  # not listed (one warning)
    assert any("refusing etcd key" in r.getMessage() for r in caplog.records)

    # the genuine version still resolves, by number, and serves the genuine tree
    assert store.dataset("ds", genuine.version) == genuine
    ix = ManifestIndex.from_blob(store.manifest("ds", genuine.version), genuine.inflated_size)
    assert {genuine.source} == {store.dataset("ds", genuine.version).source}
    assert ix.nfiles == 5 and "evil" not in genuine.source


def test_genuine_record_moved_or_parts_replaced(store: EtcdStore, tmp_path: Path) -> None:
    v1 = import_tree(_tree(tmp_path / "real", b"R"), "ds", store, 64 << 10)
    key1 = f"{store.prefix}datasets/ds/v1/info"
    signed, _ = store.call(lambda c: c.get(key1))
    # a genuine signed record copied to v2 (or to another dataset) does not verify there
    store.call(lambda c: c.put(f"{store.prefix}datasets/ds/v2/info", signed))
    store.call(lambda c: c.put(f"{store.prefix}datasets/ds/current", "2"))
    with pytest.raises(RecordUnverified):
        store.dataset("ds")
    store.call(lambda c: c.put(f"{store.prefix}datasets/other/v1/info", signed))
    store.call(lambda c: c.put(f"{store.prefix}datasets/other/current", "1"))
    with pytest.raises(RecordUnverified):
        store.dataset("other")
    # the attacker's blob under the genuine, signed record: the SHA-256 refuses it
    _tree(tmp_path / "evil" / "src", b"E")
    evil = open_store(StoreConfig(backend="embedded", path=str(tmp_path / "evil" / "store")))
    evil_blob = evil.manifest("ds", import_tree(tmp_path / "evil" / "src", "ds", evil, 64 << 10).version)
    store.call(lambda c: c.put(store.part_key("ds", 1, 0), evil_blob))
    with pytest.raises(ManifestCorrupt):
        store.manifest("ds", 1)
    assert store.dataset("ds", 1) == v1


def test_store_of_another_cluster_cannot_read(cfg: StoreConfig, store: EtcdStore, tmp_path: Path) -> None:
    import_tree(_tree(tmp_path / "real", b"R"), "ds", store, 64 << 10)
    with EtcdStore(cfg, OTHER) as other:
        with pytest.raises(RecordUnverified):
            other.dataset("ds")


def _record(name: str, port: int = 7470) -> NodeRecord:
    return NodeRecord(name, "h", ["10.9.0.1"], port, port + 1, 1 << 30, 256, 4 << 20, 512)


async def test_membership_ignores_forged_node_records(cfg: StoreConfig, store: EtcdStore,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    def put(key: str, value: bytes) -> None:
        store.call(lambda c: c.put(key, value))

    p = store.prefix + "nodes/"
    put(p + "good", _record("good").signed(store))
    put(p + "fake", _record("fake").to_json())                       # unsigned
    with EtcdStore(cfg, OTHER) as other:
        put(p + "wrong-secret", _record("wrong-secret").signed(other))
    put(p + "moved", _record("good").signed(store))                  # good's record, another key
    put(p + "garbage", b"ksig1 " + b"0" * 64 + b"\n{")

    with caplog.at_level(logging.WARNING):
        membership = Membership(store)
        async with trio.open_nursery() as nursery:
            await nursery.start(membership.run)
            assert set(membership.nodes) == {"good"}
            assert [m.node for m in membership.members] == ["good"]
            # a later genuine join is seen; later forgeries still are not
            await trio.to_thread.run_sync(put, p + "late", _record("late").signed(store))
            await trio.to_thread.run_sync(put, p + "late-fake", _record("late-fake").to_json())
            with trio.fail_after(10):
                while "late" not in membership.nodes:
                    await trio.sleep(0.05)
            assert set(membership.nodes) == {"good", "late"}
            nursery.cancel_scope.cancel()
    assert set(await trio.to_thread.run_sync(NodeRecord.list_verified, store)) == {"good", "late"}
    refused = {r.getMessage().split()[3].rstrip(":") for r in caplog.records
               if r.getMessage().startswith("refusing etcd key")}
    assert refused >= {p + k for k in ("fake", "wrong-secret", "moved", "garbage", "late-fake")}
