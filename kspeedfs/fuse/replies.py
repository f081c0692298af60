"""① What the native engine's queue leaves to Python: READ misses and xattrs, answered.

    answer_read       Reader.read_parts → _engine.reply (one writev of the chunks' views)
    answer_getxattr   Operations.xattr_values → the value, its size, or ERANGE
    answer_listxattr  the names, NUL-terminated, the same way
    read, getxattr, listxattr   the handlers, through ``boundary.fuse_op`` (the one errno
                                boundary; counted in ``op_stats`` from the request's arrival)

Each answer goes to the fd (or io_uring ring token) its request came from.
"""
from __future__ import annotations

import errno
from typing import Any

import pyfuse3

from ..cache.prefetch import Stream
from .boundary import OpStats, fuse_op
from .connection import _engine
from .operations import XATTR_PREFIX, Operations


class Replies:
    """Python's answers to queued requests, each run as a trio task of its own.

    Every ``answer_*`` replies exactly once, with the data or the errno ``fuse_op`` made of
    the handler's error. Holds what ``fuse_op`` needs (``slow_op``, ``op_stats``: the
    Python-side rows that ``NativeSession.op_rows`` adds to C's; ``index``).
    """

    def __init__(self, ops: Operations) -> None:
        self.ops = ops
        self.index = ops.index          # fuse_op fails closed once its pages failed
        self.slow_op = ops.slow_op
        self.op_stats = OpStats()

    # the handlers' since= is @fuse_op's (boundary.py), not in their signatures: hence the
    # call-arg ignores below

    async def answer_read(self, fd: int, unique: int, entry: int, offset: int, size: int,
                          random: int, since: float) -> None:
        # the C thread did the sequential-read bookkeeping; this stream only carries
        # its verdict (``read_policy.is_random``) and starts no prefetch of its own
        stream = Stream(next_offset=-1 if random else offset)
        try:
            data = await self.read(entry, offset, size, stream, since=since)  # type: ignore[call-arg]
        except pyfuse3.FUSEError as e:
            _engine.reply_error(fd, unique, e.errno)
            return
        _engine.reply(fd, unique, data)

    async def answer_getxattr(self, fd: int, unique: int, entry: int, name: bytes,
                              size: int, since: float) -> None:
        try:
            value = await self.getxattr(entry, name, since=since)  # type: ignore[call-arg]
        except pyfuse3.FUSEError as e:
            _engine.reply_error(fd, unique, e.errno)
            return
        self._reply_xattr(fd, unique, value, size)

    async def answer_listxattr(self, fd: int, unique: int, entry: int, size: int,
                               since: float) -> None:
        try:
            names = await self.listxattr(entry, since=since)  # type: ignore[call-arg]
        except pyfuse3.FUSEError as e:
            _engine.reply_error(fd, unique, e.errno)
            return
        self._reply_xattr(fd, unique, b"".join(n + b"\0" for n in names), size)

    @staticmethod
    def _reply_xattr(fd: int, unique: int, value: bytes, size: int) -> None:
        if size == 0:
            _engine.reply_xattr_size(fd, unique, len(value))
        elif len(value) > size:
            _engine.reply_error(fd, unique, errno.ERANGE)
        else:
            _engine.reply(fd, unique, value)

    # -- the handlers (through the one errno boundary) -----------------------------------

    @fuse_op
    async def read(self, entry: int, offset: int, size: int, stream: Stream) -> Any:
        return await self.ops.reader.read_parts(entry, offset, size, stream)

    @fuse_op
    async def getxattr(self, entry: int, name: bytes) -> bytes:
        if not name.startswith(XATTR_PREFIX):
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        value = self.ops.xattr_values(entry).get(name[len(XATTR_PREFIX):])
        if value is None:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        return value

    @fuse_op
    async def listxattr(self, entry: int) -> list[bytes]:
        return [XATTR_PREFIX + k for k in self.ops.xattr_values(entry)]
