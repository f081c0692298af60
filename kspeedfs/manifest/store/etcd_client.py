"""The etcd client of every kspeedfs process: the endpoints (one per rail), their
gRPC channels, failover, and the mapping of client errors.

Endpoints and failure. ``store.etcd`` lists client URLs, one per rail in a cluster (or
etcd members on several networks). Every request to one endpoint has a deadline of
``store.etcd_attempt_timeout`` (1 s), never the whole budget: a request on a cut rail
then costs one attempt, not ``etcd_timeout``. Two ways to send (see "two ways to send"):
``call`` tries the last endpoint that answered, then the others in configured order,
round after round (short sleeps) until ``store.etcd_timeout`` seconds have passed and
every endpoint has been tried, then raises ``StoreUnavailable`` naming the endpoints;
``race`` sends an idempotent request to every endpoint at once and takes the first
answer, as ``rdma/vrdma/dial.py`` dials a peer's NICs (only where latency matters more
than etcd's load: each raced request is served E times, and a put applied E times).
Why a deadline per attempt: with the whole budget per attempt on the first endpoint,
a cut rail held each lease refresh 5 s, longer than the 5 s lease, and a healthy node
left the cluster. The arithmetic is in docs/design.md ("etcd
across rails"). A TLS failure on every endpoint is reported as a TLS error at once.
The retry loop also rides out an etcd restart: gRPC's reconnect backoff is capped at
1 s here (its default grows to 120 s, which would keep a channel failing long after
the server is back). ``store.etcd_user``/``etcd_password`` (or ``_file``) enable etcd auth, over
http too (the token then travels as gRPC metadata only: see ``_connect``), and the
client re-authenticates when etcd says the token expired (simple tokens last 5 min),
watches included; ``https://`` endpoints use TLS with ``store.etcd_ca_cert`` (default:
the system CA bundle) and optionally a client certificate/key for mutual TLS. A gRPC
channel that failed is retired and closed by its last user, never under a concurrent
call; a watch is such a call too, one bounded stream (:func:`watch_once`).

The client. This uses the ``etcd3`` 0.12 gRPC client as Debian ships it
(python3-etcd3 0.12.0-2) with Debian's python3-protobuf 3.21.12 (Python package
version 4.21.12), through the venv's --system-site-packages, and grpcio from PyPI
(``pyproject.toml``), not Debian's python3-grpcio 1.51.1: with that one, a process
whose lease keep-alive or watch streams were open when etcd stopped or came back died
now and then of SIGILL in gRPC's ``channel_spin`` thread (a ``ud2`` in gRPC core's cold
code, where GCC isolates a NULL dereference): a node or a mount gone at an etcd
restart. Measured (3 nodes and 6 mounts with TLS and auth, etcd stopped 4-5 s and
started again, round after round): 1.51.1 lost 3 processes in 11 rounds, grpcio
1.85.4 none in 24. gRPC's Python API is stable across those versions; etcd3's stubs
only call it.
Contrary to what one might assume, Debian did *not* regenerate the ``etcdrpc/*_pb2.py``
stubs: they are the upstream 0.12.0 files from an old protoc (``_b=...``,
``serialized_pb=``, descriptors built by direct ``FieldDescriptor(...)`` calls). What
makes them import is that Debian builds python3-protobuf with the C++ extension and
compiles ``api_version=2`` into ``google.protobuf.internal._api_implementation``, so the
backend is ``cpp`` (Debian ships no ``google._upb``). The cpp backend still accepts
direct descriptor creation when the caller's file name ends in ``_pb2.py``; the upb
backend of the PyPI 4.21+ wheels refuses it ("Descriptors cannot be created
directly", python-etcd3 issues #1957, #2000, #2242, #2709; regenerated stubs were
merged upstream in #1958 but never released). Checked here: ``import etcd3`` under
``-W error`` works with the cpp backend; the same stub copied to a file not named
``*_pb2.py`` fails with that TypeError; ``PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python``
also imports but emits DeprecationWarnings on every descriptor. Consequences: do not
``pip install etcd3`` or ``protobuf`` into the venv (PyPI's protobuf would shadow
Debian's and break the import), and do not set ``PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION``.
The etcd3 import is lazy (``open_store`` imports this module only for backend etcd),
so a broken client never affects the embedded store.

The store (``etcd.py``: datasets and manifests) and membership (``cluster/membership.py``: leases,
watches) send every request through one :class:`EtcdClient`. Lease keep-alives
(:meth:`EtcdClient.keep_alive`) travel on one long-lived stream per endpoint
(``etcd_keepalive.py``), not on a stream per keep-alive as etcd3's ``refresh_lease``.
"""
from __future__ import annotations

