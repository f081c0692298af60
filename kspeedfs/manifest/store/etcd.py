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

What is where: :class:`EtcdStore` here is the MetadataStore (publish, read and remove
in the orders above) and every etcd user's door to the cluster (``call``, ``race``,
``watch_prefix``: membership, preload, status); it composes :class:`VersionRecords`
(``etcd_versions.py``: the ``datasets/`` keys, their transactions and signatures) and
:class:`ManifestParts` (``etcd_parts.py``: the ``manifests/`` parts). Endpoints,
failover, error mapping and the gRPC client live in ``etcd_client.py``
(:class:`EtcdClient`): requests go through its ``call`` (one endpoint at a time, for
writes that must not run twice) or ``race`` (every rail at once). A transaction whose
reply was lost (deadline, reset) is sent again, so each is written to be harmless when
repeated: allocate at worst skips a version number, seal re-puts the same info; only
``remove`` may then report ``DatasetNotFound`` for the version it has just removed.

Capacity: etcd's default backend quota is 2 GB; each manifest version costs its blob
size plus etcd's MVCC history until compaction. Run etcd with auto-compaction.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ...config import StoreConfig
from ...errors import DatasetNotFound
from .base import DatasetInfo, MetadataStore, check_name, verify_blob
from .etcd_client import EtcdClient, WatchBatch, watch_once
from .etcd_parts import ManifestParts
from .etcd_versions import VersionRecords
from .signature import RecordSigner

log = logging.getLogger(__name__)

T = TypeVar("T")


