"""① FUSE requests, top to bottom. Each handler is a few lines: the index answers
metadata, ``reader.Reader`` answers data, ``boundary.fuse_op`` maps errors.

Read-only by construction: every write-type request raises :class:`ReadOnly`
(EROFS) from the ``read_only`` table at the bottom of the class, and ``open`` refuses
any write access mode.
The snapshot never changes under a mount, so entries and attributes are cached by
the kernel for ``fuse.entry_timeout``/``attr_timeout`` (a day by default) and files
open with ``keep_cache``: a page the kernel has cached stays valid forever.

Inode numbers are manifest entry numbers + 1 (``pyfuse3.ROOT_INODE`` is 1); the
index is immutable, so lookup counts need no bookkeeping and ``forget`` is a no-op.
"""
from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict
from typing import Any

import pyfuse3

from ..cache.prefetch import Stream
from ..config import FuseConfig
from ..errors import ReadOnly
from ..manifest.index import ManifestIndex
from ..manifest.store.base import DatasetInfo
from ..reader import Reader
from .boundary import OpStats, fuse_op

XATTR_PREFIX = b"user.kspeedfs."
_ACCMODE = os.O_RDONLY | os.O_WRONLY | os.O_RDWR


def read_only(name: str) -> Callable[..., Coroutine[Any, Any, Any]]:
    """The handler of write-type request ``name``: EROFS, through ``@fuse_op`` (named
    before it is wrapped, so the access log says ``write``, not ``op``)."""
    async def op(self: Operations, *request: object) -> None:
        raise ReadOnly(f"{name}: kspeedfs is read-only")

    op.__name__ = op.__qualname__ = name
    return fuse_op(op)


