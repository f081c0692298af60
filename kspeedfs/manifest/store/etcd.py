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

Endpoints, failover, error mapping and the gRPC client live in ``etcd_client.py``
(:class:`EtcdClient`): requests here go through ``self.client.call`` (one endpoint at
a time, for writes that must not run twice) or ``race`` (every rail at once). A
transaction whose reply was lost (deadline, reset) is sent again, so each is written
to be harmless when repeated: allocate at worst skips a version number, seal re-puts
the same info; only ``remove`` may then report ``DatasetNotFound`` for the version it
has just removed.

Capacity: etcd's default backend quota is 2 GB; each manifest version costs its blob
size plus etcd's MVCC history until compaction. Run etcd with auto-compaction.
"""
from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

import etcd3.transactions as tx  # noqa: E402

from ...config import StoreConfig  # noqa: E402
from ...errors import ConfigError, DatasetNotFound, RecordUnverified, StoreError, VersionConflict  # noqa: E402
from .base import DatasetInfo, MetadataStore, check_name, verify_blob  # noqa: E402
from .etcd_client import EtcdClient, watch_once  # first: it sets gRPC's fork option before grpc loads
from .signature import RecordSigner  # noqa: E402

log = logging.getLogger(__name__)

T = TypeVar("T")

PART_SIZE = 1 << 20          # bytes per manifest part key; etcd's request limit is 1.5 MiB
_CAS_ATTEMPTS = 200          # per transaction; each failed attempt means someone else won
_INFO = re.compile(r"^v(\d+)/info$")


class EtcdStore(MetadataStore):
    """MetadataStore over etcd, records signed with the cluster secret. Thread-safe:
    every request goes through one :class:`EtcdClient` (``client``), whose endpoints,
    channels and failover the cluster's membership shares through :meth:`call` and
    :meth:`race`."""

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

    def __repr__(self) -> str:
        return f"EtcdStore({self.client.urls!r}, prefix={self.prefix!r})"

    @property
    def identity(self) -> str:
        from . import identity

        return identity(self.cfg)

    # -- keys -----------------------------------------------------------------------------

    def _ds(self, name: str, *rest: str) -> str:
        return "/".join([f"{self.prefix}datasets/{check_name(name)}", *rest])

    def _parts_dir(self, name: str, version: int) -> str:
        return f"{self.prefix}manifests/{check_name(name)}/v{version}/"

    def part_key(self, name: str, version: int, index: int) -> str:
        """The etcd key of one manifest part (for tests and ``etcdctl`` forensics)."""
        return f"{self._parts_dir(name, version)}{index}"

    # -- requests (etcd_client.py) ------------------------------------------------------------

    def call(self, op: Callable[[Any], T]) -> T:
        """``op(client)`` one endpoint at a time (:meth:`EtcdClient.call`). Membership,
        preload and status share the store's endpoints, credentials and ``etcd_prefix``
        through this and :meth:`race` (``cluster/membership.py``)."""
        return self.client.call(op)

    def race(self, op: Callable[[Any], T], budget: float | None = None) -> T:
        """An idempotent ``op(client)`` on every endpoint at once (:meth:`EtcdClient.race`)."""
        return self.client.race(op, budget)

    def watch_prefix(self, prefix: str, start_revision: int, timeout: float) -> bool:
        """Block until a key under ``prefix`` (a full key) changes at or after
        ``start_revision`` (True), or ``timeout`` s pass with no change (False); a bounded
        watch (:func:`watch_once`) sent like any :meth:`call`, so a cut rail costs one
        attempt timeout."""
        return self.client.call(lambda c: watch_once(c, prefix, start_revision, timeout,
                                                     self.client.attempt_timeout))

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

    def _get(self, key: str) -> tuple[bytes | None, Any]:
        got: tuple[bytes | None, Any] = self.client.call(lambda c: c.get(key))
        return got

    def _txn(self, compare: list[Any], success: list[Any],
             failure: list[Any]) -> tuple[bool, list[Any]]:
        done: tuple[bool, list[Any]] = self.client.call(
            lambda c: c.transaction(compare=compare, success=success, failure=failure))
        return done

    # -- publish --------------------------------------------------------------------------

    def publish(self, info: DatasetInfo, blob: bytes) -> DatasetInfo:
        name = check_name(info.name)
        t0 = time.monotonic()
        version = self._allocate(name)
        sealed = info.sealed(version, blob, time.time())
        parts = range(0, len(blob), PART_SIZE)
        for i, off in enumerate(parts):
            key, chunk = self.part_key(name, version, i), blob[off:off + PART_SIZE]
            # call() runs op before returning: the loop variables are this part's
            self.client.call(lambda c: c.put(key, chunk))  # noqa: B023
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
        record: dict[str, Any] = self._need_signer().open_json(key, raw)
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
        kvs = self.client.call(lambda c: list(c.get_prefix(base)))
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
        kvs = self.client.call(lambda c: list(c.get_prefix(base, keys_only=True)))
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
                self.client.call(lambda c: c.delete_prefix(self._parts_dir(name, version)))
                log.info("removed %s v%d", name, version)
                return
        raise VersionConflict(f"could not remove {name!r} v{version}: "
                              f"{_CAS_ATTEMPTS} compare-and-swap attempts lost")

    def _remove_all(self, name: str) -> None:
        # Metadata first: once it is gone nobody starts reading the parts.
        self.client.call(lambda c: c.delete_prefix(self._ds(name) + "/"))
        self.client.call(lambda c: c.delete_prefix(f"{self.prefix}manifests/{name}/"))
        log.info("removed dataset %s", name)

    def close(self) -> None:
        self.client.close()
