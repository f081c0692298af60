"""Reading a dataset without FUSE: the Python library behind ``kspeedfs.open_dataset``.

    open_dataset(name, version)          caller's thread: store → manifest → ManifestIndex
      └─ Dataset                         the façade docs/api.md describes; its parts:
           tree     client/tree.py       listdir / stat / walk: the index alone
                                         (immutable: no lock, no trio hop)
           reads    client/reads.py      read / read_many / open().read: resident in the
                                         memory tier? sliced right here; else one hop to
                                         the loop (a batch: one for all)
           _loop    client/loop.py       the trio thread ("kspeedfs-<name>") holding the
                                         same Reader as a mount (compose.py), so the same
                                         tiers, replicas, hedging and checksums
      DatasetFile                        one open file: a read stream of its own

One boundary (``client/errors.py``): every error a public call raises is what ``open()``
and ``read()`` on the mount raise — FileNotFoundError, NotADirectoryError,
IsADirectoryError, and ``OSError(err.errno)`` for the kspeedfs and rdma trees
(ChunkUnavailable and SourceChanged are EIO), with the original as ``__cause__``; a
bug is logged with its traceback and raised as EIO. A closed dataset or file raises
ValueError, as a closed Python file does.

Processes: a handle belongs to the process that opened it (its thread and, in a cluster,
its gRPC channels and vRDMA endpoint do not survive a fork): using it in a forked child
raises RuntimeError. Open one per process, after the fork (``kspeedfs.torch`` does).
"""
from __future__ import annotations

import dataclasses
import errno
import io
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from .. import compose
from ..cache.prefetch import Stream
from ..config import Config, load
from ..manifest.index import ManifestIndex
from ..manifest.load import open_on_host
from ..manifest.store.base import DatasetInfo
from ..stats import ReadStatistics
from .errors import PathLike, boundary, mapped, oserror
from .loop import ReadLoop
from .reads import FileReads
from .tree import DatasetTree

__all__ = ["Dataset", "DatasetFile", "open_dataset"]


def _config(etcd: Sequence[str] | None, config: Config | str | os.PathLike[str] | Mapping[str, Any] | None,
            ) -> Config:
    """The effective configuration: ``config`` as a Config is used as is; a path is the
    TOML file; a mapping is ``section.key`` overrides (like ``--set``) on top of the
    defaults, ``/etc/kspeedfs/kspeedfs.toml`` and the environment. ``etcd`` selects the
    etcd store at those endpoints (like ``--etcd``)."""
    cluster = {"store.backend": "etcd", "store.etcd": list(etcd)} if etcd else {}
    if isinstance(config, Config):
        if not cluster:
            return config
        store = dataclasses.replace(config.store, backend="etcd", etcd=list(etcd or ()))
        return dataclasses.replace(config, store=store).validate()
    if config is None or isinstance(config, (str, os.PathLike)):
        return load(config, overrides=cluster)
    return load(overrides={**config, **cluster})


def open_dataset(name: str, version: int | None = None, *, etcd: Sequence[str] | None = None,
                 config: Config | str | os.PathLike[str] | Mapping[str, Any] | None = None,
                 source: str | None = None) -> Dataset:
    """Open version ``version`` (None: the newest) of dataset ``name`` for reading.

    Args:
        name: the dataset's name (``kspeedfs ls``).
        version: a version number; None for the newest.
        etcd: the cluster's etcd endpoints (one per rail); None: the configured store
            (single node: the embedded store at ``store.path``).
        config: a :class:`~kspeedfs.config.Config`, a TOML file, or a mapping of
            ``section.key`` overrides such as ``{"store.path": "/data/store",
            "cache.memory": "256MiB"}``; None: defaults < ``/etc/kspeedfs/kspeedfs.toml``
            < ``KSPEEDFS_*`` environment, as for the CLI.
        source: read the source from here instead of where it was imported from
            (a mount's ``--source``).

    Returns:
        A :class:`Dataset`; close it (or use it as a context manager).

    Raises:
        FileNotFoundError: no such dataset or version (or its source directory is gone).
        OSError: the store cannot be read (its errno: EHOSTUNREACH for etcd down,
            EINVAL for a bad configuration value, whose message names the key).
    """
    with boundary(name):
        cfg = _config(etcd, config)
        info, blob = compose.fetch_manifest(cfg, name, version)
        index = open_on_host(cfg, blob, info)
        del blob
        return Dataset(cfg, info, index, source)


