"""An fsspec filesystem over the library: ``kspeedfs://<dataset>[@<version>]/<path>``.

Registered through the package's entry points (``fsspec.specs`` in pyproject.toml), so
``fsspec.open("kspeedfs://imagenet/train/x.JPEG")``, ``pandas.read_parquet`` and
``pyarrow.parquet.read_table(..., filesystem=fsspec.filesystem("kspeedfs"))`` find it
with only kspeedfs installed (fsspec itself is the ``fsspec`` extra).

    URL                       kspeedfs://imagenet@3/train/x.JPEG
    → dataset, version        "imagenet", 3 (no "@": the newest, fixed at first use)
    → Dataset                 one per (dataset, version) per process (client.py)
    cat_file / cat / cat_ranges  Dataset.read / read_many: the Reader's loads overlap
    _open                     Dataset.open: an io.BufferedReader, seekable
    ls / info                 the manifest index (no store access, no trio hop)

The listing of the root (``ls("")``: the store's datasets) is the one call that asks the
store. Options (``storage_options``): ``etcd`` and ``config``, as ``open_dataset``.
Errors are the library's: FileNotFoundError, IsADirectoryError, OSError(EIO).
"""
from __future__ import annotations

import errno
import os
import stat as stat_
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from fsspec.spec import AbstractFileSystem

from .client import Dataset, _config, open_dataset

__all__ = ["KspeedfsFileSystem"]


