"""The etcd metadata store: manifests in an etcd cluster, shared by every node.

Key layout (``P`` = ``store.etcd_prefix``, default ``/kspeedfs/``)::

    P datasets/<name>/last            highest version ever allocated ("7"); never goes down
    P datasets/<name>/current         the current version ("7")
    P datasets/<name>/v<N>/info       DatasetInfo JSON of version N, plus "parts", "part_size",
                                      signed for this key (signature.py; unsigned: refused)
    P manifests/<name>/v<N>/<i>       part i of version N's manifest blob (PART_SIZE bytes each)

Why parts: etcd refuses requests over ``--max-request-bytes`` (1.5 MiB by default) and
a manifest of 10^6 files is tens of MB. Parts are 1 MiB, well under that limit and
under gRPC's default 4 MiB receive limit. They live apart from ``datasets/`` so that
listing datasets reads a few small keys and never the bulk.

Publish, in order (a crash anywhere leaves the previous version current)::

    1. allocate  txn: last == L  ->  last = L+1                       (CAS, retried)
    2. upload    put manifests/<name>/v<N>/0 .. k-1                    (invisible so far)
    3. seal      txn: current unchanged -> put v<N>/info [, current = N if N > current]

Two concurrent publishers of one name therefore get two distinct versions from step 1,
and ``current`` only moves forward in step 3, whichever of them finishes first. A
version exists (``versions()``, ``dataset()``) exactly when its ``info`` key does; a
crash after step 1 or 2 leaves an unused version number and orphan parts, which
nothing reads and which ``remove(name)`` deletes. Versions are never reused while the
dataset exists (``last`` survives removing single versions), so a mount's "v7" always
means the same bytes; removing the whole dataset resets the numbering to 1.

Remove is one transaction (delete ``v<N>/info``; if N was current, point ``current`` at
the newest remaining version, guarded by ``current``'s mod revision) followed by a
range delete of the parts. Readers that fetched the info just before a remove find
parts missing and get ``DatasetNotFound`` (the info is gone too) rather than a
corrupt-manifest error.

Endpoints and failure. ``store.etcd`` lists client URLs, one per rail in a cluster (or
etcd members on several networks). Every request to one endpoint has a deadline of
``store.etcd_attempt_timeout`` (1 s), never the whole budget: a request on a cut rail
then costs one attempt, not ``etcd_timeout``. Two ways to send (see "connection" below):
``call`` tries the last endpoint that answered, then the others in configured order,
round after round (short sleeps) until ``store.etcd_timeout`` seconds have passed and
every endpoint has been tried, then raises ``StoreUnavailable`` naming the endpoints;
``race`` sends an idempotent request to every endpoint at once and takes the first
answer (the membership lease keep-alive, puts on the lease, listings), as
``rdma/vrdma/dial.py`` dials a peer's NICs. Why: with the whole budget per attempt on
the first endpoint, a cut rail held each lease refresh 5 s, longer than the 5 s lease,
and a healthy node left the cluster. The arithmetic is in docs/design.md ("etcd
across rails"). A TLS failure on every endpoint is reported as a TLS error at once.
A transaction whose reply was lost (deadline, reset) is sent again, so each is written
to be harmless when repeated: allocate at worst skips a version number, seal re-puts
the same info; only ``remove`` may then report ``DatasetNotFound`` for the version it
has just removed.
The retry loop also rides out an etcd restart: gRPC's reconnect backoff is capped at
1 s here (its default grows to 120 s, which would keep a channel failing long after
the server is back). ``store.etcd_user``/``etcd_password`` enable etcd auth, over
http too (the token then travels as gRPC metadata only: see ``_connect``), and the
client re-authenticates when etcd says the token expired (simple tokens last 5 min),
watches included; ``https://`` endpoints use TLS with ``store.etcd_ca_cert`` (default:
the system CA bundle) and optionally a client certificate/key for mutual TLS. A gRPC
channel that failed is retired and closed by its last user, never under a concurrent
call.

The client. This uses the ``etcd3`` 0.12 gRPC client as Debian ships it
(python3-etcd3 0.12.0-2) with Debian's python3-protobuf 3.21.12 (Python package
version 4.21.12) and python3-grpcio 1.51.1, through the venv's --system-site-packages.
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

Capacity: etcd's default backend quota is 2 GB; each manifest version costs its blob
size plus etcd's MVCC history until compaction. Run etcd with auto-compaction.
"""
from __future__ import annotations

