"""Keep-alives and puts on the lease go to one etcd member, and fail over to the next.

Raced on every endpoint, with every member of a 3-member etcd an endpoint, etcd applied
each put on the lease three times and received each keep-alive three times
(``bench.cluster_sim``; docs/design.md, "1,000 nodes, simulated"). Sent to one member,
a stopped member costs one attempt timeout, shorter than a refresh period, so the
leases hold. Against a real 3-member etcd on loopback (``tests/fixtures/etcd_cluster.py``),
about 30 s.
"""
from __future__ import annotations

import logging
import os
import signal
import uuid
from collections.abc import Iterator

import pytest
import trio

from kspeedfs.cluster.membership import Registration
from kspeedfs.config import StoreConfig
from kspeedfs.manifest.store.etcd import EtcdStore
from tests.fixtures.etcd import EtcdServer
from tests.fixtures.etcd_cluster import EtcdCluster

TTL = 3                  # s: a refresh every second


@pytest.fixture(scope="module")
def cluster() -> Iterator[EtcdCluster]:
    with EtcdCluster(3) as c:
        yield c


def _store(endpoints: list[str], prefix: str) -> EtcdStore:
    return EtcdStore(StoreConfig(backend="etcd", etcd=endpoints, etcd_prefix=prefix,
                                 etcd_attempt_timeout=0.5), os.urandom(32))


def _counter(cluster: EtcdCluster, prefix: str, label: str = "") -> list[float]:
    """The counter ``prefix`` (with ``label``) of each member."""
    return [sum(v for k, v in cluster.metrics(i).items() if k.startswith(prefix) and label in k)
            for i in range(len(cluster.members))]


def _keepalives(cluster: EtcdCluster) -> float:
    return sum(_counter(cluster, "grpc_server_msg_received_total",
                        'grpc_method="LeaseKeepAlive"'))


def _puts(cluster: EtcdCluster) -> float:
    return max(_counter(cluster, "etcd_mvcc_put_total"))     # what every member applied


async def test_keep_alives_and_lease_puts_reach_one_member(cluster: EtcdCluster) -> None:
    prefix = f"/kst-{uuid.uuid4().hex[:12]}/"
    store = _store(cluster.endpoints, prefix)
    try:
        reg = Registration(store, TTL)
        await trio.to_thread.run_sync(reg.put, prefix + "first", b"v")   # grants the lease
        puts0, alive0 = _puts(cluster), _keepalives(cluster)
        for i in range(10):
            await trio.to_thread.run_sync(reg.put, f"{prefix}k{i}", b"v")
        with trio.move_on_after(3.5):                # refreshes at 0, 1, 2, 3 s
            await reg.run()
        puts, alives = _puts(cluster) - puts0, _keepalives(cluster) - alive0
    finally:
        store.close()
    assert puts == 10, f"10 puts on the lease were applied {puts:g} times"
    assert 3 <= alives <= 5, f"4 refreshes reached etcd as {alives:g} keep-alives"


async def test_registrations_keep_their_leases_with_a_member_stopped(
        cluster: EtcdCluster, caplog: pytest.LogCaptureFixture) -> None:
    """The member every registration sends to (the first endpoint) is SIGSTOPped for
    three TTLs: each refresh fails over within a period, no lease lapses, no key goes."""
    prefix = f"/kst-{uuid.uuid4().hex[:12]}/"
    store = _store(cluster.endpoints, prefix)
    watcher = _store(cluster.endpoints[1:], prefix)
    stopped = cluster.members[0].pid or 0
    keys = [f"{prefix}k{i}" for i in range(5)]
    caplog.set_level(logging.WARNING, "kspeedfs.cluster.membership")
    try:
        regs = [Registration(store, TTL) for _ in keys]
        for reg, key in zip(regs, keys, strict=True):
            await trio.to_thread.run_sync(reg.put, key, b"v")
        leases = [r.lease_id for r in regs]
        async with trio.open_nursery() as n:
            for reg in regs:
                n.start_soon(reg.run)
            os.kill(stopped, signal.SIGSTOP)
            try:
                for _ in range(3 * TTL * 2):
                    await trio.sleep(0.5)
                    # serializable: a follower answers while its stopped leader is replaced
                    resp = await trio.to_thread.run_sync(lambda: watcher.call(
                        lambda c: c.get_prefix_response(prefix, serializable=True)))
                    assert len(resp.kvs) == len(keys), "a key went with its lease"
            finally:
                os.kill(stopped, signal.SIGCONT)
            n.cancel_scope.cancel()
        assert [r.lease_id for r in regs] == leases, "a lease was granted again"
        assert not [r for r in caplog.records if "expired" in r.getMessage()]
    finally:
        store.close()
        watcher.close()


