"""A view's resync renews its watch; it lists the prefix again only when something changed.

Listing on every resync (10 s) was the cluster's largest etcd load at scale: every view
read every node record, N × N, three times with every etcd member an endpoint
(``bench.cluster_sim``, docs/design.md "1,000 nodes, simulated"). A quiet watch from the
listing's revision misses nothing, so a quiet resync costs one one-key read."""
from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import trio

from kspeedfs.cluster.membership import PrefixView
from kspeedfs.config import StoreConfig
from kspeedfs.manifest.store.etcd import EtcdStore
from tests.fixtures.etcd import EtcdServer


class Counting(EtcdStore):
    lists = 0

    def race(self, op: Any, budget: float | None = None) -> Any:
        self.lists += 1                  # a view's only race is its listing
        return super().race(op, budget)


@pytest.fixture
def store(etcd_server: EtcdServer) -> Iterator[Counting]:
    cfg = StoreConfig(backend="etcd", etcd=[etcd_server.endpoint],
                      etcd_prefix=f"/ksf-{uuid.uuid4().hex[:12]}/")
    s = Counting(cfg, os.urandom(32))
    yield s
    s.close()


def _put(store: EtcdStore, key: str) -> None:
    store.call(lambda c: c.put(store.prefix + "nodes/" + key, b"x"))


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
        assert set(view.values) == {"a", "b"} and store.lists == 2
        n.cancel_scope.cancel()


async def test_etcd_going_back_in_time_lists_again(store: Counting) -> None:
    await trio.to_thread.run_sync(_put, store, "a")
    view = PrefixView(store, "nodes/", resync=0.2)
    async with trio.open_nursery() as n:
        await n.start(view.run)
        assert store.lists == 1
        store.revision = lambda: 0                  # type: ignore[method-assign]  # restored
        await trio.sleep(0.7)
        assert store.lists >= 2
        n.cancel_scope.cancel()
