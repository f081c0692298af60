"""Signed etcd records and the parsers of everything read from etcd, without a server.

The signer (``manifest/store/signature.py``): a record verifies only with the same
cluster secret and at the same key; unsigned, truncated, re-keyed or edited values are
``RecordUnverified``. Then fuzzing (hypothesis, a bounded budget each: ~200-400
examples, a few seconds): the signed-envelope parser, ``DatasetInfo.from_json``, the
etcd store's info-record check, ``NodeRecord.from_json``/``verified`` and the manifest
loader (``inflate`` + ``ManifestIndex``) each return a valid object or raise their
documented exception (``RecordUnverified``/``StoreError``, ``ValueError``,
``ManifestCorrupt``): never ``RecursionError``, ``TypeError``, ``KeyError`` or
``MemoryError``. And the decompression cap: a zlib bomb costs at most its declared size.
"""
from __future__ import annotations

import json
import resource
import zlib
from dataclasses import asdict
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kspeedfs.cluster.membership import NodeRecord
from kspeedfs.config import StoreConfig
from kspeedfs.errors import ConfigError, ManifestCorrupt, RecordUnverified, StoreError
from kspeedfs.manifest.importer import import_tree
from kspeedfs.manifest.index import ManifestIndex, inflate
from kspeedfs.manifest.store import open_store
from kspeedfs.manifest.store.base import DatasetInfo
from kspeedfs.manifest.store.etcd import EtcdStore
from kspeedfs.manifest.store.etcd_parts import PART_SIZE
from kspeedfs.manifest.store.signature import RecordSigner, canonical_json, derive_key

SECRET = b"0123456789abcdef-test-secret"
OTHER = b"0123456789abcdef-other-secret"
FUZZ = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# JSON values of every shape: what an attacker can put in a record
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)


def _store(secret: bytes | None = SECRET) -> EtcdStore:
    """An etcd store that never connects (parsing and signing only)."""
    return EtcdStore(StoreConfig(backend="etcd", etcd=["http://127.0.0.1:9"], etcd_prefix="/t/"),
                     secret)


def _info_record(name: str = "ds", version: int = 3) -> dict[str, Any]:
    blob = zlib.compress(b"x" * 5000)
    info = DatasetInfo(name, 0, 1, 2, 5000, 1, 4 << 20, 0.0, "/data/ds",
                       inflated_size=5000).sealed(version, blob, 1.7e9)
    return {**info.to_json(), "parts": 1, "part_size": PART_SIZE}


def _node(name: str = "n1") -> NodeRecord:
    return NodeRecord(name, "host1", ["10.0.0.1", "10.0.1.1"], 7470, 7471, 1 << 30, 256, 4 << 20, 512)


# -- the signer ----------------------------------------------------------------------------

def test_seal_open_round_trip_and_refusals() -> None:
    s = RecordSigner(SECRET)
    v = s.seal("/p/nodes/a", b'{"x":1}')
    assert v.startswith(b"ksig1 ") and s.open("/p/nodes/a", v) == b'{"x":1}'
    assert s.open_json("/p/nodes/a", v) == {"x": 1}
    refused = [
        b'{"x":1}',                                   # unsigned
        v[:-1] + b"2",                                # payload edited
        v[:10] + v[11:],                              # signature truncated
        RecordSigner(OTHER).seal("/p/nodes/a", b'{"x":1}'),   # another cluster's secret
    ]
    for value in refused:
        with pytest.raises(RecordUnverified):
            s.open("/p/nodes/a", value)
    with pytest.raises(RecordUnverified):              # moved to another key
        s.open("/p/nodes/b", v)
    with pytest.raises(RecordUnverified):              # or another prefix
        s.open("/q/nodes/a", v)


def test_key_is_derived_and_domain_separated() -> None:
    k = derive_key(SECRET)
    assert len(k) == 32 and k != SECRET and SECRET not in k
    assert derive_key(SECRET) == k and derive_key(OTHER) != k


def test_refusal_logged_once_per_value(caplog: pytest.LogCaptureFixture) -> None:
    s = RecordSigner(SECRET)
    for _ in range(5):
        with pytest.raises(RecordUnverified):
            s.open("/p/nodes/once", b"forged")
    with pytest.raises(RecordUnverified):
        s.open("/p/nodes/once", b"forged again")
    lines = [r for r in caplog.records if "/p/nodes/once" in r.getMessage()]
    assert len(lines) == 2, [r.getMessage() for r in lines]


