"""A view lists its prefix once, then applies its watch's events; it lists again only
when etcd compacted the watch's revision or went back in time.

Listing on every resync (10 s), then on every change, was the cluster's largest etcd
load at scale: every view read every node record, N × N, three times with every etcd
member an endpoint (``bench.cluster_sim``, docs/design.md "1,000 nodes, simulated"). A
quiet watch from the listing's revision misses nothing, so a quiet resync costs one
one-key read, and a change is one event per view."""
from __future__ import annotations

import os
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from kspeedfs.cluster.membership import PrefixView
from kspeedfs.config import StoreConfig
from kspeedfs.manifest.store.etcd import EtcdStore
from tests.fixtures.etcd import EtcdServer


class Counting(EtcdStore):
    lists = 0

    def call(self, op: Any, budget: float | None = None) -> Any:
        self.lists += 1                  # a view's only call is its listing (watches and
        return super().call(op, budget)  # etcd's revision go through the client)

    def race(self, op: Any, budget: float | None = None) -> Any:
        self.lists += 1                  # (raced, before)
        return super().race(op, budget)


@pytest.fixture
def store(etcd_server: EtcdServer) -> Iterator[Counting]:
    cfg = StoreConfig(backend="etcd", etcd=[etcd_server.endpoint],
                      etcd_prefix=f"/ksf-{uuid.uuid4().hex[:12]}/")
    s = Counting(cfg, os.urandom(32))
    yield s
    s.close()


def _put(store: EtcdStore, key: str, value: bytes = b"x") -> None:
    store.client.call(lambda c: c.put(store.prefix + "nodes/" + key, value))


def _delete(store: EtcdStore, key: str) -> None:
    store.client.call(lambda c: c.delete(store.prefix + "nodes/" + key))


async def test_quiet_resyncs_list_nothing_and_changes_still_arrive(store: Counting) -> None:
    await trio.to_thread.run_sync(_put, store, "a")
    view = PrefixView(store, "nodes/", resync=0.2)
    async with trio.open_nursery() as n:
        await n.start(view.run)
        assert set(view.values) == {"a"} and store.lists == 1
        await trio.sleep(1.2)                       # ~6 resyncs, nothing changed
        assert store.lists == 1
        changed = view.changed
        await trio.to_thread.run_sync(_put, store, "b")
        with trio.fail_after(5):
            await changed.wait()
        assert set(view.values) == {"a", "b"} and store.lists == 1
        n.cancel_scope.cancel()


async def test_changes_are_applied_from_events_without_listing(store: Counting) -> None:
    await trio.to_thread.run_sync(_put, store, "a")
    view = PrefixView(store, "nodes/", resync=5.0)
    steps = [(_put, ("b", b"1")), (_put, ("a", b"2")), (_delete, ("b",)), (_put, ("c", b"3"))]
    expected = [{"a": b"x", "b": b"1"}, {"a": b"2", "b": b"1"}, {"a": b"2"}, {"a": b"2", "c": b"3"}]
    async with trio.open_nursery() as n:
        await n.start(view.run)
        for (op, args), want in zip(steps, expected, strict=True):
            changed = view.changed
            await trio.to_thread.run_sync(op, store, *args)
            with trio.fail_after(5):
                await changed.wait()
            assert view.values == want
        n.cancel_scope.cancel()
    assert store.lists == 1


@asynccontextmanager
async def _listed(store: Counting) -> AsyncIterator[PrefixView]:
    """A view of ``nodes/`` holding "a", listed once, resyncing every 0.2 s."""
    await trio.to_thread.run_sync(_put, store, "a")
    view = PrefixView(store, "nodes/", resync=0.2)
    async with trio.open_nursery() as n:
        await n.start(view.run)
        assert store.lists == 1
        yield view
        n.cancel_scope.cancel()


async def test_a_compacted_watch_lists_again(store: Counting) -> None:
    def compact_past_the_view() -> None:
        for _ in range(2):               # the view watches from its listing's rev + 1
            store.client.call(lambda c: c.put(store.prefix + "elsewhere", b"x"))
        rev = store.revision()
        store.client.call(lambda c: c.compact(rev))

    async with _listed(store) as view:
        await trio.to_thread.run_sync(compact_past_the_view)
        with trio.fail_after(5):
            while store.lists < 2:
                await trio.sleep(0.05)
        assert set(view.values) == {"a"}


async def test_etcd_going_back_in_time_lists_again(store: Counting) -> None:
    async with _listed(store):
        store.revision = lambda: 0                  # type: ignore[method-assign]  # restored
        await trio.sleep(0.7)
        assert store.lists >= 2


def _watch_streams(server: EtcdServer) -> float:
    with urllib.request.urlopen(f"{server.endpoint}/metrics", timeout=5) as r:
        return sum(float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                   if line.startswith('grpc_server_started_total{grpc_method="Watch",'
                                      'grpc_service="etcdserverpb.Watch"'))


async def test_changes_arrive_on_one_watch_stream(etcd_server_private: EtcdServer) -> None:
    """A view's watch stays open across changes until its resync deadline: 4 changes
    cost no new stream (a stream per change before)."""
    cfg = StoreConfig(backend="etcd", etcd=[etcd_server_private.endpoint],
                      etcd_prefix=f"/ksf-{uuid.uuid4().hex[:12]}/")
    with Counting(cfg, os.urandom(32)) as store:
        view = PrefixView(store, "nodes/", resync=30.0)
        async with trio.open_nursery() as n:
            await n.start(view.run)
            await trio.sleep(0.3)                   # the first watch is open
            streams = _watch_streams(etcd_server_private)
            for i in range(4):
                changed = view.changed
                await trio.to_thread.run_sync(_put, store, f"k{i}")
                with trio.fail_after(5):
                    await changed.wait()
            assert set(view.values) == {"k0", "k1", "k2", "k3"}
            assert _watch_streams(etcd_server_private) == streams
            n.cancel_scope.cancel()
        assert store.lists == 1