import logging
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import etcd3  # (after the package's __init__ set gRPC's fork option)
import etcd3.exceptions as etcd_exc
import etcd3.utils
import grpc
from etcd3 import etcdrpc

from ...config import StoreConfig
from ...errors import ConfigError, StoreError, StoreUnavailable
from ...tuning import ETCD_MIN_CHANNEL_AGE
from .etcd_keepalive import KeepAlives

log = logging.getLogger(__name__)

T = TypeVar("T")

_SYSTEM_CA = "/etc/ssl/certs/ca-certificates.crt"
_GRPC_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", 16 << 20),
]
_UNREACHABLE = (etcd_exc.ConnectionFailedError, etcd_exc.ConnectionTimeoutError)
_UNREACHABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_DIAL_BACKOFF_MIN, _DIAL_BACKOFF_MAX = 0.25, 4.0    # s, after a failed dial (_Endpoint._dial)
_PUT, _DELETE = 0, 1                                 # mvccpb.Event.EventType


class _Endpoint:
    """One client URL, parsed, with the gRPC client every thread shares for it.

    A client that failed is *retired*, never closed under a concurrent user: it is closed
    when the last call that holds it returns. (Closing a shared channel while another
    thread used it raised ``ValueError: Cannot invoke RPC on closed channel!`` there.)
    ``lock`` is this endpoint's own and guards ``client``, ``_users`` and ``_retired``:
    dialling a dead endpoint (at most one attempt timeout, when auth is on) never holds
    up a call to a live one."""

    def __init__(self, url: str) -> None:
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ConfigError(f"store.etcd: {url!r} is not http[s]://host[:port]")
        self.url = url.rstrip("/")
        self.host = u.hostname
        self.port = u.port or 2379
        self.tls = u.scheme == "https"
        self.lock = threading.Lock()
        self.client: etcd3.Etcd3Client | None = None   # protected by lock
        self._born = 0.0                                   # when ``client`` was dialled
        self._next_dial = 0.0                              # no dial before (after a failed one)
        self._dial_backoff = _DIAL_BACKOFF_MIN
        self._dial_error: _Unreachable | None = None
        self._users: dict[int, int] = {}                  # id(client) -> calls using it
        self._retired: dict[int, etcd3.Etcd3Client] = {}  # failed, closed by the last user

    @contextmanager
    def using(self, connect: Callable[[_Endpoint], etcd3.Etcd3Client]) -> Iterator[etcd3.Etcd3Client]:
        """The current client (made by ``connect`` if there is none), held for the call."""
        with self.lock:
            if self.client is None:
                self.client = self._dial(connect)
            client = self.client
            self._users[id(client)] = self._users.get(id(client), 0) + 1
        try:
            yield client
        finally:
            self._release(client)

    def hold(self, client: etcd3.Etcd3Client) -> Callable[[], None]:
        """One more user of ``client``, which the caller holds already (inside
        :meth:`using`), until the returned function is called: a stream that outlives
        the call that opened it (``etcd_keepalive.py``)."""
        with self.lock:
            self._users[id(client)] += 1
        return lambda: self._release(client)

    def _release(self, client: etcd3.Etcd3Client) -> None:
        with self.lock:
            left = self._users.pop(id(client)) - 1
            if left:
                self._users[id(client)] = left
            done = None if left else self._retired.pop(id(client), None)
        if done is not None:
            _close(done)

    def _dial(self, connect: Callable[[_Endpoint], etcd3.Etcd3Client]) -> etcd3.Etcd3Client:
        """``connect``, unless the last dial failed less than a backoff ago (0.25 s,
        doubling to 4 s, jittered): then ``_Unreachable`` at once. Why: with auth, a dial
        is an Authenticate, a bcrypt on the server; after an etcd restart a dozen
        processes re-dialling on every 0.1 s retry kept etcd's two cores busy past every
        attempt's deadline, so every dial failed and was retried (etcd not healthy 20 s
        after its restart, in the cluster test). Caller holds ``lock``."""
        now = time.monotonic()
        if now < self._next_dial and self._dial_error is not None:
            raise _Unreachable(f"{self._dial_error} (not dialled again for "
                               f"{self._next_dial - now:.2f}s)", tls=self._dial_error.tls)
        try:
            client = connect(self)
        except _Unreachable as e:
            self._dial_error = e
            self._next_dial = time.monotonic() + self._dial_backoff * random.uniform(0.5, 1.5)
            self._dial_backoff = min(self._dial_backoff * 2, _DIAL_BACKOFF_MAX)
            raise
        self._dial_backoff = _DIAL_BACKOFF_MIN
        self._next_dial, self._dial_error = 0.0, None
        self._born = time.monotonic()
        return client

    def retire(self, client: etcd3.Etcd3Client | None = None, *, failed: bool = False) -> None:
        """Stop handing out ``client`` (default: the current one); close it once unused.
        A ``failed`` channel younger than ``ETCD_MIN_CHANNEL_AGE`` is kept (gRPC reconnects
        it on its own, backoff ≤ 1 s): a fresh channel per failed attempt was a TLS
        handshake per retry, and when etcd came back a dozen processes' handshakes
        starved it past their attempt timeouts, which aborted them and dialled again
        (etcd "rejected connection ... EOF" for 20 s on this 2-core machine)."""
        with self.lock:
            client = client if client is not None else self.client
            if client is None:
                return
            if failed and self.client is client and time.monotonic() - self._born < ETCD_MIN_CHANNEL_AGE:
                return
            if self.client is client:
                self.client = None
            if self._users.get(id(client)):
                self._retired[id(client)] = client
                return
        _close(client)