class KspeedfsFileSystem(AbstractFileSystem):  # type: ignore[misc]  # fsspec is untyped
    """fsspec's view of the datasets of one store (embedded, or a cluster's etcd)."""

    protocol = "kspeedfs"
    root_marker = ""

    def __init__(self, etcd: Sequence[str] | None = None,
                 config: Mapping[str, Any] | str | None = None, **kwargs: Any) -> None:
        super().__init__(etcd=etcd, config=config, **kwargs)
        self._etcd = list(etcd) if etcd else None
        self._options = config
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._datasets: dict[str, Dataset] = {}     # protected by _lock

    # -- paths --------------------------------------------------------------------------

    def _dataset(self, path: str) -> tuple[Dataset, str]:
        """The open dataset a path names, and the path inside it."""
        path = self._strip_protocol(path)
        head, _, inner = path.partition("/")
        if not head:
            raise IsADirectoryError(errno.EISDIR, "the root of kspeedfs:// lists datasets", path)
        with self._lock:
            if os.getpid() != self._pid:          # a forked child: the parent's are not ours
                self._datasets, self._pid = {}, os.getpid()
            ds = self._datasets.get(head)
            if ds is None:
                name, at, version = head.partition("@")
                if at and not version.isdigit():
                    raise FileNotFoundError(errno.ENOENT, "version is not a number", path)
                ds = open_dataset(name, int(version) if at else None, etcd=self._etcd,
                                  config=self._options)
                self._datasets[head] = ds
        return ds, inner

    def close(self) -> None:
        """Close every dataset this filesystem opened (their trio threads end)."""
        with self._lock:
            datasets, self._datasets = self._datasets, {}
        for ds in datasets.values():
            ds.close()

    # -- metadata -----------------------------------------------------------------------

    def _entry(self, full: str, st: os.stat_result) -> dict[str, Any]:
        kind = ("directory" if stat_.S_ISDIR(st.st_mode) else "file" if stat_.S_ISREG(st.st_mode)
                else "link" if stat_.S_ISLNK(st.st_mode) else "other")
        return {"name": full, "size": st.st_size, "type": kind, "mode": st.st_mode,
                "mtime": st.st_mtime, "ino": st.st_ino}

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        path = self._strip_protocol(path)
        if not path:
            return {"name": "", "size": 0, "type": "directory"}
        ds, inner = self._dataset(path)
        return self._entry(path, ds.stat(inner))

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        path = self._strip_protocol(path)
        if not path:
            return self._ls_root(detail)
        ds, inner = self._dataset(path)
        names: list[str] = ds.listdir(inner)    # type: ignore[assignment]  # str path: str names
        full = [f"{path}/{n}" for n in names]
        if not detail:
            return full
        return [self._entry(f, ds.stat(f"{inner}/{n}" if inner else n, follow_symlinks=False))
                for f, n in zip(full, names, strict=False)]

    def _ls_root(self, detail: bool) -> list[Any]:
        from .manifest.store import open_configured

        with open_configured(_config(self._etcd, self._options)) as store:
            names = sorted(info.name for info in store.datasets())
        if not detail:
            return names
        return [{"name": n, "size": 0, "type": "directory"} for n in names]

    def modified(self, path: str) -> Any:
        import datetime

        return datetime.datetime.fromtimestamp(self.info(path)["mtime"], datetime.UTC)

    # -- data: the library's fast paths --------------------------------------------------

    def cat_file(self, path: str, start: int | None = None, end: int | None = None,
                 **kwargs: Any) -> bytes:
        ds, inner = self._dataset(path)
        offset, size = self._range(ds, inner, start, end)
        return ds.read(inner, offset, size)

    def cat(self, path: Any, recursive: bool = False, on_error: str = "raise",
            **kwargs: Any) -> Any:
        """Every file's bytes in one batch per dataset (``Dataset.read_many``)."""
        paths = self.expand_path(path, recursive=recursive)
        if len(paths) == 1 and not isinstance(path, list) and paths[0] == self._strip_protocol(path):
            return self.cat_file(paths[0])
        files = [p for p in paths if not self.isdir(p)]
        got = self.cat_ranges(files, None, None, on_error="return" if on_error != "raise" else "raise")
        out: dict[str, Any] = {}
        for p, data in zip(files, got, strict=False):
            if isinstance(data, Exception) and on_error == "omit":
                continue
            out[p] = data
        return out

    def cat_ranges(self, paths: list[str], starts: Any, ends: Any, max_gap: int | None = None,
                   on_error: str = "return", **kwargs: Any) -> list[Any]:
        """Byte ranges of files in one batch per dataset (``Dataset.read_many``)."""
        if not isinstance(paths, list):
            raise TypeError("paths must be a list")
        starts = starts if isinstance(starts, list) else [starts] * len(paths)
        ends = ends if isinstance(ends, list) else [ends] * len(paths)
        if len(starts) != len(paths) or len(ends) != len(paths):
            raise ValueError("paths, starts and ends differ in length")
        out: list[Any] = [None] * len(paths)
        batches: dict[int, tuple[Dataset, list[int], list[tuple[str, int, int | None]]]] = {}
        for i, (p, s, e) in enumerate(zip(paths, starts, ends, strict=False)):
            try:
                ds, inner = self._dataset(p)
                offset, size = self._range(ds, inner, s, e)
            except OSError as err:
                if on_error != "return":
                    raise
                out[i] = err
                continue
            _, where, items = batches.setdefault(id(ds), (ds, [], []))
            where.append(i)
            items.append((inner, offset, size))
        for ds, where, items in batches.values():
            got = ds.read_many(items, return_exceptions=on_error == "return")
            for i, data in zip(where, got, strict=False):
                out[i] = data
        return out

    @staticmethod
    def _range(ds: Dataset, inner: str, start: int | None, end: int | None) -> tuple[int, int | None]:
        """fsspec's [start, end) (negative: from the end) as (offset, size)."""
        if start is not None and start < 0 or end is not None and end < 0:
            size = ds.stat(inner).st_size
            start = max(0, size + start) if start is not None and start < 0 else start
            end = max(0, size + end) if end is not None and end < 0 else end
        offset = start or 0
        return offset, None if end is None else max(0, end - offset)

    def _open(self, path: str, mode: str = "rb", block_size: int | None = None,
              autocommit: bool = True, cache_options: Any = None, **kwargs: Any) -> Any:
        if mode != "rb":
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        ds, inner = self._dataset(path)
        return ds.open(inner, "rb", buffering=block_size or -1)