class Dataset:
    """One dataset version, readable from any thread of the process that opened it.

    Paths are relative to the dataset's root (a leading ``/`` is allowed), ``str`` or
    ``bytes`` (names that are not UTF-8: ``os.fsencode``/``os.fsdecode``, as ``os``
    does). Symlinks inside the dataset are followed; an absolute target is ENOENT, and
    ``..`` stops at the dataset's root, as at ``/``. Every call raises what the mount
    would (``client/errors.py``), ValueError once closed, RuntimeError in a forked child.
    This class checks arguments and delegates: the namespace to ``tree``, file bytes to
    ``reads``, the trio thread's lifetime to its loop.

    Attributes:
        info: the dataset's record (name, version, files, bytes, chunk size, source).
        index: the manifest (read-only, shared by every thread).
        tree: the namespace (``tree.DatasetTree``).
        reads: file bytes by entry (``reads.FileReads``).
    """

    def __init__(self, cfg: Config, info: DatasetInfo, index: ManifestIndex,
                 source: str | None = None) -> None:
        self.info = info
        self.index = index
        self._loop = ReadLoop(cfg, info, index, source)
        self.tree = DatasetTree(index, self._loop.check)
        self.reads = FileReads(index, self._loop)

    # -- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the read loop and drop the tiers; idempotent. Open files fail afterwards."""
        self._loop.close()

    def __enter__(self) -> Dataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._loop.closed

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def version(self) -> int:
        return self.info.version

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.info.entries} entries"
        return f"<kspeedfs.Dataset {self.info.name}@{self.info.version} {state}>"

    def statistics(self) -> ReadStatistics:
        """The Reader's counters (tier hits, source and peer loads, checksum failures),
        as a mount's ``user.kspeedfs.stats`` shows them."""
        return self._loop.statistics()

    # -- metadata: the index alone (DatasetTree) ---------------------------------------------

    def stat(self, path: PathLike = "", *, follow_symlinks: bool = True) -> os.stat_result:
        """What ``os.stat`` on the mount returns (``DatasetTree.stat``)."""
        return self.tree.stat(path, follow_symlinks=follow_symlinks)

    def exists(self, path: PathLike) -> bool:
        return self.tree.exists(path)

    def isdir(self, path: PathLike) -> bool:
        return self.tree.isdir(path)

    def isfile(self, path: PathLike) -> bool:
        return self.tree.isfile(path)

    def listdir(self, path: PathLike = "") -> list[str] | list[bytes]:
        """Names in directory ``path``, in name order (bytes when ``path`` is bytes,
        as ``os.listdir``)."""
        return self.tree.listdir(path)

    def walk(self, top: PathLike = "") -> Iterator[tuple[str, list[str], list[str]]]:
        """``os.walk`` over the dataset, top-down (``DatasetTree.walk``)."""
        return self.tree.walk(top)

    # -- data (FileReads) --------------------------------------------------------------------

    def read(self, path: PathLike, offset: int = 0, size: int | None = None) -> bytes:
        """The bytes of file ``path`` from ``offset`` (``size`` of them, fewer at its end;
        None: to the end), verified, from the nearest tier.

        Raises:
            FileNotFoundError, IsADirectoryError, NotADirectoryError: as ``open()``.
            OSError: EIO when no tier can produce verified bytes (ChunkUnavailable) or
                the source changed since import (SourceChanged).
        """
        entry, offset, size = self._job(path, offset, size)
        return self.reads.read(entry, offset, size, path) if size else b""

    async def aread(self, path: PathLike, offset: int = 0, size: int | None = None) -> bytes:
        """:meth:`read` for asyncio and trio code: awaited, with no thread blocked on it
        (a memory hit is answered at once; a load runs in the dataset's trio thread
        while the caller's event loop goes on). Cancelling the caller abandons the
        answer. Raises as :meth:`read`."""
        entry, offset, size = self._job(path, offset, size)
        return await self.reads.aread(entry, offset, size, path) if size else b""

    def _job(self, path: PathLike, offset: int, size: int | None) -> tuple[int, int, int]:
        """(entry, offset, size) of a read of ``path``, its size cut at the file's end."""
        entry = self.tree.file(path)
        if offset < 0 or (size is not None and size < 0):
            raise ValueError("offset and size must be >= 0")
        end = self.index.size[entry] if size is None else min(offset + size, self.index.size[entry])
        return entry, offset, max(0, end - offset)

    def read_many(self, items: Iterable[PathLike | tuple[PathLike, int, int | None]], *,
                  return_exceptions: bool = False) -> list[Any]:
        """:meth:`read` of each item — a path (the whole file) or ``(path, offset, size)``
        (``size`` None: to the end) — the loads overlapped (up to
        ``tuning.READ_MANY_CONCURRENCY`` files at once, each file's chunks concurrently): a batch
        costs about its slowest file, not the sum. Results in ``items``' order. An item
        that fails: its OSError in its place with ``return_exceptions``, else the first
        failing item (in ``items``' order) raises once all have finished."""
        items = list(items)
        todo, failed = self._jobs(items)
        return self._answers(items, failed, self.reads.read_batch(todo), return_exceptions)

    async def aread_many(self, items: Iterable[PathLike | tuple[PathLike, int, int | None]], *,
                         return_exceptions: bool = False) -> list[Any]:
        """:meth:`read_many` for asyncio and trio code, as :meth:`aread` is :meth:`read`."""
        items = list(items)
        todo, failed = self._jobs(items)
        batch = await self.reads.aread_batch(todo)
        return self._answers(items, failed, batch, return_exceptions)

    def _jobs(self, items: list[Any]) -> tuple[list[tuple[int, int, int] | None],
                                               list[Exception | None]]:
        """Each item's (entry, offset, size), or None and its error (a bad path)."""
        todo: list[tuple[int, int, int] | None] = []
        failed: list[Exception | None] = []
        for item in items:
            path, offset, size = item if isinstance(item, tuple) else (item, 0, None)
            try:
                todo.append(self._job(path, offset, size))
                failed.append(None)
            except OSError as e:
                todo.append(None)
                failed.append(e)
        return todo, failed

    @staticmethod
    def _answers(items: list[Any], failed: list[Exception | None],
                 batch: tuple[list[Any], list[Exception | None]],
                 return_exceptions: bool) -> list[Any]:
        """The batch's results in ``items``' order, errors mapped with their paths;
        raise the first unless ``return_exceptions``."""
        results, faults = batch
        for i, error in enumerate(faults):
            if error is not None:
                item = items[i]
                out = mapped(error, item[0] if isinstance(item, tuple) else item)
                if out is not error:
                    out.__cause__ = error
                failed[i] = out
        done: list[Any] = list(results)
        for i, fault in enumerate(failed):
            if fault is not None:
                if not return_exceptions:
                    raise fault
                done[i] = fault
        return done

    def open(self, path: PathLike, mode: str = "rb", buffering: int = -1,
             encoding: str | None = None, errors: str | None = None,
             newline: str | None = None) -> io.IOBase:
        """A read-only file object, as ``open()`` on the mount returns: ``"rb"`` (the
        default) is an ``io.BufferedReader`` over a :class:`DatasetFile` (``buffering=0``:
        the DatasetFile itself), whose buffer is the dataset's block size, the mount's
        ``st_blksize``; ``"r"`` is text. Any write mode is EROFS."""
        if set(mode) - set("rbt") or "r" not in mode or ("b" in mode and "t" in mode):
            if set(mode) & set("wax+"):
                raise oserror(errno.EROFS, path)
            raise ValueError(f"invalid mode: {mode!r}")
        raw = DatasetFile(self, path)
        if "b" in mode:
            if encoding is not None or errors is not None or newline is not None:
                raise ValueError("binary mode doesn't take an encoding, errors or newline")
            if buffering == 0:
                return raw
            return io.BufferedReader(raw, buffering if buffering > 1 else raw.blksize)
        if buffering == 0:
            raise ValueError("can't have unbuffered text I/O")
        buffered = io.BufferedReader(raw, buffering if buffering > 1 else raw.blksize)
        return io.TextIOWrapper(buffered, encoding, errors, newline)