def _close(client: etcd3.Etcd3Client) -> None:
    """Close a retired client's channel. Called only once no request holds it; watches
    are requests like any other here (:func:`watch_once`), so no stream outlives its
    holder. (etcd3's own Watcher kept one stream per channel open forever, with a
    request-iterator thread inside gRPC blocked on a queue; closing that channel after
    an etcd restart crashed nodes inside gRPC's native code, SIGSEGV/SIGILL, in the
    cluster tests' etcd outage. That watcher is never started now.)"""
    client.close()


@dataclass(frozen=True)
class WatchBatch:
    """The changes one watch response carried: ``events``, in etcd's order, each a key
    and its new value (None: deleted), up to ``revision``. ``relist``: they cannot be
    applied (the start revision was compacted, the stream ended early, or the response
    is not what was asked for): the watcher lists the prefix again."""

    events: list[tuple[bytes, bytes | None]]
    revision: int = 0
    relist: bool = False


_RELIST = WatchBatch([], relist=True)


def watch_batch(rs: Any, prefix: bytes, start_revision: int) -> WatchBatch:
    """The :class:`WatchBatch` of a ``WatchResponse`` ``rs`` (from etcd: untrusted) to a
    watch of ``prefix`` from ``start_revision``. An event outside the prefix, of an
    unknown type or from before the start revision (etcd going back in time) makes
    the whole batch ``relist``: a listing is the safe answer to a surprise."""
    if rs.compact_revision:
        return _RELIST
    events: list[tuple[bytes, bytes | None]] = []
    revision = 0
    for ev in rs.events:
        kv = ev.kv
        if (not kv.key.startswith(prefix) or ev.type not in (_PUT, _DELETE)
                or kv.mod_revision < start_revision):
            return _RELIST
        events.append((bytes(kv.key), bytes(kv.value) if ev.type == _PUT else None))
        revision = max(revision, kv.mod_revision)
    return WatchBatch(events, revision)


