"""② for the Python library: a dataset version's paths answered from its manifest index
alone, in the caller's thread (no I/O, no lock, no trio hop: the index is immutable).

    resolve(path)                     the entry, symlinks inside the dataset followed
    file(path)                        the same, not a directory (EISDIR)
    stat / exists / isdir / isfile    what ``os`` on the mount answers
    listdir / walk                    directory listings, as ``os.listdir``/``os.walk``
"""
from __future__ import annotations

import errno
import os
import stat as stat_
from collections.abc import Callable, Iterator

from ..manifest.index import ManifestIndex
from .errors import PathLike, oserror

__all__ = ["MAXSYMLINKS", "DatasetTree"]

#: symlinks followed in one path resolution before ELOOP (Linux's limit)
MAXSYMLINKS = 40


class DatasetTree:
    """The namespace of one dataset version, from any thread.

    Paths are relative to the dataset's root (a leading ``/`` is allowed), ``str`` or
    ``bytes``. Symlinks inside the dataset are followed; an absolute target is ENOENT,
    and ``..`` stops at the dataset's root, as at ``/``. Errors are those of ``os`` on
    the mount (FileNotFoundError, NotADirectoryError, IsADirectoryError, ELOOP), raised
    as OSError; ``check()`` runs before each resolution (and after a stat or a listing)
    and raises what it raises (the handle's closed or forked state, a manifest page that
    could not be loaded). Owns nothing: the index is shared, read-only.

    Attributes:
        index: the manifest.
        check: called before each resolution; raises to refuse it.
    """

    def __init__(self, index: ManifestIndex, check: Callable[[], None]) -> None:
        self.index = index
        self.check = check

    def resolve(self, path: PathLike, follow: bool = True) -> int:
        """The entry at ``path``, following symlinks inside the dataset (the last
        component only when ``follow``)."""
        self.check()
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
                raise oserror(errno.ENOTDIR, path)
            entry = ix.lookup(parent, name)
            if entry is None:
                raise oserror(errno.ENOENT, path)
            if ix.is_symlink(entry) and (todo or follow):
                hops += 1
                if hops > MAXSYMLINKS:
                    raise oserror(errno.ELOOP, path)
                target = ix.readlink(entry)
                if target.startswith(b"/"):     # outside the dataset: not ours to follow
                    raise oserror(errno.ENOENT, path)
                todo.extend(reversed([n for n in target.split(b"/") if n and n != b"."]))
                continue
            here.append(entry)
        return here[-1] if here else 0

    def file(self, path: PathLike) -> int:
        """The entry of the file at ``path`` (symlinks followed); EISDIR for a directory."""
        entry = self.resolve(path)
        if self.index.is_dir(entry):
            raise oserror(errno.EISDIR, path)
        return entry

    def stat(self, path: PathLike = "", *, follow_symlinks: bool = True) -> os.stat_result:
        """What ``os.stat`` on the mount returns (``st_ino`` is the mount's inode
        number; directories are 4096 bytes; every time is the source's mtime)."""
        ix = self.index
        entry = self.resolve(path, follow_symlinks)
        size = 4096 if ix.is_dir(entry) else ix.size[entry]
        ns = ix.mtime_ns[entry]
        sec = ns // 1_000_000_000
        self.check()                    # again: a page that failed since reads as zeros
        return os.stat_result((
            ix.mode[entry], entry + 1, 0, ix.nlink(entry), ix.uid[entry], ix.gid[entry], size,
            sec, sec, sec, ns / 1e9, ns / 1e9, ns / 1e9, ns, ns, ns,
            ix.block_size or ix.chunk_size, (size + 511) // 512, 0))

    def exists(self, path: PathLike) -> bool:
        try:
            self.resolve(path)
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
        entry = self.resolve(path)
        if not ix.is_dir(entry):
            raise oserror(errno.ENOTDIR, path)
        names = [ix.name(c) for c in ix.children(entry)]
        self.check()
        return names if isinstance(path, bytes) else [os.fsdecode(n) for n in names]

    def walk(self, top: PathLike = "") -> Iterator[tuple[str, list[str], list[str]]]:
        """``os.walk`` over the dataset, top-down: ``(dirpath, dirnames, filenames)``
        with ``dirpath`` relative to the root (``""`` for the root itself); symlinks are
        listed among the files and not followed. Pruning ``dirnames`` in place works."""
        ix = self.index
        entry = self.resolve(top)
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
