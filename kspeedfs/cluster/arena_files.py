"""The files behind a node's arena and index (``cluster.arena_dir``), and who may own them.

A node keeps its arena (the chunk slots peers READ) and its index in tmpfs files, so a
restarted node re-adopts its verified chunks (``arena.py``). A root process maps them
shared and they hold every byte it caches, so where they live is a trust boundary,
checked here whatever the host's ``fs.protected_symlinks``/``protected_regular`` say:

* **the directory** (:func:`private_directory`): its path is walked from ``/`` one
  component at a time with ``O_NOFOLLOW`` (a symbolic link anywhere on it is refused:
  name the real path); every ancestor must belong to root or to us and, if others may
  write to it, be sticky (``/dev/shm``, ``/tmp``), so nobody else can swap a component;
  the directory itself is made 0700 when missing and must be a directory of ours that
  group and others cannot enter;
* **the files** (:meth:`ArenaFiles.open`): opened inside that directory (``dir_fd``)
  with ``O_NOFOLLOW``, then checked with ``fstat`` before anything is truncated or
  mapped: a regular file of ours, no access for group or others, one link. Anything
  else is :class:`~kspeedfs.errors.UnsafePath`, one line naming the file;
* **the names** carry the cluster and the node, ``<cluster>-<node>.arena.<i>`` (segment
  i of the arena, ``arena_segments.py``; an older node's single ``.arena`` is removed
  by the next node of its name) and ``.index``:
  the cluster is a digest of its shared secret and etcd prefix (:func:`cluster_tag`),
  so two clusters on one host, each with a node ``n1``, never adopt each other's slots;
* **one owner at a time**: a running node holds an exclusive ``flock`` on its index, so
  a second node of the same cluster and name on this host is refused, and
  ``kspeedfs arena drop`` (:func:`drop`) refuses to remove files a node still uses.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import hmac
import logging
import mmap
import os
import stat
import time
from dataclasses import dataclass

from ..errors import DatasetInUse, UnsafePath
from ..tuning import ARENA_LOCK_WAIT
from .arena_segments import SegmentMemory, segment_lengths

log = logging.getLogger(__name__)

INDEX = ".index"
LEGACY = ".arena"                 # the whole arena in one file, before segments
GRANTED = ".granted"              # segments were handed to local readers (grant.py)


def exclusive_lock(fd: int, wait: float) -> bool:
    """An exclusive flock on ``fd`` within ``wait`` seconds (polled: flock has no timeout)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def cluster_tag(secret: bytes, etcd_prefix: str) -> str:
    """12 hex digits naming one cluster's files: a keyed digest of its etcd prefix, so the
    name tells nothing of the secret, and two clusters differ if either differs."""
    return hmac.new(secret, b"kspeedfs arena files\0" + etcd_prefix.encode(),
                    hashlib.sha256).hexdigest()[:12]


def _refuse(path: str, why: str, key: str = "cluster.arena_dir") -> UnsafePath:
    return UnsafePath(f"{key}: {path} {why}; refusing to keep a node's files there "
                      "(docs/security.md, \"The arena files\")")


def _check_ancestor(path: str, st: os.stat_result, key: str) -> None:
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "is not a directory", key)
    if st.st_uid not in (0, os.geteuid()):
        raise _refuse(path, f"belongs to uid {st.st_uid}", key)
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise _refuse(path, "may be written by others and is not sticky", key)