def watch_once(client: etcd3.Etcd3Client, prefix: str, start_revision: int, timeout: float,
               create_timeout: float,
               on_batch: Callable[[WatchBatch], None] | None = None) -> WatchBatch | None:
    """Block until a key under ``prefix`` changes at or after ``start_revision`` (the
    changes of etcd's first response, :func:`watch_batch`), or for ``timeout`` seconds
    (None: nothing changed); meant to run as
    ``EtcdClient.call(lambda c: watch_once(c, ...))``. With ``on_batch``, every batch
    of changes goes to it and the same stream goes on until ``timeout`` (None) or a
    batch asks for a listing (returned): a change costs a view one response, not a
    stream of its own.

    One bounded gRPC stream per call, held like any unary request: the request side is
    one create request, then closed (etcd keeps a watch stream open after the client's
    half-close), so gRPC's request-iterator thread ends at once; the stream's deadline is
    ``timeout``; it is cancelled before this returns. A watch not created within
    ``create_timeout`` (a cut rail) raises ``ConnectionTimeoutError``: the client tries
    the next endpoint. A compacted start revision returns a ``relist`` batch; a failed
    stream raises its gRPC error for :meth:`EtcdClient._classify`."""
    key = prefix.encode()
    create = etcdrpc.WatchCreateRequest(key=key, range_end=etcd3.utils.increment_last_byte(key),
                                        start_revision=start_revision)
    stream = etcdrpc.WatchStub(client.channel).Watch(
        iter([etcdrpc.WatchRequest(create_request=create)]), timeout=timeout,
        credentials=client.call_credentials, metadata=client.metadata)
    created = threading.Event()
    timed_out = threading.Event()

    def give_up() -> None:
        if not created.is_set():
            timed_out.set()
            stream.cancel()
    timer = threading.Timer(create_timeout, give_up)
    timer.start()
    try:
        for rs in stream:
            created.set()
            if rs.compact_revision or rs.events:
                batch = watch_batch(rs, key, start_revision)  # a change, or compacted
                if on_batch is None or batch.relist:
                    return batch
                on_batch(batch)
                start_revision = batch.revision + 1
                continue
            if rs.canceled:
                raise StoreError(f"etcd refused a watch of {prefix!r}: {rs.cancel_reason}")
    except grpc.RpcError as e:
        if timed_out.is_set():
            raise etcd_exc.ConnectionTimeoutError("watch not created in time") from e
        # no change within ``timeout``: gRPC's own deadline, or etcd's context ending
        # first (then it answers UNKNOWN "context deadline exceeded"; seen in CI)
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED or (
                e.code() == grpc.StatusCode.UNKNOWN and "deadline exceeded" in (e.details() or "")):
            return None
        raise
    finally:
        timer.cancel()
        timer.join()                         # its cancel() has returned, if it ran
        stream.cancel()
    return _RELIST                           # the stream ended early: list again to be sure


class _Unreachable(Exception):
    """Internal: this endpoint did not answer (or failed TLS); try the next one."""

    def __init__(self, message: str, *, tls: bool = False) -> None:
        super().__init__(message)
        self.tls = tls


def _is_tls_failure(details: str) -> bool:
    d = details.lower()
    return any(w in d for w in ("ssl", "tls", "certificate", "handshake failed"))


def _unreachable(code: Any, details: str) -> _Unreachable:
    if _is_tls_failure(details):
        return _Unreachable(f"TLS failure: {details}", tls=True)
    return _Unreachable(f"{code.name}: {details}")


# -- two ways to send --------------------------------------------------------------------
#
# Two ways to send a request, both bounded by ``etcd_attempt_timeout`` per endpoint:
#
#   call(op)  one endpoint at a time, the last one that answered first: for writes
#             that must not run twice at once (allocate, seal, remove, lease grant),
#             and for lease keep-alives and puts on the lease, whose budget (a
#             refresh period) holds one attempt timeout and the next endpoint's answer.
#   race(op)  every endpoint at once, the first answer wins: for idempotent requests
#             whose latency matters more than etcd's load (each is served E times).
#
# Error classes (``_classify``): no answer, a closed or cancelled channel, a TLS
# failure -> _Unreachable (next endpoint; a TLS failure everywhere is reported as
# such at once, it is configuration, not an outage); an expired or rejected token ->
# re-authenticate once; anything else etcd answered -> StoreError naming it.


