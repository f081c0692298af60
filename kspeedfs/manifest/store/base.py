"""The metadata store: where dataset manifests live between import and mount.

One interface, two backends: ``embedded.py`` (a directory on local disk, no server;
the single-node default) and ``etcd.py`` (a real etcd cluster, which the cluster
membership also uses). ``tests/etcd/test_store_contract.py`` runs the same contract over both.

The store is on the control path only. Import publishes a manifest once; a mount
fetches one version once and never talks to the store again on lookup/getattr/read
(see ``manifest/index.py``).

Versioning. A dataset is a sequence of immutable versions 1, 2, 3, ...; ``publish``
allocates the next version number and makes it current atomically (an flock in the
embedded store, a compare-and-swap transaction in etcd), so two concurrent imports
of one name get two versions, never one overwritten manifest. A version's blob is
never modified after publish; ``remove`` deletes whole versions.

Integrity. The blob's size, xxh3-128 digest and SHA-256 are recorded in
:class:`DatasetInfo` and checked by :meth:`MetadataStore.manifest` on every fetch
(``ManifestCorrupt`` on mismatch). xxh3 catches accidents; SHA-256 is what makes the
blob as trustworthy as the info record: in etcd the info record is signed with a key
derived from the cluster secret (``signature.py``), so a writer without the secret can
neither change a version's info nor, through a second preimage of a non-cryptographic
hash, its blob. ``inflated_size`` declares the blob's size after zlib; the index
loader (``manifest/index.py``) refuses to inflate past it, so a zlib bomb costs at most
that. Records written before these fields existed (embedded store only: it is local
and stays unsigned) have ``sha256 = ""`` and ``inflated_size = 0`` and are checked by
xxh3 only and inflated without a cap.

Parsing. :meth:`DatasetInfo.from_json` takes untrusted JSON: it returns a valid info
or raises ``ValueError`` (wrong type, missing field, out of range), never ``TypeError``
or ``KeyError``; the stores turn that into ``StoreError``.
"""
from __future__ import annotations

import abc
import builtins
import hashlib
import logging
import math
import re
import zlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any

import xxhash

from ...errors import ConfigError, ManifestCorrupt, SourceError, StoreError
from ...tuning import PAGE_PUTS
from ..pages import PageDirectory, PageStore, Root, is_root, referenced, sweep, write_pages

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_name(name: str) -> str:
    """Dataset names are used as store keys and in paths: keep them to a safe alphabet."""
    if not _NAME.match(name):
        raise ConfigError(
            f"invalid dataset name {name!r}: use 1-128 characters from A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit"
        )
    return name


_HEX = re.compile(r"^[0-9a-f]*$")
_INT_MAX = (1 << 63) - 1
_INT_FIELDS = ("version", "files", "entries", "bytes", "chunks", "chunk_size", "manifest_size",
               "inflated_size")


