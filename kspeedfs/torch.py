"""A map-style ``torch.utils.data.Dataset`` over a kspeedfs dataset, safe in DataLoader
worker processes.

    MapDataset(name, paths, decode)      the parent: names and paths only, nothing opened
      DataLoader(workers=N) forks/spawns N workers
      worker: ds[i]                      first use in this process id → open_dataset(...)
                                         → decode(path, ds.read(paths[i]))

Why lazily, per process id: a ``kspeedfs.Dataset`` owns a trio thread and, on a cluster,
gRPC channels to etcd and a vRDMA endpoint — none of which survives ``fork()``. The
parent never opens one (``len`` needs the paths alone), and a process that finds a
handle opened by another process id (its parent's, pickled or forked into it) opens its
own. ``__getstate__`` drops the handle, so spawn and forkserver workers start clean too.

``__getitems__`` (the batched fetch a ``DataLoader`` calls when it exists) reads a whole
batch with ``read_many``: its loads overlap instead of running one after the other.

``packed`` is a ``collate_fn`` for raw samples (decoded later, on a GPU say): a batch's
bytes in one uint8 tensor plus its offsets, made in shared memory in a worker as
``default_collate`` makes decoded batches, so the batch reaches the main process as a
mapping, where a list of ``bytes`` is pickled through the worker's pipe (1.51x against
1.05x the mount's files/s, docs/benchmarks.md, "The library in a DataLoader and from
peers").
"""
from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils.data

from .client import Dataset, open_dataset

__all__ = ["MapDataset", "packed"]


def _raw(path: str, data: bytes) -> bytes:
    return data


def packed(batch: Sequence[bytes | bytearray | memoryview]) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``collate_fn``: samples of raw bytes → ``(data, offsets)``, sample ``i`` being
    ``data[offsets[i]:offsets[i + 1]]`` (a uint8 tensor, e.g. for
    ``torchvision.io.decode_jpeg``). In a DataLoader worker ``data`` is made in shared
    memory, so handing the batch over copies nothing more."""
    offsets = [0]
    for sample in batch:
        offsets.append(offsets[-1] + memoryview(sample).nbytes)
    total = offsets[-1]
    if torch.utils.data.get_worker_info() is not None:
        shared = torch.UntypedStorage._new_shared(total)     # type: ignore[no-untyped-call]
        data = torch.empty(0, dtype=torch.uint8).set_(shared)
    else:
        data = torch.empty(total, dtype=torch.uint8)
    if total:
        out = memoryview((ctypes.c_ubyte * total).from_address(data.data_ptr())).cast("B")
        for sample, lo, hi in zip(batch, offsets, offsets[1:], strict=False):
            out[lo:hi] = memoryview(sample).cast("B")
    return data, torch.tensor(offsets, dtype=torch.int64)


class MapDataset(torch.utils.data.Dataset[Any]):
    """Item ``i`` is ``decode(paths[i], bytes of paths[i])``.

    Args:
        name: the kspeedfs dataset; ``version``, ``etcd``, ``config``: as
            :func:`kspeedfs.open_dataset` (``config`` should be picklable for spawned
            workers: a mapping or a path).
        paths: the files, relative to the dataset's root.
        decode: ``(path, data) -> item``; the default returns the bytes. It runs in the
            worker, so it may be a PIL decode plus transforms; it must be picklable for
            spawned workers (a module-level function).
    """

    def __init__(self, name: str, paths: Sequence[str], decode: Callable[[str, bytes], Any] = _raw,
                 *, version: int | None = None, etcd: Sequence[str] | None = None,
                 config: Mapping[str, Any] | str | None = None) -> None:
        self.name = name
        self.paths = list(paths)
        self.decode = decode
        self.version = version
        self.etcd = list(etcd) if etcd else None
        self.config = config
        self._ds: Dataset | None = None
        self._pid = -1
        self._lock = threading.Lock()

    def dataset(self) -> Dataset:
        """This process's handle, opened on first use in it."""
        if self._ds is None or self._pid != os.getpid():
            with self._lock:
                if self._ds is None or self._pid != os.getpid():
                    self._ds = open_dataset(self.name, self.version, etcd=self.etcd,
                                            config=self.config)
                    self._pid = os.getpid()
        return self._ds

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> Any:
        path = self.paths[i]
        return self.decode(path, self.dataset().read(path))

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        paths = [self.paths[i] for i in indices]
        return [self.decode(p, d) for p, d in zip(paths, self.dataset().read_many(paths), strict=False)]

    def close(self) -> None:
        """Close this process's handle (workers' handles end with their processes)."""
        if self._ds is not None and self._pid == os.getpid():
            self._ds.close()
        self._ds = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_ds=None, _pid=-1, _lock=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