def private_directory(path: str, key: str = "cluster.arena_dir", create: bool = True) -> int:
    """An fd (``O_DIRECTORY``, close-on-exec) of ``path``, made 0700 if missing (with
    ``create``; else ``FileNotFoundError``), after the checks in the module docstring;
    :class:`UnsafePath` naming the config ``key`` if any fails (the node's page copy,
    ``page_copy.py``, is checked the same way)."""
    real = os.path.normpath(os.path.abspath(path))
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    walked = ""
    try:
        parts = [p for p in real.split("/") if p]
        for i, part in enumerate(parts):
            _check_ancestor(walked or "/", os.fstat(fd), key)
            walked += "/" + part
            last = i == len(parts) - 1
            if last and create:
                try:
                    os.mkdir(part, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                dir_fd=fd)
            except OSError as e:
                if last and not create and e.errno == errno.ENOENT:
                    raise
                link = stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode)
                why = ("is a symbolic link (name the real path)" if link
                       else f"cannot be opened as a directory ({e.strerror})")
                raise _refuse(walked, why, key) from None
            os.close(fd)
            fd = child
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise _refuse(real, f"belongs to uid {st.st_uid}, not to this node's ({os.geteuid()})",
                          key)
        if st.st_mode & 0o077:
            raise _refuse(real, f"has mode {st.st_mode & 0o777:04o}: group or others may enter "
                          f"it (chmod 700 {real})", key)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _open_private(dir_fd: int, directory: str, name: str, create: bool) -> int:
    """``name`` in the directory ``dir_fd``, read-write, checked as the module docstring
    says before the caller touches it."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    path = os.path.join(directory, name)
    try:
        fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refuse(path, "is a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, "is not a regular file")
        if st.st_uid != os.geteuid():
            raise _refuse(path, f"belongs to uid {st.st_uid}")
        if st.st_mode & 0o077:
            raise _refuse(path, f"has mode {st.st_mode & 0o777:04o}: group or others may use it")
        if st.st_nlink != 1:
            raise _refuse(path, f"has {st.st_nlink} links")
        return fd
    except BaseException:
        os.close(fd)
        raise


def _sized(fd: int, length: int) -> bool:
    """Whether the file ``fd`` kept its content (it had this length; else it is emptied
    and sized anew)."""
    kept = os.fstat(fd).st_size == length
    if not kept:
        os.ftruncate(fd, 0)
        os.ftruncate(fd, length)
    return kept


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def _new_inode(dir_fd: int, name: str, fd: int, length: int) -> int:
    """``name`` (open as ``fd``, which is closed) replaced by a new file of the same
    bytes, holes kept; the new file's fd. Under the node's lock, in its private
    directory: nobody else renames there."""
    new = os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        os.ftruncate(new, length)
        offset = 0
        while True:
            try:
                start = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError as e:
                if e.errno != errno.ENXIO:
                    raise
                break                                  # nothing but holes from here
            offset = os.lseek(fd, start, os.SEEK_HOLE)
            while start < offset:
                n = os.copy_file_range(fd, new, offset - start, start, start)
                if not n:
                    break
                start += n
        os.unlink(name, dir_fd=dir_fd)
        os.link(f"/proc/self/fd/{new}", name, dst_dir_fd=dir_fd, follow_symlinks=True)
    except BaseException:
        os.close(new)
        raise
    os.close(fd)
    return new


def _map(fd: int, length: int) -> tuple[mmap.mmap, bool]:
    """``length`` bytes of the file ``fd`` mapped shared, and whether its content was
    kept (``_sized``)."""
    kept = _sized(fd, length)
    buf = mmap.mmap(fd, length, flags=mmap.MAP_SHARED)
    from rdma.buffer import advise_huge

    advise_huge(buf)
    return buf, kept


@dataclass(frozen=True)
class ArenaFile:
    """One file of :func:`listing`: its path, the node and cluster its name gives, the
    RAM it holds (tmpfs blocks) and whether a running node holds it."""

    path: str
    cluster: str
    node: str
    ram_bytes: int
    in_use: bool


def _parse(name: str) -> tuple[str, str] | None:
    """(stem, kind) of an arena file's name: kind ``index``, ``arena`` (an older node's
    single file) or ``arena.<i>`` (segment i); None for any other name."""
    for suffix in (INDEX, LEGACY, GRANTED):
        if name.endswith(suffix):
            return name[:-len(suffix)], suffix[1:]
    rest, dot, i = name.rpartition(".")
    if dot and i.isdigit() and i == str(int(i)) and rest.endswith(LEGACY):
        return rest[:-len(LEGACY)], "arena." + i
    return None


class ArenaFiles:
    """The arena segment files and the index file of node ``node`` of cluster ``cluster``
    in ``directory``.

    :meth:`open` checks the directory and every file, takes the node's lock, removes
    what an earlier layout left (an older single ``.arena``, segments past the last) and
    maps them: the segments as one range (:class:`SegmentMemory`, ``segments``); the
    lock and the mappings last until :meth:`close` (or the process's end).
    A segment handed to a local reader stays mapped by it past this node's exit, so a
    run that handed any out leaves ``<stem>.granted`` (:meth:`mark_granted`) and the next
    :meth:`open` gives every segment a new inode with the same bytes (the old ones live
    on only in those readers' mappings, and never see another chunk).
    :meth:`usage` is what ``kspeedfs status`` shows of them."""

    def __init__(self, directory: str, cluster: str, node: str) -> None:
        self.directory = directory
        self.stem = f"{cluster}-{node}"
        self.node = node
        self.nsegments = 1
        self.segments: SegmentMemory | None = None
        self._index_fd = -1
        self._granted = False

    @property
    def index_path(self) -> str:
        return os.path.join(self.directory, self.stem + INDEX)

    @property
    def paths(self) -> list[str]:
        """The segments' paths, then the index's."""
        return [os.path.join(self.directory, f"{self.stem}{LEGACY}.{i}")
                for i in range(self.nsegments)] + [self.index_path]

    def open(self, arena_bytes: int, index_bytes: int, wait: float = ARENA_LOCK_WAIT,
             segment_bytes: int = 0) -> tuple[mmap.mmap, mmap.mmap, bool]:
        """The arena's memory (segments of ``segment_bytes``, 0: one) and the index's, and
        whether all kept their content (an arena without its index is fresh).
        :class:`UnsafePath` if a check fails, :class:`DatasetInUse` if another node of
        this name and cluster still holds them after ``wait`` seconds."""
        lengths = segment_lengths(arena_bytes, segment_bytes)
        self.nsegments = len(lengths)
        fds: list[int] = []
        dir_fd = private_directory(self.directory)
        try:
            self._index_fd = _open_private(dir_fd, self.directory, self.stem + INDEX, create=True)
            for path in self.paths[:-1]:
                fds.append(_open_private(dir_fd, self.directory, os.path.basename(path),
                                         create=True))
            if not exclusive_lock(self._index_fd, wait):
                raise DatasetInUse(f"node {self.node} of this cluster already runs on this "
                                   f"host (it holds {self.index_path})")
            kept = all([_sized(fd, n) for fd, n in zip(fds, lengths, strict=True)])
            if _exists(dir_fd, self.stem + GRANTED):
                for i, n in enumerate(lengths):       # (fds stays whole if one fails)
                    fds[i] = _new_inode(dir_fd, os.path.basename(self.paths[i]), fds[i], n)
            self._remove_stale(dir_fd)
            if not kept:                    # an index of other slots: never adopted
                os.ftruncate(self._index_fd, 0)
            self.segments = SegmentMemory(fds, lengths)
        except BaseException:
            for fd in fds:
                os.close(fd)
            self.close()
            raise
        finally:
            os.close(dir_fd)
        index, index_kept = _map(self._index_fd, index_bytes)
        return self.segments.memory, index, kept and index_kept

    def _remove_stale(self, dir_fd: int) -> None:
        """Under the lock: an older single arena file, and segments past the last."""
        ours = {os.path.basename(p) for p in self.paths}
        for name in os.listdir(dir_fd):
            parsed = _parse(name)
            if parsed and parsed[0] == self.stem and name not in ours:
                log.info("removing %s: left by an earlier arena layout",
                         os.path.join(self.directory, name))
                os.unlink(name, dir_fd=dir_fd)

    def mark_granted(self) -> None:
        """Segments are being handed to a local reader: leave ``<stem>.granted`` (class
        docstring) before the first is."""
        if self._granted:
            return
        dir_fd = private_directory(self.directory)
        try:
            os.close(_open_private(dir_fd, self.directory, self.stem + GRANTED, create=True))
        finally:
            os.close(dir_fd)
        self._granted = True

    def usage(self) -> dict[str, int]:
        """The bytes of RAM the files hold now: the segments' together (as
        ``<stem>.arena.*``: thousands in a large arena) and the index's."""
        ram = {os.path.join(self.directory, self.stem + LEGACY + ".*"):
               sum(os.fstat(fd).st_blocks * 512 for fd in self.segments.fds)} if self.segments else {}
        if self._index_fd >= 0:
            ram[self.index_path] = os.fstat(self._index_fd).st_blocks * 512
        return ram

    def close(self) -> None:
        """Close the files; the lock goes with the last of them and of the mappings
        (``mmap`` holds a duplicate of the fd), i.e. when the node's arena is gone."""
        if self.segments is not None:
            self.segments.close()
            self.segments = None
        if self._index_fd >= 0:
            os.close(self._index_fd)
            self._index_fd = -1


def listing(directory: str) -> list[ArenaFile]:
    """Every arena or index file in ``directory`` (checked as :func:`private_directory`
    checks it; nothing in it is opened for writing or followed): none if it is missing,
    which is not made here."""
    try:
        dir_fd = private_directory(directory, create=False)
    except FileNotFoundError:
        return []
    out = []
    try:
        for name in sorted(os.listdir(dir_fd)):
            parsed = _parse(name)
            stem = parsed[0] if parsed else ""
            cluster, sep, node = stem.partition("-")
            if not sep:
                continue
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            out.append(ArenaFile(os.path.join(directory, name), cluster, node,
                                 st.st_blocks * 512, _locked(dir_fd, stem + INDEX)))
    finally:
        os.close(dir_fd)
    return out


def _locked(dir_fd: int, index: str) -> bool:
    try:
        fd = os.open(index, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                     dir_fd=dir_fd)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def drop(directory: str, cluster: str, node: str) -> list[ArenaFile]:
    """Remove node ``node``'s arena (segments, or an older single file) and index of
    cluster ``cluster`` (their RAM comes back),
    refused with :class:`DatasetInUse` while a node holds them; what was removed. The
    node's lock is taken first and held across the unlinks, so a node starting meanwhile
    is refused, or starts on fresh files."""
    mine = [f for f in listing(directory) if f.cluster == cluster and f.node == node]
    stem = f"{cluster}-{node}"
    try:
        dir_fd = private_directory(directory, create=False)
    except FileNotFoundError:
        return mine                          # (no directory: nothing to drop, none made)
    try:
        try:
            fd = _open_private(dir_fd, directory, stem + INDEX, create=False)
        except FileNotFoundError:
            fd = -1
        try:
            if fd >= 0:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise DatasetInUse(f"node {node}'s arena in {directory} is in use by a "
                                       "running node: stop it first") from None
            for name in os.listdir(dir_fd):
                parsed = _parse(name)
                if parsed and parsed[0] == stem:
                    try:
                        os.unlink(name, dir_fd=dir_fd)
                    except FileNotFoundError:
                        pass
        finally:
            if fd >= 0:
                os.close(fd)
    finally:
        os.close(dir_fd)
    return mine
