"""A dataset's versions in etcd: the ``P datasets/<name>/`` keys and their transactions.

``last`` (the highest version ever allocated), ``current`` and ``v<N>/info`` (the
:class:`~kspeedfs.manifest.store.base.DatasetInfo` of version N plus its parts layout,
signed for its key: ``signature.py``). The publish and remove protocol these
compare-and-swap transactions implement, and why each is harmless when repeated, is in
``etcd.py``'s docstring; the manifest's bytes are ``etcd_parts.py``'s.
"""
from __future__ import annotations

import logging
import random
import re
import time
from typing import Any

import etcd3.transactions as tx

from ...errors import ConfigError, DatasetNotFound, RecordUnverified, StoreError, VersionConflict
from ...tuning import CAS_ATTEMPTS
from .base import DatasetInfo, check_name
from .etcd_client import EtcdClient
from .etcd_parts import PART_SIZE, check_layout
from .signature import RecordSigner

log = logging.getLogger(__name__)

_INFO = re.compile(r"^v(\d+)/info$")


class VersionRecords:
    """The ``datasets/`` keys of one etcd prefix: allocate, seal, read and remove versions.

    Promises: :meth:`allocate` returns a version number no other caller got; :meth:`seal`
    makes a version visible, and current unless a newer one already is; every record it
    returns is verified (signed with this cluster's key for exactly its key, else
    ``RecordUnverified``; a valid info of that name and version with a SHA-256 and a
    consistent parts layout, else ``StoreError``); ``DatasetNotFound`` for what does not
    exist. Signing and verifying need the cluster secret (``signer``): without it these
    raise ``ConfigError``. Blocking and thread-safe: every request goes through the
    store's shared :class:`EtcdClient` with ``call``; manifest parts are not touched."""

    def __init__(self, client: EtcdClient, prefix: str, signer: RecordSigner | None) -> None:
        self.client = client
        self.prefix = prefix
        self.signer = signer

    def key(self, name: str, *rest: str) -> str:
        """``P datasets/<name>[/<rest>...]``."""
        return "/".join([f"{self.prefix}datasets/{check_name(name)}", *rest])

    def _get(self, key: str) -> tuple[bytes | None, Any]:
        got: tuple[bytes | None, Any] = self.client.call(lambda c: c.get(key))
        return got

    def _txn(self, compare: list[Any], success: list[Any],
             failure: list[Any]) -> tuple[bool, list[Any]]:
        done: tuple[bool, list[Any]] = self.client.call(
            lambda c: c.transaction(compare=compare, success=success, failure=failure))
        return done

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

    # -- publish --------------------------------------------------------------------------

    def allocate(self, name: str) -> int:
        """Publish step 1: bump ``last`` by compare-and-swap; the new value is ours alone."""
        key = self.key(name, "last")
        value, meta = self._get(key)
        for _ in range(CAS_ATTEMPTS):
            version = (int(value) if value is not None else 0) + 1
            ok, resp = self._txn([self._unchanged(key, value, meta)],
                                 [tx.Put(key, str(version))], [tx.Get(key)])
            if ok:
                return version
            value, meta = self._first_kv(resp)
            time.sleep(random.uniform(0, 0.005))
        raise VersionConflict(f"could not allocate a version of {name!r}: "
                              f"{CAS_ATTEMPTS} compare-and-swap attempts lost")

    def seal(self, sealed: DatasetInfo, parts: int) -> None:
        """Publish step 3: put the signed info record of ``sealed`` (its blob in
        ``parts`` parts of PART_SIZE), making the version visible, and current unless a
        newer one already is."""
        name, version = sealed.name, sealed.version
        cur_key, info_key = self.key(name, "current"), self.key(name, f"v{version}", "info")
        record = self._signer().seal_json(
            info_key, {**sealed.to_json(), "parts": parts, "part_size": PART_SIZE})
        value, meta = self._get(cur_key)
        for _ in range(CAS_ATTEMPTS):
            ops = [tx.Put(info_key, record)]
            if value is None or int(value) < version:
                ops.append(tx.Put(cur_key, str(version)))
            ok, resp = self._txn([self._unchanged(cur_key, value, meta)], ops, [tx.Get(cur_key)])
            if ok:
                return
            value, meta = self._first_kv(resp)
        raise VersionConflict(f"could not make {name!r} v{version} visible: "
                              f"{CAS_ATTEMPTS} compare-and-swap attempts lost")

    # -- read -----------------------------------------------------------------------------

    def _signer(self) -> RecordSigner:
        if self.signer is None:
            raise ConfigError("the etcd store signs and verifies dataset records with the "
                              "cluster secret (cluster.secret_file), and none was given")
        return self.signer

    def record(self, name: str, version: int) -> dict[str, Any] | None:
        """The verified info record of ``name`` v``version``, or None when it has none."""
        key = self.key(name, f"v{version}", "info")
        raw, _ = self._get(key)
        if raw is None:
            return None
        return self.verified(key, raw, name, version)

    def verified(self, key: str, raw: bytes, name: str, version: int) -> dict[str, Any]:
        """The verified info record stored at ``key`` (the class docstring's checks)."""
        record: dict[str, Any] = self._signer().open_json(key, raw)
        try:
            info = DatasetInfo.from_json(record)
            check_layout(record.get("parts"), record.get("part_size"), info.manifest_size)
            if info.name != name or info.version != version:
                raise ValueError(f"it describes {info.name} v{info.version}")
            if not info.sha256:
                raise ValueError("no sha256 of the manifest")
        except ValueError as e:
            raise StoreError(f"etcd key {key} is corrupt: {e}") from e
        return record

    def _current(self, name: str) -> int:
        raw, _ = self._get(self.key(name, "current"))
        if raw is None:
            raise DatasetNotFound(f"no dataset named {name!r} in etcd under {self.prefix!r}")
        try:
            return int(raw)
        except ValueError as e:
            raise StoreError(f"etcd key {self.key(name, 'current')} is corrupt: {raw!r}") from e

    def resolve(self, name: str, version: int | None) -> dict[str, Any]:
        """The info record of ``version`` (default current). A concurrent remove can move
        ``current`` between our two reads, so re-read it a few times before giving up."""
        check_name(name)
        for _ in range(5):
            v = self._current(name) if version is None else version
            record = self.record(name, v)
            if record is not None:
                return record
            if version is not None:
                raise DatasetNotFound(f"dataset {name!r} has no version {version}")
        raise DatasetNotFound(f"dataset {name!r}: current version vanished while reading it")

    def currents(self) -> list[DatasetInfo]:
        """The current version of every dataset whose record verifies, by name."""
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
                record = self.verified(base + rel_info, raw, name, version)
            except RecordUnverified:    # the signer logged it (once): not listed
                log.debug("etcd: dataset %r v%d has no valid signature; not listed", name, version)
                continue
            out.append(DatasetInfo.from_json(record))
        return sorted(out, key=lambda i: i.name)

    def versions(self, name: str) -> list[int]:
        base = self.key(name) + "/"
        kvs = self.client.call(lambda c: list(c.get_prefix(base, keys_only=True)))
        vs = sorted(int(m.group(1)) for _, meta in kvs
                    if (m := _INFO.match(meta.key.decode(errors="replace")[len(base):])))
        if not vs:
            raise DatasetNotFound(f"no dataset named {name!r} in etcd under {self.prefix!r}")
        return vs

    # -- remove ---------------------------------------------------------------------------

    def remove_version(self, name: str, version: int) -> bool:
        """Delete ``v<version>/info`` and, if it was current, point ``current`` at the
        newest remaining version, in one transaction. False, with nothing deleted, when
        it is the dataset's only version: the caller removes the whole dataset."""
        cur_key = self.key(name, "current")
        for _ in range(CAS_ATTEMPTS):
            value, meta = self._get(cur_key)
            vs = self.versions(name)
            if version not in vs:
                raise DatasetNotFound(f"dataset {name!r} has no version {version}")
            rest = [v for v in vs if v != version]
            if not rest:
                return False
            ops: list[Any] = [tx.Delete(self.key(name, f"v{version}", "info"))]
            if value is None or int(value) == version:
                ops.append(tx.Put(cur_key, str(rest[-1])))
            ok, _ = self._txn([self._unchanged(cur_key, value, meta)], ops, [])
            if ok:
                return True
        raise VersionConflict(f"could not remove {name!r} v{version}: "
                              f"{CAS_ATTEMPTS} compare-and-swap attempts lost")

    def remove_all(self, name: str) -> None:
        """Every ``datasets/<name>/`` key: the numbering starts again at 1."""
        self.client.call(lambda c: c.delete_prefix(self.key(name) + "/"))