def _streams(cluster: EtcdCluster) -> float:
    return sum(_counter(cluster, "grpc_server_started_total", 'grpc_method="LeaseKeepAlive"'))


async def test_keep_alives_share_one_stream(cluster: EtcdCluster) -> None:
    """5 leases refreshed 4 times each: one LeaseKeepAlive stream, not 20 (etcd3's
    ``refresh_lease`` opens one per keep-alive)."""
    prefix = f"/kst-{uuid.uuid4().hex[:12]}/"
    store = _store(cluster.endpoints, prefix)
    try:
        regs = [Registration(store, TTL) for _ in range(5)]
        for i, reg in enumerate(regs):
            await trio.to_thread.run_sync(reg.put, f"{prefix}k{i}", b"v")
        streams0, alive0 = _streams(cluster), _keepalives(cluster)
        async with trio.open_nursery() as n:
            for reg in regs:
                n.start_soon(reg.run)
            await trio.sleep(3.5)
            n.cancel_scope.cancel()
        streams, alives = _streams(cluster) - streams0, _keepalives(cluster) - alive0
    finally:
        store.close()
    assert alives >= 15, alives
    assert streams == 1, f"{alives:g} keep-alives opened {streams:g} streams"


async def test_a_revoked_lease_is_granted_again(cluster: EtcdCluster) -> None:
    """The stream answers TTL 0 for a lease etcd no longer has: registered again."""
    prefix = f"/kst-{uuid.uuid4().hex[:12]}/"
    store = _store(cluster.endpoints, prefix)
    try:
        reg = Registration(store, TTL)
        await trio.to_thread.run_sync(reg.put, prefix + "k", b"v")
        first = reg.lease_id
        assert first is not None
        await trio.to_thread.run_sync(lambda: store.call(lambda c: c.revoke_lease(first)))
        with trio.move_on_after(0.5):
            await reg.run()
        resp = await trio.to_thread.run_sync(lambda: store.call(lambda c: c.get_response(prefix + "k")))
    finally:
        store.close()
    assert reg.lease_id not in (None, first)
    assert resp.kvs and resp.kvs[0].lease == reg.lease_id


async def test_keep_alives_go_on_after_an_etcd_restart(
        etcd_server_private: EtcdServer, caplog: pytest.LogCaptureFixture) -> None:
    """The stream dies with etcd; the next keep-alive opens another, on a channel that
    was released only after the old stream ended, and the lease holds."""
    prefix = f"/kst-{uuid.uuid4().hex[:12]}/"
    store = _store([etcd_server_private.endpoint], prefix)
    caplog.set_level(logging.WARNING, "kspeedfs.cluster.membership")
    try:
        reg = Registration(store, TTL)
        await trio.to_thread.run_sync(reg.put, prefix + "k", b"v")
        lease = reg.lease_id
        async with trio.open_nursery() as n:
            n.start_soon(reg.run)
            await trio.sleep(1.5)
            await trio.to_thread.run_sync(etcd_server_private.restart)
            await trio.sleep(2 * TTL)
            n.cancel_scope.cancel()
        resp = await trio.to_thread.run_sync(lambda: store.call(lambda c: c.get_response(prefix + "k")))
    finally:
        store.close()
    assert reg.lease_id == lease and resp.kvs and resp.kvs[0].lease == lease
    assert not [r for r in caplog.records if "expired" in r.getMessage()]