class EtcdClient:
    """Requests to an etcd cluster through every configured endpoint (one per rail).

    Contract: :meth:`call` and :meth:`race` run ``op(client)`` (an ``etcd3`` client call)
    and return its result, or raise ``StoreUnavailable`` once no endpoint answered within
    ``store.etcd_timeout`` or the budget given (each attempt bounded by
    ``store.etcd_attempt_timeout``), ``StoreError`` for what etcd answered (a refusal,
    bad credentials) or a TLS failure on every endpoint; :meth:`keep_alive` is a call
    on the endpoint's standing keep-alive stream. Thread-safe: any thread may call;
    channels are shared and replaced, never closed under a user (nor under a stream).
    ``race`` is only for idempotent requests.

    Attributes: ``timeout`` and ``attempt_timeout`` (s); ``authenticated``, true once a
    channel authenticated as ``store.etcd_user``; ``urls``, the endpoints in order."""

    def __init__(self, cfg: StoreConfig) -> None:
        if not cfg.etcd:
            raise ConfigError("store.etcd: at least one endpoint is needed for backend 'etcd'")
        if bool(cfg.etcd_cert) != bool(cfg.etcd_key):
            raise ConfigError("store.etcd_cert and store.etcd_key must be set together (mutual TLS)")
        self.cfg = cfg
        # read once, here: a bad password file fails the command at its start in one line,
        # not a reconnect in the middle of a mount's life
        self._password = cfg.password() if cfg.etcd_user else None
        self.timeout = float(cfg.etcd_timeout)
        self.attempt_timeout = min(float(cfg.etcd_attempt_timeout), self.timeout)
        self._endpoints = [_Endpoint(url) for url in cfg.etcd]
        if (cfg.etcd_ca_cert or cfg.etcd_cert) and not any(e.tls for e in self._endpoints):
            log.warning("store.etcd_ca_cert/etcd_cert are set but no endpoint is https://; "
                        "TLS options are ignored")
        self.authenticated = False   # set once a client authenticated (store.etcd_user)
        self.reachable: bool | None = None   # the last request was answered (None: none yet)
        self._auth_off = False       # etcd said auth is not enabled: dial without a user
        self._lock = threading.Lock()
        self._preferred = 0      # index of the endpoint that last answered; guarded by _lock
        self._said_down: set[str] = set()   # endpoints logged unreachable, until they answer
        self._closed = False
        # race() workers: an attempt on a dead rail holds one for an attempt timeout
        self._pool = ThreadPoolExecutor(max_workers=4 * len(self._endpoints),
                                        thread_name_prefix="etcd-race")
        self._keepalives = KeepAlives()

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self._endpoints]

    def _connect(self, ep: _Endpoint) -> etcd3.Etcd3Client:
        ca = cert = key = None
        if ep.tls:
            ca = self.cfg.etcd_ca_cert or _SYSTEM_CA
            cert, key = self.cfg.etcd_cert or None, self.cfg.etcd_key or None
            for what, path in (("etcd_ca_cert", ca), ("etcd_cert", cert), ("etcd_key", key)):
                if path and not os.access(path, os.R_OK):
                    raise ConfigError(f"store.{what}: {path!r} is not readable")
        user = self.cfg.etcd_user or None
        if user and self._auth_off:
            user = None                      # etcd said auth is not enabled (warned once)
        password = self._password if user else None
        try:
            # With a user, the constructor calls Authenticate: the one raw gRPC call.
            client = etcd3.client(
                host=ep.host, port=ep.port, ca_cert=ca, cert_key=key, cert_cert=cert,
                timeout=self.attempt_timeout, user=user, password=password,
                grpc_options=_GRPC_OPTIONS,
            )
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
            if code in _UNREACHABLE_CODES:
                raise _unreachable(code, details) from e
            if "authentication is not enabled" in details:
                log.warning("etcd %s: authentication is not enabled on the server, although "
                            "store.etcd_user is set: continuing without it (anyone who reaches "
                            "this etcd can change the cluster's records; docs/security.md)", ep.url)
                self._auth_off = True
                return self._connect(ep)
            raise StoreError(f"etcd {ep.url}: authentication as {user!r} failed: {details}") from e
        if user and not ep.tls:
            # etcd3 0.12 sends the token twice: as call credentials and as metadata.
            # grpcio >= 1.45 refuses call credentials on an insecure channel ("does not
            # have a sufficient security level", python-etcd3 #1876/#2713), so over
            # plain http keep only the metadata, which etcd reads just the same.
            client.call_credentials = None
        self.authenticated = bool(user)
        return client

    def _call_one(self, ep: _Endpoint, op: Callable[[etcd3.Etcd3Client], T]) -> T:
        """Run ``op`` against one endpoint; ``_Unreachable`` if it did not answer."""
        for attempt in (0, 1):
            if self._closed:
                raise StoreError("etcd store is closed")
            with ep.using(self._connect) as client:
                try:
                    return op(client)
                except Exception as e:                      # noqa: BLE001 - classified here
                    self._classify(ep, client, e, attempt)  # raises, or asks to re-auth
        raise AssertionError("unreachable")

    def _classify(self, ep: _Endpoint, client: etcd3.Etcd3Client, e: Exception,
                  attempt: int) -> None:
        """Raise what ``e`` means for this call; return to re-authenticate and retry."""
        if isinstance(e, _UNREACHABLE) or (isinstance(e, ValueError) and "closed channel" in str(e)):
            # A fresh channel next time (at most every ETCD_MIN_CHANNEL_AGE): seen here, a
            # channel whose server restarted in another network namespace kept failing
            # long after etcd was back. A closed channel is replaced at once.
            ep.retire(client, failed=isinstance(e, _UNREACHABLE))
            if self._closed:
                raise StoreError("etcd store is closed") from e
            cause = e.__context__        # etcd3 translates the gRPC error, dropping details
            if isinstance(cause, grpc.RpcError):
                raise _unreachable(cause.code(), cause.details() or "") from e
            raise _Unreachable(str(e) or type(e).__name__) from e
        if isinstance(e, grpc.RpcError):
            code, details = e.code(), e.details() or ""
            if code in _UNREACHABLE_CODES or code == grpc.StatusCode.CANCELLED:
                ep.retire(client, failed=True)
                raise _unreachable(code, details) from e
            if code == grpc.StatusCode.UNAUTHENTICATED and attempt == 0:
                log.info("etcd %s: %s; re-authenticating", ep.url, details)
                ep.retire(client)
                return
            raise StoreError(f"etcd {ep.url}: {code.name}: {details}") from e
        if isinstance(e, etcd_exc.Etcd3Exception):
            raise StoreError(f"etcd {ep.url}: {type(e).__name__}: {e}") from e
        raise e

    def _prefer(self, ep: _Endpoint, failover: bool = True) -> None:
        """Send to ``ep`` first from now on; ``failover``: because the endpoint preferred
        until now failed (said once, at INFO), not because ``ep`` merely answered a race
        first (both healthy: on a busy node the winner flips every second or two, and
        this line filled the logs, 17 times in 10 s on each node of the bench cluster)."""
        with self._lock:
            before, self._preferred = self._preferred, self._endpoints.index(ep)
        if before != self._preferred and failover:
            log.info("etcd: failed over to %s", ep.url)

    def _give_up(self, start: float, budget: float, errors: dict[str, _Unreachable]) -> None:
        """Raise once every endpoint failed for the call's whole budget, or at once when
        every endpoint failed TLS (configuration, not an outage)."""
        elapsed = time.monotonic() - start
        detail = "; ".join(f"{url}: {err}" for url, err in errors.items()) or "no answer"
        if len(errors) == len(self._endpoints) and all(e.tls for e in errors.values()):
            self.reachable = False
            raise StoreError(f"etcd TLS failure with every endpoint (check store.etcd_ca_cert, "
                             f"etcd_cert, etcd_key and the server's certificate): {detail}")
        if elapsed >= budget:
            self.reachable = False
            raise StoreUnavailable(f"etcd unreachable after {elapsed:.1f}s (store.etcd_timeout="
                                   f"{self.timeout:g}): {detail}")

    def _rpc(self, op_on: Callable[[_Endpoint], Callable[[etcd3.Etcd3Client], T]],
             budget: float) -> T:
        """Run ``op`` with failover: last good endpoint first, then the others in order,
        round after round until ``budget`` seconds have passed (each endpoint tried once
        at least). Why keep retrying: a restarting etcd or a leader election makes a
        server refuse for a second; the caller should not see that as "down"."""
        start = time.monotonic()
        n = len(self._endpoints)
        errors: dict[str, _Unreachable] = {}
        delay = 0.05
        while True:
            with self._lock:
                first = self._preferred
            for k in range(n):
                ep = self._endpoints[(first + k) % n]
                try:
                    result = self._call_one(ep, op_on(ep))
                except _Unreachable as e:
                    errors[ep.url] = e
                    if k == 0 and n > 1 and ep.url not in self._said_down:
                        # once until it answers again, not every round of every call: during
                        # an outage each mount logged it 1-2 times a second
                        self._said_down.add(ep.url)
                        log.info("etcd %s unreachable (%s), trying the next endpoint", ep.url, e)
                    continue
                self._said_down.discard(ep.url)
                if k:
                    self._prefer(ep)
                self.reachable = True
                return result
            self._give_up(start, budget, errors)
            time.sleep(min(delay * random.uniform(0.5, 1.5),
                           max(0.0, budget - (time.monotonic() - start))))
            delay = min(delay * 2, 0.5)

    def call(self, op: Callable[[etcd3.Etcd3Client], T], budget: float | None = None) -> T:
        """Run ``op(client)`` with failover, retries and error mapping, one endpoint at a
        time (see :meth:`_rpc`), for ``budget`` seconds (default ``etcd_timeout``)."""
        return self._rpc(lambda _: op, self.timeout if budget is None else budget)

    def keep_alive(self, lease_id: int, budget: float) -> int:
        """A keep-alive of ``lease_id`` as :meth:`call` sends a request, within ``budget``
        seconds; the TTL etcd answered (0: the lease is gone). Sent on the process's one
        LeaseKeepAlive stream to that endpoint (``etcd_keepalive.py``), not on a stream
        of its own as etcd3's ``refresh_lease`` does."""
        def on(ep: _Endpoint) -> Callable[[etcd3.Etcd3Client], int]:
            return lambda c: self._keepalives.send(ep.url, c, lambda: ep.hold(c), lease_id,
                                                   self.attempt_timeout)
        return self._rpc(on, budget)

    def race(self, op: Callable[[etcd3.Etcd3Client], T], budget: float | None = None) -> T:
        """Run an idempotent ``op(client)`` on every endpoint at once; the first answer
        wins. Rounds repeat until ``budget`` (default ``etcd_timeout``) has passed, then
        ``StoreUnavailable``. An endpoint whose attempt is still running when another
        answered finishes (at most ``etcd_attempt_timeout`` later) in the background."""
        budget = self.timeout if budget is None else budget
        start = time.monotonic()
        errors: dict[str, _Unreachable] = {}
        with self._lock:
            preferred = self._endpoints[self._preferred].url
        while True:
            answers: queue.SimpleQueue[tuple[_Endpoint, bool, Any]] = queue.SimpleQueue()
            for ep in self._endpoints:
                self._pool.submit(self._attempt, ep, op, answers)
            for _ in self._endpoints:
                try:     # each attempt ends within an attempt timeout (+ a dial, with auth)
                    ep, ok, value = answers.get(timeout=2 * self.attempt_timeout + 1)
                except queue.Empty:
                    break
                if ok:
                    self._prefer(ep, failover=preferred in errors)
                    self.reachable = True
                    result: T = value
                    return result
                if not isinstance(value, _Unreachable):
                    raise value                  # etcd answered: the same from every endpoint
                errors[ep.url] = value
            self._give_up(start, budget, errors)
            # jittered: a dozen processes retrying in step is a storm when etcd comes back
            time.sleep(min(random.uniform(0.05, 0.15), max(0.0, budget - (time.monotonic() - start))))

    def _attempt(self, ep: _Endpoint, op: Callable[[etcd3.Etcd3Client], T],
                 answers: queue.SimpleQueue[tuple[_Endpoint, bool, Any]]) -> None:
        try:
            answers.put((ep, True, self._call_one(ep, op)))
        except Exception as e:                              # noqa: BLE001 - handed to the racer
            answers.put((ep, False, e))

    def close(self) -> None:
        """Retire every channel (each closed by its last user) and stop the racers."""
        self._closed = True
        self._keepalives.close()
        for ep in self._endpoints:
            ep.retire()
        self._pool.shutdown(wait=False)
