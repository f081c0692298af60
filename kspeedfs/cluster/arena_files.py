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
* **the names** carry the cluster and the node, ``<cluster>-<node>.arena``/``.index``:
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

log = logging.getLogger(__name__)

SUFFIXES = (".arena", ".index")


def _lock(fd: int, wait: float) -> bool:
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


def _refuse(path: str, why: str) -> UnsafePath:
    return UnsafePath(f"cluster.arena_dir: {path} {why}; refusing to keep a node's arena "
                      "there (docs/security.md, \"The arena files\")")


def _check_ancestor(path: str, st: os.stat_result) -> None:
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "is not a directory")
    if st.st_uid not in (0, os.geteuid()):
        raise _refuse(path, f"belongs to uid {st.st_uid}")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise _refuse(path, "may be written by others and is not sticky")


def private_directory(path: str) -> int:
    """An fd (``O_DIRECTORY``, close-on-exec) of ``path``, made 0700 if missing, after the
    checks in the module docstring; :class:`UnsafePath` if any fails."""
    real = os.path.normpath(os.path.abspath(path))
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    walked = ""
    try:
        parts = [p for p in real.split("/") if p]
        for i, part in enumerate(parts):
            _check_ancestor(walked or "/", os.fstat(fd))
            walked += "/" + part
            last = i == len(parts) - 1
            if last:
                try:
                    os.mkdir(part, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                dir_fd=fd)
            except OSError as e:
                link = stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode)
                why = ("is a symbolic link (name the real path)" if link
                       else f"cannot be opened as a directory ({e.strerror})")
                raise _refuse(walked, why) from None
            os.close(fd)
            fd = child
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise _refuse(real, f"belongs to uid {st.st_uid}, not to this node's ({os.geteuid()})")
        if st.st_mode & 0o077:
            raise _refuse(real, f"has mode {st.st_mode & 0o777:04o}: group or others may enter "
                          f"it (chmod 700 {real})")
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


def _map(fd: int, length: int) -> tuple[mmap.mmap, bool]:
    """``length`` bytes of the file ``fd`` mapped shared, and whether its content was
    kept (it had this length; else it is emptied and sized anew)."""
    kept = os.fstat(fd).st_size == length
    if not kept:
        os.ftruncate(fd, 0)
        os.ftruncate(fd, length)
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


class ArenaFiles:
    """The arena and index files of node ``node`` of cluster ``cluster`` in ``directory``.

    :meth:`open` checks the directory and both files, takes the node's lock and maps them;
    the lock and the mappings last until :meth:`close` (or the process's end).
    :meth:`usage` is what ``kspeedfs status`` shows of them."""

    def __init__(self, directory: str, cluster: str, node: str) -> None:
        self.directory = directory
        self.stem = f"{cluster}-{node}"
        self.node = node
        self._fds: list[int] = []

    @property
    def paths(self) -> list[str]:
        return [os.path.join(self.directory, self.stem + s) for s in SUFFIXES]

    def open(self, arena_bytes: int, index_bytes: int,
             wait: float = ARENA_LOCK_WAIT) -> tuple[mmap.mmap, mmap.mmap, bool]:
        """The arena's and the index's memory, and whether both kept their content (an
        arena without its index is fresh). :class:`UnsafePath` if a check fails,
        :class:`DatasetInUse` if another node of this name and cluster still holds them
        after ``wait`` seconds."""
        dir_fd = private_directory(self.directory)
        try:
            arena_fd = _open_private(dir_fd, self.directory, self.stem + ".arena", create=True)
            self._fds.append(arena_fd)
            index_fd = _open_private(dir_fd, self.directory, self.stem + ".index", create=True)
            self._fds.append(index_fd)
        finally:
            os.close(dir_fd)
        if not _lock(index_fd, wait):
            self.close()
            raise DatasetInUse(f"node {self.node} of this cluster already runs on this host "
                               f"(it holds {self.paths[1]})")
        arena, arena_kept = _map(arena_fd, arena_bytes)
        index, index_kept = _map(index_fd, index_bytes)
        return arena, index, arena_kept and index_kept

    def usage(self) -> dict[str, int]:
        """Each file's path → the bytes of RAM it holds now."""
        return {os.path.join(self.directory, self.stem + s): os.fstat(fd).st_blocks * 512
                for s, fd in zip(SUFFIXES, self._fds, strict=False)}

    def close(self) -> None:
        """Close the files; the lock goes with the last of them and of the mappings
        (``mmap`` holds a duplicate of the fd), i.e. when the node's arena is gone."""
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


def listing(directory: str) -> list[ArenaFile]:
    """Every arena or index file in ``directory`` (checked as :func:`private_directory`
    checks it; nothing in it is opened for writing or followed)."""
    dir_fd = private_directory(directory)
    out = []
    try:
        for name in sorted(os.listdir(dir_fd)):
            stem, suffix = os.path.splitext(name)
            cluster, sep, node = stem.partition("-")
            if suffix not in SUFFIXES or not sep:
                continue
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            out.append(ArenaFile(os.path.join(directory, name), cluster, node,
                                 st.st_blocks * 512, _locked(dir_fd, stem + ".index")))
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
    """Remove node ``node``'s arena and index of cluster ``cluster`` (their RAM comes back),
    refused with :class:`DatasetInUse` while a node holds them; what was removed. The
    node's lock is taken first and held across the unlinks, so a node starting meanwhile
    is refused, or starts on fresh files."""
    mine = [f for f in listing(directory) if f.cluster == cluster and f.node == node]
    files = ArenaFiles(directory, cluster, node)
    dir_fd = private_directory(directory)
    try:
        try:
            fd = _open_private(dir_fd, directory, files.stem + ".index", create=False)
        except FileNotFoundError:
            fd = -1
        try:
            if fd >= 0:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise DatasetInUse(f"node {node}'s arena in {directory} is in use by a "
                                       "running node: stop it first") from None
            for s in SUFFIXES:
                try:
                    os.unlink(files.stem + s, dir_fd=dir_fd)
                except FileNotFoundError:
                    pass
        finally:
            if fd >= 0:
                os.close(fd)
    finally:
        os.close(dir_fd)
    return mine
