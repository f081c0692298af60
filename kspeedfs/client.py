"""Reading a dataset without FUSE: the Python library behind ``kspeedfs.open_dataset``.

    open_dataset(name, version)          caller's thread: store → manifest → ManifestIndex
      └─ Dataset                         a trio run in a thread of its own ("kspeedfs-<name>"):
           compose.cluster → peers?      the same composition as a mount (compose.py):
           compose.local_tiers           origin, memory tier, disk tier
           compose.new_reader            the same Reader, so the same tiers, replicas,
                                         hedging and checksums as a FUSE read
      caller's threads:
        listdir / stat / walk            the index alone (immutable: no lock, no trio hop)
        read / read_many / open().read   resident in the memory tier? sliced right here;
                                         else one ``trio.from_thread.run`` (a batch: one
                                         for all), the Reader's loads overlapping there

One boundary (``_errors``): every error a public call raises is what ``open()`` and
``read()`` on the mount raise — FileNotFoundError, NotADirectoryError,
IsADirectoryError, and ``OSError(err.errno)`` for the kspeedfs and rdma trees
(ChunkUnavailable and SourceChanged are EIO), with the original as ``__cause__``; a
bug is logged with its traceback and raised as EIO. A closed dataset or file raises
ValueError, as a closed Python file does.

Resident hits skip the trio thread (``_resident``): bytes the memory tier's resident
part holds (kept until close, never reordered) are sliced in the caller's thread, as
the native engine's C threads answer a mount's memory hits; one hop to the trio thread
costs tens of microseconds, a 4 KiB copy well under one. They are counted for
``statistics()`` the same way (``Reader.served_elsewhere``). A view of a tier's buffer
is safe to hold anywhere: buffers are immutable, and a landing slot is reused only once
nothing refers to it (``cluster/landing.py``).

Processes: a handle belongs to the process that opened it (its thread and, in a cluster,
its gRPC channels and vRDMA endpoint do not survive a fork): using it in a forked child
raises RuntimeError. Open one per process, after the fork (``kspeedfs.torch`` does).
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import logging
import os
import stat as stat_
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import trio

from . import compose
from .cache.memory import MemoryCache
from .cache.prefetch import Stream
from .config import Config, load
from .errors import ErrnoError
from .manifest.index import ManifestIndex
from .manifest.store.base import DatasetInfo
from .reader import Reader
from .stats import ReadStatistics

__all__ = ["Dataset", "DatasetFile", "open_dataset"]

T = TypeVar("T")
log = logging.getLogger(__name__)

PathLike = str | bytes | os.PathLike[str]

#: symlinks followed in one path resolution before ELOOP (Linux's limit)
MAXSYMLINKS = 40
#: concurrent file reads of one ``read_many`` (each file's chunks load concurrently too)
READ_MANY_CONCURRENCY = 64


@contextlib.contextmanager
def _errors(path: PathLike | None = None) -> Iterator[None]:
    """The library's one error boundary (``_mapped``) around a public call."""
    try:
        yield
    except Exception as e:
        mapped = _mapped(e, path)
        if mapped is e:
            raise
        raise mapped from e


def _mapped(e: Exception, path: PathLike | None) -> Exception:
    """What ``open()``/``read()`` on the mount would raise for ``e``: kspeedfs and rdma
    errors become ``OSError(e.errno)`` (which picks the subclass: ENOENT is
    FileNotFoundError); OSError, ValueError and RuntimeError stay; anything else is a bug,
    logged with its traceback, and EIO."""
    if isinstance(e, ErrnoError):
        return OSError(e.errno, str(e), _show(path))
    if isinstance(e, (OSError, ValueError, RuntimeError)):
        return e
    log.error("unexpected error reading %s, raising EIO", _show(path), exc_info=e)
    return OSError(errno.EIO, f"unexpected error: {e!r}", _show(path))


def _show(path: PathLike | None) -> str | None:
    return None if path is None else os.fsdecode(path)


