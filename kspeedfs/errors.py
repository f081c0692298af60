"""The kspeedfs exception tree.

Every error a user or a reader can meet is a :class:`KspeedfsError` subclass that
carries the errno it means. Exactly two places translate them: ``fuse/boundary.py``
turns them into ``pyfuse3.FUSEError(errno)`` for the kernel, and ``cli/app.py``
turns them into a one-line message and a non-zero exit status. Nothing else
catches them to print or to convert.
"""
from __future__ import annotations

import errno as _errno


class KspeedfsError(Exception):
    """Base class. ``errno`` is what a FUSE reader sees; the message is for humans."""

    errno: int = _errno.EIO


# -- configuration and the command line ------------------------------------------------

class ConfigError(KspeedfsError):
    """A config value is invalid; the message names the key, the value and its source."""

    errno = _errno.EINVAL


class MountError(KspeedfsError):
    """The mount cannot be made (mountpoint missing, not empty, already mounted, ...)."""

    errno = _errno.EINVAL


# -- the metadata store ------------------------------------------------------------------

class StoreError(KspeedfsError):
    """The metadata store failed (I/O error, corrupt record)."""


class StoreUnavailable(StoreError):
    """The metadata store cannot be reached (etcd down, store directory unreadable)."""

    errno = _errno.EHOSTUNREACH


class DatasetNotFound(StoreError):
    """No dataset (or no such version of it) by that name."""

    errno = _errno.ENOENT


class VersionConflict(StoreError):
    """Someone else published the same version first (compare-and-swap lost)."""

    errno = _errno.EAGAIN


class ManifestCorrupt(StoreError):
    """A manifest blob does not decode or does not match its recorded digest."""


class RecordUnverified(StoreError):
    """An etcd record (dataset info, node record) has no valid signature with this
    cluster's key: it was written without the cluster secret and is refused
    (``manifest/store/signature.py``)."""


# -- import ------------------------------------------------------------------------------

class SourceError(KspeedfsError):
    """The source directory is missing or unreadable."""

    errno = _errno.ENOENT


# -- the read path -----------------------------------------------------------------------

class ChunkCorrupt(KspeedfsError):
    """Bytes from some tier do not match the manifest's checksum (they are discarded)."""


class SourceChanged(KspeedfsError):
    """The source no longer matches the snapshot: the named file changed; re-import.

    ``entries`` are the manifest entries whose bytes no longer match; ``partial`` is the
    chunk as read, whose *other* extents did verify, so files packed next to a changed
    one stay readable (the reader serves them from it, uncached).
    """

    def __init__(self, message: str, entries: frozenset[int] = frozenset(),
                 partial: bytes | None = None) -> None:
        super().__init__(message)
        self.entries = entries
        self.partial = partial


class ChunkUnavailable(KspeedfsError):
    """No tier could produce verified bytes for a chunk: the reader gets EIO."""


class ReadOnly(KspeedfsError):
    """kspeedfs serves immutable snapshots: every write-type operation."""

    errno = _errno.EROFS
