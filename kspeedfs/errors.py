"""The kspeedfs exception tree.

Every error a user or a reader can meet is a :class:`KspeedfsError` subclass, and the
rule is the one ``rdma.errors`` states for both trees (:class:`~rdma.errors.ErrnoError`
is their shared base, so ``rdma`` stays importable without ``kspeedfs``):

* each carries an int ``errno``, the one a FUSE reader sees: a class default given in the
  class statement (``class ReadOnly(KspeedfsError, errno=EROFS)``), inherited otherwise
  (EIO at the root), which one instance may override with ``errno=``; the message is for
  humans;
* what failed underneath (an ``OSError``, an ``rdma`` error) is chained as ``__cause__``
  (``raise StoreUnavailable(...) from exc``).

Exactly three places translate them, and they read ``err.errno`` the same way for this
tree and for ``rdma.errors``: ``fuse/boundary.py`` turns them into
``pyfuse3.FUSEError(err.errno)`` for the kernel, ``client.py`` (the Python library) into
the ``OSError(err.errno)`` that ``open()`` on a mount raises, and ``cli/app.py`` into a
one-line message and exit status 1. Nothing else catches them to print or to convert.
"""
from __future__ import annotations

import errno as _errno

from rdma.errors import ErrnoError as ErrnoError  # the base of both trees; the boundaries import it here


class KspeedfsError(ErrnoError):
    """Base class of the kspeedfs tree: EIO unless a subclass or the instance says otherwise."""


# -- configuration and the command line ------------------------------------------------

class ConfigError(KspeedfsError, errno=_errno.EINVAL):
    """A config value is invalid; the message names the key, the value and its source."""


class UnsafePath(ConfigError, errno=_errno.EPERM):
    """A file or directory a root process would trust (a node's arena, its index) could be
    reached or replaced by another user: refused before it is opened or mapped."""


class GrantRefused(KspeedfsError, errno=_errno.EACCES):
    """A request on a node's grant socket (``cluster/grant.py``) is not answered: the
    peer may not read the dataset (EACCES), or the request is malformed (EINVAL) or out
    of order (EALREADY, ENOENT): the errno names which, in the error reply."""


class GrantLost(KspeedfsError):
    """The grant connection of a library on a node's host failed: the node is gone, or
    it answered outside the protocol (``cluster/granted.py``). Never a reader's error:
    the grant is dropped and reads go to the peers."""


class MountError(KspeedfsError, errno=_errno.EINVAL):
    """The mount cannot be made (mountpoint missing, not empty, already mounted, ...)."""


# -- the metadata store ------------------------------------------------------------------

class StoreError(KspeedfsError):
    """The metadata store failed (I/O error, corrupt record)."""


class StoreUnavailable(StoreError, errno=_errno.EHOSTUNREACH):
    """The metadata store cannot be reached (etcd down, store directory unreadable)."""


class DatasetNotFound(StoreError, errno=_errno.ENOENT):
    """No dataset (or no such version of it) by that name."""


class VersionConflict(StoreError, errno=_errno.EAGAIN):
    """Someone else published the same version first (compare-and-swap lost)."""


class DatasetInUse(StoreError, errno=_errno.EBUSY):
    """A dataset version a live mount holds (``kspeedfs rm`` without ``--force``)."""


class CapacityExceeded(KspeedfsError, errno=_errno.ENOSPC):
    """A preload does not fit in the cluster beside what it holds (``cluster/lifecycle.py``)."""


class ManifestCorrupt(StoreError):
    """A manifest blob does not decode or does not match its recorded digest."""


class RecordUnverified(StoreError):
    """An etcd record (dataset info, node record) has no valid signature with this
    cluster's key: it was written without the cluster secret and is refused
    (``manifest/store/signature.py``)."""


# -- import ------------------------------------------------------------------------------

class SourceError(KspeedfsError, errno=_errno.ENOENT):
    """The source directory is missing or unreadable."""


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


class SourceTimeout(ChunkUnavailable, errno=_errno.ETIMEDOUT):
    """A read from an object store outlasted ``source.read_deadline`` (all its requests'
    attempts and backoff): ETIMEDOUT, as an NFS ``softerr`` mount answers a server that
    stopped answering, so a reader tells "the source is slow" from EIO's "no bytes"; the
    next read tries again."""


class LoadCancelled(KspeedfsError, errno=_errno.EINTR):
    """A shared load was cancelled before it finished (its nursery is closing): what
    the waiters of a single-flight get instead of a result."""


class ReadOnly(KspeedfsError, errno=_errno.EROFS):
    """kspeedfs serves immutable snapshots: every write-type operation."""