class DatasetFile(io.RawIOBase):
    """One open file of a :class:`Dataset`: ``readinto``, ``seek``, ``tell``,
    ``readall``. Like a file handle on the mount it has a read stream of its own, so
    sequential reads prefetch the next chunks and small random reads load 128 KiB
    blocks, not whole chunks (``read_policy.py``). It reads through ``dataset.reads``;
    one thread at a time, as any Python file object."""

    def __init__(self, dataset: Dataset, path: PathLike) -> None:
        super().__init__()
        self._reads = dataset.reads
        self._entry = dataset.tree.file(path)
        self.name = os.fsdecode(path)
        self.mode = "rb"
        self.size: int = dataset.index.size[self._entry]
        self.blksize: int = dataset.index.block_size or dataset.index.chunk_size
        self._pos = 0
        self._stream = Stream()

    def readable(self) -> bool:
        self._checkClosed()
        return True

    def seekable(self) -> bool:
        self._checkClosed()
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._checkClosed()
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self.size}.get(whence)
        if base is None:
            raise ValueError(f"invalid whence ({whence})")
        if base + offset < 0:
            raise oserror(errno.EINVAL, self.name)
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        self._checkClosed()
        return self._pos

    def readinto(self, b: Any) -> int:
        self._checkClosed()
        view = memoryview(b).cast("B")
        size = min(len(view), self.size - self._pos)
        if size <= 0:
            return 0
        n = self._reads.readinto(self._entry, self._pos, view[:size], self._stream, self.name)
        self._pos += n
        return n

    def readall(self) -> bytes:
        """The rest of the file in one read (its chunks load concurrently)."""
        self._checkClosed()
        if self._pos >= self.size:
            return b""
        data = self._reads.read_all(self._entry, self._pos, self.size - self._pos,
                                    self._stream, self.name)
        self._pos += len(data)
        return data

    def __repr__(self) -> str:
        return f"<kspeedfs.DatasetFile name={self.name!r} size={self.size}>"
