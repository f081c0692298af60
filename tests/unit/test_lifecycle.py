"""The dataset lifecycle's pure parts (``cluster/lifecycle.py``): the capacity plan, the
version rule, and the parsers of the ``preload/`` and ``mounts/`` records and of the
counts nodes publish, fuzzed (they read what etcd holds: any JSON, or any bytes, gives a
record or ``ValueError``; a count, an int)."""
from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kspeedfs.cli import stats as stats_cli
from kspeedfs.cli import status
from kspeedfs.cluster.lifecycle import (
    Holding,
    MountRecord,
    PreloadRequest,
    collectable,
    count,
    node_stats,
    plan,
)

SLOT = 256 << 10


def test_a_dataset_that_fits_beside_the_others_fits() -> None:
    p = plan(Holding("b", 1, 40, 0), [Holding("a", 1, 50, 0)], 2, SLOT, memory_slots=192,
             disk_bytes=0)
    assert p.fits and p.in_memory and p.need == 80 and p.used == 100
    assert "fits in memory" in p.describe()


def test_the_ssd_tier_counts_but_is_named() -> None:
    p = plan(Holding("b", 1, 60, 0), [Holding("a", 1, 50, 0)], 2, SLOT, memory_slots=192,
             disk_bytes=40 * SLOT)
    assert p.fits and not p.in_memory and "partly on the SSD tier" in p.describe()


def test_equal_priority_is_never_evicted() -> None:
    p = plan(Holding("b", 1, 60, 0), [Holding("a", 1, 50, 0)], 2, SLOT, 192, 0)
    assert not p.fits and p.evict == []
    assert "does not fit" in p.describe() and "a@1" in p.describe()


def test_higher_priority_names_the_fewest_lowest_victims() -> None:
    held = [Holding("x", 1, 30, 3, requested=1), Holding("y", 1, 30, 1, requested=2),
            Holding("z", 1, 30, 1, requested=1)]
    p = plan(Holding("new", 1, 50, 5), held, 2, SLOT, 192, 0)
    assert not p.fits and [h.tag for h in p.evict] == ["z@1", "y@1"]   # lowest, oldest first
    assert "--evict" in p.describe()
    # a new version of the same dataset replaces the old one, it is not counted twice
    assert plan(Holding("x", 2, 36, 0), held, 2, SLOT, 192, 0).fits        # 72 + 120 slots


def test_the_version_rule_keeps_the_newest_and_the_pinned() -> None:
    assert collectable([1, 2, 3, 4, 5], 2, set()) == [1, 2, 3]
    assert collectable([1, 2, 3, 4, 5], 2, {1, 3}) == [2]
    assert collectable([1, 2], 5, set()) == []
    assert collectable([1, 2, 3], 0, set()) == []          # 0: keep every version


def test_old_preload_records_still_parse() -> None:
    r = PreloadRequest.from_json(b'{"version": 3, "requested": 1700000000.5}')
    assert (r.version, r.priority, r.release) == (3, 0, "manual")
    assert PreloadRequest.from_json(r.to_json()) == r


def test_a_mount_record_round_trips() -> None:
    m = MountRecord("imgs", 2, "host", "/mnt/x", 123, 5.0, True, {"reads": 7})
    assert MountRecord.from_json(m.to_json()) == m
    assert m.key("/p/") == "/p/mounts/imgs@2/host:123"


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=12), inner, max_size=6), max_leaves=20)
FIELDS = st.fixed_dictionaries({}, optional={
    "version": st.integers() | JSON, "requested": st.floats() | JSON, "priority": st.integers() | JSON,
    "release": st.sampled_from(["manual", "last-mount", "x"]) | JSON,
    "dataset": st.text(max_size=300) | JSON, "host": st.text(max_size=8) | JSON,
    "mountpoint": st.text(max_size=8) | JSON, "pid": st.integers() | JSON,
    "started": st.floats() | JSON, "unload_on_exit": st.booleans() | JSON,
    "reads": st.dictionaries(st.text(max_size=8), st.integers()) | JSON})


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(FIELDS, JSON))
def test_parsers_take_any_json(obj: object) -> None:
    raw = json.dumps(obj).encode()
    for parse in (PreloadRequest.from_json, MountRecord.from_json):
        try:
            rec = parse(raw)
        except ValueError:
            continue
        assert type(rec).from_json(rec.to_json()) == rec


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_parsers_take_any_bytes(raw: bytes) -> None:
    for parse in (PreloadRequest.from_json, MountRecord.from_json):
        try:
            parse(raw)
        except ValueError:
            pass


def test_deep_nesting_is_a_value_error() -> None:
    for parse in (PreloadRequest.from_json, MountRecord.from_json):
        try:
            parse(b"[" * 100_000)
        except ValueError:
            continue
        raise AssertionError("accepted")


COUNTS = ("owned", "cached", "refused")


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(record=st.one_of(JSON, st.fixed_dictionaries(
    {}, optional={n: st.integers() | JSON for n in COUNTS})), name=st.sampled_from(COUNTS))
