"""Lease keep-alives over one long-lived LeaseKeepAlive stream per endpoint.

etcd3's ``refresh_lease`` opens a new bidirectional stream for every keep-alive (one
request, then a half-close), and a follower forwards each to the leader: a stream set
up and torn down per refresh and per lease (docs/design.md, "1,000 nodes, simulated").
Here every lease of the process shares one stream per endpoint, opened with the raw
stub etcd3 exposes (``etcdrpc.LeaseStub(client.channel)``): a keep-alive is one
request message on it and one response, matched by lease id.

    EtcdClient.keep_alive(lease, budget)
      └─ _call_one(endpoint)           failover, retries, error classes (etcd_client.py)
           └─ KeepAlives.send           the endpoint's stream, opened on first use
                └─ _Stream              request queue → gRPC; a reader thread → waiters

A stream holds its channel like a call does (``_Endpoint.hold``), so the channel is
never closed under it. It ends in one order, whatever ended it (an error read, a
keep-alive unanswered within the attempt timeout, a newer channel, close): the request
iterator returns, the call is cancelled, the waiters get the error, and only then is
the channel released. Why that order: etcd3's own Watcher kept a request-iterator thread
blocked on a queue while its channel was closed after an etcd restart, and that crashed
processes inside gRPC's native code (``etcd_client.py``, ``_close``).
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import etcd3
import etcd3.exceptions as etcd_exc
import grpc
from etcd3 import etcdrpc

from ...tuning import ETCD_KEEPALIVE_ITERATOR_EXIT

log = logging.getLogger(__name__)


class _Stream:
    """One LeaseKeepAlive stream on one gRPC channel.

    Contract: :meth:`send` returns the TTL etcd answered for the lease (0: no such
    lease), raises the stream's gRPC error if it failed, or
    ``etcd3.exceptions.ConnectionTimeoutError`` after ``timeout`` s without an answer
    (the stream is then ended: a silent member). ``release`` runs once, after the
    stream has ended (see the module docstring's order). Thread-safe."""

    def __init__(self, client: etcd3.Etcd3Client, release: Callable[[], None]) -> None:
        self.client = client
        self._release = release
        self._requests: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._waiting: dict[int, list[Future[int]]] = {}     # guarded by _lock
        self._error: BaseException | None = None              # guarded by _lock
        self._iterator_done = threading.Event()
        self._call = etcdrpc.LeaseStub(client.channel).LeaseKeepAlive(
            self._iterate(), credentials=client.call_credentials, metadata=client.metadata)
        self._reader = threading.Thread(target=self._read, name="etcd-keepalive", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        with self._lock:
            return self._error is None

    def send(self, lease_id: int, timeout: float) -> int:
        answer: Future[int] = Future()
        with self._lock:
            if self._error is not None:
                raise self._error
            self._waiting.setdefault(lease_id, []).append(answer)
        self._requests.put(lease_id)
        try:
            return answer.result(timeout)
        except FutureTimeout:
            self.end(etcd_exc.ConnectionTimeoutError("keep-alive not answered in time"))
            raise etcd_exc.ConnectionTimeoutError("keep-alive not answered in time") from None

    def _iterate(self) -> Iterator[Any]:
        try:
            while (lease_id := self._requests.get()) is not None:
                yield etcdrpc.LeaseKeepAliveRequest(ID=lease_id)
        finally:
            self._iterator_done.set()

    def _read(self) -> None:
        error: BaseException = etcd_exc.ConnectionFailedError("keep-alive stream ended")
        try:
            for resp in self._call:
                with self._lock:
                    waiters = self._waiting.pop(resp.ID, [])
                for w in waiters:
                    w.set_result(int(resp.TTL))
        except grpc.RpcError as e:
            error = e
        except Exception as e:                  # noqa: BLE001 - handed to the waiters
            log.exception("reading the keep-alive stream failed")
            error = e
        self.end(error)
        self._requests.put(None)                # the iterator returns ...
        self._iterator_done.wait(ETCD_KEEPALIVE_ITERATOR_EXIT)
        self._release()                         # ... before the channel may close

    def end(self, error: BaseException) -> None:
        """Fail every waiter with ``error`` and stop the call (the reader then releases
        the channel). Idempotent."""
        with self._lock:
            if self._error is None:
                self._error = error
            waiting, self._waiting = self._waiting, {}
        self._requests.put(None)
        self._call.cancel()
        for futures in waiting.values():
            for f in futures:
                f.set_exception(error)


class KeepAlives:
    """This process's keep-alive streams, one per endpoint (keyed by its URL).

    Contract: :meth:`send` runs inside ``EtcdClient._call_one`` (the channel held) and
    returns the TTL etcd answered, or raises what :meth:`EtcdClient._classify` maps (a
    gRPC error, ``ConnectionTimeoutError``); a stream whose channel was replaced is ended
    and a new one opened. :meth:`close` ends them all."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._closed = False

    def send(self, url: str, client: etcd3.Etcd3Client, hold: Callable[[], Callable[[], None]],
             lease_id: int, timeout: float) -> int:
        """A keep-alive for ``lease_id`` on ``url``'s stream over ``client``; ``hold``
        takes the channel for a new stream and returns its release."""
        with self._lock:
            if self._closed:
                raise etcd_exc.ConnectionFailedError("keep-alives closed")
            stream = self._streams.get(url)
            old = None
            if stream is None or stream.client is not client or not stream.alive:
                release = hold()
                try:
                    old, stream = stream, _Stream(client, release)
                except BaseException:
                    release()
                    raise
                self._streams[url] = stream
        if old is not None:
            old.end(etcd_exc.ConnectionFailedError("keep-alive stream replaced"))
        return stream.send(lease_id, timeout)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            streams, self._streams = list(self._streams.values()), {}
        for s in streams:
            s.end(etcd_exc.ConnectionFailedError("keep-alives closed"))