import logging
import os
import queue
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar
from urllib.parse import urlsplit

# gRPC's fork handlers (pthread_atfork) abort a process that forks while gRPC threads
# run, and our processes do fork (test fixtures, daemons spawning helpers); no child of
# ours ever uses the parent's channels, so the handlers are only a hazard. Must be set
# before grpc is imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import etcd3  # noqa: E402
import etcd3.exceptions as etcd_exc  # noqa: E402
import etcd3.watch  # noqa: E402
from etcd3 import etcdrpc  # noqa: E402
import etcd3.transactions as tx
import grpc

from ...config import StoreConfig
from ...errors import (
    ConfigError, DatasetNotFound, RecordUnverified, StoreError, StoreUnavailable, VersionConflict,
)
from .base import DatasetInfo, MetadataStore, check_name, verify_blob
from .signature import RecordSigner

log = logging.getLogger(__name__)

T = TypeVar("T")

PART_SIZE = 1 << 20          # bytes per manifest part key; etcd's request limit is 1.5 MiB
_CAS_ATTEMPTS = 200          # per transaction; each failed attempt means someone else won
_SYSTEM_CA = "/etc/ssl/certs/ca-certificates.crt"
_GRPC_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", 16 << 20),
]
_INFO = re.compile(r"^v(\d+)/info$")
_UNREACHABLE = (etcd_exc.ConnectionFailedError, etcd_exc.ConnectionTimeoutError)
_UNREACHABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


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
        self._users: dict[int, int] = {}                  # id(client) -> calls using it
        self._retired: dict[int, etcd3.Etcd3Client] = {}  # failed, closed by the last user

    @contextmanager
    def using(self, connect: Callable[["_Endpoint"], etcd3.Etcd3Client]) -> Iterator[etcd3.Etcd3Client]:
        """The current client (made by ``connect`` if there is none), held for the call."""
        with self.lock:
            if self.client is None:
                self.client = connect(self)
            client = self.client
            self._users[id(client)] = self._users.get(id(client), 0) + 1
        try:
            yield client
        finally:
            with self.lock:
                left = self._users.pop(id(client)) - 1
                if left:
                    self._users[id(client)] = left
                done = None if left else self._retired.pop(id(client), None)
            if done is not None:
                done.close()

    def retire(self, client: etcd3.Etcd3Client | None = None) -> None:
        """Stop handing out ``client`` (default: the current one); close it once unused."""
        with self.lock:
            client = client if client is not None else self.client
            if client is None:
                return
            if self.client is client:
                self.client = None
            if self._users.get(id(client)):
                self._retired[id(client)] = client
                return
        client.close()


class _Watcher(etcd3.watch.Watcher):
    """etcd3 0.12's watcher, whose stream thread ends quietly once its channel is closed.
    (Its loop re-opens the stream forever and died with ``ValueError: Cannot invoke RPC:
    Channel closed!``, a thread traceback on stderr, each time a client was retired.)"""

    def _run(self) -> None:
        try:
            super()._run()
        except ValueError:
            return


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