def blob_digest(blob: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(blob)


def blob_sha256(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


def _want_int(d: dict[str, Any], key: str) -> int:
    v = d[key]
    if type(v) is not int or not 0 <= v <= _INT_MAX:
        raise ValueError(f"{key}: not an integer in 0..2^63-1 ({type(v).__name__})")
    return v


def _want_str(d: dict[str, Any], key: str, pattern: re.Pattern[str] | None = None,
              max_len: int = 1 << 16) -> str:
    v = d[key]
    if not isinstance(v, str) or len(v) > max_len or (pattern is not None and not pattern.fullmatch(v)):
        raise ValueError(f"{key}: not a valid string ({type(v).__name__})")
    return v


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
    inflated_size: int = 0  # bytes after zlib (0: unknown, a record from before the field)
    sha256: str = ""      # SHA-256 hex of the manifest blob ("" in records from before it)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Any) -> DatasetInfo:
        """Parse untrusted JSON; ``ValueError`` unless every field has its type and range.
        Keys that are not fields (``parts``, ...) are ignored; ``digest``, ``sha256``,
        ``manifest_size`` and ``inflated_size`` may be missing (older records)."""
        if not isinstance(d, dict):
            raise ValueError(f"a dataset info record must be a JSON object, not {type(d).__name__}")
        fields = cls.__dataclass_fields__
        d = {k: v for k, v in d.items() if k in fields}
        for key in ("digest", "sha256", "manifest_size", "inflated_size"):
            d.setdefault(key, fields[key].default)
        missing = sorted(set(fields) - set(d))
        if missing:
            raise ValueError(f"dataset info record lacks {', '.join(missing)}")
        _want_str(d, "name", _NAME)
        for key in _INT_FIELDS:
            _want_int(d, key)
        if d["chunk_size"] == 0 and d["chunks"]:
            raise ValueError("chunk_size: 0 with chunks")
        t = d["imported_at"]
        if not ((type(t) is int and abs(t) <= _INT_MAX)
                or (type(t) is float and math.isfinite(t))):
            raise ValueError(f"imported_at: not a finite number ({type(t).__name__})")
        _want_str(d, "source", max_len=1 << 14)
        _want_str(d, "digest", _HEX, 32)
        _want_str(d, "sha256", _HEX, 64)
        return cls(**d)

    # builtins.bytes: in this class body ``bytes`` is the field above
    def sealed(self, version: int, blob: builtins.bytes, imported_at: float) -> DatasetInfo:
        return replace(
            self, version=version, digest=blob_digest(blob), manifest_size=len(blob),
            imported_at=imported_at, sha256=blob_sha256(blob),
        )


def verify_blob(info: DatasetInfo, blob: bytes) -> bytes:
    if (len(blob) != info.manifest_size or blob_digest(blob) != info.digest
            or (info.sha256 and blob_sha256(blob) != info.sha256)):
        raise ManifestCorrupt(
            f"manifest of {info.name} v{info.version} is corrupt in the store "
            f"({len(blob)} bytes, expected {info.manifest_size}); re-import the dataset"
        )
    return blob


class MetadataStore(abc.ABC):
    """Dataset manifests, versioned and immutable. All methods are blocking; call them
    from a worker thread under trio. Errors: ``StoreUnavailable`` when the backend cannot
    be reached, ``DatasetNotFound`` for an unknown name/version, ``ManifestCorrupt``."""

    #: the directory manifest pages go to (``manifest/pages.py``); None: see :attr:`pages`
    page_dir: str | None = None
    #: where manifest pages go when it is not :attr:`page_dir` (a bucket ``store.pages``,
    #: ``objstore/pages.py``); None for both: every manifest whole
    pages: PageStore | None = None
    #: a manifest inflating past this many bytes is stored as pages (``store.paged_above``)
    paged_above: int = 1 << 20

    def page_sink(self) -> PageStore | None:
        """Where this store writes, reads and sweeps pages: :attr:`pages`, else
        :attr:`page_dir`; None for neither."""
        if self.pages is not None:
            return self.pages
        return PageDirectory(self.page_dir) if self.page_dir is not None else None

    @abc.abstractmethod
    def publish(self, info: DatasetInfo, blob: bytes) -> DatasetInfo:
        """Store ``blob`` as the next version of ``info.name`` and make it current.
        Returns the sealed info (version, digest, size, imported_at filled in)."""

    def publish_stream(self, info: DatasetInfo, pieces: Iterable[bytes | bytearray | memoryview],
                       inflated_size: int) -> DatasetInfo:
        """Publish a manifest given as its inflated bytes, in pieces (the importer's
        bounded-memory output): past :attr:`paged_above`, and when the store has a
        :meth:`page_sink`, as pages with their root as the version's blob; otherwise
        zlib'd into one blob."""
        info = replace(info, inflated_size=inflated_size)
        sink = self.page_sink()
        if sink is not None and inflated_size > self.paged_above:
            # a bucket's PUTs are round trips: several at once; a directory's are not
            workers = 1 if isinstance(sink, PageDirectory) else PAGE_PUTS
            root, stored = write_pages(pieces, sink, workers=workers)
            log.info("%s: %d bytes of manifest pages written to %s", info.name, stored,
                     sink.where)
            return self.publish(info, root)
        z = zlib.compressobj(1)
        out = [z.compress(piece) for piece in pieces]
        out.append(z.flush())
        return self.publish(info, b"".join(out))

    def sweep_pages(self, grace: float = 3600.0) -> int:
        """Delete the manifest pages no stored version needs and nothing touched for
        ``grace`` seconds (``pages.sweep``); how many went (0 without a page sink).
        A version whose pages cannot be read stops the sweep (its error), never widens it."""
        sink = self.page_sink()
        if sink is None:
            return 0
        keep: set[bytes] = set()
        for info in self.datasets():
            for v in self.versions(info.name):
                blob = self.manifest(info.name, v)
                if is_root(blob):
                    keep |= referenced(Root.parse(blob), [sink])
        return sweep(sink, keep, grace)

    def _sweep_after_remove(self) -> None:
        """After a remove: its pages go unless another version shares them. A sweep that
        fails is logged; the remove itself stands."""
        try:
            gone = self.sweep_pages()
        except (StoreError, SourceError, OSError) as e:
            log.warning("manifest pages not swept after a remove: %s", e)
            return
        if gone:
            log.info("swept %d manifest pages no version needs", gone)

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

    def fetch(self, name: str, version: int | None = None) -> tuple[DatasetInfo, bytes]:
        """:meth:`dataset` and :meth:`manifest` of one version (a mount's one store
        access); a backend may do it in fewer requests."""
        info = self.dataset(name, version)
        return info, self.manifest(info.name, info.version)

    @abc.abstractmethod
    def remove(self, name: str, version: int | None = None) -> None:
        """Delete one version, or the whole dataset when ``version`` is None. Removing
        the current version makes the newest remaining one current."""

    @property
    def identity(self) -> str:
        """This store's name in local mount records (``manifest.store.identity``); a
        backend without one matches no mount."""
        return repr(self)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections. Idempotent."""

    def __enter__(self) -> MetadataStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
