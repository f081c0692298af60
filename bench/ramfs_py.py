"""ramfs_py: a do-nothing read-only pyfuse3 filesystem serving a source tree from RAM.

The ceiling of a Python FUSE daemon on this machine: same stack as kspeedfs
(pyfuse3 + trio, one OS thread), same promises to the kernel (``ro``, the same
default options, entry/attr timeouts of a day, ``keep_cache`` on every open,
READDIRPLUS via pyfuse3), but no cache lookup, no chunking, no checksum: every file's
bytes are loaded at start and a READ is one ``memoryview`` slice (no copy; pyfuse3
takes any buffer). Whatever kspeedfs loses against this is kspeedfs's own cost.

The sysfs knobs (max_background, congestion_threshold, read_ahead_kb) are set by the
suite after the mount is live, with kspeedfs's defaults, through
``kspeedfs.fuse.tuning`` - the same code path kspeedfs's daemon uses.

Usage: python bench/ramfs_py.py SOURCE MOUNTPOINT   (foreground; fusermount3 -u stops it)
"""
from __future__ import annotations

import errno
import os
import signal
import stat
import sys

import pyfuse3
import trio

TIMEOUT = 86400.0


class Node:
    __slots__ = ("attr", "data", "children", "names")

    def __init__(self, attr: pyfuse3.EntryAttributes) -> None:
        self.attr = attr
        self.data: memoryview | bytes = b""
        self.children: dict[bytes, int] | None = None
        self.names: list[bytes] = []      # sorted child names: readdir positions


def _attr(st: os.stat_result, ino: int) -> pyfuse3.EntryAttributes:
    a = pyfuse3.EntryAttributes()
    a.st_ino = ino
    a.entry_timeout = a.attr_timeout = TIMEOUT
    a.st_mode, a.st_nlink, a.st_uid, a.st_gid = st.st_mode, st.st_nlink, st.st_uid, st.st_gid
    a.st_size, a.st_blksize, a.st_blocks = st.st_size, 4096, (st.st_size + 511) // 512
    a.st_mtime_ns = a.st_ctime_ns = a.st_atime_ns = st.st_mtime_ns
    return a


def load(root: bytes) -> list[Node]:
    """Every entry below ``root``; inode = index + 1 (the root is 1)."""
    nodes = [Node(_attr(os.lstat(root), 1))]
    todo = [(root, 0)]
    while todo:
        path, ix = todo.pop()
        node = nodes[ix]
        node.children = {}
        with os.scandir(path) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            st = e.stat(follow_symlinks=False)
            k = len(nodes)
            child = Node(_attr(st, k + 1))
            nodes.append(child)
            node.children[e.name] = k
            node.names.append(e.name)
            if stat.S_ISDIR(st.st_mode):
                todo.append((e.path, k))
            elif stat.S_ISLNK(st.st_mode):
                child.data = os.readlink(e.path)
            elif stat.S_ISREG(st.st_mode) and st.st_size:
                with open(e.path, "rb") as f:
                    child.data = memoryview(f.read())
    return nodes


class RamFS(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False

    def __init__(self, nodes: list[Node]) -> None:
        super().__init__()
        self.nodes = nodes

    def _node(self, inode: int) -> Node:
        if not 1 <= inode <= len(self.nodes):
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self.nodes[inode - 1]

    async def lookup(self, parent_inode, name, ctx=None):
        parent = self._node(parent_inode)
        if parent.children is None:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        k = parent.children.get(name)
        if k is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self.nodes[k].attr

    async def getattr(self, inode, ctx=None):
        return self._node(inode).attr

    async def readlink(self, inode, ctx):
        node = self._node(inode)
        if not stat.S_ISLNK(node.attr.st_mode):
            raise pyfuse3.FUSEError(errno.EINVAL)
        return bytes(node.data)

    async def opendir(self, inode, ctx):
        if self._node(inode).children is None:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh, start_id, token):
        node = self.nodes[fh - 1]
        for pos in range(start_id, len(node.names)):
            name = node.names[pos]
            if not pyfuse3.readdir_reply(token, name, self.nodes[node.children[name]].attr, pos + 1):
                return

    async def releasedir(self, fh):
        pass

    async def open(self, inode, flags, ctx):
        node = self._node(inode)
        if node.children is not None:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise pyfuse3.FUSEError(errno.EROFS)
        return pyfuse3.FileInfo(fh=inode, keep_cache=True, direct_io=False)

    async def read(self, fh, off, size):
        return self.nodes[fh - 1].data[off:off + size]

    async def release(self, fh):
        pass

    async def statfs(self, ctx):
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        s.f_files = len(self.nodes)
        s.f_namemax = 255
        return s


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(f"usage: {argv[0]} SOURCE MOUNTPOINT", file=sys.stderr)
        return 2
    nodes = load(os.fsencode(argv[1]))
    print(f"ramfs_py: {len(nodes)} entries loaded from {argv[1]}", file=sys.stderr, flush=True)
    options = set(pyfuse3.default_options) | {"ro", "fsname=ramfs_py", "subtype=ramfs_py"}
    pyfuse3.init(RamFS(nodes), argv[2], options)

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            async def on_signal() -> None:
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as sigs:
                    async for _ in sigs:
                        pyfuse3.terminate()
                        return
            nursery.start_soon(on_signal)
            await pyfuse3.main()
            nursery.cancel_scope.cancel()

    try:
        trio.run(serve)
    finally:
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