class Operations(pyfuse3.Operations):
    """The FUSE request handlers of one mounted dataset version: read-only, immutable.

    Passed to ``pyfuse3.init`` by ``daemon.serve``. Metadata comes from the manifest
    index alone (no I/O); ``read`` is the one handler that calls into the data path
    (``reader.Reader``), and every handler is wrapped by ``boundary.fuse_op``, the only
    place errors become errnos. Write-type requests answer EROFS from the ``read_only``
    table at the bottom; flush/fsync are left unimplemented (ENOSYS, a no-op for the
    kernel). Handlers run in the trio thread and never block it.

    Attributes:
        index: the dataset's :class:`ManifestIndex`; inode = entry number + 1.
        reader: serves ``read``, and the ``stats`` xattr of the mount root.
        info: the dataset version mounted (``generation`` of every inode is its version).
        entry_timeout, attr_timeout: kernel cache lifetimes, s (``fuse.*``).
        xattrs: serve ``user.kspeedfs.*`` xattrs; off answers ENOSYS (``fuse.xattrs``).
        blksize: ``st_blksize`` reported; 0 = the dataset's block or chunk size.
        slow_op: operations slower than this (s) are logged as WARNINGs (``log.slow_op``).
        op_stats: per-operation counts, errors and latency buckets (``boundary.OpStats``),
            read by the metrics exporter at scrape time.
        op_rows: the rows every engine answered, ``{op: [count, errors, seconds, *buckets]}``
            (pyfuse3: ``op_stats``; the native engine's session puts its C + Python sum
            here); their counts are the ``ops`` of the ``stats`` xattr.
    """

    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, index: ManifestIndex, reader: Reader, info: DatasetInfo,
                 cfg: FuseConfig, *, slow_op: float) -> None:
        super().__init__()
        self.index = index
        self.reader = reader
        self.info = info
        self.entry_timeout = cfg.entry_timeout
        self.attr_timeout = cfg.attr_timeout
        self.xattrs = cfg.xattrs
        self.blksize = cfg.blksize
        self.slow_op = slow_op
        self.op_stats = OpStats()
        self.op_rows: Callable[[], dict[str, list[Any]]] = \
            lambda: {op: list(row) for op, row in self.op_stats.rows.items()}
        self._streams: dict[int, tuple[int, Stream]] = {}   # fh -> (entry, sequential state)
        #: how requests reach the daemon, for the ``stats`` xattr (the native session's
        #: says "native io_uring" or "native /dev/fuse", with its ring counters)
        self.transport_stats: Callable[[], dict[str, Any]] = lambda: {"transport": "pyfuse3"}
        self._next_fh = 1

    # -- metadata ----------------------------------------------------------------------

    def _attr(self, entry: int) -> pyfuse3.EntryAttributes:
        ix = self.index
        a = pyfuse3.EntryAttributes()
        a.st_ino = entry + 1
        a.generation = self.info.version
        a.entry_timeout = self.entry_timeout
        a.attr_timeout = self.attr_timeout
        a.st_mode = ix.mode[entry]
        a.st_nlink = ix.nlink(entry)
        a.st_uid = ix.uid[entry]
        a.st_gid = ix.gid[entry]
        a.st_size = ix.size[entry] if not ix.is_dir(entry) else 4096
        a.st_blksize = self.blksize or ix.block_size or ix.chunk_size   # fuse.blksize: see config.py
        a.st_blocks = (a.st_size + 511) // 512
        a.st_mtime_ns = a.st_ctime_ns = a.st_atime_ns = ix.mtime_ns[entry]
        return a

    def _entry(self, inode: int) -> int:
        entry = inode - 1
        if not 0 <= entry < self.index.entries:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return entry

    @fuse_op
    async def lookup(self, parent_inode: int, name: bytes,
                     ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        parent = self._entry(parent_inode)
        if not self.index.is_dir(parent):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        if len(name) > 255:
            raise pyfuse3.FUSEError(errno.ENAMETOOLONG)
        entry = self.index.lookup(parent, name)
        if entry is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(entry)

    @fuse_op
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._attr(self._entry(inode))

    @fuse_op
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        entry = self._entry(inode)
        if not self.index.is_symlink(entry):
            raise pyfuse3.FUSEError(errno.EINVAL)
        return self.index.readlink(entry)

    # a plain function: pyfuse3 awaits forget's result only when it is not None (its
    # stub says async), so no coroutine is made per FORGET
    def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:  # type: ignore[override]
        pass

    # -- directories -------------------------------------------------------------------

    @fuse_op
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        entry = self._entry(inode)
        if not self.index.is_dir(entry):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    @fuse_op
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        """Streams the directory's children from ``start_id`` (their position + 1) until
        the kernel's buffer is full: memory per call is one buffer, not the directory."""
        children = self.index.children(fh - 1)
        for pos in range(start_id, len(children)):
            entry = children[pos]
            if not pyfuse3.readdir_reply(token, self.index.name(entry), self._attr(entry), pos + 1):
                return

    @fuse_op
    async def releasedir(self, fh: int) -> None:
        pass

    # -- files -------------------------------------------------------------------------

    @fuse_op
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        entry = self._entry(inode)
        if flags & _ACCMODE != os.O_RDONLY or flags & (os.O_TRUNC | os.O_APPEND):
            raise ReadOnly("kspeedfs is read-only")
        if self.index.is_dir(entry):
            raise pyfuse3.FUSEError(errno.EISDIR)
        fh = self._next_fh
        self._next_fh += 1
        self._streams[fh] = (entry, Stream())
        return pyfuse3.FileInfo(fh=fh, keep_cache=True, direct_io=False)

    @fuse_op
    async def read(self, fh: int, off: int, size: int) -> bytes:
        entry, stream = self._streams[fh]
        # pyfuse3 replies with any buffer (a memoryview of a cached chunk); its stub says bytes
        return await self.reader.read(entry, off, size, stream)  # type: ignore[return-value]

    @fuse_op
    async def release(self, fh: int) -> None:
        self._streams.pop(fh, None)

    # -- filesystem --------------------------------------------------------------------

    @fuse_op
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = (self.info.bytes + 4095) // 4096
        s.f_bfree = s.f_bavail = 0
        s.f_files = self.index.entries
        s.f_ffree = s.f_favail = 0
        s.f_namemax = 255
        return s

    # -- extended attributes -------------------------------------------------------------
    #
    # Off by default (``fuse.xattrs``), as in JuiceFS: ``ls -l`` asks every entry for
    # ``security.selinux`` and ``system.posix_acl_access``, the kernel caches no negative
    # answer, and two GETXATTR round trips per entry made ``ls -l`` of 100k entries run at
    # 6k entries/s (0.06x a do-nothing pyfuse3 filesystem). ENOSYS, answered once, makes
    # the kernel stop sending GETXATTR/LISTXATTR for the whole mount.

    def xattr_values(self, entry: int) -> dict[bytes, bytes]:
        """The ``user.kspeedfs.*`` attributes of ``entry`` (names without the prefix)."""
        ix = self.index
        out = {b"dataset": f"{self.info.name}@{self.info.version}".encode()}
        if ix.is_file(entry) and ix.size[entry]:
            exts = list(ix.file_extents(entry))
            out[b"checksum"] = ("xxh3-128:" + ",".join(e.digest.hex() for e in exts)).encode()
            out[b"chunks"] = ",".join(str(e.chunk) for e in exts).encode()
        if entry == 0:
            out[b"stats"] = json.dumps(self.stats_record()).encode()
        return out

    def stats_record(self) -> dict[str, Any]:
        """The mount's counters (``kspeedfs stats``, over the control socket or as the
        ``stats`` xattr): ReadStatistics, PeerStatistics on a cluster mount, per-op counts
        and how requests reach the daemon."""
        stats = asdict(self.reader.statistics())
        if self.reader.peers is not None:          # a cluster mount: its peer reads too
            stats.update(asdict(self.reader.peers.statistics()))
        stats["ops"] = {op: row[0] for op, row in self.op_rows().items() if row[0]}
        stats.update(self.transport_stats())
        return stats

    @fuse_op
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        if not self.xattrs:
            raise pyfuse3.FUSEError(errno.ENOSYS)
        return [XATTR_PREFIX + k for k in self.xattr_values(self._entry(inode))]

    @fuse_op
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        if not self.xattrs:
            raise pyfuse3.FUSEError(errno.ENOSYS)
        entry = self._entry(inode)
        if not name.startswith(XATTR_PREFIX):
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        value = self.xattr_values(entry).get(name[len(XATTR_PREFIX):])
        if value is None:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        return value

    # -- write-type requests: EROFS, from this one table ----------------------------------
    #
    # flush/fsync stay unimplemented (ENOSYS): the kernel then treats them as no-ops, which
    # is right for read-only files; EROFS there would make close() fail.

    setattr = read_only("setattr")
    mknod = read_only("mknod")
    mkdir = read_only("mkdir")
    unlink = read_only("unlink")
    rmdir = read_only("rmdir")
    symlink = read_only("symlink")
    rename = read_only("rename")
    link = read_only("link")
    write = read_only("write")
    create = read_only("create")
    setxattr = read_only("setxattr")
    removexattr = read_only("removexattr")
