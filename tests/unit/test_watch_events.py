"""The parsers of a watch's events (etcd input, untrusted), fuzzed without a server.

A membership view applies its watch's events instead of listing on every change
(``manifest/store/etcd_client.py`` ``watch_batch``, ``cluster/membership.py``
``apply_events``). Random ``WatchResponse`` s (keys inside and outside the prefix, not
UTF-8, unknown event types, revisions before the watch's start, compactions) give a
batch to apply or one that asks for a listing, never an exception; applied, the values
pass the same record checks as a listing's (``NodeRecord.verified``): only a record
signed for its own key survives. Hypothesis, a bounded budget (~300 examples).
"""
from __future__ import annotations

from etcd3 import etcdrpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kspeedfs.cluster.membership import NodeRecord, apply_events
from kspeedfs.config import StoreConfig
from kspeedfs.manifest.store.etcd import EtcdStore
from kspeedfs.manifest.store.etcd_client import watch_batch

SECRET = b"0123456789abcdef-test-secret"
PREFIX = "/t/nodes/"
START = 100
FUZZ = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])

keys = st.one_of(st.binary(max_size=12).map(lambda b: PREFIX.encode() + b),
                 st.binary(max_size=20), st.sampled_from([b"/t/nodes/n1", b"/t/nodes/n2"]))
events = st.tuples(keys, st.binary(max_size=200), st.integers(0, 3), st.integers(0, 2 * START))


def _store() -> EtcdStore:
    """An etcd store that never connects (parsing and signing only)."""
    return EtcdStore(StoreConfig(backend="etcd", etcd=["http://127.0.0.1:9"], etcd_prefix="/t/"),
                     SECRET)


def _node(name: str) -> NodeRecord:
    return NodeRecord(name, "host1", ["10.0.0.1"], 7470, 7471, 1 << 30, 256, 4 << 20, 512)


def _response(evs: list[tuple[bytes, bytes, int, int]], compact: int) -> object:
    rs = etcdrpc.WatchResponse(compact_revision=compact)
    for key, value, kind, rev in evs:
        ev = rs.events.add()
        ev.type = kind
        ev.kv.key, ev.kv.value, ev.kv.mod_revision = key, value, rev
    return rs


def test_a_batch_carries_puts_and_deletes_in_order() -> None:
    rs = _response([(b"/t/nodes/a", b"1", 0, 101), (b"/t/nodes/a", b"", 1, 102)], 0)
    batch = watch_batch(rs, PREFIX.encode(), START)
    assert not batch.relist and batch.revision == 102
    assert batch.events == [(b"/t/nodes/a", b"1"), (b"/t/nodes/a", None)]
    assert apply_events({"a": b"0", "b": b"2"}, PREFIX, batch.events) == {"b": b"2"}


def test_surprises_ask_for_a_listing() -> None:
    for evs, compact in (([], 50),                                     # compacted
                         ([(b"/t/other/a", b"1", 0, 101)], 0),          # outside the prefix
                         ([(b"/t/nodes/a", b"1", 2, 101)], 0),          # unknown type
                         ([(b"/t/nodes/a", b"1", 0, 99)], 0)):          # before the start
        assert watch_batch(_response(evs, compact), PREFIX.encode(), START).relist


@FUZZ
@given(st.lists(events, max_size=6), st.integers(0, 2).map(lambda c: c * START),
       st.dictionaries(st.text(max_size=6), st.binary(max_size=50), max_size=3), st.booleans())
def test_fuzz_watch_events_reach_the_record_checks(
        evs: list[tuple[bytes, bytes, int, int]], compact: int, values: dict[str, bytes],
        signed: bool) -> None:
    store = _store()
    if signed:         # a genuine record among the noise, and one moved to another key
        evs = [*evs, (b"/t/nodes/n1", _node("n1").signed(store), 0, START + 1),
               (b"/t/nodes/n2", _node("n1").signed(store), 0, START + 1)]
    batch = watch_batch(_response(evs, compact), PREFIX.encode(), START)
    if batch.relist:
        return
    assert all(k.startswith(PREFIX.encode()) for k, _ in batch.events)
    assert batch.revision >= START or not batch.events
    applied = apply_events(values, PREFIX, batch.events)
    assert all(isinstance(k, str) and isinstance(v, bytes) for k, v in applied.items())
    kept = NodeRecord.verified(store, applied)
    assert set(kept) <= {"n1"}
    assert set(kept) == ({"n1"} if signed else set())