def test_store_without_secret_refuses_datasets() -> None:
    store = _store(None)
    with pytest.raises(ConfigError, match="secret"):
        store.records.verified("/t/datasets/ds/v3/info", b"{}", "ds", 3)
    with pytest.raises(ConfigError, match="secret"):
        _node().signed(store)
    embedded = open_store(StoreConfig(backend="embedded", path="/tmp/kst-never-used"), None)
    embedded.close()                                  # the embedded store needs no secret


# -- fuzzing -----------------------------------------------------------------------------

@FUZZ
@given(st.binary(max_size=300) | st.builds(lambda b: b"ksig1 " + b, st.binary(max_size=120)))
def test_fuzz_envelope_random_bytes(value: bytes) -> None:
    s = RecordSigner(SECRET)
    with pytest.raises(RecordUnverified):
        s.open_json("/p/k", value)


@FUZZ
@given(st.integers(0, 200), st.integers(0, 255))
def test_fuzz_envelope_mutated(pos: int, byte: int) -> None:
    s = RecordSigner(SECRET)
    good = s.seal_json("/p/k", {"a": [1, 2, 3], "b": "x" * 50})
    bad = bytearray(good)
    bad[pos % len(bad)] = byte
    try:
        assert s.open_json("/p/k", bytes(bad)) == {"a": [1, 2, 3], "b": "x" * 50}
        assert bytes(bad) == good                   # only the unchanged value verifies
    except RecordUnverified:
        assert bytes(bad) != good


def test_signed_but_deep_or_huge_payloads() -> None:
    """A member's bug, not an attack, but still no RecursionError / TypeError."""
    s = _store()
    key = "/t/datasets/ds/v3/info"
    for payload in (b"[" * 100_000, b"{\"a\":" * 50_000, b"1" * 5000, b"1e999", b'"\\ud800"', b"\xff\xfe"):
        with pytest.raises(StoreError):
            s.records.verified(key, s.signer.seal(key, payload), "ds", 3)
    with pytest.raises(ValueError):
        NodeRecord.from_json(b"[" * 100_000)


def _mutate_record(base: dict[str, Any], key: str, value: Any, drop: bool) -> dict[str, Any]:
    d = dict(base)
    if drop:
        d.pop(key, None)
    else:
        d[key] = value
    return d


@FUZZ
@given(json_values)
def test_fuzz_dataset_info_any_json(obj: Any) -> None:
    try:
        info = DatasetInfo.from_json(obj)
    except ValueError:
        return
    assert isinstance(info.name, str) and isinstance(info.chunks, int)