class EtcdStore(MetadataStore):
    """MetadataStore over etcd, records signed with the cluster secret.

    Owns one :class:`EtcdClient` (``client``), whose endpoints, channels and failover
    every etcd user of the process shares through :meth:`call`, :meth:`race` and
    :meth:`watch_prefix` (membership, preload, status, under ``prefix``), and the two
    halves of a dataset in etcd: ``records`` (:class:`VersionRecords`, the signed
    ``datasets/`` keys) and ``parts`` (:class:`ManifestParts`, the manifest blobs).
    Blocking and thread-safe, as every :class:`MetadataStore`; ``signer`` is None when
    no secret was given (publish and dataset reads then raise ``ConfigError``)."""

    def __init__(self, cfg: StoreConfig, secret: bytes | None = None) -> None:
        """``secret``: the cluster secret (``cluster.secret()``). Dataset info and node
        records are signed and verified with a key derived from it (``signature.py``);
        without it the store still connects (``call``/``race``) but refuses to publish
        or read datasets (``ConfigError``)."""
        #: signs/verifies records under this prefix; None: no secret given
        self.signer = RecordSigner(secret) if secret else None
        self.client = EtcdClient(cfg)
        self.cfg = cfg
        self.prefix = cfg.etcd_prefix
        self.timeout = self.client.timeout
        self.records = VersionRecords(self.client, self.prefix, self.signer)
        self.parts = ManifestParts(self.client, self.prefix)

    def __repr__(self) -> str:
        return f"EtcdStore({self.client.urls!r}, prefix={self.prefix!r})"

    @property
    def identity(self) -> str:
        from . import identity

        return identity(self.cfg)

    def part_key(self, name: str, version: int, index: int) -> str:
        """The etcd key of one manifest part (for tests and ``etcdctl`` forensics)."""
        return self.parts.key(name, version, index)

    # -- requests (etcd_client.py) ------------------------------------------------------------

    def call(self, op: Callable[[Any], T], budget: float | None = None) -> T:
        """``op(client)`` one endpoint at a time (:meth:`EtcdClient.call`). Membership,
        preload and status share the store's endpoints, credentials and ``etcd_prefix``
        through this and :meth:`race` (``cluster/membership.py``)."""
        return self.client.call(op, budget)

    def race(self, op: Callable[[Any], T], budget: float | None = None) -> T:
        """An idempotent ``op(client)`` on every endpoint at once (:meth:`EtcdClient.race`)."""
        return self.client.race(op, budget)

    def keep_alive(self, lease_id: int, budget: float) -> int:
        """A keep-alive of ``lease_id`` within ``budget`` s; the TTL etcd answered (0: the
        lease is gone). One stream per endpoint for the process (:meth:`EtcdClient.keep_alive`)."""
        return self.client.keep_alive(lease_id, budget)

    def watch_prefix(self, prefix: str, start_revision: int, timeout: float,
                     on_batch: Callable[[WatchBatch], None] | None = None) -> WatchBatch | None:
        """Block until a key under ``prefix`` (a full key) changes at or after
        ``start_revision`` (the changes: a :class:`WatchBatch`), or ``timeout`` s pass
        with no change (None); a bounded watch (:func:`watch_once`) sent like any
        :meth:`call`, so a cut rail costs one attempt timeout. With ``on_batch``: every
        change goes to it until ``timeout`` (None) or a listing is asked for (that
        batch); a stream that fails meanwhile is watched again from after the last
        batch, never from ``start_revision`` (no change is applied twice)."""
        after = [start_revision]

        def seen(batch: WatchBatch) -> None:
            after[0] = batch.revision + 1
            assert on_batch is not None
            on_batch(batch)
        return self.client.call(lambda c: watch_once(
            c, prefix, after[0], timeout, self.client.attempt_timeout,
            seen if on_batch is not None else None))

    def revision(self) -> int:
        """etcd's current revision (a one-key read: its response header)."""
        return int(self.client.call(lambda c: c.get_response(self.prefix)).header.revision)

    @property
    def authenticated(self) -> bool:
        return self.client.authenticated

    @property
    def reachable(self) -> bool | None:
        """Whether the last request was answered (None before the first)."""
        return self.client.reachable

    # -- the MetadataStore: publish, read, remove (the orders of the module docstring) --------

    def publish(self, info: DatasetInfo, blob: bytes) -> DatasetInfo:
        name = check_name(info.name)
        t0 = time.monotonic()
        version = self.records.allocate(name)
        sealed = info.sealed(version, blob, time.time())
        parts = self.parts.put(name, version, blob)
        self.records.seal(sealed, parts)
        log.info("published %s v%d: %d bytes in %d parts (%.2fs)",
                 name, version, len(blob), parts, time.monotonic() - t0)
        return sealed

    def dataset(self, name: str, version: int | None = None) -> DatasetInfo:
        return DatasetInfo.from_json(self.records.resolve(name, version))

    def datasets(self) -> list[DatasetInfo]:
        return self.records.currents()

    def versions(self, name: str) -> list[int]:
        return self.records.versions(name)

    def manifest(self, name: str, version: int) -> bytes:
        return self._blob(self.records.resolve(name, version))

    def fetch(self, name: str, version: int | None = None) -> tuple[DatasetInfo, bytes]:
        # the record read once: a job-start storm's etcd bytes are per request
        record = self.records.resolve(name, version)
        return DatasetInfo.from_json(record), self._blob(record)

    def _blob(self, record: dict[str, Any]) -> bytes:
        """The blob a resolved (verified: signature, parts, sha256) record names."""
        info = DatasetInfo.from_json(record)
        name, version = info.name, info.version
        pieces = []
        for key, value in self.parts.read(name, version, record["parts"]):
            if value is None:
                if self.records.record(name, version) is None:
                    raise DatasetNotFound(f"dataset {name!r} v{version} was removed while reading it")
                log.error("etcd: manifest part %s is missing", key)
                value = b""         # verify_blob reports it as corrupt, with sizes
            pieces.append(value)
        return verify_blob(info, b"".join(pieces))

    def remove(self, name: str, version: int | None = None) -> None:
        self._remove(name, version)
        self._sweep_after_remove()

    def _remove(self, name: str, version: int | None) -> None:
        if version is None:
            self.records.versions(name)     # DatasetNotFound if there is nothing to remove
        elif self.records.remove_version(name, version):
            self.parts.delete(name, version)
            log.info("removed %s v%d", name, version)
            return
        # the whole dataset (or its last version); metadata first: once it is gone nobody
        # starts reading the parts
        self.records.remove_all(name)
        self.parts.delete_all(name)
        log.info("removed dataset %s", name)

    def close(self) -> None:
        self.client.close()