def test_a_published_count_is_a_non_negative_int_whatever_etcd_holds(record, name) -> None:
    """``count`` reads what nodes published (progress, stats: any JSON): the value when
    it is a non-negative int (not a bool), else 0, and never an exception."""
    got = count(record, name)
    value = record.get(name) if isinstance(record, dict) else None
    ok = type(value) is int and value >= 0
    assert type(got) is int and got == (value if ok else 0)
    assert count({name: 7}, name) == 7 and count({name: True}, name) == 0
    assert count({name: -1}, name) == 0 and count([name], name) == 0


def _near(inner: st.SearchStrategy, keys: tuple[str, ...]) -> st.SearchStrategy:
    """Objects with some of ``keys`` (values from ``inner``), or any JSON."""
    return st.fixed_dictionaries({}, optional={k: inner for k in keys}) | JSON


PEER = _near(JSON | st.lists(st.integers(-2, 9), max_size=12),
             ("reads", "counts", "suspected", "state", "paths", "reads_failed_over"))
STATS = st.fixed_dictionaries({}, optional={
    "node": JSON, "time": st.floats() | st.integers() | JSON,
    "arena": _near(st.integers() | JSON, ("used_bytes", "used_slots", "refused", "capacity")),
    "counters": _near(st.integers() | JSON, ("source_loads", "unloaded", "peer_bytes")),
    "disk": _near(st.integers() | JSON, ("used", "capacity")),
    "progress": st.dictionaries(st.text(max_size=8), _near(st.integers() | JSON, COUNTS),
                                max_size=3) | JSON,
    "reads": _near(JSON | st.dictionaries(st.text(max_size=4), PEER, max_size=3)
                   | st.lists(st.floats() | JSON, max_size=12),
                   ("peer_latency", "peer_latency_buckets_ms", "peer_hedges")),
    "endpoint": _near(JSON | st.dictionaries(st.text(max_size=4), PEER, max_size=3)
                      | st.lists(st.text(max_size=4) | JSON, max_size=3), ("nics", "peers")),
}) | JSON
REC = {"nics": ["eth0", "eth1"], "capacity": 1 << 30, "started": 1000.0}


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=STATS)
def test_a_stats_record_of_any_json_is_read_in_the_shape_the_cli_prints(raw) -> None:
    """``node_stats`` reads a node's ``stats/`` record (any JSON) into the shape that
    ``status`` and ``stats --cluster`` print, never raising; what they print of it is
    lines of text whatever the record held (one malformed record used to end
    ``kspeedfs status`` with an internal error)."""
    s = node_stats(raw)
    assert json.loads(json.dumps(s, allow_nan=False)) == s
    for section in ("arena", "counters", "disk"):
        assert all(type(v) is int and v >= 0 for v in s[section].values())
    for p in s["reads"]["peer_latency"].values():
        assert all(type(c) is int and c >= 0 for c in p["counts"])
    for p in s["endpoint"]["peers"].values():
        assert isinstance(p["state"], str) and all(isinstance(v, str) for v in p["paths"].values())
    lines = status.node_lines("n1", REC, s, 2000.0)
    assert lines and all(isinstance(x, str) for x in lines) and lines[0].startswith("  n1: ")
    stats_cli.node_rates(s, s)
    stats_cli.node_state(s, 1 << 30)


def test_a_well_formed_stats_record_is_printed_as_published() -> None:
    raw = {"node": "n1", "time": 1999.5,
           "arena": {"used_bytes": 3 << 30, "used_slots": 12, "refused": 4, "evictions": 2},
           "counters": {"source_loads": 5, "peer_loads": 6, "unloaded": 7},
           "disk": {"used": 1 << 30, "capacity": 4 << 30}, "progress": {"d@1": {"owned": 3}},
           "reads": {"peer_hedges": 2, "peer_hedges_won": 1, "peer_longest_wait_ms": 12.5,
                     "peer_latency_buckets_ms": [1, 5, 10],
                     "peer_latency": {"n2": {"reads": 10, "counts": [0, 9, 1, 0],
                                             "suspected": True}}},
           "endpoint": {"nics": ["eth0"], "peers": {"n2": {
               "state": "UP", "paths": {"eth0->eth0": "UP"}, "reads_failed_over": 3}}}}
    s = node_stats(raw)
    assert s["arena"] == raw["arena"] and s["progress"] == raw["progress"]
    assert s["reads"]["peer_latency"]["n2"] == raw["reads"]["peer_latency"]["n2"]
    lines = status.node_lines("n1", REC, s, 2000.0)
    assert lines[0] == ("  n1: NICs eth0, eth1; cache 3.00/1.00 GiB (12 chunks); "
                        "SSD 1.00/4.00 GiB; up 1000s")
    assert "7 dropped by unloads; 4 not stored" in lines[1]
    assert lines[2] == ("    peer READs: hedged 2 (won 1), longest wait 12.5 ms; "
                        "n2 p99 ≤ 10 ms (suspected)")
    assert lines[3] == "    to n2: UP (eth0->eth0 UP); reads failed over 3"
    # a malformed part costs that part only
    raw["reads"]["peer_latency_buckets_ms"] = "x"
    raw["arena"]["used_slots"] = "12"
    lines = status.node_lines("n1", REC, node_stats(raw), 2000.0)
    assert "(0 chunks)" in lines[0] and lines[2].endswith("n2 p99 ≤ - (suspected)")
