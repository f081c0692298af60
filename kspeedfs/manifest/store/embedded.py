"""The embedded metadata store: a directory on local disk, no server.

Layout (``root`` defaults to ``/var/lib/kspeedfs/store``)::

    root/LOCK                       flock taken by every writer
    root/<name>/v<N>.json           DatasetInfo of version N
    root/<name>/v<N>.manifest       the manifest blob of version N
    root/<name>/current             "N\\n": the current version

Every file is written to a temporary name, fsynced and renamed into place, and
``current`` moves last, so a crash mid-publish leaves the previous version current.
At worst it leaves an orphan ``v<N>.manifest``, which the next publish overwrites, or
a whole ``v<N>`` pair that is not current (``versions`` lists it; the next publish
takes N+1). Readers take no lock: they read ``current``, then the immutable files it
names.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ...errors import DatasetNotFound, StoreError, StoreUnavailable
from .base import DatasetInfo, MetadataStore, check_name, verify_blob


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class EmbeddedStore(MetadataStore):
    """MetadataStore in a directory on local disk (``root``): no server, records unsigned.

    Implements :class:`MetadataStore` with the layout and crash behaviour of the module
    docstring. ``publish`` and ``remove`` hold an exclusive flock on ``root/LOCK``, so
    writers exclude each other across threads and processes; readers take no lock.
    Differences from the interface: records are not signed (there is no secret); a root the
    caller may read but not write still opens, and ``publish``/``remove`` then raise
    ``StoreUnavailable``; an unreadable ``current`` or a corrupt version record is
    ``StoreError``; ``identity`` is that of ``StoreConfig(backend="embedded", path=root)``.
    Owns the files under ``root`` and no fd or connection between calls (``close`` is the
    inherited no-op). Blocking and thread-safe: call it from a worker thread under trio."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.page_dir = str(self.root / "pages")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            (self.root / "LOCK").touch(exist_ok=True)
        except PermissionError as e:
            # readers take no lock: a user who may read the store but not write it (the
            # library as non-root) opens it; a write by that user fails at the lock
            if not os.access(self.root, os.R_OK | os.X_OK):
                raise StoreUnavailable(f"embedded store {self.root}: {e.strerror}") from e
        except OSError as e:
            raise StoreUnavailable(f"embedded store {self.root}: {e.strerror}") from e

    def __repr__(self) -> str:
        return f"EmbeddedStore({str(self.root)!r})"

    @property
    def identity(self) -> str:
        from ...config import StoreConfig
        from . import identity

        return identity(StoreConfig(backend="embedded", path=str(self.root)))

    @contextmanager
    def _locked(self) -> Iterator[None]:
        if not os.access(self.root, os.W_OK):
            raise StoreUnavailable(f"embedded store {self.root}: Permission denied (readable only)")
        with open(self.root / "LOCK", "rb") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _dir(self, name: str) -> Path:
        return self.root / check_name(name)

    def _current(self, name: str) -> int:
        try:
            return int((self._dir(name) / "current").read_text())
        except FileNotFoundError:
            raise DatasetNotFound(f"no dataset named {name!r} in {self.root}") from None
        except (OSError, ValueError) as e:
            raise StoreError(f"{self.root}/{name}/current unreadable: {e}") from e

    def publish(self, info: DatasetInfo, blob: bytes) -> DatasetInfo:
        d = self._dir(info.name)
        with self._locked():
            d.mkdir(exist_ok=True)
            existing = self._scan_versions(d)
            version = (existing[-1] if existing else 0) + 1
            sealed = info.sealed(version, blob, time.time())
            _write_atomic(d / f"v{version}.manifest", blob)
            _write_atomic(d / f"v{version}.json", json.dumps(sealed.to_json()).encode())
            _write_atomic(d / "current", f"{version}\n".encode())
        return sealed

    @staticmethod
    def _scan_versions(d: Path) -> list[int]:
        out = []
        for p in d.glob("v*.json"):
            try:
                out.append(int(p.stem[1:]))
            except ValueError:
                continue
        return sorted(out)

    def datasets(self) -> list[DatasetInfo]:
        out = []
        for d in sorted(self.root.iterdir()):
            if d.is_dir() and (d / "current").exists():
                try:
                    out.append(self.dataset(d.name))
                except DatasetNotFound:
                    continue
        return out

    def dataset(self, name: str, version: int | None = None) -> DatasetInfo:
        if version is None:
            version = self._current(name)
        try:
            raw = (self._dir(name) / f"v{version}.json").read_bytes()
        except FileNotFoundError:
            raise DatasetNotFound(f"dataset {name!r} has no version {version}") from None
        try:
            return DatasetInfo.from_json(json.loads(raw))
        except (ValueError, TypeError) as e:
            raise StoreError(f"{self.root}/{name}/v{version}.json is corrupt: {e}") from e

    def versions(self, name: str) -> list[int]:
        vs = self._scan_versions(self._dir(name)) if self._dir(name).is_dir() else []
        if not vs:
            raise DatasetNotFound(f"no dataset named {name!r} in {self.root}")
        return vs

    def manifest(self, name: str, version: int) -> bytes:
        info = self.dataset(name, version)
        try:
            blob = (self._dir(name) / f"v{version}.manifest").read_bytes()
        except FileNotFoundError:
            raise DatasetNotFound(f"dataset {name!r} v{version}: manifest file missing") from None
        return verify_blob(info, blob)

    def remove(self, name: str, version: int | None = None) -> None:
        self._remove(name, version)
        self._sweep_after_remove()

    def _remove(self, name: str, version: int | None) -> None:
        d = self._dir(name)
        with self._locked():
            vs = self.versions(name)
            if version is None:
                shutil.rmtree(d)
                return
            if version not in vs:
                raise DatasetNotFound(f"dataset {name!r} has no version {version}")
            rest = [v for v in vs if v != version]
            if not rest:
                shutil.rmtree(d)
                return
            if self._current(name) == version:
                _write_atomic(d / "current", f"{rest[-1]}\n".encode())
            for suffix in (".json", ".manifest"):
                (d / f"v{version}{suffix}").unlink(missing_ok=True)
