"""Soft protection domain: a number the engine checks on every access (an MR serves a
READ only to a QP of the same PD, and local SGEs must name MRs of the QP's PD)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...api import MR, PD, QP, QPInitAttr

if TYPE_CHECKING:
    from .device import SoftContext


class SoftPD(PD):
    def __init__(self, ctx: SoftContext, handle: int) -> None:
        super().__init__(ctx)
        self.handle = handle
        self.engine = ctx.engine

    def reg_mr(self, buf: Any, access: int) -> MR:
        """Register ``buf`` (a writable buffer such as bytearray/mmap) or allocate an
        int's worth of zeroed, page-aligned memory (anonymous mmap)."""
        from .mr import SoftMR

        self._check_open()
        return SoftMR(self, buf, access)

    def create_qp(self, init_attr: QPInitAttr) -> QP:
        from .qp import SoftQP

        self._check_open()
        return SoftQP(self, init_attr)
