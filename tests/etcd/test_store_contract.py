"""The MetadataStore contract, run over every backend (embedded and a real etcd).

One suite for both, so that "works with the embedded store" means "works with etcd":
each test below gets ``store`` once per backend and says nothing backend-specific
except through the small ``Backend`` helpers (how to corrupt a blob, how to open a
second client). Backend-only properties follow at the end: embedded crash leftovers;
etcd orphans, dead endpoints, failover, restart, user/password auth and mutual TLS.

The etcd tests share one session server (``etcd_server``) and isolate themselves by a
unique key prefix per test; tests that stop or restart etcd, or need auth or TLS, start
a server of their own (~0.5 s each). The whole file runs in about 10 s.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from kspeedfs.config import StoreConfig
from kspeedfs.errors import ConfigError, DatasetNotFound, ManifestCorrupt, StoreError, StoreUnavailable
from kspeedfs.manifest.store import DatasetInfo, MetadataStore
from kspeedfs.manifest.store import open_store as _open_store
from kspeedfs.manifest.store.embedded import EmbeddedStore
from tests.fixtures.etcd import EtcdServer, TestCA, free_port

MiB = 1 << 20
SECRET = b"contract-test-cluster-secret"


def open_store(cfg: StoreConfig) -> MetadataStore:
    """Every store here is opened as a cluster member: etcd records are signed and
    verified with ``SECRET`` (tests/unit/test_signature.py covers the refusals)."""
    return _open_store(cfg, SECRET)


def make_info(name: str = "imagenet", files: int = 3) -> DatasetInfo:
    return DatasetInfo(
        name=name, version=0, files=files, entries=files + 1, bytes=files * 100,
        chunks=files, chunk_size=4 * MiB, imported_at=0.0, source=f"/data/{name}",
    )


class Backend:
    """How a test reaches behind a store: open another client, damage a blob."""

    kind = ""

    def open(self) -> MetadataStore:
        raise NotImplementedError

    def corrupt(self, store: MetadataStore, name: str, version: int) -> None:
        raise NotImplementedError


class Embedded(Backend):
    kind = "embedded"

    def __init__(self, root: Path) -> None:
        self.root = root

    def open(self) -> MetadataStore:
        return open_store(StoreConfig(backend="embedded", path=str(self.root)))

    def corrupt(self, store: MetadataStore, name: str, version: int) -> None:
        p = self.root / name / f"v{version}.manifest"
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0xFF
        p.write_bytes(bytes(data))


class Etcd(Backend):
    kind = "etcd"

    def __init__(self, server: EtcdServer, prefix: str) -> None:
        self.server = server
        self.cfg = StoreConfig(backend="etcd", etcd=[server.endpoint], etcd_prefix=prefix,
                               etcd_timeout=5.0)

    def open(self) -> MetadataStore:
        return open_store(self.cfg)

    def raw(self) -> etcd3.Etcd3Client:  # noqa: F821 - imported lazily
        import etcd3

        return etcd3.client("127.0.0.1", self.server.client_port, timeout=5)

    def corrupt(self, store: MetadataStore, name: str, version: int) -> None:
        key = store.part_key(name, version, 0)  # type: ignore[attr-defined]
        c = self.raw()
        try:
            value, _ = c.get(key)
            assert value is not None, key
            data = bytearray(value)
            data[len(data) // 2] ^= 0xFF
            c.put(key, bytes(data))
        finally:
            c.close()


@pytest.fixture(params=["embedded", "etcd"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "embedded":
        return Embedded(tmp_path / "store")
    server = request.getfixturevalue("etcd_server")
    return Etcd(server, f"/kst-{uuid.uuid4().hex[:12]}/")


@pytest.fixture
def store(backend: Backend) -> Iterator[MetadataStore]:
    with backend.open() as s:
        yield s


# -- round trip --------------------------------------------------------------------------

def test_publish_round_trip(store: MetadataStore) -> None:
    blob = b"manifest bytes " * 1000
    sealed = store.publish(make_info(), blob)
    assert sealed.version == 1
    assert sealed.manifest_size == len(blob) and sealed.digest and sealed.imported_at > 0
    assert store.dataset("imagenet") == sealed
    assert store.dataset("imagenet", 1) == sealed
    assert store.versions("imagenet") == [1]
    assert store.datasets() == [sealed]
    assert store.manifest("imagenet", 1) == blob


def test_large_blob_round_trip(store: MetadataStore) -> None:
    """> 3 MiB: several etcd parts (1 MiB each) plus a short last one."""
    blob = os.urandom(3 * MiB + 12345)
    sealed = store.publish(make_info(), blob)
    assert store.manifest("imagenet", sealed.version) == blob
    if hasattr(store, "part_key"):
        assert store.part_key("imagenet", 1, 3).endswith("/v1/3")  # 4 parts: 0..3


def test_empty_blob_and_info_fields(store: MetadataStore) -> None:
    """Every DatasetInfo field survives, including a non-UTF-8 source path."""
    info = replace(make_info("odd.name_1-x"), source=b"/data/caf\xe9".decode(errors="surrogateescape"))
    sealed = store.publish(info, b"")
    got = store.dataset("odd.name_1-x")
    assert got == sealed and got.source == info.source
    assert store.manifest("odd.name_1-x", 1) == b""


def test_datasets_sorted_and_current(store: MetadataStore) -> None:
    for name in ("b", "c", "a"):
        store.publish(make_info(name), name.encode())
    store.publish(make_info("b", files=7), b"b2")
    got = store.datasets()
    assert [(i.name, i.version) for i in got] == [("a", 1), ("b", 2), ("c", 1)]
    assert got[1].files == 7


# -- versions move -----------------------------------------------------------------------

def test_current_moves_on_publish_and_remove(store: MetadataStore) -> None:
    blobs = {}
    for n in range(1, 4):
        blobs[n] = f"v{n}".encode() * 100
        assert store.publish(make_info(), blobs[n]).version == n
        assert store.dataset("imagenet").version == n
    assert store.versions("imagenet") == [1, 2, 3]

    store.remove("imagenet", 3)                   # the current one: newest remaining wins
    assert store.dataset("imagenet").version == 2
    assert store.versions("imagenet") == [1, 2]
    store.remove("imagenet", 1)                   # not current: current stays
    assert store.dataset("imagenet").version == 2
    assert store.manifest("imagenet", 2) == blobs[2]
    with pytest.raises(DatasetNotFound):
        store.manifest("imagenet", 1)

    newer = store.publish(make_info(), b"again")  # numbering: above everything that exists
    assert newer.version > 2 and store.dataset("imagenet").version == newer.version

    store.remove("imagenet", 2)
    store.remove("imagenet", newer.version)       # the last one: the dataset is gone
    with pytest.raises(DatasetNotFound):
        store.dataset("imagenet")
    with pytest.raises(DatasetNotFound):
        store.versions("imagenet")
    assert store.datasets() == []


def test_remove_whole_dataset(store: MetadataStore) -> None:
    store.publish(make_info("a"), b"a1")
    store.publish(make_info("a"), b"a2")
    store.publish(make_info("ab"), b"ab")         # a name that starts with the other one
    store.remove("a")
    with pytest.raises(DatasetNotFound):
        store.dataset("a")
    with pytest.raises(DatasetNotFound):
        store.remove("a")
    assert [i.name for i in store.datasets()] == ["ab"]
    assert store.manifest("ab", 1) == b"ab"
    assert store.publish(make_info("a"), b"fresh").version == 1   # numbering restarts


def test_unknown_names_and_versions(store: MetadataStore) -> None:
    store.publish(make_info(), b"x")
    calls: list[Callable[[], object]] = [
        lambda: store.dataset("nope"),
        lambda: store.dataset("imagenet", 2),
        lambda: store.versions("nope"),
        lambda: store.manifest("nope", 1),
        lambda: store.manifest("imagenet", 2),
        lambda: store.remove("nope"),
        lambda: store.remove("nope", 1),
        lambda: store.remove("imagenet", 2),
    ]
    for call in calls:
        with pytest.raises(DatasetNotFound):
            call()
    assert store.versions("imagenet") == [1]


@pytest.mark.parametrize("name", ["", ".hidden", "-x", "a/b", "../etc", "sp ace", "é", "x" * 129])
def test_invalid_names_refused(store: MetadataStore, name: str) -> None:
    with pytest.raises(ConfigError):
        store.publish(make_info(name), b"x")
    with pytest.raises(ConfigError):
        store.dataset(name)
    assert store.datasets() == []


# -- integrity and concurrency ------------------------------------------------------------

def test_corrupt_blob_detected(store: MetadataStore, backend: Backend) -> None:
    blob = os.urandom(2 * MiB + 7)
    store.publish(make_info(), blob)
    backend.corrupt(store, "imagenet", 1)
    with pytest.raises(ManifestCorrupt):
        store.manifest("imagenet", 1)
    assert store.dataset("imagenet").version == 1      # the info itself is still readable


def test_concurrent_publish_distinct_versions(backend: Backend) -> None:
    """Separate store instances (separate importers) publishing one name at once."""
    n = 6
    stores = [backend.open() for _ in range(n)]
    barrier = threading.Barrier(n)
    results: dict[int, tuple[int, bytes]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        blob = f"publisher {i} ".encode() * (1000 + i)
        try:
            barrier.wait()
            results[i] = (stores[i].publish(make_info(), blob).version, blob)
        except BaseException as e:  # reported below, with the others
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert not errors, errors
        versions = sorted(v for v, _ in results.values())
        assert versions == list(range(1, n + 1))
        check = stores[0]
        assert check.versions("imagenet") == versions
        assert check.dataset("imagenet").version == n
        for v, blob in results.values():
            assert check.manifest("imagenet", v) == blob
    finally:
        for s in stores:
            s.close()


# -- embedded only -----------------------------------------------------------------------

def test_embedded_crash_leftovers_are_harmless(tmp_path: Path) -> None:
    """A publish killed before ``current`` moved leaves v<N> files (or temp files); the
    store must keep serving the old current version and the next publish must work."""
    root = tmp_path / "store"
    store = EmbeddedStore(root)
    v1 = store.publish(make_info(), b"one")
    d = root / "imagenet"
    # Crash after the blob was renamed into place, and a half-written temp file.
    (d / "v2.manifest").write_bytes(b"half of a manif")
    (d / ".v2.json.4242.tmp").write_bytes(b'{"name": "imag')
    assert store.dataset("imagenet") == v1
    assert store.versions("imagenet") == [1]
    assert [i.version for i in store.datasets()] == [1]
    assert store.manifest("imagenet", 1) == b"one"
    v2 = store.publish(make_info(), b"two")
    assert v2.version == 2 and store.manifest("imagenet", 2) == b"two"

    # Crash after blob and info were written, before current: v3 complete but not current.
    sealed3 = make_info().sealed(3, b"three", time.time())
    (d / "v3.manifest").write_bytes(b"three")
    (d / "v3.json").write_text(json.dumps(sealed3.to_json()))
    assert store.dataset("imagenet").version == 2
    assert store.manifest("imagenet", 2) == b"two"
    v4 = store.publish(make_info(), b"four")
    assert v4.version == 4 and store.dataset("imagenet") == v4
    assert store.manifest("imagenet", 4) == b"four"


# -- etcd only ---------------------------------------------------------------------------

def _etcd_cfg(endpoints: list[str], timeout: float = 5.0) -> StoreConfig:
    return StoreConfig(backend="etcd", etcd=endpoints, etcd_prefix=f"/kst-{uuid.uuid4().hex[:12]}/",
                       etcd_timeout=timeout)


def test_etcd_dead_endpoint_is_unavailable() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with open_store(_etcd_cfg([dead], timeout=0.3)) as store:
        with pytest.raises(StoreUnavailable, match="127.0.0.1"):
            store.datasets()
        with pytest.raises(StoreUnavailable):
            store.publish(make_info(), b"x")
    assert time.monotonic() - t0 < 5


def test_etcd_fails_over_to_next_endpoint(etcd_server: EtcdServer, caplog: pytest.LogCaptureFixture) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with caplog.at_level(logging.INFO, logger="kspeedfs.manifest.store"):
        with open_store(_etcd_cfg([dead, etcd_server.endpoint], timeout=2)) as store:
            store.publish(make_info(), b"x")
            assert store.manifest("imagenet", 1) == b"x"
    assert any("failed over" in r.message for r in caplog.records)


def test_etcd_races_between_healthy_endpoints_are_not_failovers(
        etcd_server: EtcdServer, caplog: pytest.LogCaptureFixture) -> None:
    """Two live endpoints answer races in either order: no "failed over" line for that
    (it filled every node's log of a busy cluster every second or two)."""
    url = etcd_server.endpoint
    other = url.replace("127.0.0.1", "localhost")
    assert other != url
    with caplog.at_level(logging.INFO, logger="kspeedfs.manifest.store"):
        with open_store(_etcd_cfg([url, other], timeout=2)) as store:
            for _ in range(40):
                store.race(lambda c: c.get_prefix_response("/kst-none/"))
    assert not any("failed over" in r.message for r in caplog.records)


def test_etcd_missing_part_and_orphans(etcd_server: EtcdServer) -> None:
    """An allocated version whose publish died (parts written, no info) is invisible and
    never reused; a part deleted behind our back is a corrupt manifest."""
    backend = Etcd(etcd_server, f"/kst-{uuid.uuid4().hex[:12]}/")
    with backend.open() as store:
        blob = os.urandom(2 * MiB + 3)
        store.publish(make_info(), blob)
        orphan = store.records.allocate("imagenet")  # type: ignore[attr-defined]
        raw = backend.raw()
        try:
            raw.put(store.part_key("imagenet", orphan, 0), b"orphan")  # type: ignore[attr-defined]
            assert store.versions("imagenet") == [1]
            assert store.dataset("imagenet").version == 1
            assert store.publish(make_info(), b"next").version == orphan + 1
            assert store.versions("imagenet") == [1, orphan + 1]

            raw.delete(store.part_key("imagenet", 1, 1))  # type: ignore[attr-defined]
            with pytest.raises(ManifestCorrupt):
                store.manifest("imagenet", 1)

            store.remove("imagenet")
            assert list(raw.get_prefix(backend.cfg.etcd_prefix)) == []   # parts too
        finally:
            raw.close()


def test_etcd_survives_restart(etcd_server_private: EtcdServer) -> None:
    server = etcd_server_private
    with open_store(_etcd_cfg([server.endpoint], timeout=10)) as store:
        sealed = store.publish(make_info(), b"before")
        server.restart()
        assert store.dataset("imagenet") == sealed     # rides out gRPC reconnect backoff
        assert store.publish(make_info(), b"after").version == 2
        server.stop()
    with open_store(_etcd_cfg([server.endpoint], timeout=0.3)) as down:
        with pytest.raises(StoreUnavailable, match=str(server.client_port)):
            down.datasets()


def _etcdctl(server: EtcdServer, *args: str) -> None:
    subprocess.run(["etcdctl", "--endpoints", server.endpoint, *args], check=True,
                   capture_output=True, env={**os.environ, "ETCDCTL_API": "3"})


def test_etcd_user_password_auth() -> None:
    """Auth over plain http (grpcio refuses etcd3's call credentials there; the store
    sends the token as metadata), re-authentication after the token expires, and a bad
    password as a StoreError that is not "unavailable"."""
    with EtcdServer(name="kst-auth", extra_args=["--auth-token-ttl", "1"]) as server:
        _etcdctl(server, "user", "add", "root:s3cret")
        _etcdctl(server, "auth", "enable")
        cfg = replace(_etcd_cfg([server.endpoint]), etcd_user="root", etcd_password="s3cret")
        with open_store(cfg) as store:
            blob = os.urandom(MiB + 1)
            store.publish(make_info(), blob)
            time.sleep(2.2)                               # the simple token expires
            assert store.manifest("imagenet", 1) == blob
        for user, password in (("root", "wrong"), ("", "")):
            with open_store(replace(cfg, etcd_user=user, etcd_password=password)) as store:
                with pytest.raises(StoreError) as exc:
                    store.datasets()
                assert not isinstance(exc.value, StoreUnavailable), exc.value


def test_etcd_auth_with_a_password_file(tmp_path: Path) -> None:
    """``store.etcd_password_file``: the password from a 0600 file authenticates; a file
    others may read is refused when the store opens, in one line naming it."""
    with EtcdServer(name="kst-authfile") as server:
        _etcdctl(server, "user", "add", "root:s3cret-in-a-file")
        _etcdctl(server, "auth", "enable")
        secret = tmp_path / "etcd-password"
        secret.write_text("s3cret-in-a-file\n")
        secret.chmod(0o600)
        cfg = replace(_etcd_cfg([server.endpoint]), etcd_user="root",
                      etcd_password_file=str(secret))
        with open_store(cfg) as store:
            store.publish(make_info(), b"authenticated")
            assert store.manifest("imagenet", 1) == b"authenticated"
        secret.chmod(0o644)
        with pytest.raises(ConfigError, match=f"store.etcd_password_file {secret}: mode 0644"):
            open_store(cfg)


def test_etcd_mutual_tls(tmp_path: Path) -> None:
    ca = TestCA.create(tmp_path / "tls")
    with EtcdServer(name="kst-tls", tls=ca) as server:
        assert server.endpoint.startswith("https://")
        cfg = replace(_etcd_cfg([server.endpoint]), etcd_ca_cert=str(ca.ca),
                      etcd_cert=str(ca.cert), etcd_key=str(ca.key))
        with open_store(cfg) as store:
            store.publish(make_info(), b"over tls")
            assert store.manifest("imagenet", 1) == b"over tls"
        with open_store(replace(cfg, etcd_cert="", etcd_key="", etcd_timeout=0.3)) as store:
            with pytest.raises(StoreError):               # no client certificate: refused
                store.datasets()
        with pytest.raises(ConfigError):
            open_store(replace(cfg, etcd_key=""))


# -- paged manifests (manifest/pages.py) -----------------------------------------------

def test_a_paged_manifest_keeps_its_root_in_the_store(store: MetadataStore,
                                                      tmp_path: Path) -> None:
    from kspeedfs.manifest.pages import Root, is_root, read_all, read_table

    pages = tmp_path / "pages"
    store.page_dir, store.paged_above = str(pages), 1000
    raw = b"".join(i.to_bytes(4, "little") for i in range(3 * MiB // 4))
    sealed = store.publish_stream(make_info(), [raw[i:i + 70_000] for i in range(0, len(raw), 70_000)],
                                  len(raw))
    blob = store.manifest("imagenet", sealed.version)
    assert is_root(blob) and len(blob) < 100 and sealed.inflated_size == len(raw)
    root = Root.parse(blob)
    assert read_all(root, read_table(root, [str(pages)]), [str(pages)]) == raw
    small = store.publish_stream(make_info(), [b"x" * 999], 999)       # not past paged_above
    assert not is_root(store.manifest("imagenet", small.version))
    store.remove("imagenet", sealed.version)
    assert store.sweep_pages(grace=0) == root.pages + len(root.tables)
    assert not [p for p in pages.rglob("*") if p.is_file()]


def test_fetch_is_the_record_and_its_blob(store: MetadataStore) -> None:
    first = store.publish(make_info(), b"one")
    second = store.publish(make_info(files=9), b"two")
    assert store.fetch("imagenet") == (second, b"two")
    assert store.fetch("imagenet", first.version) == (first, b"one")
    with pytest.raises(DatasetNotFound):
        store.fetch("imagenet", 99)
