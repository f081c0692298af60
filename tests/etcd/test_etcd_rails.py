"""The control plane across rails, against a real etcd: a silent endpoint (a cut rail)
costs no lease refresh, watches work with auth over http, TLS failures are named, a
failed channel is never closed under a concurrent call, and a node whose record
disappears keeps its placement for ``cluster.leave_grace``.

A "silent" endpoint is a loopback listener that accepts TCP and never answers (gRPC
gives up waiting for the server's HTTP/2 settings within ~0.1 s and backs off). A rail
that drops every packet is the netns cluster test's (tests/cluster/test_cluster.py). About 25 s.
"""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import trio

from kspeedfs.cluster.membership import Membership, NodeRecord, Registration
from kspeedfs.config import StoreConfig
from kspeedfs.errors import StoreError, StoreUnavailable
from kspeedfs.manifest.store.etcd import EtcdStore
from tests.fixtures.etcd import EtcdServer, TestCA, free_port


@pytest.fixture
def silent() -> Iterator[str]:
    """An endpoint that accepts connections and never says a word."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    try:
        yield f"http://127.0.0.1:{s.getsockname()[1]}"
    finally:
        s.close()


def _cfg(endpoints: list[str], **kw: object) -> StoreConfig:
    return StoreConfig(backend="etcd", etcd=endpoints, etcd_prefix=f"/kst-{uuid.uuid4().hex[:12]}/",
                       **kw)  # type: ignore[arg-type]


def test_race_answers_at_once_while_a_rail_is_silent(etcd_server: EtcdServer, silent: str) -> None:
    with EtcdStore(_cfg([silent, etcd_server.endpoint], etcd_attempt_timeout=1.0)) as store:
        t0 = time.monotonic()
        for _ in range(5):
            store.race(lambda c: c.get("x"))
        raced = time.monotonic() - t0
        assert raced < 0.5, f"5 raced gets took {raced:.2f}s with one endpoint silent"


def test_call_fails_over_after_one_attempt_timeout(etcd_server: EtcdServer, silent: str) -> None:
    """The first request to a silent preferred endpoint costs at most one attempt timeout
    (not store.etcd_timeout); the next ones go to the endpoint that answered."""
    with EtcdStore(_cfg([silent, etcd_server.endpoint], etcd_attempt_timeout=0.5,
                        etcd_timeout=5.0)) as store:
        t0 = time.monotonic()
        store.call(lambda c: c.get("x"))
        first = time.monotonic() - t0
        t0 = time.monotonic()
        store.call(lambda c: c.get("x"))
        second = time.monotonic() - t0
    assert first < 1.5, first
    assert second < 0.2, second


def test_everything_silent_is_unavailable_within_the_budget(silent: str) -> None:
    with EtcdStore(_cfg([silent], etcd_attempt_timeout=0.3, etcd_timeout=1.0)) as store:
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable):
            store.race(lambda c: c.get("x"), budget=1.0)
        with pytest.raises(StoreUnavailable):
            store.call(lambda c: c.get("x"))
    assert time.monotonic() - t0 < 5


def test_an_unreachable_endpoint_is_logged_once_until_it_answers(
        caplog: pytest.LogCaptureFixture) -> None:
    """Every endpoint down (an outage): calls fail round after round, and "unreachable,
    trying the next endpoint" is logged once, not each round of each call (each mount
    logged it 1-2 times a second through an outage)."""
    caplog.set_level(logging.INFO, logger="kspeedfs.manifest.store.etcd_client")
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    with EtcdStore(_cfg(dead, etcd_attempt_timeout=0.2, etcd_timeout=1.0)) as store:
        for _ in range(3):
            with pytest.raises(StoreUnavailable):
                store.call(lambda c: c.get("x"))
    lines = [r for r in caplog.records if "trying the next endpoint" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]


async def test_lease_survives_a_silent_rail(etcd_server: EtcdServer, silent: str) -> None:
    """A lease of 2 s refreshed through [silent, live] for 4 TTLs never lapses. (Before:
    each refresh waited the whole etcd_timeout on the silent endpoint, longer than the
    TTL, and the record vanished.)"""
    with EtcdStore(_cfg([silent, etcd_server.endpoint], etcd_attempt_timeout=1.0)) as store:
        reg = Registration(store, ttl=2)
        key = store.prefix + "nodes/n1"
        await trio.to_thread.run_sync(reg.put, key, b"{}")
        async with trio.open_nursery() as n:
            n.start_soon(reg.run)
            for _ in range(16):
                await trio.sleep(0.5)
                value, _ = await trio.to_thread.run_sync(store.call, lambda c: c.get(key))
                assert value == b"{}", "the lease lapsed while one endpoint was silent"
            n.cancel_scope.cancel()


def test_watch_works_with_auth_over_http() -> None:
    """etcd3's watcher kept the call credentials grpcio refuses on plain http: every
    watch failed UNAUTHENTICATED and views fell back to re-listing."""
    with EtcdServer(name="kst-auth-watch") as server:
        for args in (["user", "add", "root:s3cret"], ["auth", "enable"]):
            subprocess.run(["etcdctl", "--endpoints", server.endpoint, *args], check=True,
                           capture_output=True, env={**os.environ, "ETCDCTL_API": "3"})
        cfg = replace(_cfg([server.endpoint]), etcd_user="root", etcd_password="s3cret")
        with EtcdStore(cfg) as store:
            rev = store.call(lambda c: c.get_prefix_response(store.prefix)).header.revision
            threading.Timer(0.3, lambda: store.call(lambda c: c.put(store.prefix + "k", "v"))).start()
            t0 = time.monotonic()
            store.watch_prefix(store.prefix, rev + 1, 5.0)
            assert time.monotonic() - t0 < 3, "the watch did not see the put"
            assert store.authenticated


def test_watch_sees_a_change_and_ends_on_its_deadline(etcd_server: EtcdServer,
                                                     silent: str) -> None:
    """A bounded watch returns on a change, returns after its timeout without one, costs
    one attempt timeout on a silent endpoint, and leaves no thread behind (etcd3's own
    watcher kept a request-iterator thread per channel blocked inside gRPC)."""
    with EtcdStore(_cfg([silent, etcd_server.endpoint], etcd_attempt_timeout=0.5)) as store:
        rev = store.call(lambda c: c.get_prefix_response(store.prefix)).header.revision
        threading.Timer(0.3, lambda: store.call(lambda c: c.put(store.prefix + "k", "v"))).start()
        t0 = time.monotonic()
        store.watch_prefix(store.prefix, rev + 1, 5.0)        # silent first: 0.5 s, then live
        assert time.monotonic() - t0 < 2.0, "the watch did not see the put"
        threads = threading.active_count()
        for _ in range(20):
            t0 = time.monotonic()
            store.watch_prefix(store.prefix + "none/", rev + 1, 0.1)
            assert time.monotonic() - t0 < 0.6, "a watch outlived its timeout"
        time.sleep(0.2)
        assert threading.active_count() <= threads, "watches left threads behind"


def test_etcd_restarts_under_watches_and_closes(etcd_server_private: EtcdServer) -> None:
    """Watches running while etcd restarts (their channels fail, are retired and closed)
    and while the store closes: every error is a StoreError and the process survives.
    Before: a channel closed after an etcd restart crashed nodes inside gRPC."""
    server = etcd_server_private
    bad: list[BaseException] = []
    stop = threading.Event()
    cfg = _cfg([server.endpoint, f"http://127.0.0.1:{free_port()}"],
               etcd_attempt_timeout=0.5, etcd_timeout=2.0)
    for round_ in range(3):
        with EtcdStore(cfg) as store:
            def watch() -> None:
                while not stop.is_set():
                    try:
                        store.watch_prefix(store.prefix, 1, 0.3)
                    except StoreError:
                        pass
                    except BaseException as e:      # noqa: BLE001 - what the test looks for
                        bad.append(e)
            threads = [threading.Thread(target=watch) for _ in range(4)]
            for t in threads:
                t.start()
            time.sleep(0.5)
            server.restart()
            time.sleep(1.0)
            if round_ == 2:
                stop.set()
        # (rounds 0, 1: the store closes under running watches)
        stop.set()
        for t in threads:
            t.join(10)
        stop.clear()
    assert bad == [], bad[:3]


def test_tls_failure_is_named_tls(tmp_path: Path) -> None:
    ca, other = TestCA.create(tmp_path / "ca"), TestCA.create(tmp_path / "other")
    with EtcdServer(name="kst-tls-bad", tls=ca) as server:
        cfg = replace(_cfg([server.endpoint]), etcd_ca_cert=str(other.ca),
                      etcd_cert=str(other.cert), etcd_key=str(other.key), etcd_timeout=3.0)
        with EtcdStore(cfg) as store:
            t0 = time.monotonic()
            with pytest.raises(StoreError, match="TLS") as exc:
                store.datasets()
            assert not isinstance(exc.value, StoreUnavailable)
            assert time.monotonic() - t0 < 2.5, "a TLS failure is not an outage to wait out"


def test_no_closed_channel_errors_under_concurrent_use(etcd_server_private: EtcdServer) -> None:
    """Threads share the channels while etcd restarts (channels fail and are replaced):
    every error is a StoreError, none is gRPC's "Cannot invoke RPC on closed channel"."""
    server = etcd_server_private
    bad: list[BaseException] = []
    stop = threading.Event()
    with EtcdStore(_cfg([server.endpoint, f"http://127.0.0.1:{free_port()}"],
                        etcd_attempt_timeout=0.5, etcd_timeout=2.0)) as store:
        def hammer(raced: bool) -> None:
            while not stop.is_set():
                try:
                    (store.race if raced else store.call)(lambda c: c.get("x"))
                except StoreError:
                    pass
                except BaseException as e:      # noqa: BLE001 - what the test looks for
                    bad.append(e)
        threads = [threading.Thread(target=hammer, args=(i % 2 == 0,)) for i in range(6)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        server.restart()
        time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join(10)
    assert bad == [], bad[:3]


async def test_a_node_back_within_its_grace_keeps_its_placement(etcd_server: EtcdServer) -> None:
    with EtcdStore(_cfg([etcd_server.endpoint]), secret=os.urandom(32)) as store:
        ms = Membership(store, resync=1.0, leave_grace=2.0)
        key = store.prefix + "nodes/n1"
        record = NodeRecord(node="n1", host="h", nics=["127.0.0.1"], port=1, rpc_port=2,
                            capacity=1 << 30, nslots=1, slot_size=1 << 20, nbuckets=1)
        put = lambda: store.call(lambda c: c.put(key, record.signed(store)))   # noqa: E731
        delete = lambda: store.call(lambda c: c.delete(key))              # noqa: E731
        await trio.to_thread.run_sync(put)
        async with trio.open_nursery() as n:
            await n.start(ms.run)
            assert list(ms.nodes) == ["n1"]
            epoch = ms.epoch
            await trio.to_thread.run_sync(delete)
            await trio.sleep(0.7)
            assert list(ms.nodes) == ["n1"] and "n1" in ms.leaving     # held, not gone
            await trio.to_thread.run_sync(put)
            await trio.sleep(0.7)
            assert list(ms.nodes) == ["n1"] and not ms.leaving
            assert ms.epoch == epoch, "a flap within the grace changed placement"
            # gone for longer than the grace: it leaves
            await trio.to_thread.run_sync(delete)
            with trio.fail_after(5):
                await ms.changed.wait()
            assert ms.nodes == {} and ms.members == []
            n.cancel_scope.cancel()