def _oserror(code: int, path: PathLike) -> OSError:
    return OSError(code, os.strerror(code), _show(path))


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
    with _errors(name):
        cfg = _config(etcd, config)
        info, blob = compose.fetch_manifest(cfg, name, version)
        index = ManifestIndex.from_blob(blob, info.inflated_size)
        del blob
        return Dataset(cfg, info, index, source)


class Dataset:
    """One dataset version, readable from any thread of the process that opened it.

    Paths are relative to the dataset's root (a leading ``/`` is allowed), ``str`` or
    ``bytes`` (names that are not UTF-8: ``os.fsencode``/``os.fsdecode``, as ``os``
    does). Symlinks inside the dataset are followed; an absolute target is ENOENT, and
    ``..`` stops at the dataset's root, as at ``/``.

    Attributes:
        info: the dataset's record (name, version, files, bytes, chunk size, source).
        index: the manifest (read-only, shared by every thread).
    """

    def __init__(self, cfg: Config, info: DatasetInfo, index: ManifestIndex,
                 source: str | None = None) -> None:
        self.info = info
        self.index = index
        self._cfg = cfg
        self._source = source
        self._pid = os.getpid()
        self._reader: Reader | None = None
        self._memory: MemoryCache | None = None
        self._served = [0, 0, 0]            # resident hits: reads, bytes, hits; under _lock
        self._lock = threading.Lock()
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._started = threading.Event()
        self._failed: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"kspeedfs-{info.name}",
                                        daemon=True)
        self._thread.start()
        self._started.wait()
        if self._failed is not None:
            self._thread.join()
            raise self._failed

    # -- the trio thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as e:      # before started: the opener raises it
            if self._started.is_set():
                log.exception("dataset %s: its read loop failed", self.info.name)
            while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
                e = e.exceptions[0]     # a nursery's one error, as itself (the boundary maps it)
            self._failed = e
        finally:
            self._started.set()

    async def _main(self) -> None:
        """The read path's lifetime: built as a mount builds it, torn down on close."""
        cfg, info, index = self._cfg, self.info, self.index
        tiers = await trio.to_thread.run_sync(compose.local_tiers, cfg, info, index, self._source)
        async with compose.cluster(cfg, index) as (peers, _store), trio.open_nursery() as nursery:
            self._reader = compose.new_reader(cfg, info, index, tiers, nursery, peers)
            self._reader.served_elsewhere = lambda: tuple(self._served)  # type: ignore[assignment]
            self._memory = tiers.memory
            self._token = trio.lowlevel.current_trio_token()
            self._stop = trio.Event()
            self._started.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    def _call(self, afn: Callable[..., Awaitable[T]], *args: Any,
              path: PathLike | None = None) -> T:
        """``await afn(*args)`` in the trio thread, from a caller's thread."""
        self._check()
        with _errors(path):
            try:
                return trio.from_thread.run(afn, *args, trio_token=self._token)
            except trio.RunFinishedError:
                raise ValueError("I/O operation on a closed dataset") from None

    def _check(self) -> None:
        if self._closed:
            raise ValueError("I/O operation on a closed dataset")
        if os.getpid() != self._pid:
            raise RuntimeError(f"dataset {self.info.name} was opened in process {self._pid}; "
                               "open one in each process after it forks (kspeedfs.torch)")

    # -- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the read loop and drop the tiers; idempotent. Open files fail afterwards."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:      # a forked child's copy: nothing of it runs here
            return
        if self._stop is not None and self._thread.is_alive():
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join()

    def __enter__(self) -> Dataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def version(self) -> int:
        return self.info.version

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.info.entries} entries"
        return f"<kspeedfs.Dataset {self.info.name}@{self.info.version} {state}>"

    # -- metadata: the index alone -----------------------------------------------------------

    def _resolve(self, path: PathLike, follow: bool = True) -> int:
        """The entry at ``path``, following symlinks inside the dataset (the last
        component only when ``follow``)."""
        self._check()
        ix = self.index
        todo = [n for n in os.fsencode(path).split(b"/") if n and n != b"."]
        todo.reverse()                  # a stack: the next component last
        here: list[int] = []            # entries of the directories walked into, root implied
        hops = 0
        while todo:
            name = todo.pop()
            parent = here[-1] if here else 0
            if name == b"..":
                if here:
                    here.pop()
                continue
            if not ix.is_dir(parent):
                raise _oserror(errno.ENOTDIR, path)
            entry = ix.lookup(parent, name)
            if entry is None:
                raise _oserror(errno.ENOENT, path)
            if ix.is_symlink(entry) and (todo or follow):
                hops += 1
                if hops > MAXSYMLINKS:
                    raise _oserror(errno.ELOOP, path)
                target = ix.readlink(entry)
                if target.startswith(b"/"):     # outside the dataset: not ours to follow
                    raise _oserror(errno.ENOENT, path)
                todo.extend(reversed([n for n in target.split(b"/") if n and n != b"."]))
                continue
            here.append(entry)
        return here[-1] if here else 0

    def _file(self, path: PathLike) -> int:
        entry = self._resolve(path)
        if self.index.is_dir(entry):
            raise _oserror(errno.EISDIR, path)
        return entry

    def stat(self, path: PathLike = "", *, follow_symlinks: bool = True) -> os.stat_result:
        """What ``os.stat`` on the mount returns (``st_ino`` is the mount's inode
        number; directories are 4096 bytes; every time is the source's mtime)."""
        ix = self.index
        entry = self._resolve(path, follow_symlinks)
        size = 4096 if ix.is_dir(entry) else ix.size[entry]
        ns = ix.mtime_ns[entry]
        sec = ns // 1_000_000_000
        return os.stat_result((
            ix.mode[entry], entry + 1, 0, ix.nlink(entry), ix.uid[entry], ix.gid[entry], size,
            sec, sec, sec, ns / 1e9, ns / 1e9, ns / 1e9, ns, ns, ns,
            ix.block_size or ix.chunk_size, (size + 511) // 512, 0))

    def exists(self, path: PathLike) -> bool:
        try:
            self._resolve(path)
        except OSError:
            return False
        return True

    def isdir(self, path: PathLike) -> bool:
        return self.exists(path) and stat_.S_ISDIR(self.stat(path).st_mode)

    def isfile(self, path: PathLike) -> bool:
        return self.exists(path) and stat_.S_ISREG(self.stat(path).st_mode)

    def listdir(self, path: PathLike = "") -> list[str] | list[bytes]:
        """Names in directory ``path``, in name order (bytes when ``path`` is bytes,
        as ``os.listdir``)."""
        ix = self.index
        entry = self._resolve(path)
        if not ix.is_dir(entry):
            raise _oserror(errno.ENOTDIR, path)
        names = [ix.name(c) for c in ix.children(entry)]
        return names if isinstance(path, bytes) else [os.fsdecode(n) for n in names]

    def walk(self, top: PathLike = "") -> Iterator[tuple[str, list[str], list[str]]]:
        """``os.walk`` over the dataset, top-down: ``(dirpath, dirnames, filenames)``
        with ``dirpath`` relative to the root (``""`` for the root itself); symlinks are
        listed among the files and not followed. Pruning ``dirnames`` in place works."""
        ix = self.index
        entry = self._resolve(top)
        if not ix.is_dir(entry):
            return
        stack = [(os.fsdecode(top).strip("/"), entry)]
        while stack:
            dirpath, d = stack.pop()
            dirs, files, kids = [], [], {}
            for c in ix.children(d):
                name = os.fsdecode(ix.name(c))
                if ix.is_dir(c):
                    dirs.append(name)
                    kids[name] = c
                else:
                    files.append(name)
            yield dirpath, dirs, files
            for name in reversed(dirs):
                if name in kids:
                    stack.append((f"{dirpath}/{name}" if dirpath else name, kids[name]))

    # -- data: resident hits here, the rest through the Reader in the trio thread ------------

    def _resident(self, entry: int, offset: int, size: int) -> list[memoryview] | None:
        """Bytes [offset, offset + size) of file ``entry`` (``size`` > 0, inside the file)
        as views of buffers the memory tier's resident part holds — the chunks, or the
        small file's extent (where ``Reader`` keeps it) — or None if any is not there."""
        ix, resident = self.index, self._memory.resident  # type: ignore[union-attr]
        chunks = ix.chunk_range(entry, offset, size)
        c, start = ix.chunk_size, ix.data[entry] + offset
        parts = []
        for k in chunks:
            data = resident(ix.chunk_digest(k))
            if data is None:
                break
            parts.append(memoryview(data)[max(start, k * c) - k * c:
                                          min(start + size, (k + 1) * c) - k * c])
        else:
            self._count(size, len(chunks))
            return parts
        if len(chunks) == 1 and len(ix.chunk_range(entry, 0, ix.size[entry])) == 1:
            (ext,) = ix.file_extents(entry)
            data = resident(ext.digest)
            if data is not None:
                self._count(size, 1)
                return [memoryview(data)[offset:offset + size]]
        return None

    def _count(self, nbytes: int, hits: int) -> None:
        with self._lock:
            self._served[0] += 1
            self._served[1] += nbytes
            self._served[2] += hits

    def read(self, path: PathLike, offset: int = 0, size: int | None = None) -> bytes:
        """The bytes of file ``path`` from ``offset`` (``size`` of them, fewer at its end;
        None: to the end), verified, from the nearest tier.

        Raises:
            FileNotFoundError, IsADirectoryError, NotADirectoryError: as ``open()``.
            OSError: EIO when no tier can produce verified bytes (ChunkUnavailable) or
                the source changed since import (SourceChanged).
        """
        entry = self._file(path)
        if offset < 0 or (size is not None and size < 0):
            raise ValueError("offset and size must be >= 0")
        end = self.index.size[entry] if size is None else min(offset + size, self.index.size[entry])
        if end <= offset:
            return b""
        self._check()
        parts = self._resident(entry, offset, end - offset)
        if parts is not None:
            return bytes(parts[0]) if len(parts) == 1 else b"".join(parts)
        return self._call(self._read, entry, offset, end - offset, path=path)

    def read_many(self, items: Iterable[PathLike | tuple[PathLike, int, int | None]], *,
                  return_exceptions: bool = False) -> list[Any]:
        """:meth:`read` of each item — a path (the whole file) or ``(path, offset, size)``
        (``size`` None: to the end) — the loads overlapped (up to
        ``READ_MANY_CONCURRENCY`` files at once, each file's chunks concurrently): a batch
        costs about its slowest file, not the sum. Results in ``items``' order. An item
        that fails: its OSError in its place with ``return_exceptions``, else the first
        failing item (in ``items``' order) raises once all have finished."""
        items = list(items)
        todo: list[tuple[int, int, int] | None] = []
        failed: list[Exception | None] = []
        for item in items:
            path, offset, size = item if isinstance(item, tuple) else (item, 0, None)
            try:
                entry = self._file(path)
                if offset < 0 or (size is not None and size < 0):
                    raise ValueError("offset and size must be >= 0")
                end = self.index.size[entry] if size is None else offset + size
                todo.append((entry, offset, max(0, end - offset)))
                failed.append(None)
            except OSError as e:
                todo.append(None)
                failed.append(e)
        self._check()
        here: dict[int, bytes] = {}
        for i, job in enumerate(todo):
            if job is not None:
                entry, offset, size = job
                end = min(offset + size, self.index.size[entry])
                parts = self._resident(entry, offset, end - offset) if end > offset else [b""]
                if parts is not None:
                    here[i] = bytes(parts[0]) if len(parts) == 1 else b"".join(parts)
                    todo[i] = None
        if any(item is not None for item in todo):
            results, errors = self._call(self._read_batch, todo)
        else:                               # all resident: no trio hop
            results, errors = [b""] * len(todo), [None] * len(todo)
        for i, data in here.items():
            results[i] = data
        for i, error in enumerate(errors):
            if error is not None:
                item = items[i]
                mapped = _mapped(error, item[0] if isinstance(item, tuple) else item)
                if mapped is not error:
                    mapped.__cause__ = error
                failed[i] = mapped
        out: list[Any] = list(results)
        for i, fault in enumerate(failed):
            if fault is not None:
                if not return_exceptions:
                    raise fault
                out[i] = fault
        return out

    def open(self, path: PathLike, mode: str = "rb", buffering: int = -1,
             encoding: str | None = None, errors: str | None = None,
             newline: str | None = None) -> io.IOBase:
        """A read-only file object, as ``open()`` on the mount returns: ``"rb"`` (the
        default) is an ``io.BufferedReader`` over a :class:`DatasetFile` (``buffering=0``:
        the DatasetFile itself), whose buffer is the dataset's block size, the mount's
        ``st_blksize``; ``"r"`` is text. Any write mode is EROFS."""
        if set(mode) - set("rbt") or "r" not in mode or ("b" in mode and "t" in mode):
            if set(mode) & set("wax+"):
                raise _oserror(errno.EROFS, path)
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

    def statistics(self) -> ReadStatistics:
        """The Reader's counters (tier hits, source and peer loads, checksum failures),
        as a mount's ``user.kspeedfs.stats`` shows them."""
        self._check()
        with _errors():
            return trio.from_thread.run_sync(lambda: self._reader.statistics(),  # type: ignore[union-attr]
                                             trio_token=self._token)

    async def _read(self, entry: int, offset: int, size: int, stream: Stream | None = None) -> bytes:
        parts = await self._reader.read_parts(entry, offset, size, stream)  # type: ignore[union-attr]
        return bytes(parts[0]) if len(parts) == 1 else b"".join(parts)

    async def _readinto(self, entry: int, offset: int, buf: memoryview, stream: Stream) -> int:
        parts = await self._reader.read_parts(entry, offset, len(buf), stream)  # type: ignore[union-attr]
        n = 0
        for p in parts:
            buf[n:n + len(p)] = p
            n += len(p)
        return n

    async def _read_batch(self, todo: list[tuple[int, int, int] | None],
                          ) -> tuple[list[Any], list[Exception | None]]:
        results: list[Any] = [b""] * len(todo)
        errors: list[Exception | None] = [None] * len(todo)
        limit = trio.CapacityLimiter(READ_MANY_CONCURRENCY)

        async def one(i: int, entry: int, offset: int, size: int) -> None:
            async with limit:
                try:
                    results[i] = await self._read(entry, offset, size)
                except Exception as e:      # mapped and raised by read_many
                    errors[i] = e

        async with trio.open_nursery() as n:
            for i, item in enumerate(todo):
                if item is not None:
                    n.start_soon(one, i, *item)
        return results, errors


class DatasetFile(io.RawIOBase):
    """One open file of a :class:`Dataset`: ``readinto``, ``seek``, ``tell``,
    ``readall``. Like a file handle on the mount it has a read stream of its own, so
    sequential reads prefetch the next chunks and small random reads load 128 KiB
    blocks, not whole chunks (``read_policy.py``)."""

    def __init__(self, dataset: Dataset, path: PathLike) -> None:
        super().__init__()
        self._ds = dataset
        self._entry = dataset._file(path)
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
            raise _oserror(errno.EINVAL, self.name)
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
        self._ds._check()
        parts = self._ds._resident(self._entry, self._pos, size)
        if parts is None:
            n = self._ds._call(self._ds._readinto, self._entry, self._pos, view[:size],
                               self._stream, path=self.name)
        else:
            s = self._stream                # as Prefetcher.advise records a read
            s.run, s.next_offset = (s.run + 1 if self._pos == s.next_offset else 0), self._pos + size
            n = 0
            for p in parts:
                view[n:n + len(p)] = p
                n += len(p)
        self._pos += n
        return n

    def readall(self) -> bytes:
        """The rest of the file in one read (its chunks load concurrently)."""
        self._checkClosed()
        if self._pos >= self.size:
            return b""
        data = self._ds._call(self._ds._read, self._entry, self._pos, self.size - self._pos,
                              self._stream, path=self.name)
        self._pos += len(data)
        return data

    def __repr__(self) -> str:
        return f"<kspeedfs.DatasetFile name={self.name!r} size={self.size}>"
