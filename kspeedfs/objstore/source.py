"""A bucket prefix as the importer's source (``manifest/importer.py``, ``ImportSource``).

Keys become paths: the key below the prefix, split at ``/`` (``a/b/c.jpg`` is file
``c.jpg`` in directories ``a/b``). Directories exist because keys are below them; a
key ending in ``/`` (a "directory marker" some tools write) makes a directory and no
file. A key that cannot be a path (an empty, ``.`` or ``..`` component, ``a//b``) is
skipped with a warning, and so is an object whose name is also a directory's
(``a`` beside ``a/b``): the directory wins. Files are mode 0644 and directories 0755,
owned by root; a file's mtime is its object's Last-Modified, a directory's the import's
start.

Each file's ETag and version go into the manifest (format 3, ``manifest/model.py``) and
every ranged GET, at import and later in the origin, is pinned to them (``If-Match``,
and the version: S3's ``VersionId``, GCS's generation, Azure's version id): an object
overwritten while the import reads it fails the import naming it, unless the version
read is kept. Where the listing gives no version (GCS, Azure), the first GET of each
object records the one it was served, and the object's later GETs ask for it.
"""
from __future__ import annotations

import logging
import stat
import threading
import time

from ..errors import SourceChanged, SourceError
from ..manifest.importer import ScanProgress, _Tree
from ..manifest.model import NAME_MAX
from .bucket import Bucket, ObjectInfo
from .listing import list_objects
from .url import ObjectUrl

log = logging.getLogger(__name__)

FILE_MODE = stat.S_IFREG | 0o644
DIR_MODE = stat.S_IFDIR | 0o755


class _Dir:
    __slots__ = ("dirs", "files")

    def __init__(self) -> None:
        self.dirs: dict[bytes, _Dir] = {}
        self.files: dict[bytes, ObjectInfo] = {}


def _parts(url: ObjectUrl, key: str) -> tuple[list[bytes], bool] | None:
    """(path components, is a directory marker) of ``key``, or None if it is no path."""
    rel = key[len(url.prefix):]
    if not rel:
        return [], True          # the prefix's own marker: the root
    marker = rel.endswith("/")
    parts = [p.encode() for p in (rel[:-1] if marker else rel).split("/")]
    if any(p in (b"", b".", b"..") for p in parts):
        return None
    for p in parts:
        if len(p) > NAME_MAX:
            raise SourceError(f"{url.name(key)}: a name longer than {NAME_MAX} bytes")
    return parts, marker


def build_tree(url: ObjectUrl, objects: list[ObjectInfo], now_ns: int) -> _Tree:
    """The entry arrays (breadth-first, each directory's children contiguous and sorted)."""
    root = _Dir()
    for o in objects:
        got = _parts(url, o.key)
        if got is None:
            log.warning("skipping %s: not a path (empty, . or .. component)", url.name(o.key))
            continue
        parts, marker = got
        d = root
        for p in parts if marker else parts[:-1]:
            d = d.dirs.setdefault(p, _Dir())
        if not marker:
            d.files[parts[-1]] = o
    tree = _Tree()
    ids = tree.track_objects()
    ids.append(b"")
    tree.add_entry(0, b"", DIR_MODE, 0, 0, 0, now_ns)
    queue: list[tuple[int, _Dir]] = [(0, root)]
    for idx, d in queue:       # grows as directories are added: breadth-first
        for name in [n for n in d.files if n in d.dirs]:
            log.warning("skipping %s: a directory has its name", url.name(d.files.pop(name).key))
        children = sorted([*d.dirs, *d.files])
        tree.data[idx] = len(tree.mode)
        tree.size[idx] = len(children)
        for name in children:
            if name in d.dirs:
                child = tree.add_entry(idx, name, DIR_MODE, 0, 0, 0, now_ns)
                queue.append((child, d.dirs[name]))
                ids.append(b"")
            else:
                o = d.files[name]
                tree.add_entry(idx, name, FILE_MODE, 0, 0, o.size, o.mtime_ns)
                ids.append(o.etag.encode() + b"\0" + o.version_id.encode())
    tree.flush()
    return tree


class ObjectSource:
    """A bucket prefix (``s3://``, ``gs://``, ``az://``) for ``import_tree``."""

    def __init__(self, bucket: Bucket, threads: int) -> None:
        self.bucket = bucket
        self.url = str(bucket.url)
        self.threads = threads
        self._learned = threading.Lock()

    def scan(self, progress: ScanProgress | None) -> _Tree:
        now_ns = time.time_ns()
        objects = list_objects(self.bucket, self.threads, progress)
        if not any(not o.key.endswith("/") for o in objects):
            raise SourceError(f"{self.url}: no objects under this prefix")
        return build_tree(self.bucket.url, objects, now_ns)

    def read_into(self, tree: _Tree, entry: int, offset: int, out: memoryview) -> None:
        assert tree.objects is not None
        etag, _, version = tree.objects[entry].decode().partition("\0")
        key = self.bucket.url.key(tree.path(entry))
        got = self.bucket.get_range(key, offset, out, etag, version)
        if got.changed:
            raise SourceChanged(f"{self.bucket.url.name(key)} {got.changed}: it changed during import")
        if not version and got.version:
            with self._learned:     # the object's first GET names its version: pin the rest
                etag, _, version = tree.objects[entry].decode().partition("\0")
                if not version:
                    tree.objects[entry] = f"{etag}\0{got.version}".encode()
                elif version != got.version:
                    raise SourceChanged(f"{self.bucket.url.name(key)} was served as versions "
                                        f"{version} and {got.version}: it changed during import")

    def record(self) -> dict[str, str]:
        return self.bucket.record()
