"""Soft memory region: pins a Python buffer (a buffer export, so a bytearray cannot be
resized and an mmap cannot be closed under the engine) and registers its address range.

``close()`` deregisters first, and the engine kills any connection or QP that still has
work pointing into the region before ``dereg_mr`` returns: a closed MR never serves a READ
and is never written into again.  Only then is the buffer export released.
"""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

from ...api import MR
from ...buffer import anonymous
from ...errors import RdmaUserError

if TYPE_CHECKING:
    from .pd import SoftPD


class SoftMR(MR):
    """:class:`rdma.api.MR` on a soft device: a pinned Python buffer registered with the engine.

    An int allocates zeroed private anonymous memory (``rdma.buffer.anonymous``); a writable
    buffer is registered in place and stays exported (pinned: a bytearray cannot be resized
    nor an mmap closed) until ``close()``. ``buf`` is the buffer's address; ``lkey`` and
    ``rkey`` are the one key the engine returns. Beyond the interface, ``view()`` gives the
    registered bytes without a copy. The engine's thread serves READs from this memory and
    lands READ responses in it, checking rkey, PD, bounds and access itself.
    Owns the registration and the export: ``close()`` deregisters first (the engine kills
    any connection or QP whose work still points into the region before ``dereg_mr``
    returns, so a closed MR is never read or written by it again), then releases the export.
    ``read``/``write`` copy under no lock: a buffer a posted WR names is the engine's until
    its WC has been polled (:mod:`rdma.api`)."""

    def __init__(self, pd: SoftPD, buf: Any, access: int) -> None:
        super().__init__(pd, access)
        self.engine = pd.engine
        if isinstance(buf, int):
            if buf <= 0:
                raise RdmaUserError(f"MR length must be > 0, got {buf}")
            buf = anonymous(buf)           # private, huge pages if large (rdma/buffer.py)
        self._obj = buf
        view = memoryview(buf)
        if view.readonly:
            raise RdmaUserError("MR buffer must be writable")
        self._view = view.cast("B")
        self.length: int = self._view.nbytes
        if self.length == 0:
            raise RdmaUserError("MR buffer is empty")
        # keeps the buffer exported (pinned) for as long as the MR lives
        self._c = (ctypes.c_char * self.length).from_buffer(self._view)
        self.buf: int = ctypes.addressof(self._c)
        key = self.engine.call("reg_mr", self.engine.raw.reg_mr, pd.handle, self.buf,
                               self.length, int(access))
        self.lkey: int = key
        self.rkey: int = key

    def _close_impl(self) -> None:
        if not hasattr(self, 'lkey'):
            return  # construction failed before the engine made it
        self.engine.call("dereg_mr", self.engine.raw.dereg_mr, self.lkey)
        del self._c
        self._view.release()
        self._obj = None

    def read(self, length: int, offset: int = 0) -> bytes:
        self._check_open()
        self._check_range(offset, length)
        return bytes(self._view[offset:offset + length])

    def write(self, data: bytes | bytearray | memoryview, offset: int = 0) -> None:
        self._check_open()
        n = memoryview(data).nbytes
        self._check_range(offset, n)
        self._view[offset:offset + n] = memoryview(data).cast("B")

    def view(self) -> memoryview:
        """The registered bytes (valid until ``close()``), for zero-copy consumers."""
        self._check_open()
        return self._view
