"""Verbs memory region (``ibv_reg_mr``).

An int allocates: pyverbs' ``MR(pd, length, access)`` allocates page-aligned memory and
frees it with the MR.  A buffer is registered in place: it stays exported (pinned, so a
bytearray cannot be resized and an mmap cannot be closed) until ``close()`` has
deregistered it.  ``close()`` is ``ibv_dereg_mr``: the device stops serving the rkey
before it returns, so a closed MR never serves a READ (REM_ACCESS_ERR at the peer).
"""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

from pyverbs.mr import MR as _MR

from ...api import MR
from ...errors import RdmaUserError
from .errors import mapped

if TYPE_CHECKING:
    from .pd import VerbsPD


class VerbsMR(MR):
    """:class:`rdma.api.MR` over a pyverbs ``MR`` (``ibv_reg_mr``) on a real RDMA device.

    An int makes pyverbs allocate the memory (page-aligned, freed with the MR); a writable
    buffer is registered in place and stays exported (pinned: a bytearray cannot be resized
    nor an mmap closed) until ``close()``. ``buf``, ``lkey`` and ``rkey`` are the device's.
    ``read``/``write`` check the range and copy with ``ctypes`` at ``buf``; unlike the soft
    provider's MR there is no ``view()``.
    Owns the registration and the buffer export: ``close()`` deregisters first (the device
    stops serving the rkey before ``ibv_dereg_mr`` returns), then releases the export.
    No lock of its own: a buffer a posted WR names is the device's until its WC has been
    polled (:mod:`rdma.api`)."""

    def __init__(self, pd: VerbsPD, buf: Any, access: int) -> None:
        super().__init__(pd, access)
        self._pin: Any = None
        self._view: memoryview | None = None
        if isinstance(buf, int):
            if buf <= 0:
                raise RdmaUserError(f"MR length must be > 0, got {buf}")
            with mapped(f"ibv_reg_mr({buf} bytes)"):
                self.raw = _MR(pd.raw, buf, int(access))
            self.length: int = buf
        else:
            view = memoryview(buf)
            if view.readonly:
                raise RdmaUserError("MR buffer must be writable")
            self._view = view.cast("B")
            self.length = self._view.nbytes
            if self.length == 0:
                raise RdmaUserError("MR buffer is empty")
            self._pin = (ctypes.c_char * self.length).from_buffer(self._view)
            with mapped(f"ibv_reg_mr({self.length} bytes)"):
                self.raw = _MR(pd.raw, self.length, int(access),
                               address=ctypes.addressof(self._pin))
        self.buf: int = int(self.raw.buf)
        self.lkey: int = int(self.raw.lkey)
        self.rkey: int = int(self.raw.rkey)

    def _close_impl(self) -> None:
        raw = getattr(self, "raw", None)
        if raw is not None:
            raw.close()
        self._pin = None
        if self._view is not None:
            self._view.release()
            self._view = None

    def read(self, length: int, offset: int = 0) -> bytes:
        self._check_open()
        self._check_range(offset, length)
        return ctypes.string_at(self.buf + offset, length)

    def write(self, data: bytes | bytearray | memoryview, offset: int = 0) -> None:
        self._check_open()
        src = memoryview(data).cast("B")
        self._check_range(offset, src.nbytes)
        if src.nbytes:
            tmp = (ctypes.c_char * src.nbytes).from_buffer_copy(src)
            ctypes.memmove(self.buf + offset, tmp, src.nbytes)