class EtcdStore(MetadataStore):
    """MetadataStore over etcd. Thread-safe: one gRPC channel per endpoint, shared."""

    def __init__(self, cfg: StoreConfig, secret: bytes | None = None) -> None:
        """``secret``: the cluster secret (``cluster.secret()``). Dataset info and node
        records are signed and verified with a key derived from it (``signature.py``);
        without it the store still connects (``call``/``race``) but refuses to publish
        or read datasets (``ConfigError``)."""
        #: signs/verifies records under this prefix; None: no secret given
        self.signer = RecordSigner(secret) if secret else None
        if not cfg.etcd:
            raise ConfigError("store.etcd: at least one endpoint is needed for backend 'etcd'")
        if bool(cfg.etcd_cert) != bool(cfg.etcd_key):
            raise ConfigError("store.etcd_cert and store.etcd_key must be set together (mutual TLS)")
        self.cfg = cfg
        self.prefix = cfg.etcd_prefix
        self.timeout = float(cfg.etcd_timeout)
        self._endpoints = [_Endpoint(url) for url in cfg.etcd]
        if (cfg.etcd_ca_cert or cfg.etcd_cert) and not any(e.tls for e in self._endpoints):
            log.warning("store.etcd_ca_cert/etcd_cert are set but no endpoint is https://; "
                        "TLS options are ignored")
        self.attempt_timeout = min(float(cfg.etcd_attempt_timeout), self.timeout)
        self.authenticated = False   # set once a client authenticated (store.etcd_user)
        self._auth_off = False       # etcd said auth is not enabled: dial without a user
        self._lock = threading.Lock()
        self._preferred = 0      # index of the endpoint that last answered; guarded by _lock
        self._closed = False
        # race() workers: an attempt on a dead rail holds one for an attempt timeout
        self._pool = ThreadPoolExecutor(max_workers=4 * len(self._endpoints),
                                        thread_name_prefix="etcd-race")

    def __repr__(self) -> str:
        return f"EtcdStore({[e.url for e in self._endpoints]!r}, prefix={self.prefix!r})"

    # -- keys -----------------------------------------------------------------------------

    def _ds(self, name: str, *rest: str) -> str:
        return "/".join([f"{self.prefix}datasets/{check_name(name)}", *rest])

    def _parts_dir(self, name: str, version: int) -> str:
        return f"{self.prefix}manifests/{check_name(name)}/v{version}/"

    def part_key(self, name: str, version: int, index: int) -> str:
        """The etcd key of one manifest part (for tests and ``etcdctl`` forensics)."""
        return f"{self._parts_dir(name, version)}{index}"

    # -- connection, failover, error mapping ----------------------------------------------
    #
    # Two ways to send a request, both bounded by ``etcd_attempt_timeout`` per endpoint:
    #
    #   call(op)  one endpoint at a time, the last one that answered first: for writes
    #             that must not run twice at once (allocate, seal, remove, lease grant).
    #   race(op)  every endpoint at once, the first answer wins: for idempotent requests
    #             whose latency matters (lease keep-alive, puts on the lease, listings).
    #             Endpoints are one per rail, so a cut rail costs nothing: the live
    #             rail's answer arrives while the dead one's attempt runs out.
    #
    # Error classes (``_classify``): no answer, a closed or cancelled channel, a TLS
    # failure -> _Unreachable (next endpoint; a TLS failure everywhere is reported as
    # such at once, it is configuration, not an outage); an expired or rejected token ->
    # re-authenticate once; anything else etcd answered -> StoreError naming it.

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
        password = self.cfg.etcd_password if user else None
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
        # The watcher copied the credentials when the client was made (over http with
        # auth every watch then failed "UNAUTHENTICATED ... call credential"): a new one.
        client.watcher = _Watcher(etcdrpc.WatchStub(client.channel), timeout=self.attempt_timeout,
                                  call_credentials=client.call_credentials,
                                  metadata=client.metadata)
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
            # A fresh channel next time: seen here, a channel whose server restarted in
            # another network namespace kept failing long after etcd was back.
            ep.retire(client)
            if self._closed:
                raise StoreError("etcd store is closed") from e
            cause = e.__context__        # etcd3 translates the gRPC error, dropping details
            if isinstance(cause, grpc.RpcError):
                raise _unreachable(cause.code(), cause.details() or "") from e
            raise _Unreachable(str(e) or type(e).__name__) from e
        if isinstance(e, grpc.RpcError):
            code, details = e.code(), e.details() or ""
            if code in _UNREACHABLE_CODES or code == grpc.StatusCode.CANCELLED:
                ep.retire(client)
                raise _unreachable(code, details) from e
            if code == grpc.StatusCode.UNAUTHENTICATED and attempt == 0:
                log.info("etcd %s: %s; re-authenticating", ep.url, details)
                ep.retire(client)
                return
            raise StoreError(f"etcd {ep.url}: {code.name}: {details}") from e
        if isinstance(e, etcd_exc.Etcd3Exception):
            raise StoreError(f"etcd {ep.url}: {type(e).__name__}: {e}") from e
        raise e

    def _prefer(self, ep: _Endpoint) -> None:
        with self._lock:
            before, self._preferred = self._preferred, self._endpoints.index(ep)
        if before != self._preferred:
            log.info("etcd: failed over to %s", ep.url)

    def _give_up(self, start: float, budget: float, errors: dict[str, _Unreachable]) -> None:
        """Raise once every endpoint failed for the call's whole budget, or at once when
        every endpoint failed TLS (configuration, not an outage)."""
        elapsed = time.monotonic() - start
        detail = "; ".join(f"{url}: {err}" for url, err in errors.items()) or "no answer"
        if len(errors) == len(self._endpoints) and all(e.tls for e in errors.values()):
            raise StoreError(f"etcd TLS failure with every endpoint (check store.etcd_ca_cert, "
                             f"etcd_cert, etcd_key and the server's certificate): {detail}")
        if elapsed >= budget:
            raise StoreUnavailable(f"etcd unreachable after {elapsed:.1f}s (store.etcd_timeout="
                                   f"{self.timeout:g}): {detail}")

    def _rpc(self, op: Callable[[etcd3.Etcd3Client], T]) -> T:
        """Run ``op`` with failover: last good endpoint first, then the others in order,
        round after round until ``etcd_timeout`` has passed (each endpoint tried once
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
                    result = self._call_one(ep, op)
                except _Unreachable as e:
                    errors[ep.url] = e
                    if k == 0 and n > 1:
                        log.info("etcd %s unreachable (%s), trying the next endpoint", ep.url, e)
                    continue
                if k:
                    self._prefer(ep)
                return result
            self._give_up(start, self.timeout, errors)
            time.sleep(min(delay, max(0.0, self.timeout - (time.monotonic() - start))))
            delay = min(delay * 2, 0.5)

    def call(self, op: Callable[[etcd3.Etcd3Client], T]) -> T:
        """Run ``op(client)`` with this store's failover, retries and error mapping, one
        endpoint at a time. The cluster's membership, preload and status keys share the
        store's endpoints, credentials and ``etcd_prefix`` through this and :meth:`race`
        (``cluster/membership.py``)."""
        return self._rpc(op)

    def race(self, op: Callable[[etcd3.Etcd3Client], T], budget: float | None = None) -> T:
        """Run an idempotent ``op(client)`` on every endpoint at once; the first answer
        wins. Rounds repeat until ``budget`` (default ``etcd_timeout``) has passed, then
        ``StoreUnavailable``. An endpoint whose attempt is still running when another
        answered finishes (at most ``etcd_attempt_timeout`` later) in the background."""
        budget = self.timeout if budget is None else budget
        start = time.monotonic()
        errors: dict[str, _Unreachable] = {}
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
                    self._prefer(ep)
                    return value
                if not isinstance(value, _Unreachable):
                    raise value                  # etcd answered: the same from every endpoint
                errors[ep.url] = value
            self._give_up(start, budget, errors)
            time.sleep(min(0.1, max(0.0, budget - (time.monotonic() - start))))

    def _attempt(self, ep: _Endpoint, op: Callable[[etcd3.Etcd3Client], T],
                 answers: "queue.SimpleQueue[tuple[_Endpoint, bool, Any]]") -> None:
        try:
            answers.put((ep, True, self._call_one(ep, op)))
        except Exception as e:                              # noqa: BLE001 - handed to the racer
            answers.put((ep, False, e))

    def _get(self, key: str) -> tuple[bytes | None, Any]:
        return self._rpc(lambda c: c.get(key))

    def _txn(self, compare: list[Any], success: list[Any],
             failure: list[Any]) -> tuple[bool, list[Any]]:
        return self._rpc(lambda c: c.transaction(compare=compare, success=success, failure=failure))

    # -- publish --------------------------------------------------------------------------

    def publish(self, info: DatasetInfo, blob: bytes) -> DatasetInfo:
        name = check_name(info.name)
        t0 = time.monotonic()
        version = self._allocate(name)
        sealed = info.sealed(version, blob, time.time())
        parts = range(0, len(blob), PART_SIZE)
        for i, off in enumerate(parts):
            key, chunk = self.part_key(name, version, i), blob[off:off + PART_SIZE]
            self._rpc(lambda c: c.put(key, chunk))
        record = {**sealed.to_json(), "parts": len(parts), "part_size": PART_SIZE}
        info_key = self._ds(name, f"v{version}", "info")
        self._seal(name, version, self._need_signer().seal_json(info_key, record))
        log.info("published %s v%d: %d bytes in %d parts (%.2fs)",
                 name, version, len(blob), len(parts), time.monotonic() - t0)
        return sealed

    @staticmethod
    def _unchanged(key: str, value: bytes | None, meta: Any) -> Any:
        """Compare for "``key`` is still what we read" (absent: never created)."""
        if value is None:
            return tx.Version(key) == 0
        return tx.Mod(key) == meta.mod_revision

    @staticmethod
    def _first_kv(responses: list[Any]) -> tuple[bytes | None, Any]:
        """The (value, meta) of a failure branch's single Get, or (None, None)."""
        kvs = responses[0] if responses else []
        return kvs[0] if kvs else (None, None)

    def _allocate(self, name: str) -> int:
        """Step 1: bump ``last`` by compare-and-swap; the new value is ours alone."""
        key = self._ds(name, "last")
        value, meta = self._get(key)
        for _ in range(_CAS_ATTEMPTS):
            version = (int(value) if value is not None else 0) + 1
            ok, resp = self._txn([self._unchanged(key, value, meta)],
                                 [tx.Put(key, str(version))], [tx.Get(key)])
            if ok:
                return version
            value, meta = self._first_kv(resp)
            time.sleep(random.uniform(0, 0.005))
        raise VersionConflict(f"could not allocate a version of {name!r}: "
                              f"{_CAS_ATTEMPTS} compare-and-swap attempts lost")

    def _seal(self, name: str, version: int, record: bytes) -> None:
        """Step 3: make the version visible, and current unless a newer one already is."""
        cur_key, info_key = self._ds(name, "current"), self._ds(name, f"v{version}", "info")
        value, meta = self._get(cur_key)
        for _ in range(_CAS_ATTEMPTS):
            ops = [tx.Put(info_key, record)]
            if value is None or int(value) < version:
                ops.append(tx.Put(cur_key, str(version)))
            ok, resp = self._txn([self._unchanged(cur_key, value, meta)], ops, [tx.Get(cur_key)])
            if ok:
                return
            value, meta = self._first_kv(resp)
        raise VersionConflict(f"could not make {name!r} v{version} visible: "
                              f"{_CAS_ATTEMPTS} compare-and-swap attempts lost")

    # -- read -----------------------------------------------------------------------------

    def _record(self, name: str, version: int) -> dict[str, Any] | None:
        key = self._ds(name, f"v{version}", "info")
        raw, _ = self._get(key)
        if raw is None:
            return None
        return self._info_record(key, raw, name, version)

    def _need_signer(self) -> RecordSigner:
        if self.signer is None:
            raise ConfigError("the etcd store signs and verifies dataset records with the "
                              "cluster secret (cluster.secret_file), and none was given")
        return self.signer

    def _info_record(self, key: str, raw: bytes, name: str, version: int) -> dict[str, Any]:
        """The verified info record stored at ``key``: signed with this cluster's key for
        exactly this key (``RecordUnverified`` otherwise), a valid :class:`DatasetInfo`
        of ``name`` v``version`` with a SHA-256 and a consistent part count
        (``StoreError`` otherwise)."""
        record = self._need_signer().open_json(key, raw)
        try:
            info = DatasetInfo.from_json(record)
            parts, part_size = record.get("parts"), record.get("part_size")
            if type(parts) is not int or type(part_size) is not int or not 0 < part_size <= PART_SIZE:
                raise ValueError("parts/part_size missing or invalid")
            if parts != -(-info.manifest_size // part_size):
                raise ValueError(f"{parts} parts of {part_size} bytes cannot hold "
                                 f"{info.manifest_size} bytes")
            if info.name != name or info.version != version:
                raise ValueError(f"it describes {info.name} v{info.version}")
            if not info.sha256:
                raise ValueError("no sha256 of the manifest")
        except ValueError as e:
            raise StoreError(f"etcd key {key} is corrupt: {e}") from e
        return record

    def _current(self, name: str) -> int:
        raw, _ = self._get(self._ds(name, "current"))
        if raw is None:
            raise DatasetNotFound(f"no dataset named {name!r} in etcd under {self.prefix!r}")
        try:
            return int(raw)
        except ValueError as e:
            raise StoreError(f"etcd key {self._ds(name, 'current')} is corrupt: {raw!r}") from e

    def _resolve(self, name: str, version: int | None) -> dict[str, Any]:
        """The info record of ``version`` (default current). A concurrent remove can move
        ``current`` between our two reads, so re-read it a few times before giving up."""
        check_name(name)
        for _ in range(5):
            v = self._current(name) if version is None else version
            record = self._record(name, v)
            if record is not None:
                return record
            if version is not None:
                raise DatasetNotFound(f"dataset {name!r} has no version {version}")
        raise DatasetNotFound(f"dataset {name!r}: current version vanished while reading it")

    def dataset(self, name: str, version: int | None = None) -> DatasetInfo:
        return DatasetInfo.from_json(self._resolve(name, version))

    def datasets(self) -> list[DatasetInfo]:
        # One range read of the small keys: a consistent snapshot of every dataset.
        base = f"{self.prefix}datasets/"
        kvs = self._rpc(lambda c: list(c.get_prefix(base)))
        by_key = {meta.key.decode(errors="surrogateescape")[len(base):]: value for value, meta in kvs}
        out = []
        for rel, value in by_key.items():
            name, _, leaf = rel.partition("/")
            if leaf != "current":
                continue
            rel_info = f"{name}/v{value.decode(errors='replace')}/info"
            raw = by_key.get(rel_info)
            if raw is None:
                log.warning("etcd: dataset %r: current=%r has no info key; skipped", name, value)
                continue
            try:
                version = int(value)
            except ValueError:
                log.warning("etcd: dataset %r: current=%r is not a version; skipped", name, value)
                continue
            try:
                record = self._info_record(base + rel_info, raw, name, version)
            except RecordUnverified:    # the signer logged it (once): not listed
                log.debug("etcd: dataset %r v%d has no valid signature; not listed", name, version)
                continue
            out.append(DatasetInfo.from_json(record))
        return sorted(out, key=lambda i: i.name)

    def versions(self, name: str) -> list[int]:
        base = self._ds(name) + "/"
        kvs = self._rpc(lambda c: list(c.get_prefix(base, keys_only=True)))
        vs = sorted(int(m.group(1)) for _, meta in kvs
                    if (m := _INFO.match(meta.key.decode(errors="replace")[len(base):])))
        if not vs:
            raise DatasetNotFound(f"no dataset named {name!r} in etcd under {self.prefix!r}")
        return vs

    def manifest(self, name: str, version: int) -> bytes:
        record = self._resolve(name, version)     # verified: signature, parts, sha256
        info = DatasetInfo.from_json(record)
        nparts = record["parts"]
        pieces = []
        for i in range(nparts):
            key = self.part_key(name, version, i)
            value, _ = self._get(key)
            if value is None:
                if self._record(name, version) is None:
                    raise DatasetNotFound(f"dataset {name!r} v{version} was removed while reading it")
                pieces.append(b"")    # verify_blob reports it as corrupt, with sizes
                log.error("etcd: manifest part %s is missing", key)
                continue
            pieces.append(value)
        return verify_blob(info, b"".join(pieces))

    # -- remove ---------------------------------------------------------------------------

    def remove(self, name: str, version: int | None = None) -> None:
        if version is None:
            self.versions(name)     # DatasetNotFound if there is nothing to remove
            self._remove_all(name)
            return
        cur_key = self._ds(name, "current")
        for _ in range(_CAS_ATTEMPTS):
            value, meta = self._get(cur_key)
            vs = self.versions(name)
            if version not in vs:
                raise DatasetNotFound(f"dataset {name!r} has no version {version}")
            rest = [v for v in vs if v != version]
            if not rest:
                self._remove_all(name)
                return
            ops: list[Any] = [tx.Delete(self._ds(name, f"v{version}", "info"))]
            if value is None or int(value) == version:
                ops.append(tx.Put(cur_key, str(rest[-1])))
            ok, _ = self._txn([self._unchanged(cur_key, value, meta)], ops, [])
            if ok:
                self._rpc(lambda c: c.delete_prefix(self._parts_dir(name, version)))
                log.info("removed %s v%d", name, version)
                return
        raise VersionConflict(f"could not remove {name!r} v{version}: "
                              f"{_CAS_ATTEMPTS} compare-and-swap attempts lost")

    def _remove_all(self, name: str) -> None:
        # Metadata first: once it is gone nobody starts reading the parts.
        self._rpc(lambda c: c.delete_prefix(self._ds(name) + "/"))
        self._rpc(lambda c: c.delete_prefix(f"{self.prefix}manifests/{name}/"))
        log.info("removed dataset %s", name)

    def close(self) -> None:
        self._closed = True
        for ep in self._endpoints:
            ep.retire()
        self._pool.shutdown(wait=False)