@FUZZ
@given(st.sampled_from(sorted(_info_record())), json_values | st.integers(-2**70, 2**70), st.booleans())
def test_fuzz_dataset_info_wrong_fields(key: str, value: Any, drop: bool) -> None:
    """Every field replaced by any JSON value (or dropped), through the etcd store's check
    of a *signed* record: a valid record or StoreError, never another exception."""
    store = _store()
    record = _mutate_record(_info_record(), key, value, drop)
    etcd_key = "/t/datasets/ds/v3/info"
    try:
        # json.dumps, not canonical_json: NaN and Infinity literals reach the parser too
        got = store.records.verified(etcd_key, store.signer.seal(etcd_key, json.dumps(record).encode()),
                                     "ds", 3)
    except StoreError:
        return
    info = DatasetInfo.from_json(got)
    assert info.name == "ds" and info.version == 3 and info.sha256
    assert got["parts"] == -(-info.manifest_size // got["part_size"])


def _node_from(obj: Any) -> NodeRecord | None:
    """``NodeRecord.from_json`` of any JSON value: a record, or None for ValueError."""
    try:
        return NodeRecord.from_json(json.dumps(obj).encode())
    except ValueError:             # not serialisable here, or refused by the parser
        return None


@FUZZ
@given(json_values)
def test_fuzz_node_record_any_json(obj: Any) -> None:
    rec = _node_from(obj)
    assert rec is None or (isinstance(rec.nics, list) and rec.member().weight > 0)


@FUZZ
@given(st.sampled_from(sorted(asdict(_node()))), json_values | st.integers(-2**70, 2**70), st.booleans())
def test_fuzz_node_record_wrong_fields(key: str, value: Any, drop: bool) -> None:
    rec = _node_from(_mutate_record(asdict(_node()), key, value, drop))
    assert rec is None or (all(isinstance(n, str) for n in rec.nics) and 0 <= rec.rpc_port <= 65535)


@FUZZ
@given(st.dictionaries(st.text(max_size=8), st.binary(max_size=200), max_size=4), st.booleans())
def test_fuzz_node_listing_filter(values: dict[str, bytes], add_good: bool) -> None:
    """The membership filter never raises; only a record signed for its own key survives."""
    store = _store()
    if add_good:
        values = {**values, "n1": _node("n1").signed(store)}
        values["n2"] = _node("n1").signed(store)       # n1's record moved to n2: refused
    kept = NodeRecord.verified(store, values)
    assert set(kept) == ({"n1"} if add_good else set())
    for payload in kept.values():
        assert NodeRecord.from_json(payload).node == "n1"


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, int]:
    """A small real manifest blob and its inflated size."""
    root = tmp_path_factory.mktemp("fuzz")
    src = root / "src"
    for i in range(20):
        (src / f"d{i % 3}").mkdir(parents=True, exist_ok=True)
        (src / f"d{i % 3}" / f"f{i}").write_bytes(bytes([i]) * (i * 3000))
    (src / "link").symlink_to("d0/f0")
    store = open_store(StoreConfig(backend="embedded", path=str(root / "store")))
    info = import_tree(src, "fz", store, 64 << 10)
    blob = store.manifest("fz", info.version)
    assert info.inflated_size == len(zlib.decompress(blob))
    ManifestIndex.from_blob(blob, info.inflated_size)
    return blob, info.inflated_size


@FUZZ
@given(st.binary(max_size=400), st.integers(0, 1 << 20) | st.integers(0, (1 << 63) - 1))
def test_fuzz_manifest_random_blob(blob: bytes, declared: int) -> None:
    try:
        ManifestIndex.from_blob(blob, declared)
    except ManifestCorrupt:
        pass


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 1 << 30), st.integers(0, 255)), min_size=1, max_size=6),
       st.booleans(), st.booleans())
def test_fuzz_manifest_mutated(manifest: tuple[bytes, int], edits: list[tuple[int, int]],
                               inflated: bool, declare: bool) -> None:
    """Byte edits of the compressed blob (mostly zlib errors) and of the inflated arrays,
    recompressed (the index parser: header fields, lengths, truncation)."""
    blob, size = manifest
    data = bytearray(zlib.decompress(blob) if inflated else blob)
    for pos, byte in edits:
        data[pos % len(data)] = byte
    if inflated and edits[0][0] % 7 == 0:
        data = data[:edits[0][0] % len(data)]        # truncated too
    out = zlib.compress(bytes(data)) if inflated else bytes(data)
    try:
        ix = ManifestIndex.from_blob(out, len(data) if inflated and declare else (size if declare else 0))
    except ManifestCorrupt:
        return
    assert ix.entries >= 1


def test_inflate_cap_bounds_a_bomb() -> None:
    """256 MiB of zeros in ~256 KiB of zlib, declared as 1 MiB: refused after inflating
    about 1 MiB; peak RSS grows by far less than the bomb."""
    c = zlib.compressobj(9)
    zeros = bytes(1 << 20)
    bomb = b"".join(c.compress(zeros) for _ in range(256)) + c.flush()
    assert len(bomb) < 1 << 20
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ManifestCorrupt, match="past its declared"):
        inflate(bomb, 1 << 20)
    with pytest.raises(ManifestCorrupt, match="inflates to"):
        inflate(zlib.compress(b"abc"), 10)           # shorter than declared
    with pytest.raises(ManifestCorrupt, match="trailing"):
        inflate(zlib.compress(b"abc") + b"junk", 3)
    with pytest.raises(ManifestCorrupt, match="truncated"):
        inflate(zlib.compress(b"abc" * 100)[:-3], 300)
    assert inflate(zlib.compress(b"abc"), 3) == b"abc"
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 64 << 10, f"peak RSS grew {grown_kib} KiB"


def test_canonical_json_is_stable() -> None:
    a = canonical_json({"b": 1, "a": [1.5, "é"]})
    assert a == b'{"a":[1.5,"\\u00e9"],"b":1}'
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})
