"""The metadata store: where dataset manifests live between import and mount.

One interface, two backends: ``embedded.py`` (a directory on local disk, no server;
the single-node default) and ``etcd.py`` (a real etcd cluster, which the cluster
membership also uses). ``tests/t1_store_contract.py`` runs the same contract over both.

The store is on the control path only. Import publishes a manifest once; a mount
fetches one version once and never talks to the store again on lookup/getattr/read
(see ``manifest/index.py``).

Versioning. A dataset is a sequence of immutable versions 1, 2, 3, ...; ``publish``
allocates the next version number and makes it current atomically (an flock in the
embedded store, a compare-and-swap transaction in etcd), so two concurrent imports
of one name get two versions, never one overwritten manifest. A version's blob is
never modified after publish; ``remove`` deletes whole versions.

Integrity. The blob's xxh3-128 digest is recorded in :class:`DatasetInfo` and checked
by :meth:`MetadataStore.manifest` on every fetch (``ManifestCorrupt`` on mismatch).
"""
from __future__ import annotations

import abc
import re
from dataclasses import asdict, dataclass, replace
from typing import Any

import xxhash

from ...errors import ConfigError, ManifestCorrupt

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_name(name: str) -> str:
    """Dataset names are used as store keys and in paths: keep them to a safe alphabet."""
    if not _NAME.match(name):
        raise ConfigError(
            f"invalid dataset name {name!r}: use 1-128 characters from A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit"
        )
    return name


def blob_digest(blob: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(blob)


@dataclass(frozen=True)
class DatasetInfo:
    """What ``kspeedfs ls`` shows and what a mount needs before it fetches the blob."""

    name: str
    version: int          # 0 until publish assigns one
    files: int            # regular files
    entries: int          # all inodes: files, directories, symlinks
    bytes: int            # sum of regular file sizes
    chunks: int
    chunk_size: int
    imported_at: float    # unix time of publish
    source: str           # source directory as given to import (surrogateescape for non-UTF-8)
    digest: str = ""      # xxh3-128 hex of the manifest blob
    manifest_size: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "DatasetInfo":
        fields = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in fields})

    def sealed(self, version: int, blob: bytes, imported_at: float) -> "DatasetInfo":
        return replace(
            self, version=version, digest=blob_digest(blob), manifest_size=len(blob),
            imported_at=imported_at,
        )


def verify_blob(info: DatasetInfo, blob: bytes) -> bytes:
    if len(blob) != info.manifest_size or blob_digest(blob) != info.digest:
        raise ManifestCorrupt(
            f"manifest of {info.name} v{info.version} is corrupt in the store "
            f"({len(blob)} bytes, expected {info.manifest_size}); re-import the dataset"
        )
    return blob


class MetadataStore(abc.ABC):
    """Dataset manifests, versioned and immutable. All methods are blocking; call them
    from a worker thread under trio. Errors: ``StoreUnavailable`` when the backend cannot
    be reached, ``DatasetNotFound`` for an unknown name/version, ``ManifestCorrupt``."""

    @abc.abstractmethod
    def publish(self, info: DatasetInfo, blob: bytes) -> DatasetInfo:
        """Store ``blob`` as the next version of ``info.name`` and make it current.
        Returns the sealed info (version, digest, size, imported_at filled in)."""

    @abc.abstractmethod
    def datasets(self) -> list[DatasetInfo]:
        """The current version of every dataset, sorted by name."""

    @abc.abstractmethod
    def dataset(self, name: str, version: int | None = None) -> DatasetInfo:
        """Info of one version (default: the current one)."""

    @abc.abstractmethod
    def versions(self, name: str) -> list[int]:
        """All stored versions of a dataset, ascending (``DatasetNotFound`` if none)."""

    @abc.abstractmethod
    def manifest(self, name: str, version: int) -> bytes:
        """The blob of one version, verified against its digest."""

    @abc.abstractmethod
    def remove(self, name: str, version: int | None = None) -> None:
        """Delete one version, or the whole dataset when ``version`` is None. Removing
        the current version makes the newest remaining one current."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections. Idempotent."""

    def __enter__(self) -> "MetadataStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
