"""The disk tier: verified chunks kept on a local SSD across restarts.

Files are ``<dir>/<2 hex>/<32 hex digest>``, written to a temporary name and renamed,
so a writer that dies never leaves a half-written chunk under its final name (there
is no fsync: after a power loss, the reader's check below is what catches one). A
chunk read back is *not* trusted: the reader checks it against the digest it is named
by (the SSD, the filesystem or another process may have changed it) and ``discard``s
it on mismatch. Capacity is enforced by LRU over an in-memory list built at start
from the directory (oldest atime/mtime first). One daemon per directory.

Blocking methods: run them in a worker thread.
"""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path

from .memory import page_aligned

log = logging.getLogger(__name__)


class DiskCache:
    """The disk tier: chunk files named by their digest key under ``dir``, LRU in ``capacity``.

    ``get`` returns a held chunk's bytes unchecked (the caller verifies them against the key
    and ``discard``s a mismatch) in a read-only page-aligned buffer, or None when the key is
    not held or its file has gone; it makes the key the most recently used. ``put`` skips a
    key already held and a chunk larger than ``capacity``, renames the file into place only
    once written, then evicts least recently used chunks until ``used`` <= ``capacity``.
    Filesystem errors (``OSError``) propagate.
    Owns the files under ``dir``: the constructor deletes leftover temporary files there and
    evicts past ``capacity``, so one process per directory. The index (``_files``, ``used``)
    is guarded by a threading lock; no fd outlives a call.
    Threads: the constructor, ``get``, ``put`` and ``discard`` do file I/O: run them in
    worker threads, any number at once. ``in`` only takes the lock (the trio thread may use
    it)."""

    def __init__(self, directory: str | os.PathLike[str], capacity: int) -> None:
        self.dir = Path(directory)
        self.capacity = capacity
        self.used = 0
        self._lock = threading.Lock()
        self._files: OrderedDict[bytes, int] = OrderedDict()   # protected by _lock
        self.dir.mkdir(parents=True, exist_ok=True)
        found = []
        for sub in self.dir.iterdir():
            if not sub.is_dir():
                continue
            for f in sub.iterdir():
                if f.name.startswith("."):
                    f.unlink(missing_ok=True)      # leftover temp file
                    continue
                try:
                    key = bytes.fromhex(f.name)
                    st = f.stat()
                except (ValueError, OSError):
                    continue
                found.append((max(st.st_atime, st.st_mtime), key, st.st_size))
        for _, key, size in sorted(found):
            self._files[key] = size
            self.used += size
        self._evict()
        log.info("disk tier %s: %d chunks, %d bytes of %d", self.dir, len(self._files), self.used, capacity)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._files

    def _path(self, key: bytes) -> Path:
        h = key.hex()
        return self.dir / h[:2] / h

    def get(self, key: bytes) -> memoryview | None:
        """The file's bytes, unchecked (the caller verifies them), in a buffer the memory
        tier replies from (``page_aligned``); None if the chunk is not held."""
        with self._lock:
            if key not in self._files:
                return None
            self._files.move_to_end(key)
        try:
            with open(self._path(key), "rb", buffering=0) as f:
                buf = page_aligned(os.fstat(f.fileno()).st_size)
                got = 0
                while got < len(buf) and (n := f.readinto(buf[got:])):
                    got += n
        except FileNotFoundError:
            self.discard(key)
            return None
        return buf[:got].toreadonly()       # shorter if it shrank meanwhile: fails the check

    def put(self, key: bytes, data: bytes | memoryview) -> None:
        if len(data) > self.capacity:
            return
        with self._lock:
            if key in self._files:
                return
        path = self._path(key)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        with self._lock:
            # two threads may have written the same key at once: the bytes are the same
            # (content-addressed), so count them once
            self.used += len(data) - self._files.get(key, 0)
            self._files[key] = len(data)
        self._evict()

    def discard(self, key: bytes) -> None:
        with self._lock:
            size = self._files.pop(key, None)
            if size is not None:
                self.used -= size
        self._path(key).unlink(missing_ok=True)

    def _evict(self) -> None:
        while True:
            with self._lock:
                if self.used <= self.capacity or not self._files:
                    return
                key, size = self._files.popitem(last=False)
                self.used -= size
            self._path(key).unlink(missing_ok=True)
